package mysqlstore_test

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/mysqlstore"
)

func charges(t *testing.T, db *sql.DB) {
	t.Helper()
	if _, err := db.Exec("CREATE TABLE charges (`key` BINARY(16) NOT NULL, amount INT NOT NULL)"); err != nil {
		t.Fatal(err)
	}
}

func countCharges(t *testing.T, db *sql.DB, key idem.Key) int {
	t.Helper()
	var n int
	if err := db.QueryRow("SELECT count(*) FROM charges WHERE `key` = ?", key[:]).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// chargeTx begins a transaction, inserts a charge for l's key and runs
// CompleteTx in it. The caller ends the transaction; if t stops first, it
// is rolled back when t ends.
func chargeTx(t *testing.T, db *sql.DB, s *mysqlstore.Store, l idem.Lease) (*sql.Tx, error) {
	t.Helper()
	tx, err := db.BeginTx(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tx.Rollback() })
	if _, err := tx.Exec("INSERT INTO charges (`key`, amount) VALUES (?, 1000)", l.Key[:]); err != nil {
		t.Fatal(err)
	}
	return tx, s.CompleteTx(t.Context(), tx, l, resp, time.Hour)
}

// TestCompleteTx checks that the completion commits, or rolls back, with
// the business write of its transaction.
func TestCompleteTx(t *testing.T) {
	db := srv.New(t)
	s := newStore(t, db, mysqlstore.Options{Migrate: true})
	charges(t, db)
	ctx := t.Context()

	t.Run("Commit", func(t *testing.T) {
		key := newKey(1)
		l := lease(t, s, key, time.Minute)
		tx, err := chargeTx(t, db, s, l)
		if err != nil {
			t.Fatalf("CompleteTx: got error %v, want none", err)
		}
		// Before the commit, other callers see the key in flight, at once.
		if acq := acquire(t, s, key, time.Minute); acq.Outcome != idem.InFlight {
			t.Errorf("Acquire before the commit: got %v, want in_flight", acq.Outcome)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		acq := acquire(t, s, key, time.Minute)
		if acq.Outcome != idem.Replay || acq.Response.Status != 201 {
			t.Errorf("Acquire after the commit: got %v %+v, want a replay of 201", acq.Outcome, acq.Response)
		}
		if n := countCharges(t, db, key); n != 1 {
			t.Errorf("charges after the commit: got %d, want 1", n)
		}
		// A second transaction by the same lease must not commit a second charge.
		tx, err = chargeTx(t, db, s, l)
		if !errors.Is(err, idem.ErrLeaseLost) {
			t.Errorf("CompleteTx by a lease that completed already: got %v, want ErrLeaseLost", err)
		}
		tx.Rollback()
	})

	t.Run("Rollback", func(t *testing.T) {
		key := newKey(2)
		l := lease(t, s, key, time.Minute)
		tx, err := chargeTx(t, db, s, l)
		if err != nil {
			t.Fatalf("CompleteTx: got error %v, want none", err)
		}
		if err := tx.Rollback(); err != nil {
			t.Fatal(err)
		}
		if n := countCharges(t, db, key); n != 0 {
			t.Errorf("charges after the rollback: got %d, want 0", n)
		}
		rec, ok, err := s.Get(ctx, key)
		if err != nil || !ok || rec.State != idem.StateInFlight || rec.LeaseID != l.ID {
			t.Fatalf("Get after the rollback: got %+v, %t, %v; want the lease in flight", rec, ok, err)
		}
		tx, err = chargeTx(t, db, s, l)
		if err != nil {
			t.Fatalf("CompleteTx after the rollback: got error %v, want none", err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		if n := countCharges(t, db, key); n != 1 {
			t.Errorf("charges after the second transaction: got %d, want 1", n)
		}
	})

	t.Run("RollbackThenTakeover", func(t *testing.T) {
		key := newKey(3)
		old := lease(t, s, key, 500*time.Millisecond) // long enough for chargeTx on a loaded machine
		tx, err := chargeTx(t, db, s, old)
		if err != nil {
			t.Fatalf("CompleteTx: got error %v, want none", err)
		}
		tx.Rollback() // the crash
		time.Sleep(600 * time.Millisecond)
		cur := lease(t, s, key, time.Minute)
		if cur.Token <= old.Token {
			t.Errorf("takeover: got token %d, want > %d", cur.Token, old.Token)
		}
		tx, err = chargeTx(t, db, s, old)
		if !errors.Is(err, idem.ErrLeaseLost) {
			t.Errorf("CompleteTx by the old lease: got %v, want ErrLeaseLost", err)
		}
		tx.Rollback()
		tx, err = chargeTx(t, db, s, cur)
		if err != nil {
			t.Fatalf("CompleteTx by the new lease: got error %v, want none", err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		if n := countCharges(t, db, key); n != 1 {
			t.Errorf("charges: got %d, want 1", n)
		}
	})

	t.Run("ExpiredDuringTx", func(t *testing.T) {
		// The row lock taken by CompleteTx holds off a takeover until the
		// transaction ends, even when the lease runs out meanwhile; the
		// lease granted after the wait is measured from its write.
		key := newKey(4)
		l := lease(t, s, key, 500*time.Millisecond)
		tx, err := chargeTx(t, db, s, l)
		if err != nil {
			t.Fatalf("CompleteTx: got error %v, want none", err)
		}
		time.Sleep(600 * time.Millisecond)
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
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		if r := <-done; r.err != nil || r.acq.Outcome != idem.Replay {
			t.Errorf("Acquire after the commit: got %v, %v; want replay", r.acq.Outcome, r.err)
		}
	})

	t.Run("RolledBackDuringWait", func(t *testing.T) {
		// As above, but the transaction rolls back after a wait longer
		// than the new lease: the takeover's lease starts at its write,
		// not at its statement's start, so it is not granted spent.
		key := newKey(7)
		l := lease(t, s, key, 500*time.Millisecond)
		tx, err := chargeTx(t, db, s, l)
		if err != nil {
			t.Fatalf("CompleteTx: got error %v, want none", err)
		}
		time.Sleep(600 * time.Millisecond)
		done := make(chan idem.Acquisition, 1)
		go func() {
			acq, _ := s.Acquire(context.Background(), idem.AcquireRequest{Key: key, Fingerprint: fp, LeaseID: idem.NewLeaseID(), TTL: 2 * time.Second})
			done <- acq
		}()
		time.Sleep(2500 * time.Millisecond) // longer than the new lease
		tx.Rollback()
		acq := <-done
		if acq.Outcome != idem.Acquired {
			t.Fatalf("Acquire after the rollback: got %v, want acquired", acq.Outcome)
		}
		rec, ok, err := s.Get(ctx, key)
		if err != nil || !ok || rec.LeaseID != acq.Lease.ID || rec.TTL < time.Second {
			t.Errorf("Get after the takeover: got %+v, %t, %v; want the new lease with more than 1s left", rec, ok, err)
		}
	})

	t.Run("Expired", func(t *testing.T) {
		key := newKey(6)
		l := lease(t, s, key, 100*time.Millisecond)
		time.Sleep(150 * time.Millisecond)
		tx, err := chargeTx(t, db, s, l)
		if !errors.Is(err, idem.ErrLeaseLost) {
			t.Errorf("CompleteTx after the lease ended: got error %v, want ErrLeaseLost", err)
		}
		if err := tx.Rollback(); err != nil {
			t.Fatal(err)
		}
		if n := countCharges(t, db, key); n != 0 {
			t.Errorf("charges after the rollback: got %d, want 0", n)
		}
		if next := lease(t, s, key, time.Minute); next.Token <= l.Token {
			t.Errorf("Acquire after the expired lease: got token %d, want > %d", next.Token, l.Token)
		}
	})

	t.Run("CancelledContext", func(t *testing.T) {
		key := newKey(5)
		l := lease(t, s, key, time.Minute)
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback()
		cancelled, cancel := context.WithCancel(ctx)
		cancel()
		err = s.CompleteTx(cancelled, tx, l, resp, time.Hour)
		var se *idem.StoreError
		if !errors.Is(err, context.Canceled) || !errors.As(err, &se) {
			t.Errorf("CompleteTx with a cancelled context: got %v, want a *StoreError wrapping context.Canceled", err)
		}
	})
}

// TestBeginFunc checks that fn's write and the completion commit
// together, that renewals during a long fn do not lose the lease, and that
// a failure rolls back and releases the key.
func TestBeginFunc(t *testing.T) {
	db := srv.New(t)
	ctx := t.Context()
	s := newStore(t, db, mysqlstore.Options{Migrate: true})
	if _, err := db.Exec("CREATE TABLE charges (`key` BINARY(16) PRIMARY KEY, token BIGINT)"); err != nil {
		t.Fatal(err)
	}
	var lost atomic.Int64
	g, err := idem.New(s, idem.Config{Lease: 300 * time.Millisecond, OnRenew: func(_ idem.Key, err error) {
		if errors.Is(err, idem.ErrLeaseLost) {
			lost.Add(1)
		}
	}})
	if err != nil {
		t.Fatal(err)
	}
	charge := func(key idem.Key, fail error) (*idem.Response, error) {
		att, acq, err := g.Begin(ctx, key, fp)
		if err != nil || acq.Outcome != idem.Acquired {
			t.Fatalf("Begin: got %v, %v, want Acquired", acq.Outcome, err)
		}
		res, err := s.BeginFunc(ctx, db, att, func(ctx context.Context, tx *sql.Tx) (*idem.Response, error) {
			lease, _ := idem.LeaseFromContext(ctx)
			if _, err := tx.ExecContext(ctx, "INSERT INTO charges VALUES (?, ?)", lease.Key[:], lease.Token); err != nil {
				return nil, err
			}
			time.Sleep(450 * time.Millisecond) // renewals run meanwhile
			return resp, fail
		})
		return res.Response, err
	}
	rows := func(key idem.Key) int {
		var n int
		if err := db.QueryRow("SELECT count(*) FROM charges WHERE `key` = ?", key[:]).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	k := newKey(1)
	if got, err := charge(k, nil); err != nil || got.Status != resp.Status {
		t.Fatalf("BeginFunc: got %v, %v, want the response", got, err)
	}
	if n := lost.Load(); n != 0 {
		t.Fatalf("renewals reported the lease lost %d times, want 0", n)
	}
	if n := rows(k); n != 1 {
		t.Fatalf("charges: got %d rows, want 1", n)
	}
	if _, acq, _ := g.Begin(ctx, k, fp); acq.Outcome != idem.Replay {
		t.Fatalf("after the commit: got %v, want Replay", acq.Outcome)
	}
	k = newKey(2)
	boom := errors.New("card declined by a flaky network")
	if _, err := charge(k, boom); !errors.Is(err, boom) {
		t.Fatalf("BeginFunc: got %v, want fn's error", err)
	}
	if n := rows(k); n != 0 {
		t.Fatalf("after fn failed: got %d charges, want 0 (rolled back)", n)
	}
	if _, err := charge(k, nil); err != nil || rows(k) != 1 {
		t.Fatalf("retry: got %v and %d rows, want success and 1", err, rows(k))
	}
}

// TestFoundRows runs the transitions on a pool with CLIENT_FOUND_ROWS set
// (clientFoundRows=true), which changes what an UPDATE that leaves a row as
// it was reports: the verdicts must not depend on it.
func TestFoundRows(t *testing.T) {
	db := srv.New(t)
	name := ""
	if err := db.QueryRow("SELECT DATABASE()").Scan(&name); err != nil {
		t.Fatal(err)
	}
	cfg := srv.Config(name)
	cfg.ClientFoundRows = true
	conn, err := mysql.NewConnector(cfg)
	if err != nil {
		t.Fatal(err)
	}
	found := sql.OpenDB(conn)
	defer found.Close()
	ctx := t.Context()
	s := newStore(t, found, mysqlstore.Options{Migrate: true})
	key := newKey(1)
	l := lease(t, s, key, time.Minute)
	// A live conflict leaves the row as it is: 1 row found, 0 changed.
	if acq := acquire(t, s, key, time.Minute); acq.Outcome != idem.InFlight {
		t.Fatalf("second Acquire: got %v, want in_flight", acq.Outcome)
	}
	if err := s.Complete(ctx, l, resp, time.Hour); err != nil {
		t.Fatal(err)
	}
	// A repeated Complete changes nothing, and is accepted.
	if err := s.Complete(ctx, l, resp, time.Hour); err != nil {
		t.Fatalf("repeated Complete: got %v, want nil", err)
	}
	if acq := acquire(t, s, key, time.Minute); acq.Outcome != idem.Replay {
		t.Fatalf("Acquire after Complete: got %v, want replay", acq.Outcome)
	}
	// A stale lease is lost however rows are counted.
	if err := s.Renew(ctx, l, time.Minute); !errors.Is(err, idem.ErrLeaseLost) {
		t.Fatalf("Renew of a completed lease: got %v, want ErrLeaseLost", err)
	}
}

// TestContention races many acquirers of few keys, and of many adjacent
// new keys, whose statements deadlock in InnoDB now and then (error 1213:
// the duplicate-key check locks the gap before a new key). The store
// retries them: no caller may see an error, and each key is acquired once.
func TestContention(t *testing.T) {
	db := srv.New(t)
	db.SetMaxOpenConns(32)
	s := newStore(t, db, mysqlstore.Options{Migrate: true})
	ctx := t.Context()
	const keys, callers = 200, 32
	var acquired [keys]atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, keys*callers)
	for c := range callers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range keys {
				k := (i + c%4) % keys // four orders
				acq, err := s.Acquire(ctx, idem.AcquireRequest{Key: newKey(k), Fingerprint: fp, LeaseID: idem.NewLeaseID(), TTL: time.Minute})
				if err != nil {
					errs <- err
					continue
				}
				if acq.Outcome == idem.Acquired {
					acquired[k].Add(1)
				} else if acq.Outcome != idem.InFlight {
					t.Errorf("key %d: got %v, want acquired or in_flight", k, acq.Outcome)
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Errorf("Acquire: got error %v, want none", err)
	}
	for k := range keys {
		if n := acquired[k].Load(); n != 1 {
			t.Errorf("key %d acquired %d times, want 1", k, n)
		}
	}
}

// TestLargeResponse checks responses over the server's max_allowed_packet
// (16 MiB on MariaDB 10.11): the driver splits what it sends into packets
// and the server stores and returns the record whole. (Bodies over 64 MiB
// are refused by idem's encoding, whatever the store.)
func TestLargeResponse(t *testing.T) {
	db := srv.New(t)
	s := newStore(t, db, mysqlstore.Options{Migrate: true})
	ctx := t.Context()
	var maxPacket int
	if err := db.QueryRow("SELECT @@max_allowed_packet").Scan(&maxPacket); err != nil {
		t.Fatal(err)
	}
	big := &idem.Response{Status: 200, Body: bytes.Repeat([]byte("x"), maxPacket+1)}

	key := newKey(1)
	l := lease(t, s, key, time.Minute)
	if err := s.Complete(ctx, l, big, time.Hour); err != nil {
		t.Fatalf("Complete of a %d-byte body (max_allowed_packet %d): got %v, want nil", len(big.Body), maxPacket, err)
	}
	if acq := acquire(t, s, key, time.Minute); acq.Outcome != idem.Replay || !bytes.Equal(acq.Response.Body, big.Body) {
		t.Fatalf("Acquire after a %d-byte completion: got %v, want its replay, byte for byte", len(big.Body), acq.Outcome)
	}

}

// TestLockWaitRetry holds a record locked for longer than the pool's
// innodb_lock_wait_timeout (1s here): the store's Renew times out on the
// lock (error 1205), which rolls back its statement only, and the store
// retries it until the lock is free.
func TestLockWaitRetry(t *testing.T) {
	db := srv.New(t)
	var name string
	if err := db.QueryRow("SELECT DATABASE()").Scan(&name); err != nil {
		t.Fatal(err)
	}
	cfg := srv.Config(name)
	cfg.Params = map[string]string{"innodb_lock_wait_timeout": "1"}
	conn, err := mysql.NewConnector(cfg)
	if err != nil {
		t.Fatal(err)
	}
	short := sql.OpenDB(conn)
	defer short.Close()
	ctx := t.Context()
	s := newStore(t, short, mysqlstore.Options{Migrate: true})
	key := newKey(1)
	l := lease(t, s, key, time.Minute)
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	var n int
	if err := tx.QueryRow("SELECT count(*) FROM idem_records WHERE `key` = ? FOR UPDATE", key[:]).Scan(&n); err != nil || n != 1 {
		t.Fatalf("locking the record: got %d rows, %v", n, err)
	}
	go func() {
		time.Sleep(1500 * time.Millisecond) // past one lock wait timeout
		tx.Commit()
	}()
	if err := s.Renew(ctx, l, time.Minute); err != nil {
		t.Fatalf("Renew while the record is locked for 1.5s: got %v, want nil (retried after 1205)", err)
	}
}
