package idemmsg_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemmsg"
)

// plainStore hides the idem.BatchStore methods of the store it holds.
type plainStore struct{ idem.Store }

// countingBatch counts the batched calls to its store.
type countingBatch struct {
	idem.BatchStore
	acquires, completes, releases atomic.Int32
}

func (c *countingBatch) AcquireMany(ctx context.Context, reqs []idem.AcquireRequest) []idem.AcquireResult {
	c.acquires.Add(1)
	return c.BatchStore.AcquireMany(ctx, reqs)
}

func (c *countingBatch) CompleteMany(ctx context.Context, cs []idem.Completion) []error {
	c.completes.Add(1)
	return c.BatchStore.CompleteMany(ctx, cs)
}

func (c *countingBatch) ReleaseMany(ctx context.Context, ls []idem.Lease) []error {
	c.releases.Add(1)
	return c.BatchStore.ReleaseMany(ctx, ls)
}

// batchStores runs f with each store, batched and not.
func batchStores(t *testing.T, f func(t *testing.T, store idem.Store, batched bool)) {
	stores(t, func(t *testing.T, store idem.Store) {
		t.Run("batch", func(t *testing.T) { f(t, store, true) })
		t.Run("single", func(t *testing.T) { f(t, plainStore{store}, false) })
	})
}

// settlements records what settle receives.
type settlements struct {
	mu     sync.Mutex
	groups [][]idemmsg.Settled
	at     []time.Time
}

func (s *settlements) settle(g []idemmsg.Settled) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.groups = append(s.groups, append([]idemmsg.Settled(nil), g...))
	s.at = append(s.at, time.Now())
	return nil
}

// byIndex returns the settled deliveries by index, failing on one settled
// twice.
func (s *settlements) byIndex(t *testing.T) map[int]idemmsg.Settled {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	out := map[int]idemmsg.Settled{}
	for _, g := range s.groups {
		for k, st := range g {
			if _, dup := out[st.Index]; dup {
				t.Fatalf("delivery %d settled twice", st.Index)
			}
			if k > 0 && g[k-1].Index > st.Index {
				t.Errorf("group %v not in index order", g)
			}
			out[st.Index] = st
		}
	}
	return out
}

func deliveries(keys ...string) []idemmsg.Delivery {
	dls := make([]idemmsg.Delivery, len(keys))
	for i, k := range keys {
		dls[i] = idemmsg.Delivery{Key: k, Attempt: 1}
	}
	return dls
}

func TestHandleBatchOutcomes(t *testing.T) {
	batchStores(t, func(t *testing.T, store idem.Store, batched bool) {
		ctx := context.Background()
		d := newDedup(t, store, idemmsg.Config{Namespace: "batch/" + t.Name(), MaxFailures: 2, Lease: time.Second})
		// Before the batch: "done" completed, "dead" dead-lettered, "held"
		// in flight elsewhere.
		handle(t, d, idemmsg.Delivery{Key: "done"}, ok)
		handle(t, d, idemmsg.Delivery{Key: "dead", Attempt: 2}, func(context.Context) error { return errors.New("bad payload") })
		held, err := d.Key("held")
		if err != nil {
			t.Fatal(err)
		}
		if _, err := store.Acquire(ctx, idem.AcquireRequest{Key: held, LeaseID: idem.NewLeaseID(), TTL: time.Minute}); err != nil {
			t.Fatal(err)
		}

		dls := deliveries("a", "b", "a", "done", "dead", "held", "", "fails", "poison", "a", "b")
		dls[8].Attempt = 2
		var runs sync.Map
		var order []string
		var mu sync.Mutex
		var got settlements
		err = d.HandleBatch(ctx, dls, idemmsg.BatchOptions{}, func(ctx context.Context, i int) error {
			if _, ok := idem.LeaseFromContext(ctx); !ok {
				t.Errorf("delivery %d: no lease in the handler's context", i)
			}
			mu.Lock()
			order = append(order, dls[i].Key)
			mu.Unlock()
			n, _ := runs.LoadOrStore(dls[i].Key, new(atomic.Int32))
			n.(*atomic.Int32).Add(1)
			switch dls[i].Key {
			case "fails", "poison":
				return fmt.Errorf("%s failed", dls[i].Key)
			}
			return nil
		}, got.settle)
		if err != nil {
			t.Fatalf("HandleBatch: %v", err)
		}
		res := got.byIndex(t)
		want := []idemmsg.Outcome{idemmsg.Executed, idemmsg.Executed, idemmsg.Replayed, idemmsg.Replayed, idemmsg.DeadLettered,
			idemmsg.InFlight, 0, idemmsg.Released, idemmsg.DeadLettered, idemmsg.Replayed, idemmsg.Replayed}
		for i, w := range want {
			st, ok := res[i]
			if !ok {
				t.Errorf("delivery %d (%s) not settled", i, dls[i].Key)
				continue
			}
			if st.Result.Outcome != w {
				t.Errorf("delivery %d (%s): got %v (%v), want %v", i, dls[i].Key, st.Result.Outcome, st.Err, w)
			}
		}
		if !errors.Is(res[6].Err, idem.ErrInvalidKey) {
			t.Errorf("the delivery without a key: got error %v, want ErrInvalidKey", res[6].Err)
		}
		if ra := res[5].Result.RetryAfter; ra <= 0 || ra > time.Minute {
			t.Errorf("InFlight: RetryAfter %v", ra)
		}
		var dle *idemmsg.DeadLetterError
		if !errors.As(res[4].Result.Err, &dle) || dle.Text != "bad payload" {
			t.Errorf("the earlier dead letter: got %v, want its kept text", res[4].Result.Err)
		}
		if res[8].Result.Err == nil || res[8].Result.Err.Error() != "poison failed" {
			t.Errorf("the new dead letter: got %v", res[8].Result.Err)
		}
		for key, want := range map[string]int32{"a": 1, "b": 1, "fails": 1, "poison": 1} {
			n, _ := runs.Load(key)
			if n == nil || n.(*atomic.Int32).Load() != want {
				t.Errorf("handler of %s ran %v times, want %d", key, n, want)
			}
		}
		if want := []string{"a", "b", "fails", "poison"}; fmt.Sprint(order) != fmt.Sprint(want) {
			t.Errorf("handlers ran in the order %v, want %v (Concurrency 1: batch order)", order, want)
		}
		// What the store holds afterwards.
		if r := handle(t, d, idemmsg.Delivery{Key: "poison"}, ok); r.Outcome != idemmsg.DeadLettered {
			t.Errorf("poison after the batch: got %v, want dead-lettered", r.Outcome)
		}
		if r := handle(t, d, idemmsg.Delivery{Key: "fails"}, ok); r.Outcome != idemmsg.Executed {
			t.Errorf("fails after the batch: got %v, want executed (released)", r.Outcome)
		}
	})
}

// TestHandleBatchRoundTrips: on a batch store, one acquire step for the
// batch and one complete step per group.
func TestHandleBatchRoundTrips(t *testing.T) {
	stores(t, func(t *testing.T, store idem.Store) {
		c := &countingBatch{BatchStore: store.(idem.BatchStore)}
		d := newDedup(t, c, idemmsg.Config{Namespace: "rt"})
		keys := make([]string, 16)
		for i := range keys {
			keys[i] = fmt.Sprint("k", i)
		}
		for _, conc := range []int{1, 16} {
			var got settlements
			c.acquires.Store(0)
			c.completes.Store(0)
			dls := deliveries(keys...)
			for i := range dls {
				dls[i].Key += fmt.Sprint("-", conc)
			}
			if err := d.HandleBatch(context.Background(), dls, idemmsg.BatchOptions{Concurrency: conc, FlushInterval: time.Second}, func(context.Context, int) error { return nil }, got.settle); err != nil {
				t.Fatal(err)
			}
			if a, cm := c.acquires.Load(), c.completes.Load(); a != 1 || cm != 1 {
				t.Errorf("Concurrency %d: %d AcquireMany and %d CompleteMany, want 1 and 1", conc, a, cm)
			}
			if n := len(got.byIndex(t)); n != 16 || len(got.groups) != 1 {
				t.Errorf("Concurrency %d: %d deliveries settled in %d groups, want 16 in 1", conc, n, len(got.groups))
			}
		}
	})
}

// TestHandleBatchFlushInterval: a slow handler does not hold up the
// settling of the fast ones.
func TestHandleBatchFlushInterval(t *testing.T) {
	batchStores(t, func(t *testing.T, store idem.Store, batched bool) {
		for _, conc := range []int{1, 4} {
			d := newDedup(t, store, idemmsg.Config{Namespace: fmt.Sprint("flush/", t.Name(), conc)})
			keys := []string{"fast-1", "fast-2", "slow", "fast-3"}
			if conc == 1 {
				keys = []string{"fast-1", "fast-2", "slow"}
			}
			var got settlements
			start := time.Now()
			const slow = 300 * time.Millisecond
			err := d.HandleBatch(context.Background(), deliveries(keys...), idemmsg.BatchOptions{Concurrency: conc, FlushInterval: 5 * time.Millisecond},
				func(_ context.Context, i int) error {
					if keys[i] == "slow" {
						time.Sleep(slow)
					}
					return nil
				}, got.settle)
			if err != nil {
				t.Fatal(err)
			}
			res := got.byIndex(t)
			if len(res) != len(keys) {
				t.Fatalf("Concurrency %d: %d settled, want %d", conc, len(res), len(keys))
			}
			if len(got.groups) < 2 || got.at[0].Sub(start) > slow/2 {
				t.Errorf("Concurrency %d: %d groups, the first settled after %v; want the fast ones settled before the slow one finished",
					conc, len(got.groups), got.at[0].Sub(start))
			}
		}
	})
}

// TestHandleBatchConcurrency: handlers overlap up to Concurrency.
func TestHandleBatchConcurrency(t *testing.T) {
	batchStores(t, func(t *testing.T, store idem.Store, batched bool) {
		d := newDedup(t, store, idemmsg.Config{Namespace: "conc/" + t.Name()})
		keys := make([]string, 32)
		for i := range keys {
			keys[i] = fmt.Sprint("k", i)
		}
		var running, peak atomic.Int32
		var got settlements
		err := d.HandleBatch(context.Background(), deliveries(keys...), idemmsg.BatchOptions{Concurrency: 8}, func(context.Context, int) error {
			n := running.Add(1)
			defer running.Add(-1)
			for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
			}
			time.Sleep(5 * time.Millisecond)
			return nil
		}, got.settle)
		if err != nil {
			t.Fatal(err)
		}
		if p := peak.Load(); p < 2 || p > 8 {
			t.Errorf("peak of %d handlers at once, want 2 to 8", p)
		}
		if n := len(got.byIndex(t)); n != len(keys) {
			t.Errorf("%d settled, want %d", n, len(keys))
		}
	})
}

// TestHandleBatchCancel: once ctx ends, handlers not started are not run,
// not settled, and their keys are free at once.
func TestHandleBatchCancel(t *testing.T) {
	batchStores(t, func(t *testing.T, store idem.Store, batched bool) {
		d := newDedup(t, store, idemmsg.Config{Namespace: "cancel/" + t.Name(), Lease: time.Minute})
		ctx, cancel := context.WithCancel(context.Background())
		keys := []string{"c0", "c1", "c2", "c3"}
		var ran []int
		var got settlements
		err := d.HandleBatch(ctx, deliveries(keys...), idemmsg.BatchOptions{}, func(hctx context.Context, i int) error {
			ran = append(ran, i)
			if i == 1 {
				cancel()
				<-hctx.Done()
			}
			return nil
		}, got.settle)
		if err != nil {
			t.Fatal(err)
		}
		if fmt.Sprint(ran) != "[0 1]" {
			t.Errorf("handlers ran for %v, want [0 1]", ran)
		}
		res := got.byIndex(t)
		if len(res) != 2 || res[0].Result.Outcome != idemmsg.Executed || res[1].Result.Outcome != idemmsg.Executed {
			t.Errorf("settled: %+v, want 0 and 1 executed", res)
		}
		for _, k := range keys[2:] {
			if r := handle(t, d, idemmsg.Delivery{Key: k}, ok); r.Outcome != idemmsg.Executed {
				t.Errorf("%s after the cancelled batch: got %v, want executed at once", k, r.Outcome)
			}
		}
	})
}

// TestHandleBatchPanic: a handler's panic goes on after the batch is
// cleaned up: its key and those not started released, the decided ones
// recorded and settled.
func TestHandleBatchPanic(t *testing.T) {
	batchStores(t, func(t *testing.T, store idem.Store, batched bool) {
		for _, conc := range []int{1, 3} {
			d := newDedup(t, store, idemmsg.Config{Namespace: fmt.Sprint("panic/", t.Name(), conc), Lease: time.Minute})
			keys := []string{"p0", "p1", "p2", "p3", "p4", "p5"}
			var got settlements
			func() {
				defer func() {
					if v := recover(); v != "boom" {
						t.Errorf("Concurrency %d: recovered %v, want boom", conc, v)
					}
				}()
				d.HandleBatch(context.Background(), deliveries(keys...), idemmsg.BatchOptions{Concurrency: conc}, func(_ context.Context, i int) error {
					if i == 1 {
						time.Sleep(20 * time.Millisecond)
						panic("boom")
					}
					return nil
				}, got.settle)
			}()
			res := got.byIndex(t)
			if st, ok := res[0]; !ok || st.Result.Outcome != idemmsg.Executed {
				t.Errorf("Concurrency %d: delivery 0: got %+v, want executed and settled", conc, st)
			}
			if _, ok := res[1]; ok {
				t.Errorf("Concurrency %d: the panicking delivery was settled", conc)
			}
			for i, k := range keys {
				r := handle(t, d, idemmsg.Delivery{Key: k}, ok)
				want := idemmsg.Executed // released, or never taken
				if _, settled := res[i]; settled {
					want = idemmsg.Replayed
				}
				if r.Outcome != want {
					t.Errorf("Concurrency %d: %s after the panic: got %v, want %v", conc, k, r.Outcome, want)
				}
			}
		}
	})
}

// TestHandleBatchSettleError: an error from settle stops the batch as a
// crash would.
func TestHandleBatchSettleError(t *testing.T) {
	stores(t, func(t *testing.T, store idem.Store) {
		d := newDedup(t, store, idemmsg.Config{Namespace: "crash/" + t.Name(), Lease: time.Minute})
		crash := errors.New("crash")
		keys := []string{"s0", "s1", "s2", "s3"}
		var ran atomic.Int32
		calls := 0
		err := d.HandleBatch(context.Background(), deliveries(keys...), idemmsg.BatchOptions{FlushInterval: time.Millisecond},
			func(context.Context, int) error {
				ran.Add(1)
				time.Sleep(10 * time.Millisecond)
				return nil
			}, func([]idemmsg.Settled) error { calls++; return crash })
		if !errors.Is(err, crash) {
			t.Fatalf("HandleBatch: got %v, want the settle error", err)
		}
		if calls != 1 || ran.Load() > 2 {
			t.Errorf("settle called %d times, %d handlers ran; want 1 and at most 2", calls, ran.Load())
		}
		// The deliveries not recorded keep their leases, as after a crash.
		if r := handle(t, d, idemmsg.Delivery{Key: "s3"}, ok); r.Outcome != idemmsg.InFlight {
			t.Errorf("s3 after the crash: got %v, want in flight", r.Outcome)
		}
	})
}

// TestHandleBatchInOrder: with InOrder, a failure or an InFlight stops the
// handlers after it; the rest is left undecided, with its keys free.
func TestHandleBatchInOrder(t *testing.T) {
	batchStores(t, func(t *testing.T, store idem.Store, batched bool) {
		ctx := context.Background()
		d := newDedup(t, store, idemmsg.Config{Namespace: "inorder/" + t.Name(), Lease: time.Minute, MaxFailures: 3})
		handle(t, d, idemmsg.Delivery{Key: "done"}, ok)
		held, _ := d.Key("held")
		if _, err := store.Acquire(ctx, idem.AcquireRequest{Key: held, LeaseID: idem.NewLeaseID(), TTL: time.Minute}); err != nil {
			t.Fatal(err)
		}
		for _, tt := range []struct {
			keys    []string
			fail    string
			ran     string
			settled string
		}{
			{keys: []string{"a1", "b1", "c1"}, fail: "b1", ran: "[a1 b1]", settled: "[0 1]"},
			{keys: []string{"a2", "held", "c2"}, ran: "[a2]", settled: "[0 1]"},
			{keys: []string{"a3", "done", "c3"}, ran: "[a3 c3]", settled: "[0 1 2]"},
		} {
			var ran []string
			var got settlements
			err := d.HandleBatch(ctx, deliveries(tt.keys...), idemmsg.BatchOptions{InOrder: true, Concurrency: 8}, func(_ context.Context, i int) error {
				ran = append(ran, tt.keys[i])
				if tt.keys[i] == tt.fail {
					return errors.New("fails")
				}
				return nil
			}, got.settle)
			if err != nil {
				t.Fatal(err)
			}
			res := got.byIndex(t)
			var idx []int
			for i := range tt.keys {
				if _, ok := res[i]; ok {
					idx = append(idx, i)
				}
			}
			if fmt.Sprint(ran) != tt.ran || fmt.Sprint(idx) != tt.settled {
				t.Errorf("%v: ran %v, settled %v; want %s and %s", tt.keys, ran, idx, tt.ran, tt.settled)
			}
			last := tt.keys[len(tt.keys)-1]
			if want := tt.settled != "[0 1 2]"; want {
				if r := handle(t, d, idemmsg.Delivery{Key: last}, ok); r.Outcome != idemmsg.Executed {
					t.Errorf("%s, left undecided: got %v, want executed at once", last, r.Outcome)
				}
			}
		}
	})
}
