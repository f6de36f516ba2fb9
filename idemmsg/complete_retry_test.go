package idemmsg_test

import (
	"context"
	"testing"
	"time"

	"github.com/idemkit/idem/idemmsg"
	"github.com/idemkit/idem/idemmsg/internal/msgtest"
)

// storeDownFor takes the store behind p away now and brings it back after
// d, in the background; the returned function waits for that.
func storeDownFor(t *testing.T, p *msgtest.Proxy, d time.Duration) (wait func()) {
	t.Helper()
	p.Reset(t)
	back := make(chan struct{})
	go func() {
		defer close(back)
		time.Sleep(d)
		p.Restore(t)
	}()
	t.Cleanup(func() { <-back })
	return func() { <-back }
}

// The store goes down after the handler's effect and before its result
// is recorded, and is back a second later: the completion is tried again
// (Config.CompleteRetry, on by default), the delivery is Executed with no
// error, and a redelivery is Replayed, not run again.
func TestCompleteRetriedWhileStoreDown(t *testing.T) {
	store, p := msgtest.RedisStore(t)
	d := newDedup(t, store, idemmsg.Config{Namespace: "q"})
	ctx := context.Background()
	var back func()
	res, err := d.Handle(ctx, idemmsg.Delivery{Key: "k", Attempt: 1}, func(context.Context) error {
		back = storeDownFor(t, p, time.Second)
		return nil
	})
	if res.Outcome != idemmsg.Executed || err != nil {
		t.Fatalf("Handle with the store down for 1s after the handler: got %v, %v; want executed, nil", res.Outcome, err)
	}
	back()
	ran := false
	res, err = d.Handle(ctx, idemmsg.Delivery{Key: "k", Attempt: 2}, func(context.Context) error { ran = true; return nil })
	if res.Outcome != idemmsg.Replayed || err != nil || ran {
		t.Fatalf("redelivery: got %v, %v (ran %t); want replayed, nil, not run", res.Outcome, err, ran)
	}
}

// The same for a batch: the store goes down in the first handler and is
// back a second later; every delivery is Executed with no error, and
// replays.
func TestHandleBatchCompleteRetriedWhileStoreDown(t *testing.T) {
	for _, batched := range []bool{true, false} {
		name := "batch"
		if !batched {
			name = "single"
		}
		t.Run(name, func(t *testing.T) {
			store, p := msgtest.RedisStore(t)
			if !batched {
				store = plainStore{store}
			}
			d := newDedup(t, store, idemmsg.Config{Namespace: "q"})
			ctx := context.Background()
			dls := deliveries("a", "b", "c")
			var back func()
			var s settlements
			err := d.HandleBatch(ctx, dls, idemmsg.BatchOptions{}, func(_ context.Context, i int) error {
				if i == 0 {
					back = storeDownFor(t, p, time.Second)
				}
				return nil
			}, s.settle)
			if err != nil {
				t.Fatal(err)
			}
			got := s.byIndex(t)
			for i := range dls {
				if st := got[i]; st.Result.Outcome != idemmsg.Executed || st.Err != nil {
					t.Errorf("delivery %d: got %v, %v; want executed, nil", i, st.Result.Outcome, st.Err)
				}
			}
			back()
			var again settlements
			err = d.HandleBatch(ctx, dls, idemmsg.BatchOptions{}, func(_ context.Context, i int) error {
				t.Errorf("redelivery: handler %d ran", i)
				return nil
			}, again.settle)
			if err != nil {
				t.Fatal(err)
			}
			got = again.byIndex(t)
			for i := range dls {
				if st := got[i]; st.Result.Outcome != idemmsg.Replayed || st.Err != nil {
					t.Errorf("redelivery %d: got %v, %v; want replayed, nil", i, st.Result.Outcome, st.Err)
				}
			}
		})
	}
}

// CompleteRetry defaults to the lease; negative turns the retries off.
func TestCompleteRetryConfig(t *testing.T) {
	store, _ := msgtest.RedisStore(t)
	for _, c := range []struct{ in, lease, want time.Duration }{
		{0, 0, 30 * time.Second},
		{0, time.Minute, time.Minute},
		{5 * time.Second, 0, 5 * time.Second},
		{-1, 0, -1},
	} {
		d := newDedup(t, store, idemmsg.Config{CompleteRetry: c.in, Lease: c.lease})
		if got := d.Config().CompleteRetry; got != c.want {
			t.Errorf("CompleteRetry %v, Lease %v: got %v, want %v", c.in, c.lease, got, c.want)
		}
	}
}
