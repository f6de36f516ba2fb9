package storetest

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// guardLease is the Guard's lease in the Guard subtests: it renews every
// 50ms.
const guardLease = 150 * time.Millisecond

func (e *env) guard(store idem.Store) *idem.Guard {
	e.t.Helper()
	g, err := idem.New(store, idem.Config{Lease: guardLease, Retention: retention})
	if err != nil {
		e.t.Fatalf("idem.New: %v", err)
	}
	return g
}

// sleepBoth lets d pass on the store's clock and on the real clock, which
// Guard's renewal timer runs on.
func (e *env) sleepBoth(d time.Duration) {
	start := time.Now()
	e.Sleep(d)
	if rest := d - time.Since(start); rest > 0 {
		time.Sleep(rest)
	}
}

// lossyRenewals passes calls on to Store, but while drop is set it answers
// Renew with nil without calling Store: renewals lost on the way, as when
// a failover loses a write.
type lossyRenewals struct {
	idem.Store
	drop atomic.Bool
}

func (s *lossyRenewals) Renew(ctx context.Context, l idem.Lease, ttl time.Duration) error {
	if s.drop.Load() {
		return nil
	}
	return s.Store.Renew(ctx, l, ttl)
}

// testGuard runs idem.Guard over the store.
func (s *suite) testGuard(t *testing.T) {
	for _, tt := range []struct {
		name string
		fn   func(*suite, *testing.T)
	}{
		{"RunsOnceThenReplays", (*suite).testGuardRunsOnce},
		{"ErrorReleases", (*suite).testGuardErrorReleases},
		{"PanicReleases", (*suite).testGuardPanicReleases},
		{"RenewsLongWork", (*suite).testGuardRenews},
		{"LeaseLostToTakeover", (*suite).testGuardLeaseLost},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			tt.fn(s, t)
		})
	}
}

func (s *suite) testGuardRunsOnce(t *testing.T) {
	e := s.env(t)
	g := e.guard(e.Store)
	key := newKey()
	want := &idem.Response{Status: 201, Header: jsonHeader, Body: []byte(`{"id":7}`)}
	runs := 0
	var seen idem.Lease
	fn := func(ctx context.Context) (*idem.Response, error) {
		runs++
		var ok bool
		if seen, ok = idem.LeaseFromContext(ctx); !ok {
			t.Error("LeaseFromContext: got no lease, want one")
		}
		return cloneResponse(want), nil
	}
	for i, replayed := range []bool{false, true} {
		res, err := g.Do(e.ctx, key, fpA, fn)
		if err != nil {
			t.Fatalf("Do %d: got error %v, want none", i+1, err)
		}
		if res.Replayed != replayed {
			t.Errorf("Do %d: got Replayed %t, want %t", i+1, res.Replayed, replayed)
		}
		if diff := diffResponse(res.Response, want); diff != "" {
			t.Errorf("Do %d: response: %s", i+1, diff)
		}
	}
	if runs != 1 {
		t.Errorf("got %d runs, want 1", runs)
	}
	if seen.Key != key || seen.Token == 0 {
		t.Errorf("LeaseFromContext: got key %v and token %d, want key %v and a token > 0", seen.Key, seen.Token, key)
	}
	rec, _ := e.get(key)
	if rec.Token != seen.Token {
		t.Errorf("stored token: got %d, want %d (the one in the work's context)", rec.Token, seen.Token)
	}
	if _, err := g.Do(e.ctx, key, fpB, fn); !errors.Is(err, idem.ErrMismatch) {
		t.Errorf("Do with another fingerprint: got error %v, want ErrMismatch", err)
	}
}

func (s *suite) testGuardErrorReleases(t *testing.T) {
	e := s.env(t)
	g := e.guard(e.Store)
	key := newKey()
	errWork := errors.New("work failed")
	_, err := g.Do(e.ctx, key, fpA, func(context.Context) (*idem.Response, error) { return nil, errWork })
	if !errors.Is(err, errWork) {
		t.Fatalf("Do with failing work: got error %v, want %v", err, errWork)
	}
	wantFree(e, "after failed work", key)
	wantRunsAgain(e, g, key)
}

func (s *suite) testGuardPanicReleases(t *testing.T) {
	e := s.env(t)
	g := e.guard(e.Store)
	key := newKey()
	boom := errors.New("boom")
	func() {
		defer func() {
			if r := recover(); r != boom {
				t.Errorf("recovered %v, want the work's panic %v", r, boom)
			}
		}()
		g.Do(e.ctx, key, fpA, func(context.Context) (*idem.Response, error) { panic(boom) })
	}()
	wantFree(e, "after the work panicked", key)
	wantRunsAgain(e, g, key)
}

// wantFree checks that key is released or absent.
func wantFree(e *env, what string, key idem.Key) {
	e.t.Helper()
	if rec, ok := e.get(key); ok && rec.State != idem.StateReleased {
		e.t.Errorf("%s: Get: got a %v record, want a released one or none", what, rec.State)
	}
}

// wantRunsAgain checks that Do runs the work for key.
func wantRunsAgain(e *env, g *idem.Guard, key idem.Key) {
	e.t.Helper()
	ran := false
	res, err := g.Do(e.ctx, key, fpA, func(context.Context) (*idem.Response, error) {
		ran = true
		return &idem.Response{Status: 200}, nil
	})
	if err != nil || !ran || res.Replayed {
		e.t.Errorf("next Do: got ran %t, Replayed %t, error %v; want ran, not replayed, no error", ran, res.Replayed, err)
	}
}

// testGuardRenews runs work for well past the lease: Guard must renew it,
// so nobody else can take the key and the work completes.
func (s *suite) testGuardRenews(t *testing.T) {
	e := s.env(t)
	// Three leases of work, with a lease long enough that a renewal delayed
	// by a loaded machine (the race detector, parallel subtests) still
	// lands in time.
	const lease, work, step = 400 * time.Millisecond, 1200 * time.Millisecond, 10 * time.Millisecond
	g, err := idem.New(e.Store, idem.Config{Lease: lease, Retention: retention})
	if err != nil {
		t.Fatal(err)
	}
	key := newKey()
	res, err := g.Do(e.ctx, key, fpA, func(ctx context.Context) (*idem.Response, error) {
		for range work / step {
			e.sleepBoth(step)
		}
		if err := context.Cause(ctx); err != nil {
			t.Errorf("work context after %v: got %v, want not done", work, err)
		}
		e.wantOutcome("Acquire by another lease during long work", e.acquire(key, fpA, idem.NewLeaseID(), longTTL), idem.InFlight)
		return &idem.Response{Status: 200}, nil
	})
	if err != nil || res.Replayed {
		t.Fatalf("Do with long work: got Replayed %t, error %v; want not replayed, no error", res.Replayed, err)
	}
	if rec, _ := e.get(key); rec.State != idem.StateCompleted {
		t.Errorf("after long work: got state %v, want %v", rec.State, idem.StateCompleted)
	}
}

// testGuardLeaseLost has Guard's renewals lost while another caller takes
// the key over: the next renewal must find the lease gone, cancel the work
// with cause ErrLeaseLost, and Do must report ErrLeaseLost without touching
// the new holder's record.
func (s *suite) testGuardLeaseLost(t *testing.T) {
	e := s.env(t)
	lossy := &lossyRenewals{Store: e.Store}
	g := e.guard(lossy)
	key := newKey()
	want := &idem.Response{Status: 200, Body: []byte("late")}
	var taken idem.Lease
	res, err := g.Do(e.ctx, key, fpA, func(ctx context.Context) (*idem.Response, error) {
		mine, _ := idem.LeaseFromContext(ctx)
		lossy.drop.Store(true)
		e.sleepBoth(guardLease * 3 / 2)
		taken = e.lease(key, fpA, longTTL)
		if taken.Token <= mine.Token {
			t.Errorf("takeover: got token %d, want > %d", taken.Token, mine.Token)
		}
		lossy.drop.Store(false)
		select {
		case <-ctx.Done():
			if cause := context.Cause(ctx); !errors.Is(cause, idem.ErrLeaseLost) {
				t.Errorf("work context: got cause %v, want ErrLeaseLost", cause)
			}
		case <-time.After(10 * guardLease):
			t.Errorf("work context: not done %v after the takeover, want cancelled with ErrLeaseLost", 10*guardLease)
		}
		return cloneResponse(want), nil
	})
	if !errors.Is(err, idem.ErrLeaseLost) {
		t.Errorf("Do: got error %v, want ErrLeaseLost", err)
	}
	if diff := diffResponse(res.Response, want); diff != "" {
		t.Errorf("Do: response: %s", diff)
	}
	e.wantRecord("after Do", key, inFlight(taken, fpA), longTTL/2)
}
