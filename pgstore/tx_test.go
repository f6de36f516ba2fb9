package pgstore_test

import (
	"context"
	"errors"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/pgstore"
)

// exampleDatabase is a private database for the examples, which have no
// testing.T (see TestMain).
var exampleDatabase string

func TestMain(m *testing.M) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	url, drop, err := pgtest.CreateDatabase(ctx)
	cancel()
	if err != nil {
		os.Stderr.WriteString(err.Error() + "\n")
		os.Exit(1)
	}
	exampleDatabase = url
	code := m.Run()
	if err := drop(); err != nil {
		os.Stderr.WriteString(err.Error() + "\n")
	}
	os.Exit(code)
}

// slowCommit delays a transaction's COMMIT, which widens the window
// between CompleteTx and the commit in which a lease renewal would wait
// on the record's row lock.
type slowCommit struct {
	*pgxpool.Pool
	delay time.Duration
}

func (b slowCommit) Begin(ctx context.Context) (pgx.Tx, error) {
	tx, err := b.Pool.Begin(ctx)
	return slowTx{tx, b.delay}, err
}

type slowTx struct {
	pgx.Tx
	delay time.Duration
}

func (tx slowTx) Commit(ctx context.Context) error {
	time.Sleep(tx.delay)
	return tx.Tx.Commit(ctx)
}

func TestBeginFunc(t *testing.T) {
	pool := pgtest.New(t)
	ctx := t.Context()
	s := newStore(t, pool, pgstore.Options{Migrate: true})
	if _, err := pool.Exec(ctx, `CREATE TABLE charges (key bytea PRIMARY KEY, token bigint)`); err != nil {
		t.Fatal(err)
	}
	// A short lease, renewed every 100ms, and a commit that takes 600ms:
	// without StopRenewal, renewals wait on the row CompleteTx locked, find
	// the record completed and report the lease lost. (Long enough that a
	// loaded machine still renews in time.)
	var lost atomic.Int64
	g, err := idem.New(s, idem.Config{Lease: 300 * time.Millisecond, OnRenew: func(_ idem.Key, err error) {
		if errors.Is(err, idem.ErrLeaseLost) {
			lost.Add(1)
		}
	}})
	if err != nil {
		t.Fatal(err)
	}
	charge := func(key idem.Key, fail error) (*idem.Response, context.Context, error) {
		att, acq, err := g.Begin(ctx, key, fp)
		if err != nil || acq.Outcome != idem.Acquired {
			t.Fatalf("Begin: got %v, %v, want Acquired", acq.Outcome, err)
		}
		var workCtx context.Context
		res, err := s.BeginFunc(ctx, slowCommit{pool, 600 * time.Millisecond}, att,
			func(ctx context.Context, tx pgx.Tx) (*idem.Response, error) {
				workCtx = ctx
				lease, _ := idem.LeaseFromContext(ctx)
				if _, err := tx.Exec(ctx, `INSERT INTO charges VALUES ($1, $2)`, lease.Key[:], lease.Token); err != nil {
					return nil, err
				}
				time.Sleep(250 * time.Millisecond) // renewals run meanwhile
				return resp, fail
			})
		if err == nil && res.Replayed {
			t.Errorf("BeginFunc: Replayed is true for a first commit, want false")
		}
		return res.Response, workCtx, err
	}
	rows := func(key idem.Key) int {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM charges WHERE key = $1`, key[:]).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}

	// Success: the write and the completion commit together.
	k := newKey(1)
	got, workCtx, err := charge(k, nil)
	if err != nil || got.Status != resp.Status {
		t.Fatalf("BeginFunc: got %v, %v, want the response", got, err)
	}
	if n := lost.Load(); n != 0 {
		t.Fatalf("renewals reported the lease lost %d times, want 0", n)
	}
	if cause := context.Cause(workCtx); errors.Is(cause, idem.ErrLeaseLost) {
		t.Fatalf("the work's context ended with %v, want the attempt's end", cause)
	}
	if n := rows(k); n != 1 {
		t.Fatalf("charges: got %d rows, want 1", n)
	}
	if _, acq, _ := g.Begin(ctx, k, fp); acq.Outcome != idem.Replay {
		t.Fatalf("after the commit: got %v, want Replay", acq.Outcome)
	}

	// Failure: rolled back and released, so a retry runs again.
	k = newKey(2)
	boom := errors.New("card declined by a flaky network")
	if _, _, err := charge(k, boom); !errors.Is(err, boom) {
		t.Fatalf("BeginFunc: got %v, want fn's error", err)
	}
	if n := rows(k); n != 0 {
		t.Fatalf("after fn failed: got %d charges, want 0 (rolled back)", n)
	}
	if _, _, err := charge(k, nil); err != nil || rows(k) != 1 {
		t.Fatalf("retry: got %v and %d rows, want success and 1", err, rows(k))
	}
}
