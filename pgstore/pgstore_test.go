package pgstore_test

import (
	"context"
	"errors"
	"fmt"
	"math"
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
	"github.com/idemkit/idem/storetest"
)

func newStore(t testing.TB, pool *pgxpool.Pool, opts pgstore.Options) *pgstore.Store {
	t.Helper()
	s, err := pgstore.New(context.Background(), pool, opts)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestConformance(t *testing.T) {
	pool := pgtest.New(t)
	if err := pgstore.Migrate(t.Context(), pool, ""); err != nil {
		t.Fatal(err)
	}
	storetest.Run(t, func(t *testing.T, prefix string) storetest.Fixture {
		s := newStore(t, pool, pgstore.Options{Namespace: prefix})
		return storetest.Fixture{
			Store: s,
			Sleep: time.Sleep,
			Corrupt: func(key idem.Key) error {
				// 0xC0 sets the version bits of the response encoding to version 7: no such version (0xFF would start a sealed value).
				_, err := pool.Exec(context.Background(),
					`UPDATE idem_records SET response = '\xc0' WHERE namespace = $1 AND key = $2 AND state = 2`, prefix, key[:])
				return err
			},
		}
	})
}

var (
	fp   = idem.Fingerprint{0: 'f'}
	resp = &idem.Response{Status: 201, Body: []byte(`{"id":1}`)}
)

func newKey(i int) idem.Key {
	k, err := idem.Scope{Method: "POST", Route: "/test"}.Key(fmt.Sprint("key-", i))
	if err != nil {
		panic(err)
	}
	return k
}

func acquire(t testing.TB, s *pgstore.Store, key idem.Key, ttl time.Duration) idem.Acquisition {
	t.Helper()
	acq, err := s.Acquire(context.Background(), idem.AcquireRequest{Key: key, Fingerprint: fp, LeaseID: idem.NewLeaseID(), TTL: ttl})
	if err != nil {
		t.Fatalf("Acquire: got error %v, want none", err)
	}
	return acq
}

func lease(t testing.TB, s *pgstore.Store, key idem.Key, ttl time.Duration) idem.Lease {
	t.Helper()
	acq := acquire(t, s, key, ttl)
	if acq.Outcome != idem.Acquired {
		t.Fatalf("Acquire: got outcome %v, want acquired", acq.Outcome)
	}
	return acq.Lease
}

// charges creates a business table, to write in the same transaction as
// the completion.
func charges(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	if _, err := pool.Exec(t.Context(), `CREATE TABLE charges (key bytea NOT NULL, amount int NOT NULL)`); err != nil {
		t.Fatal(err)
	}
}

func countCharges(t *testing.T, pool *pgxpool.Pool, key idem.Key) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(t.Context(), `SELECT count(*) FROM charges WHERE key = $1`, key[:]).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// chargeTx begins a transaction, inserts a charge for l's key and runs
// CompleteTx in it. The caller ends the transaction; if t stops first (a
// t.Fatal), the transaction is rolled back when t ends, so that its
// connection goes back to the pool and closing the pool does not hang.
func chargeTx(t *testing.T, pool *pgxpool.Pool, s *pgstore.Store, l idem.Lease) (pgx.Tx, error) {
	t.Helper()
	tx, err := pool.Begin(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tx.Rollback(context.Background()) }) // a no-op once tx has ended
	if _, err := tx.Exec(t.Context(), `INSERT INTO charges (key, amount) VALUES ($1, 1000)`, l.Key[:]); err != nil {
		t.Fatal(err)
	}
	return tx, s.CompleteTx(t.Context(), tx, l, resp, time.Hour)
}

// TestCompleteTx checks that the completion commits, or rolls back, with
// the business write of its transaction.
func TestCompleteTx(t *testing.T) {
	pool := pgtest.New(t)
	s := newStore(t, pool, pgstore.Options{Migrate: true})
	charges(t, pool)
	ctx := t.Context()

	t.Run("Commit", func(t *testing.T) {
		key := newKey(1)
		l := lease(t, s, key, time.Minute)
		tx, err := chargeTx(t, pool, s, l)
		if err != nil {
			t.Fatalf("CompleteTx: got error %v, want none", err)
		}
		// Before the commit, other callers see the key in flight.
		if acq := acquire(t, s, key, time.Minute); acq.Outcome != idem.InFlight {
			t.Errorf("Acquire before the commit: got %v, want in_flight", acq.Outcome)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		acq := acquire(t, s, key, time.Minute)
		if acq.Outcome != idem.Replay || acq.Response.Status != 201 {
			t.Errorf("Acquire after the commit: got %v %+v, want a replay of 201", acq.Outcome, acq.Response)
		}
		if n := countCharges(t, pool, key); n != 1 {
			t.Errorf("charges after the commit: got %d, want 1", n)
		}
		// A second transaction by the same lease must not commit a second charge.
		tx, err = chargeTx(t, pool, s, l)
		if !errors.Is(err, idem.ErrLeaseLost) {
			t.Errorf("CompleteTx by a lease that completed already: got %v, want ErrLeaseLost", err)
		}
		tx.Rollback(ctx)
	})

	t.Run("Rollback", func(t *testing.T) {
		key := newKey(2)
		l := lease(t, s, key, time.Minute)
		tx, err := chargeTx(t, pool, s, l)
		if err != nil {
			t.Fatalf("CompleteTx: got error %v, want none", err)
		}
		if err := tx.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
		if n := countCharges(t, pool, key); n != 0 {
			t.Errorf("charges after the rollback: got %d, want 0", n)
		}
		rec, ok, err := s.Get(ctx, key)
		if err != nil || !ok || rec.State != idem.StateInFlight || rec.LeaseID != l.ID {
			t.Fatalf("Get after the rollback: got %+v, %t, %v; want the lease in flight", rec, ok, err)
		}
		// The same lease may try again, and commit.
		tx, err = chargeTx(t, pool, s, l)
		if err != nil {
			t.Fatalf("CompleteTx after the rollback: got error %v, want none", err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		if n := countCharges(t, pool, key); n != 1 {
			t.Errorf("charges after the second transaction: got %d, want 1", n)
		}
	})

	t.Run("RollbackThenTakeover", func(t *testing.T) {
		key := newKey(3)
		old := lease(t, s, key, 100*time.Millisecond)
		tx, err := chargeTx(t, pool, s, old)
		if err != nil {
			t.Fatalf("CompleteTx: got error %v, want none", err)
		}
		tx.Rollback(ctx) // the crash
		time.Sleep(150 * time.Millisecond)
		cur := lease(t, s, key, time.Minute)
		if cur.Token <= old.Token {
			t.Errorf("takeover: got token %d, want > %d", cur.Token, old.Token)
		}
		// The old holder, late, must not commit its charge.
		tx, err = chargeTx(t, pool, s, old)
		if !errors.Is(err, idem.ErrLeaseLost) {
			t.Errorf("CompleteTx by the old lease: got %v, want ErrLeaseLost", err)
		}
		tx.Rollback(ctx)
		tx, err = chargeTx(t, pool, s, cur)
		if err != nil {
			t.Fatalf("CompleteTx by the new lease: got error %v, want none", err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		if n := countCharges(t, pool, key); n != 1 {
			t.Errorf("charges: got %d, want 1", n)
		}
	})

	t.Run("ExpiredDuringTx", func(t *testing.T) {
		// The row lock taken by CompleteTx holds off a takeover until the
		// transaction ends, even when the lease runs out meanwhile.
		key := newKey(4)
		l := lease(t, s, key, 100*time.Millisecond)
		tx, err := chargeTx(t, pool, s, l)
		if err != nil {
			t.Fatalf("CompleteTx: got error %v, want none", err)
		}
		time.Sleep(150 * time.Millisecond)
		// Buffered, and the error sent rather than reported: a t.Fatalf
		// below must leave the goroutine free to end (the rollback at the
		// end of t lets its Acquire return).
		type result struct {
			acq idem.Acquisition
			err error
		}
		done := make(chan result, 1)
		go func() {
			acq, err := s.Acquire(context.Background(), idem.AcquireRequest{Key: key, Fingerprint: fp, LeaseID: idem.NewLeaseID(), TTL: time.Minute})
			done <- result{acq, err}
		}()
		select {
		case r := <-done:
			t.Fatalf("Acquire during the completing transaction: got %v, %v at once, want it to wait", r.acq.Outcome, r.err)
		case <-time.After(100 * time.Millisecond):
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		if r := <-done; r.err != nil || r.acq.Outcome != idem.Replay {
			t.Errorf("Acquire after the commit: got %v, %v; want replay", r.acq.Outcome, r.err)
		}
	})

	t.Run("Expired", func(t *testing.T) {
		// A holder that outlived its lease, nobody having taken the key
		// over, cannot complete it in its transaction: ErrLeaseLost, and
		// after the rollback nothing of the transaction is written and
		// the key is free.
		key := newKey(6)
		l := lease(t, s, key, 100*time.Millisecond)
		time.Sleep(150 * time.Millisecond)
		tx, err := chargeTx(t, pool, s, l)
		if !errors.Is(err, idem.ErrLeaseLost) {
			t.Errorf("CompleteTx after the lease ended: got error %v, want ErrLeaseLost", err)
		}
		if err := tx.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
		if n := countCharges(t, pool, key); n != 0 {
			t.Errorf("charges after the rollback: got %d, want 0", n)
		}
		if rec, ok, err := s.Get(ctx, key); err != nil || ok {
			t.Errorf("Get after the rollback: got %+v, %t, %v; want no record", rec, ok, err)
		}
		if next := lease(t, s, key, time.Minute); next.Token <= l.Token {
			t.Errorf("Acquire after the expired lease: got token %d, want > %d", next.Token, l.Token)
		}
	})

	t.Run("CancelledContext", func(t *testing.T) {
		key := newKey(5)
		l := lease(t, s, key, time.Minute)
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		cancelled, cancel := context.WithCancel(ctx)
		cancel()
		err = s.CompleteTx(cancelled, tx, l, resp, time.Hour)
		var se *idem.StoreError
		if !errors.Is(err, context.Canceled) || !errors.As(err, &se) {
			t.Errorf("CompleteTx with a cancelled context: got %v, want a *StoreError wrapping context.Canceled", err)
		}
	})
}

// TestMigrate checks that Migrate is idempotent, also run concurrently,
// that it honours the table name, and that bad names are refused.
func TestMigrate(t *testing.T) {
	pool := pgtest.New(t)
	ctx := t.Context()
	if _, err := pool.Exec(ctx, `CREATE SCHEMA app`); err != nil {
		t.Fatal(err)
	}
	for _, table := range []string{"", "custom_records", "app.records"} {
		var wg sync.WaitGroup
		for range 8 {
			wg.Go(func() {
				if err := pgstore.Migrate(ctx, pool, table); err != nil {
					t.Errorf("Migrate(%q) concurrently: %v", table, err)
				}
			})
		}
		wg.Wait()
		if err := pgstore.Migrate(ctx, pool, table); err != nil {
			t.Errorf("Migrate(%q) again: %v", table, err)
		}
		s := newStore(t, pool, pgstore.Options{Table: table})
		if l := lease(t, s, newKey(1), time.Minute); l.Token == 0 {
			t.Errorf("table %q: got token 0", table)
		}
	}
	var n int
	err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_indexes WHERE indexname IN ('idem_records_expires_at', 'custom_records_expires_at', 'records_expires_at')`).Scan(&n)
	if err != nil || n != 3 {
		t.Errorf("expiry indexes: got %d, %v; want 3", n, err)
	}

	// With everything in place, Migrate takes no lock: it returns while a
	// writer's transaction is open on the table (CREATE INDEX IF NOT
	// EXISTS would wait for it, and queue every later writer behind).
	for _, table := range []string{"", "app.records"} {
		n := table
		if n == "" {
			n = pgstore.DefaultTable
		}
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, `LOCK TABLE `+n+` IN ROW EXCLUSIVE MODE`); err != nil {
			t.Fatal(err)
		}
		mctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		if err := pgstore.Migrate(mctx, pool, table); err != nil {
			t.Errorf("Migrate(%q) beside an open writer: %v, want nil at once", table, err)
		}
		cancel()
		tx.Rollback(ctx)
	}

	for _, bad := range []string{"a-b", "1abc", "a.b.c", `x"; DROP TABLE y; --`, ".t", "t.", "a b", strings.Repeat("x", 49)} {
		if err := pgstore.Migrate(ctx, pool, bad); err == nil {
			t.Errorf("Migrate(%q): got nil error, want one", bad)
		}
		if _, err := pgstore.New(ctx, pool, pgstore.Options{Table: bad}); err == nil {
			t.Errorf("New with Table %q: got nil error, want one", bad)
		}
	}
	if _, err := pgstore.New(ctx, nil, pgstore.Options{}); err == nil {
		t.Error("New with a nil pool: got nil error, want one")
	}
	// Without Migrate, New does not create the table: the store's calls fail.
	s := newStore(t, pool, pgstore.Options{Table: "missing"})
	_, err = s.Acquire(ctx, idem.AcquireRequest{Key: newKey(1), LeaseID: idem.NewLeaseID(), TTL: time.Second})
	var se *idem.StoreError
	if !errors.As(err, &se) {
		t.Errorf("Acquire on a missing table: got %v, want a *StoreError", err)
	}
}

// TestReap checks that Reap deletes expired records only, of every
// namespace, in batches, and leaves locked ones alone.
func TestReap(t *testing.T) {
	pool := pgtest.New(t)
	ctx := t.Context()
	// A grace far under the records' expiry: Reap takes them at once.
	s := newStore(t, pool, pgstore.Options{Migrate: true, Namespace: "a", ReapGrace: time.Millisecond})
	other := newStore(t, pool, pgstore.Options{Namespace: "b", ReapGrace: time.Millisecond})
	const expiring, live = 25, 10
	for i := range expiring {
		st := s
		if i%2 == 1 {
			st = other
		}
		switch l := lease(t, st, newKey(i), 50*time.Millisecond); i % 3 {
		case 0: // in flight
		case 1:
			if err := st.Complete(ctx, l, resp, 50*time.Millisecond); err != nil {
				t.Fatal(err)
			}
		case 2:
			if err := st.Release(ctx, l); err != nil {
				t.Fatal(err)
			}
		}
	}
	for i := range live {
		l := lease(t, s, newKey(1000+i), time.Minute)
		if i%2 == 0 {
			if err := s.Complete(ctx, l, resp, time.Hour); err != nil {
				t.Fatal(err)
			}
		}
	}
	// One more expiring record, locked by a transaction in progress.
	locked := lease(t, s, newKey(2000), 50*time.Millisecond)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if err := s.CompleteTx(ctx, tx, locked, resp, time.Hour); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)

	countRows := func() int {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem_records`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if n := countRows(); n != expiring+live+1 {
		t.Fatalf("rows before Reap: got %d, want %d", n, expiring+live+1)
	}
	counted, sent := countingPool(t, pool)
	// With the default grace (a minute) nothing is old enough yet.
	if deleted, err := newStore(t, pool, pgstore.Options{}).Reap(ctx, 4); deleted != 0 || err != nil {
		t.Errorf("Reap within the grace: got %d deleted, %v; want 0", deleted, err)
	}
	countedReaper := newStore(t, counted, pgstore.Options{ReapGrace: time.Millisecond})
	opened := sent.n() // New reads the store id
	deleted, err := countedReaper.Reap(ctx, 4)
	if err != nil {
		t.Fatal(err)
	}
	if deleted != expiring {
		t.Errorf("Reap: got %d deleted, want %d", deleted, expiring)
	}
	if want := expiring/4 + 1; sent.n()-opened != want {
		t.Errorf("Reap of %d records by 4: got %d statements, want %d", expiring, sent.n()-opened, want)
	}
	if n := countRows(); n != live+1 {
		t.Errorf("rows after Reap: got %d, want %d", n, live+1)
	}
	for i := range live {
		if _, ok, err := s.Get(ctx, newKey(1000+i)); !ok || err != nil {
			t.Errorf("Get of live key %d after Reap: got %t, %v; want the record", i, ok, err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if acq := acquire(t, s, newKey(2000), time.Minute); acq.Outcome != idem.Replay {
		t.Errorf("Acquire of the record locked during Reap: got %v, want replay", acq.Outcome)
	}
	if deleted, err := s.Reap(ctx, 4); deleted != 0 || err != nil {
		t.Errorf("second Reap: got %d, %v; want 0, nil", deleted, err)
	}
	if _, err := s.Reap(ctx, 0); err == nil {
		t.Error("Reap with batch 0: got nil error, want one")
	}

	// RunReaper reaps on its ticks until its context ends, and reports
	// each pass to OnReap.
	lease(t, s, newKey(3000), time.Millisecond)
	lease(t, s, newKey(3001), time.Millisecond)
	var passes, reaped, failed atomic.Int64
	reaper := newStore(t, pool, pgstore.Options{ReapGrace: time.Millisecond, OnReap: func(deleted int, took time.Duration, err error) {
		passes.Add(1)
		reaped.Add(int64(deleted))
		if err != nil || took <= 0 {
			failed.Add(1)
		}
	}})
	rctx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		if err := reaper.RunReaper(rctx, 10*time.Millisecond, 100); err != nil {
			t.Errorf("RunReaper: %v", err)
		}
		close(done)
	}()
	deadline := time.Now().Add(5 * time.Second)
	for (countRows() != live+1 || reaped.Load() < 2) && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	stop()
	<-done
	if n := countRows(); n != live+1 {
		t.Errorf("rows with RunReaper running: got %d, want %d", n, live+1)
	}
	if passes.Load() == 0 || reaped.Load() != 2 || failed.Load() != 0 {
		t.Errorf("OnReap: got %d passes, %d deleted, %d failed or untimed; want passes that deleted 2, none failed", passes.Load(), reaped.Load(), failed.Load())
	}
	if err := s.RunReaper(ctx, 0, 100); err == nil {
		t.Error("RunReaper with interval 0: got nil error, want one")
	}
}

// TestCorruptState checks that rows no statement writes are reported as
// corrupt, never obeyed.
func TestCorruptState(t *testing.T) {
	pool := pgtest.New(t)
	ctx := t.Context()
	s := newStore(t, pool, pgstore.Options{Migrate: true})
	for i, set := range []string{
		`state = 9`,
		`fingerprint = '\x01'`,
		`lease_id = NULL`,
	} {
		key := newKey(i)
		lease(t, s, key, time.Minute)
		if _, err := pool.Exec(ctx, `UPDATE idem_records SET `+set+` WHERE key = $1`, key[:]); err != nil {
			t.Fatal(err)
		}
		_, err := s.Acquire(ctx, idem.AcquireRequest{Key: key, Fingerprint: fp, LeaseID: idem.NewLeaseID(), TTL: time.Minute})
		var se *idem.StoreError
		if !errors.Is(err, idem.ErrCorrupt) || !errors.As(err, &se) {
			t.Errorf("%s: Acquire: got %v, want a *StoreError wrapping ErrCorrupt", set, err)
		}
		if _, _, err := s.Get(ctx, key); !errors.Is(err, idem.ErrCorrupt) {
			t.Errorf("%s: Get: got %v, want ErrCorrupt", set, err)
		}
	}
}

// TestRoundTrips counts the statements each call sends: one each.
func TestRoundTrips(t *testing.T) {
	pool := pgtest.New(t)
	ctx := t.Context()
	if err := pgstore.Migrate(ctx, pool, ""); err != nil {
		t.Fatal(err)
	}
	counted, sent := countingPool(t, pool)
	s := newStore(t, counted, pgstore.Options{})
	g, err := idem.New(s, idem.Config{})
	if err != nil {
		t.Fatal(err)
	}
	work := func(context.Context) (*idem.Response, error) { return resp, nil }
	for i := range 20 {
		before := sent.n()
		if _, err := g.Do(ctx, newKey(i), fp, work); err != nil {
			t.Fatal(err)
		}
		if got := sent.n() - before; got != 2 {
			t.Fatalf("first request: got %d statements, want 2", got)
		}
		before = sent.n()
		if res, err := g.Do(ctx, newKey(i), fp, work); err != nil || !res.Replayed {
			t.Fatalf("repeat: got %+v, %v; want a replay", res, err)
		}
		if got := sent.n() - before; got != 1 {
			t.Fatalf("replay: got %d statements, want 1", got)
		}
	}
}

// countingPool returns a pool like pool whose queries are counted.
func countingPool(t *testing.T, pool *pgxpool.Pool) (*pgxpool.Pool, *counter) {
	t.Helper()
	cfg := pool.Config()
	sent := new(counter)
	cfg.ConnConfig.Tracer = sent
	counted, err := pgxpool.NewWithConfig(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(counted.Close)
	return counted, sent
}

// counter is a pgx tracer that counts the queries sent.
type counter struct {
	mu    sync.Mutex
	count int
}

func (c *counter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.mu.Lock()
	c.count++
	c.mu.Unlock()
	return ctx
}

func (c *counter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (c *counter) n() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.count
}

// TestAnswersWriteNothing checks that Acquire answering in flight,
// mismatch, a repeat of the same lease or replay neither writes the row nor
// draws a token.
func TestAnswersWriteNothing(t *testing.T) {
	pool := pgtest.New(t)
	ctx := t.Context()
	s := newStore(t, pool, pgstore.Options{Migrate: true})
	key := newKey(1)
	version := func() (xmin string, seq int64) {
		t.Helper()
		err := pool.QueryRow(ctx, `SELECT xmin::text, (SELECT last_value FROM idem_records_token) FROM idem_records WHERE key = $1`, key[:]).Scan(&xmin, &seq)
		if err != nil {
			t.Fatal(err)
		}
		return xmin, seq
	}
	req := idem.AcquireRequest{Key: key, Fingerprint: fp, LeaseID: idem.NewLeaseID(), TTL: time.Minute}
	first, err := s.Acquire(ctx, req)
	if err != nil || first.Outcome != idem.Acquired {
		t.Fatalf("Acquire: got %v, %v", first.Outcome, err)
	}
	check := func(what string, want idem.Outcome, req idem.AcquireRequest) {
		t.Helper()
		x0, s0 := version()
		acq, err := s.Acquire(ctx, req)
		if err != nil || acq.Outcome != want {
			t.Fatalf("%s: got %v, %v; want %v", what, acq.Outcome, err, want)
		}
		if x1, s1 := version(); x1 != x0 || s1 != s0 {
			t.Errorf("%s: row version %s → %s, sequence %d → %d; want both unchanged", what, x0, x1, s0, s1)
		}
	}
	check("repeat of the same lease", idem.Acquired, req)
	check("in flight", idem.InFlight, idem.AcquireRequest{Key: key, Fingerprint: fp, LeaseID: idem.NewLeaseID(), TTL: time.Minute})
	check("mismatch", idem.Mismatch, idem.AcquireRequest{Key: key, LeaseID: idem.NewLeaseID(), TTL: time.Minute})
	if err := s.Complete(ctx, first.Lease, resp, time.Hour); err != nil {
		t.Fatal(err)
	}
	check("replay", idem.Replay, idem.AcquireRequest{Key: key, Fingerprint: fp, LeaseID: idem.NewLeaseID(), TTL: time.Minute})
}

// An Acquire that waits on a row lock (a CompleteTx in progress whose
// lease expired) and takes the key after the rollback gets a lease that
// starts when it is written: the key is its own for the TTL it was told,
// and nobody else takes it meanwhile.
func TestTakeoverAfterLockWait(t *testing.T) {
	pool := pgtest.New(t)
	ctx := t.Context()
	s := newStore(t, pool, pgstore.Options{Migrate: true})
	key := newKey(1)
	l := lease(t, s, key, 100*time.Millisecond)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.CompleteTx(ctx, tx, l, resp, time.Hour); err != nil {
		t.Fatal(err)
	}
	time.Sleep(150 * time.Millisecond) // the lease ends while tx holds the row
	done := make(chan idem.Acquisition, 1)
	go func() {
		acq, err := s.Acquire(context.Background(), idem.AcquireRequest{Key: key, Fingerprint: fp, LeaseID: idem.NewLeaseID(), TTL: time.Second})
		if err != nil {
			t.Error(err)
		}
		done <- acq
	}()
	time.Sleep(500 * time.Millisecond) // the Acquire waits on the row lock
	tx.Rollback(ctx)
	x := <-done
	if x.Outcome != idem.Acquired || x.Lease.TTL < 900*time.Millisecond {
		t.Fatalf("takeover after the rollback: got %v with TTL %v, want Acquired with about 1s left", x.Outcome, x.Lease.TTL)
	}
	if y := acquire(t, s, key, time.Minute); y.Outcome != idem.InFlight {
		t.Fatalf("another Acquire right after: got %v, want in flight (the takeover's lease is live)", y.Outcome)
	}
}

// Durations too large for an interval saturate instead of wrapping, and
// namespaces must be text PostgreSQL accepts.
func TestEdgeInputs(t *testing.T) {
	pool := pgtest.New(t)
	s := newStore(t, pool, pgstore.Options{Migrate: true})
	key := newKey(1)
	if a := acquire(t, s, key, time.Duration(math.MaxInt64)); a.Outcome != idem.Acquired || a.Lease.TTL <= 0 {
		t.Fatalf("Acquire with the largest TTL: got %v, TTL %v; want Acquired with a positive TTL", a.Outcome, a.Lease.TTL)
	}
	if a := acquire(t, s, key, time.Minute); a.Outcome != idem.InFlight {
		t.Fatalf("second Acquire: got %v, want in flight", a.Outcome)
	}
	for _, ns := range []string{"a\x00b", "\xff"} {
		if _, err := pgstore.New(t.Context(), pool, pgstore.Options{Namespace: ns}); err == nil {
			t.Errorf("New with Namespace %q: got nil error, want one", ns)
		}
	}
}
