package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/pgstore"
)

// TestChaos sends 1,000 charge requests (200 keys, 5 sends each, 16 at a
// time; the sends of a key mostly at once, so that they meet in flight)
// and, at random points of a third of the attempts, cancels
// the request's context or terminates its database backend, before or
// while a statement runs (so also during the commit, when the answer may
// be lost after the commit). Each send retries until it gets an answer.
// Then: every key has exactly one charge row (none twice, none lost), a
// completed record whose response names that charge, and every send got
// that same charge; no send waited much past one lease.
func TestChaos(t *testing.T) {
	const (
		keys, sends, workers = 200, 5, 16
		lease                = time.Second
		faultRate            = 0.35
		maxAttempts          = 200
	)
	admin := pgtest.New(t)
	ch := &chaos{admin: admin}
	cfg := admin.Config()
	cfg.ConnConfig.Tracer = ch
	pool, err := pgxpool.NewWithConfig(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	svc, err := newService(t.Context(), testStore(t, pool), lease)
	if err != nil {
		t.Fatal(err)
	}

	type job struct{ key, send int }
	jobs := make(chan job)
	go func() {
		defer close(jobs)
		for _, k := range rand.Perm(keys) {
			for send := range sends {
				jobs <- job{k, send}
			}
		}
	}()
	c := &client{svc: svc, faultRate: faultRate, maxAttempts: maxAttempts}
	var (
		mu      sync.Mutex
		got     = make(map[string][]int64) // client key → charge id per send
		replays atomic.Int64
		slowest atomic.Int64 // the longest send, in nanoseconds
	)
	start := time.Now()
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for j := range jobs {
				key := fmt.Sprintf("order-%03d", j.key)
				req := chargeRequest{Amount: int64(100 + j.key), Currency: "eur"}
				began := time.Now()
				resp, replayed, err := c.charge(t.Context(), key, req)
				took := time.Since(began)
				slowest.Store(max(slowest.Load(), int64(took))) // racy max: for the log only
				if took > lease+3*time.Second {
					t.Errorf("%s send %d: got an answer after %v, want within about one lease (%v)", key, j.send, took, lease)
				}
				if err != nil {
					t.Errorf("%s send %d: %v", key, j.send, err)
					continue
				}
				if replayed {
					replays.Add(1)
				}
				var ch charge
				if err := json.Unmarshal(resp.Body, &ch); err != nil || ch.Key != key || ch.ID == 0 {
					t.Errorf("%s send %d: got body %s (%v), want a charge for the key", key, j.send, resp.Body, err)
					continue
				}
				mu.Lock()
				got[key] = append(got[key], ch.ID)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	ch.wg.Wait()
	t.Logf("%d sends, %d attempts in %v: %d faults (%d cancellations, %d terminations), %d waits on a key in flight, %d replays; slowest send %v",
		keys*sends, c.attempts.Load(), time.Since(start).Round(time.Millisecond),
		ch.cancelled.Load()+ch.terminated.Load(), ch.cancelled.Load(), ch.terminated.Load(), c.waits.Load(), replays.Load(),
		time.Duration(slowest.Load()).Round(time.Millisecond))
	if ch.cancelled.Load() == 0 || ch.terminated.Load() == 0 {
		t.Errorf("got %d cancellations and %d terminations, want some of each", ch.cancelled.Load(), ch.terminated.Load())
	}

	// The charges, counted per key: no UNIQUE constraint hides duplicates.
	rows, err := admin.Query(t.Context(), `SELECT idem_key, count(*), min(id) FROM charges GROUP BY idem_key`)
	if err != nil {
		t.Fatal(err)
	}
	charged := make(map[string]int64)
	var duplicates int
	for rows.Next() {
		var key string
		var n, id int64
		if err := rows.Scan(&key, &n, &id); err != nil {
			t.Fatal(err)
		}
		if n != 1 {
			duplicates += int(n - 1)
			t.Errorf("%s: got %d charge rows, want 1", key, n)
		}
		charged[key] = id
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if duplicates > 0 {
		t.Errorf("got %d duplicate charges, want 0", duplicates)
	}

	var lost int
	for i := range keys {
		key := fmt.Sprintf("order-%03d", i)
		id, ok := charged[key]
		if !ok {
			t.Errorf("%s: got no charge row, want 1", key)
			continue
		}
		k, _ := scope.Key(key)
		rec, ok, err := svc.store.Get(t.Context(), k)
		for try := 0; err != nil && try < 3; try++ {
			// The pool may still hold a connection the chaos terminated
			// (57P01): pgx finds out on its next use. Ask again.
			rec, ok, err = svc.store.Get(t.Context(), k)
		}
		var c charge
		if err == nil && ok && rec.State == idem.StateCompleted {
			err = json.Unmarshal(rec.Response.Body, &c)
		}
		if err != nil || !ok || rec.State != idem.StateCompleted || c.ID != id {
			lost++
			t.Errorf("%s: got record %v %v (%v) naming charge %d, want a completed record naming charge %d", key, ok, rec.State, err, c.ID, id)
		}
		for send, seen := range got[key] {
			if seen != id {
				t.Errorf("%s: answer %d named charge %d, want %d", key, send, seen, id)
			}
		}
		if len(got[key]) != sends {
			t.Errorf("%s: got %d answers, want %d", key, len(got[key]), sends)
		}
	}
	if lost > 0 {
		t.Errorf("got %d lost completions, want 0", lost)
	}
	if len(charged) != keys {
		t.Errorf("got charges for %d keys, want %d", len(charged), keys)
	}
}

// client retries charges as a client does, on failures and on 409, and
// injects a fault into each attempt with probability faultRate.
type client struct {
	svc         *service
	faultRate   float64
	maxAttempts int

	attempts, waits atomic.Int64
}

// charge calls Charge until it answers with a response.
func (c *client) charge(ctx context.Context, key string, req chargeRequest) (*idem.Response, bool, error) {
	for range c.maxAttempts {
		c.attempts.Add(1)
		actx, cancel := context.WithCancel(ctx)
		if rand.Float64() < c.faultRate {
			actx = context.WithValue(actx, faultKey{}, newFault(cancel))
		}
		resp, replayed, err := c.svc.Charge(actx, key, req)
		cancel()
		var inFlight *idem.InFlightError
		switch {
		case err == nil:
			return resp, replayed, nil
		case errors.As(err, &inFlight):
			if inFlight.RetryAfter <= 0 || inFlight.RetryAfter > c.svc.lease {
				return nil, false, fmt.Errorf("in flight: got RetryAfter %v, want in (0, %v]", inFlight.RetryAfter, c.svc.lease)
			}
			c.waits.Add(1)
			time.Sleep(min(inFlight.RetryAfter, 20*time.Millisecond))
		case errors.Is(err, idem.ErrMismatch):
			return nil, false, err
		}
		// Any other error is a failure a client retries at once.
	}
	return nil, false, fmt.Errorf("no answer after %d attempts", c.maxAttempts)
}

// points are the statements of a charge where a fault may strike, each
// recognised by a fragment of its SQL.
var points = []string{
	"ON CONFLICT",         // Acquire
	"begin",               // pool.Begin
	"INSERT INTO charges", // the business write
	"SET state = 2",       // CompleteTx
	"commit",              // tx.Commit
}

// fault is what strikes one attempt: at the statement containing point,
// cancel its context or terminate its backend, before the statement is sent
// or after a delay, while it runs or after.
type fault struct {
	point     string
	terminate bool
	delay     time.Duration // 0: before the statement is sent
	cancel    context.CancelFunc
	fired     atomic.Bool
}

type faultKey struct{}

func newFault(cancel context.CancelFunc) *fault {
	f := &fault{point: points[rand.IntN(len(points))], terminate: rand.IntN(2) == 0, cancel: cancel}
	if rand.IntN(2) == 0 {
		f.delay = time.Duration(rand.Int64N(int64(2 * time.Millisecond)))
	}
	return f
}

// chaos is a pgx tracer that strikes the faults carried by the queries'
// contexts.
type chaos struct {
	admin                 *pgxpool.Pool // terminates backends; not traced
	cancelled, terminated atomic.Int64
	wg                    sync.WaitGroup // delayed faults
}

func (c *chaos) TraceQueryStart(ctx context.Context, conn *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	f, ok := ctx.Value(faultKey{}).(*fault)
	if !ok || !strings.Contains(data.SQL, f.point) || !f.fired.CompareAndSwap(false, true) {
		return ctx
	}
	pid := conn.PgConn().PID() // the backend serving this connection, as pg_backend_pid() reports it
	strike := func() {
		if !f.terminate {
			f.cancel()
			c.cancelled.Add(1)
			return
		}
		if _, err := c.admin.Exec(context.Background(), `SELECT pg_terminate_backend($1)`, pid); err == nil {
			c.terminated.Add(1)
		}
	}
	if f.delay == 0 {
		strike()
	} else {
		c.wg.Go(func() {
			time.Sleep(f.delay)
			strike()
		})
	}
	return ctx
}

func (c *chaos) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// TestHTTP checks the service's answers over HTTP.
func TestHTTP(t *testing.T) {
	svc, err := newService(t.Context(), testStore(t, pgtest.New(t)), time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(svc)
	defer srv.Close()
	post := func(key, body string) *http.Response {
		t.Helper()
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/charges", strings.NewReader(body))
		if key != "" {
			req.Header.Set("Idempotency-Key", key)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp
	}
	const body = `{"amount":1999,"currency":"eur"}`
	for i, want := range []struct {
		status   int
		replayed string
	}{{http.StatusCreated, ""}, {http.StatusCreated, "true"}} {
		if resp := post("order-1", body); resp.StatusCode != want.status || resp.Header.Get("Idempotent-Replayed") != want.replayed {
			t.Errorf("POST %d: got %d, Idempotent-Replayed %q; want %d, %q", i+1, resp.StatusCode, resp.Header.Get("Idempotent-Replayed"), want.status, want.replayed)
		}
	}
	if resp := post("order-1", `{"amount":1,"currency":"eur"}`); resp.StatusCode != http.StatusUnprocessableEntity {
		t.Errorf("POST with the key and another body: got %d, want 422", resp.StatusCode)
	}
	if resp := post("", body); resp.StatusCode != http.StatusBadRequest {
		t.Errorf("POST without a key: got %d, want 400", resp.StatusCode)
	}
	var n int
	if err := svc.pool.QueryRow(t.Context(), `SELECT count(*) FROM charges`).Scan(&n); err != nil || n != 1 {
		t.Errorf("charges: got %d, %v; want 1", n, err)
	}
}

// testStore is the service's store on a test's pool, as main opens it.
func testStore(t *testing.T, pool *pgxpool.Pool) *pgstore.Store {
	t.Helper()
	s, err := pgstore.New(t.Context(), pool, pgstore.Options{Namespace: "payments", Migrate: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}
