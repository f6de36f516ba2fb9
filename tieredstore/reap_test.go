package tieredstore_test

import (
	"context"
	"crypto/rand"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/redisstore"
	"github.com/idemkit/idem/tieredstore"
)

// reapTable creates a completions table of the test's own: a reaper with
// a short grace must not delete the expired rows other tests keep as token
// floors in the shared table.
func reapTable(t *testing.T, name string) string {
	t.Helper()
	table := "reap_" + name + "_" + strings.ToLower(rand.Text()[:8])
	if err := tieredstore.Migrate(t.Context(), newPool(t, 2), table); err != nil {
		t.Fatal(err)
	}
	return table
}

// completeKeys completes n keys of s, kept for retention.
func completeKeys(t *testing.T, s *tieredstore.Store, n int, name string, retention time.Duration) {
	t.Helper()
	for i := range n {
		k, _ := idem.Scope{Route: name}.Key(string(rune('a' + i)))
		acq, err := s.Acquire(t.Context(), idem.AcquireRequest{Key: k, LeaseID: idem.NewLeaseID(), TTL: time.Minute})
		if err != nil || acq.Outcome != idem.Acquired {
			t.Fatalf("Acquire: got %v, %v; want acquired", acq.Outcome, err)
		}
		if err := s.Complete(t.Context(), acq.Lease, &idem.Response{Status: 201}, retention); err != nil {
			t.Fatal(err)
		}
	}
}

func countTable(t *testing.T, table string) int {
	t.Helper()
	var n int
	if err := newPool(t, 1).QueryRow(t.Context(), "SELECT count(*) FROM "+pgx.Identifier{table}.Sanitize()).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// The background reaper deletes the rows expired for ReapGrace every
// ReapInterval and reports each pass to OnReap, until Close; a negative ReapInterval
// runs the relay without it, and Reap still works when called.
func TestBackgroundReaper(t *testing.T) {
	t.Parallel()
	pool := newPool(t, 4)
	c := newRueidis(t, shared.Addr())

	table := reapTable(t, "on")
	var passes, reaped, failed atomic.Int64
	s := newStore(t, c, pool, uniquePrefix(t.Name()), redisstore.Options{}, tieredstore.Options{Table: table,
		ReapGrace: time.Millisecond, ReapInterval: 20 * time.Millisecond,
		OnReap: func(deleted int, took time.Duration, err error) {
			passes.Add(1)
			reaped.Add(int64(deleted))
			if err != nil || took <= 0 {
				failed.Add(1)
			}
		}})
	completeKeys(t, s, 3, "expiring", 50*time.Millisecond)
	completeKeys(t, s, 2, "live", time.Hour)
	eventually(t, 5*time.Second, "the reaper did not delete the 3 expired rows", func() bool { return reaped.Load() >= 3 })
	if n := countTable(t, table); n != 2 {
		t.Errorf("rows after the reaper: got %d, want the 2 live ones", n)
	}
	if reaped.Load() != 3 || failed.Load() != 0 || passes.Load() < 2 {
		t.Errorf("OnReap: got %d passes, %d deleted, %d failed or untimed; want passes that deleted 3, none failed", passes.Load(), reaped.Load(), failed.Load())
	}
	s.Close()
	stopped := passes.Load()
	time.Sleep(100 * time.Millisecond) // 5 intervals
	if p := passes.Load(); p != stopped {
		t.Errorf("after Close: %d more passes, want none (Close stops the reaper)", p-stopped)
	}

	off := reapTable(t, "off")
	var offPasses atomic.Int64
	so := newStore(t, c, pool, uniquePrefix(t.Name()), redisstore.Options{}, tieredstore.Options{Table: off,
		ReapGrace: time.Millisecond, ReapInterval: -1, RelayInterval: 20 * time.Millisecond,
		OnReap: func(int, time.Duration, error) { offPasses.Add(1) }})
	completeKeys(t, so, 3, "expiring", 10*time.Millisecond)
	time.Sleep(300 * time.Millisecond) // 15 relay polls
	if n := countTable(t, off); n != 3 || offPasses.Load() != 0 {
		t.Fatalf("ReapInterval -1: got %d rows and %d passes, want the 3 expired rows kept and no pass", n, offPasses.Load())
	}
	if n, err := so.Reap(context.Background(), 10); n != 3 || err != nil {
		t.Fatalf("Reap with the background reaper off: got %d, %v; want 3 deleted", n, err)
	}
}
