package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/mysqltest"
	"github.com/idemkit/idem/mysqlstore"
)

var srv *mysqltest.Server

func TestMain(m *testing.M) {
	// The driver logs each connection the chaos kills: not news here.
	mysql.SetLogger(log.New(io.Discard, "", 0))
	srv = mysqltest.MustStart()
	code := m.Run()
	srv.Stop()
	os.Exit(code)
}

// TestChaos sends 1,000 charge requests (200 keys, 5 sends each, 16 at a
// time; the sends of a key mostly at once, so that they meet in flight)
// and, in a third of the attempts, after a random delay of up to 6ms,
// cancels the request's context or kills (KILL, from another session) a
// connection of the service that is running a statement: so also during
// the commit, when the answer may be lost after the commit. Each send
// retries until it gets an answer. Then: every key has exactly one charge
// row (none twice, none lost), a completed record whose response names
// that charge, and every send got that same charge.
func TestChaos(t *testing.T) {
	const (
		keys, sends, workers = 200, 5, 16
		lease                = time.Second
		faultRate            = 0.35
		maxAttempts          = 200
	)
	db := srv.New(t)
	db.SetMaxOpenConns(24)
	var dbName string
	if err := db.QueryRow("SELECT DATABASE()").Scan(&dbName); err != nil {
		t.Fatal(err)
	}
	admin := srv.New(t) // another database's pool: it kills, and is not killed
	svc, err := newService(t.Context(), testStore(t, db), lease)
	if err != nil {
		t.Fatal(err)
	}
	ch := &chaos{admin: admin, db: dbName}

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
	c := &client{svc: svc, chaos: ch, faultRate: faultRate, maxAttempts: maxAttempts}
	var (
		mu      sync.Mutex
		got     = make(map[string][]int64) // client key → charge id per send
		replays atomic.Int64
	)
	start := time.Now()
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for j := range jobs {
				key := fmt.Sprintf("order-%03d", j.key)
				req := chargeRequest{Amount: int64(100 + j.key), Currency: "eur"}
				resp, replayed, err := c.charge(t.Context(), key, req)
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
	t.Logf("%d sends, %d attempts in %v: %d cancellations, %d connections killed, %d waits on a key in flight, %d replays",
		keys*sends, c.attempts.Load(), time.Since(start).Round(time.Millisecond),
		ch.cancelled.Load(), ch.killed.Load(), c.waits.Load(), replays.Load())
	if ch.cancelled.Load() == 0 || ch.killed.Load() == 0 {
		t.Errorf("got %d cancellations and %d kills, want some of each", ch.cancelled.Load(), ch.killed.Load())
	}

	// The charges, counted per key: no UNIQUE constraint hides duplicates.
	rows, err := admin.Query("SELECT idem_key, count(*), min(id) FROM " + dbName + ".charges GROUP BY idem_key")
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
// strikes a fault in each attempt with probability faultRate.
type client struct {
	svc         *service
	chaos       *chaos
	faultRate   float64
	maxAttempts int

	attempts, waits atomic.Int64
}

func (c *client) charge(ctx context.Context, key string, req chargeRequest) (*idem.Response, bool, error) {
	for range c.maxAttempts {
		c.attempts.Add(1)
		actx, cancel := context.WithCancel(ctx)
		var stop func() bool
		if rand.Float64() < c.faultRate {
			stop = c.chaos.strike(cancel)
		}
		resp, replayed, err := c.svc.Charge(actx, key, req)
		if stop != nil {
			stop()
		}
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
	}
	return nil, false, fmt.Errorf("no answer after %d attempts", c.maxAttempts)
}

// chaos cancels attempts and kills the service's busy connections.
type chaos struct {
	admin             *sql.DB
	db                string
	cancelled, killed atomic.Int64
	wg                sync.WaitGroup
}

// strike arms a fault that fires after up to 6ms: cancel, or kill a
// connection of the service's database that is running a statement
// (perhaps another attempt's: any of them may be struck). It returns the
// timer's Stop.
func (c *chaos) strike(cancel context.CancelFunc) func() bool {
	kill := rand.IntN(2) == 0
	c.wg.Add(1)
	t := time.AfterFunc(time.Duration(rand.Int64N(int64(6*time.Millisecond))), func() {
		defer c.wg.Done()
		if !kill {
			cancel()
			c.cancelled.Add(1)
			return
		}
		var id int64
		err := c.admin.QueryRow("SELECT id FROM information_schema.processlist WHERE db = ? AND command <> 'Sleep' ORDER BY RAND() LIMIT 1", c.db).Scan(&id)
		if err == nil {
			if _, err := c.admin.Exec(fmt.Sprintf("KILL %d", id)); err == nil {
				c.killed.Add(1)
			}
		}
	})
	return func() bool {
		if t.Stop() {
			c.wg.Done()
			return true
		}
		return false
	}
}

// TestHTTP checks the service's answers over HTTP.
func TestHTTP(t *testing.T) {
	db := srv.New(t)
	svc, err := newService(t.Context(), testStore(t, db), time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(svc)
	defer hs.Close()
	post := func(key, body string) *http.Response {
		t.Helper()
		req, _ := http.NewRequest(http.MethodPost, hs.URL+"/charges", strings.NewReader(body))
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
	if err := db.QueryRow("SELECT count(*) FROM charges").Scan(&n); err != nil || n != 1 {
		t.Errorf("charges: got %d, %v; want 1", n, err)
	}
}

// testStore is the service's store on a test's database, as main opens it.
func testStore(t *testing.T, db *sql.DB) *mysqlstore.Store {
	t.Helper()
	s, err := mysqlstore.New(t.Context(), db, mysqlstore.Options{Namespace: "payments", Migrate: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}
