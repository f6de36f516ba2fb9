package idem_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
)

// downStore is a store that is down for its completions: the next `fails`
// Complete (or CompleteMany) calls fail as a broken connection does (all
// of them when fails is negative); it counts the calls and the releases.
type downStore struct {
	*memstore.Store
	fails     atomic.Int32
	completes atomic.Int32
	releases  atomic.Int32
}

func (s *downStore) down() bool {
	s.completes.Add(1)
	for {
		n := s.fails.Load()
		if n == 0 {
			return false
		}
		if n < 0 || s.fails.CompareAndSwap(n, n-1) {
			return true
		}
	}
}

func (s *downStore) Complete(ctx context.Context, l idem.Lease, r *idem.Response, ttl time.Duration) error {
	if s.down() {
		return &idem.StoreError{Op: "complete", Key: l.Key, Err: errors.New("connection refused")}
	}
	return s.Store.Complete(ctx, l, r, ttl)
}

func (s *downStore) CompleteMany(ctx context.Context, cs []idem.Completion) []error {
	if s.down() {
		out := make([]error, len(cs))
		for i, c := range cs {
			out[i] = &idem.StoreError{Op: "complete", Key: c.Lease.Key, Err: errors.New("connection refused")}
		}
		return out
	}
	return s.Store.CompleteMany(ctx, cs)
}

func (s *downStore) Release(ctx context.Context, l idem.Lease) error {
	s.releases.Add(1)
	return s.Store.Release(ctx, l)
}

func (s *downStore) ReleaseMany(ctx context.Context, ls []idem.Lease) []error {
	s.releases.Add(int32(len(ls)))
	return s.Store.ReleaseMany(ctx, ls)
}

func newDownStore(fails int32) *downStore {
	s := &downStore{Store: memstore.New(memstore.Options{})}
	s.fails.Store(fails)
	return s
}

// With CompleteRetry, a completion that fails while the store is down is
// tried again: once the store answers, the result is recorded and the key
// is not released (it would run again: a second effect).
func TestCompleteRetryRecords(t *testing.T) {
	s := newDownStore(3)
	g, err := idem.New(s, idem.Config{Lease: 10 * time.Second, CompleteRetry: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	key, _ := idem.Scope{}.Key("k")
	att, _, err := g.Begin(ctx, key, idem.Fingerprint{})
	if err != nil {
		t.Fatal(err)
	}
	if err := att.Complete(ctx, &idem.Response{Status: 201}); err != nil {
		t.Fatalf("Complete: got %v, want nil once the store is back", err)
	}
	if n := s.completes.Load(); n != 4 {
		t.Errorf("got %d completions sent, want 4 (3 failed, then the one that went through)", n)
	}
	if n := s.releases.Load(); n != 0 {
		t.Errorf("got %d releases, want 0", n)
	}
	if rec, _, _ := s.Get(ctx, key); rec.State != idem.StateCompleted || rec.Response.Status != 201 {
		t.Errorf("got a %v record (%+v), want it completed with 201", rec.State, rec.Response)
	}
}

// A store that stays down past the lease: the retries stop before the
// lease may end, and the key is released, as without retries. The
// retries stop a tenth of the lease before its end: 2s leaves 200ms for
// the release on a loaded machine (1s, 100ms, was seen missed at a load
// average of 13 on 2 cores).
func TestCompleteRetryGivesUpBeforeLeaseEnds(t *testing.T) {
	const lease = 2 * time.Second
	s := newDownStore(-1)
	g, err := idem.New(s, idem.Config{Lease: lease, CompleteRetry: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	key, _ := idem.Scope{}.Key("k")
	begun := time.Now()
	att, _, err := g.Begin(ctx, key, idem.Fingerprint{})
	if err != nil {
		t.Fatal(err)
	}
	var se *idem.StoreError
	if err := att.Complete(ctx, &idem.Response{Status: 200}); !errors.As(err, &se) {
		t.Fatalf("Complete: got %v, want the store's error", err)
	}
	if took := time.Since(begun); took >= lease {
		t.Errorf("Complete returned %v after the acquire, want before the %v lease ends", took, lease)
	}
	if n := s.completes.Load(); n < 2 {
		t.Errorf("got %d completions sent, want it tried again", n)
	}
	if n := s.releases.Load(); n != 1 {
		t.Errorf("got %d releases, want 1", n)
	}
	if rec, _, _ := s.Get(ctx, key); rec.State != idem.StateReleased {
		t.Errorf("got a %v record, want the key released", rec.State)
	}
}

// The retries stop when the context ends; then the key is released.
func TestCompleteRetryStopsWithContext(t *testing.T) {
	s := newDownStore(-1)
	g, _ := idem.New(s, idem.Config{Lease: time.Minute, CompleteRetry: time.Minute})
	key, _ := idem.Scope{}.Key("k")
	att, _, err := g.Begin(context.Background(), key, idem.Fingerprint{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 150*time.Millisecond)
	defer cancel()
	start := time.Now()
	if err := att.Complete(ctx, &idem.Response{Status: 200}); err == nil {
		t.Fatal("Complete: got nil, want the store's error")
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("Complete returned after %v, want soon after its context ended", took)
	}
	if n := s.releases.Load(); n != 1 {
		t.Errorf("got %d releases, want 1", n)
	}
}

// Without CompleteRetry (the default), a failed completion is not tried
// again.
func TestCompleteNoRetryByDefault(t *testing.T) {
	s := newDownStore(1)
	g, _ := idem.New(s, idem.Config{})
	ctx := context.Background()
	key, _ := idem.Scope{}.Key("k")
	att, _, err := g.Begin(ctx, key, idem.Fingerprint{})
	if err != nil {
		t.Fatal(err)
	}
	if err := att.Complete(ctx, &idem.Response{Status: 200}); err == nil {
		t.Fatal("Complete: got nil, want the store's error")
	}
	if n := s.completes.Load(); n != 1 {
		t.Errorf("got %d completions sent, want 1", n)
	}
	if _, err := idem.New(s, idem.Config{CompleteRetry: -time.Second}); err == nil {
		t.Error("New with a negative CompleteRetry: got nil error, want one")
	}
}

// FinishMany tries the failed completions again together, on a batch
// store and on one without batches; a release is not retried.
func TestFinishManyCompleteRetry(t *testing.T) {
	for _, batched := range []bool{true, false} {
		name := "batched"
		if !batched {
			name = "plain"
		}
		t.Run(name, func(t *testing.T) {
			s := newDownStore(2)
			var store idem.Store = s
			fails := int32(2)
			if !batched {
				store = plainStore{s}
				fails = 4 // two keys, one Complete each per try
			}
			s.fails.Store(fails)
			g, err := idem.New(store, idem.Config{Lease: 10 * time.Second, CompleteRetry: 5 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			ctx := context.Background()
			k := []idem.Key{testKey(t, "0"), testKey(t, "1"), testKey(t, "2")}
			begun := g.BeginMany(ctx, []idem.BeginRequest{{Key: k[0]}, {Key: k[1]}, {Key: k[2]}})
			errs := g.FinishMany(ctx, []idem.Finish{
				{Attempt: begun[0].Attempt, Response: &idem.Response{Status: 200}},
				{Attempt: begun[1].Attempt}, // release
				{Attempt: begun[2].Attempt, Response: &idem.Response{Status: 202}},
			})
			for i, err := range errs {
				if err != nil {
					t.Errorf("FinishMany answer %d: got %v, want nil", i, err)
				}
			}
			if n := s.releases.Load(); n != 1 {
				t.Errorf("got %d releases, want 1 (the release asked for)", n)
			}
			for i, want := range []idem.State{idem.StateCompleted, idem.StateReleased, idem.StateCompleted} {
				if rec, _, _ := s.Get(ctx, k[i]); rec.State != want {
					t.Errorf("key %d: got a %v record, want %v", i, rec.State, want)
				}
			}
		})
	}
}

// FinishMany gives up on a store that stays down before the lease may
// end, and releases the keys.
func TestFinishManyCompleteRetryGivesUp(t *testing.T) {
	const lease = time.Second
	s := newDownStore(-1)
	g, _ := idem.New(s, idem.Config{Lease: lease, CompleteRetry: time.Minute})
	ctx := context.Background()
	k := []idem.Key{testKey(t, "0"), testKey(t, "1")}
	begun := time.Now()
	bg := g.BeginMany(ctx, []idem.BeginRequest{{Key: k[0]}, {Key: k[1]}})
	errs := g.FinishMany(ctx, []idem.Finish{
		{Attempt: bg[0].Attempt, Response: &idem.Response{Status: 200}},
		{Attempt: bg[1].Attempt, Response: &idem.Response{Status: 200}},
	})
	if took := time.Since(begun); took >= lease {
		t.Errorf("FinishMany returned %v after the acquire, want before the %v lease ends", took, lease)
	}
	var se *idem.StoreError
	for i, err := range errs {
		if !errors.As(err, &se) {
			t.Errorf("FinishMany answer %d: got %v, want the store's error", i, err)
		}
	}
	if n := s.completes.Load(); n < 2 {
		t.Errorf("got %d CompleteMany calls, want them tried again", n)
	}
	if n := s.releases.Load(); n != 2 {
		t.Errorf("got %d releases, want 2", n)
	}
}
