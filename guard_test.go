package idem_test

import (
	"bytes"
	"context"
	"errors"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
)

func TestNewValidates(t *testing.T) {
	s := memstore.New(memstore.Options{})
	if _, err := idem.New(nil, idem.Config{}); err == nil {
		t.Error("nil store: got nil error, want one")
	}
	// What a caller that ignored Open's error passes: a typed nil.
	var typedNil *memstore.Store
	if _, err := idem.New(typedNil, idem.Config{}); err == nil || !strings.Contains(err.Error(), "nil Store") {
		t.Errorf("typed nil store: got %v, want the nil Store error", err)
	}
	for _, cfg := range []idem.Config{
		{Lease: 5 * time.Millisecond},
		{Lease: -time.Second},
		{Retention: -time.Hour},
		{MaxResponseSize: -1},
		{MaxResponseSize: idem.MaxEncodedBody + 1},
	} {
		if _, err := idem.New(s, cfg); err == nil {
			t.Errorf("New(%+v): got nil error, want one", cfg)
		}
	}
	g, err := idem.New(s, idem.Config{})
	if err != nil {
		t.Fatal(err)
	}
	want := idem.Config{Lease: idem.DefaultLease, Retention: idem.DefaultRetention, MaxResponseSize: idem.DefaultMaxResponseSize}
	if got := g.Config(); got.Lease != want.Lease || got.Retention != want.Retention || got.MaxResponseSize != want.MaxResponseSize {
		t.Errorf("defaults: got %+v, want %+v", got, want)
	}
}

func TestDoOmitsLargeBodyWithoutRerunning(t *testing.T) {
	g, err := idem.New(memstore.New(memstore.Options{}), idem.Config{MaxResponseSize: 10})
	if err != nil {
		t.Fatal(err)
	}
	key, _ := idem.Scope{}.Key("big")
	var runs atomic.Int32
	work := func(context.Context) (*idem.Response, error) {
		runs.Add(1)
		return &idem.Response{Status: 200, Body: bytes.Repeat([]byte("x"), 11)}, nil
	}
	first, err := g.Do(context.Background(), key, idem.Fingerprint{}, work)
	if err != nil || len(first.Response.Body) != 11 {
		t.Fatalf("first Do: got %+v, %v; want the full 11-byte body", first, err)
	}
	again, err := g.Do(context.Background(), key, idem.Fingerprint{}, work)
	if err != nil || !again.Replayed || !again.Response.BodyOmitted || len(again.Response.Body) != 0 || again.Response.Status != 200 {
		t.Fatalf("repeat: got %+v (%+v), %v; want a replay of status 200 with BodyOmitted", again, again.Response, err)
	}
	if n := runs.Load(); n != 1 {
		t.Fatalf("work ran %d times, want 1", n)
	}
}

func TestDoCancelledContext(t *testing.T) {
	g, _ := idem.New(memstore.New(memstore.Options{}), idem.Config{})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	key, _ := idem.Scope{}.Key("k")
	_, err := g.Do(ctx, key, idem.Fingerprint{}, func(context.Context) (*idem.Response, error) {
		t.Error("work ran with a cancelled context")
		return nil, nil
	})
	var se *idem.StoreError
	if !errors.As(err, &se) || !errors.Is(err, context.Canceled) {
		t.Fatalf("got %v, want a *StoreError wrapping context.Canceled", err)
	}
}

func TestDoMismatchAndInFlight(t *testing.T) {
	g, _ := idem.New(memstore.New(memstore.Options{}), idem.Config{})
	ctx := context.Background()
	key, _ := idem.Scope{}.Key("k")
	a, b := idem.Fingerprint{1}, idem.Fingerprint{2}
	_, err := g.Do(ctx, key, a, func(ctx context.Context) (*idem.Response, error) {
		_, err := g.Do(ctx, key, a, func(context.Context) (*idem.Response, error) { return nil, nil })
		var inFlight *idem.InFlightError
		if !errors.As(err, &inFlight) || !errors.Is(err, idem.ErrInFlight) || inFlight.RetryAfter <= 0 {
			t.Errorf("Do while in flight: got %v, want an *InFlightError with RetryAfter > 0", err)
		}
		return &idem.Response{Status: 200}, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := g.Do(ctx, key, b, func(context.Context) (*idem.Response, error) { return nil, nil }); !errors.Is(err, idem.ErrMismatch) {
		t.Fatalf("Do with another fingerprint: got %v, want ErrMismatch", err)
	}
}

func TestAttemptFinishOnce(t *testing.T) {
	g, _ := idem.New(memstore.New(memstore.Options{}), idem.Config{})
	ctx := context.Background()
	key, _ := idem.Scope{}.Key("k")
	att, acq, err := g.Begin(ctx, key, idem.Fingerprint{})
	if err != nil || acq.Outcome != idem.Acquired || att == nil {
		t.Fatalf("Begin: got %v, %v, %v", att, acq.Outcome, err)
	}
	if err := att.Complete(ctx, &idem.Response{Status: 204}); err != nil {
		t.Fatal(err)
	}
	if context.Cause(att.Context()) == nil {
		t.Error("work context still live after Complete")
	}
	if err := att.Release(ctx); err == nil {
		t.Error("Release after Complete: got nil error, want one")
	}
}

// hangingRenew is a store whose Renew blocks until its context ends.
type hangingRenew struct{ idem.Store }

func (s hangingRenew) Renew(ctx context.Context, _ idem.Lease, _ time.Duration) error {
	<-ctx.Done()
	return ctx.Err()
}

// A renewal in progress must not hold up Complete, nor cost the result.
func TestCompleteDuringSlowRenewal(t *testing.T) {
	g, _ := idem.New(hangingRenew{memstore.New(memstore.Options{})}, idem.Config{Lease: 3 * time.Second})
	ctx := context.Background()
	key, _ := idem.Scope{}.Key("k")
	att, _, err := g.Begin(ctx, key, idem.Fingerprint{})
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(1100 * time.Millisecond) // past a third of the lease: a renewal hangs
	start := time.Now()
	if err := att.Complete(ctx, &idem.Response{Status: 200}); err != nil {
		t.Fatalf("Complete: got %v, want nil (the lease is still valid)", err)
	}
	// Waiting for the renewal would take the lease's remaining 1.9s;
	// the bound leaves room for a loaded machine.
	if took := time.Since(start); took > time.Second {
		t.Errorf("Complete waited %v for the hanging renewal", took)
	}
}

// failingComplete is a store whose Complete fails like a broken network.
type failingComplete struct{ idem.Store }

func (s failingComplete) Complete(context.Context, idem.Lease, *idem.Response, time.Duration) error {
	return &idem.StoreError{Op: "complete", Err: errors.New("connection reset")}
}

// When the result cannot be stored, the key is released so that a retry
// need not wait for the lease; a nil response leaves the attempt open.
func TestCompleteFailureReleases(t *testing.T) {
	mem := memstore.New(memstore.Options{})
	g, _ := idem.New(failingComplete{mem}, idem.Config{})
	ctx := context.Background()
	key, _ := idem.Scope{}.Key("k")
	att, _, err := g.Begin(ctx, key, idem.Fingerprint{})
	if err != nil {
		t.Fatal(err)
	}
	if err := att.Complete(ctx, nil); err == nil {
		t.Fatal("Complete(nil): got nil error, want one")
	}
	var se *idem.StoreError
	if err := att.Complete(ctx, &idem.Response{Status: 200}); !errors.As(err, &se) {
		t.Fatalf("Complete: got %v, want the store's error", err)
	}
	if rec, ok, _ := mem.Get(ctx, key); ok && rec.State != idem.StateReleased {
		t.Fatalf("after a failed Complete: got a %v record, want the key released", rec.State)
	}
}

// lostReply is a store whose Acquire is applied but reports an error, as
// when the reply is lost on the way back.
type lostReply struct{ idem.Store }

func (s lostReply) Acquire(ctx context.Context, req idem.AcquireRequest) (idem.Acquisition, error) {
	s.Store.Acquire(ctx, req)
	return idem.Acquisition{}, &idem.StoreError{Op: "acquire", Key: req.Key, Err: errors.New("i/o timeout")}
}

// A failed Acquire may have taken the key: Begin releases that lease in
// the background, so the key does not stay blocked for a whole lease.
func TestBeginReleasesAfterLostReply(t *testing.T) {
	mem := memstore.New(memstore.Options{})
	g, _ := idem.New(lostReply{mem}, idem.Config{Lease: time.Hour})
	ctx := context.Background()
	key, _ := idem.Scope{}.Key("k")
	if _, _, err := g.Begin(ctx, key, idem.Fingerprint{}); err == nil {
		t.Fatal("Begin: got nil error, want the store's")
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		rec, ok, err := mem.Get(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		if ok && rec.State == idem.StateReleased {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("after a lost acquire reply: record %v (present %t), want it released, not in flight for the hour-long lease", rec.State, ok)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// Stop ends an attempt whose record the caller finished itself: the store
// is not touched, the context ends, and the attempt cannot finish twice.
func TestAttemptStop(t *testing.T) {
	mem := memstore.New(memstore.Options{})
	g, _ := idem.New(mem, idem.Config{Lease: 30 * time.Millisecond})
	ctx := context.Background()
	key, _ := idem.Scope{}.Key("k")
	att, _, err := g.Begin(ctx, key, idem.Fingerprint{})
	if err != nil {
		t.Fatal(err)
	}
	// The caller completes the record through the store (as CompleteTx).
	if err := mem.Complete(ctx, att.Lease(), &idem.Response{Status: 201}, time.Hour); err != nil {
		t.Fatal(err)
	}
	if err := att.Stop(); err != nil {
		t.Fatalf("Stop: got %v, want nil", err)
	}
	if context.Cause(att.Context()) == nil {
		t.Error("work context still live after Stop")
	}
	time.Sleep(50 * time.Millisecond) // past a renewal's time: none may run
	if rec, _, _ := mem.Get(ctx, key); rec.State != idem.StateCompleted {
		t.Errorf("after Stop: got a %v record, want the completed one untouched", rec.State)
	}
	if err := att.Release(ctx); err == nil {
		t.Error("Release after Stop: got nil error, want one")
	}
}

// OnRenew sees every background renewal, and the loss of the lease.
func TestOnRenew(t *testing.T) {
	mem := memstore.New(memstore.Options{})
	var mu sync.Mutex
	var results []error
	g, _ := idem.New(mem, idem.Config{Lease: 300 * time.Millisecond, OnRenew: func(_ idem.Key, err error) {
		mu.Lock()
		results = append(results, err)
		mu.Unlock()
	}})
	key, _ := idem.Scope{}.Key("k")
	att, _, _ := g.Begin(context.Background(), key, idem.Fingerprint{})
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) { // past one renewal
		mu.Lock()
		n := len(results)
		mu.Unlock()
		if n > 0 || time.Now().After(deadline) {
			break
		}
	}
	mem.Delete(context.Background(), key) // the lease is gone
	<-att.Context().Done()
	mu.Lock()
	defer mu.Unlock()
	if len(results) < 2 || results[0] != nil || !errors.Is(results[len(results)-1], idem.ErrLeaseLost) {
		t.Fatalf("renewals: got %v, want successes, then ErrLeaseLost", results)
	}
}

// BenchmarkGuardDo measures Guard.Do on memstore: first executions on
// unique keys, and replays.
func BenchmarkGuardDo(b *testing.B) {
	// A short retention keeps the store at a steady size, so each op does
	// not pay for its growth.
	g, _ := idem.New(memstore.New(memstore.Options{}), idem.Config{Retention: 50 * time.Millisecond})
	resp := &idem.Response{Status: 201, Body: []byte(`{"id":"ch_1"}`)}
	work := func(context.Context) (*idem.Response, error) { return resp, nil }
	ctx := context.Background()
	b.Run("execute", func(b *testing.B) {
		b.ReportAllocs()
		var n atomic.Int64
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				key, _ := idem.Scope{Tenant: "bench"}.Key(strconv.FormatInt(n.Add(1), 10))
				if _, err := g.Do(ctx, key, idem.Fingerprint{}, work); err != nil {
					b.Error(err)
					return
				}
			}
		})
	})
	b.Run("replay", func(b *testing.B) {
		g, _ := idem.New(memstore.New(memstore.Options{}), idem.Config{})
		key, _ := idem.Scope{Tenant: "bench"}.Key("replayed")
		g.Do(ctx, key, idem.Fingerprint{}, work)
		b.ReportAllocs()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				if res, err := g.Do(ctx, key, idem.Fingerprint{}, work); err != nil || !res.Replayed {
					b.Errorf("got %v, %v; want a replay", res, err)
					return
				}
			}
		})
	})
}

// countingRenew counts renewals that reach the store.
type countingRenew struct {
	idem.Store
	n *atomic.Int32
}

func (s countingRenew) Renew(ctx context.Context, l idem.Lease, ttl time.Duration) error {
	s.n.Add(1)
	return s.Store.Renew(ctx, l, ttl)
}

// StopRenewal, for a caller about to complete the record in its own
// transaction: no renewal runs after it, the context stays live, and the
// lease is not reported lost once the record completes.
func TestAttemptStopRenewal(t *testing.T) {
	mem := memstore.New(memstore.Options{})
	var renewals atomic.Int32
	var lost atomic.Bool
	g, _ := idem.New(countingRenew{mem, &renewals}, idem.Config{
		Lease:   30 * time.Millisecond,
		OnRenew: func(_ idem.Key, err error) { lost.Store(lost.Load() || errors.Is(err, idem.ErrLeaseLost)) },
	})
	ctx := context.Background()
	key, _ := idem.Scope{}.Key("k")
	att, _, err := g.Begin(ctx, key, idem.Fingerprint{})
	if err != nil {
		t.Fatal(err)
	}
	att.StopRenewal()
	before := renewals.Load()
	if err := mem.Complete(ctx, att.Lease(), &idem.Response{Status: 201}, time.Hour); err != nil {
		t.Fatal(err)
	}
	time.Sleep(60 * time.Millisecond) // several renewal periods
	if n := renewals.Load() - before; n != 0 {
		t.Errorf("%d renewals after StopRenewal, want 0", n)
	}
	if err := context.Cause(att.Context()); err != nil {
		t.Errorf("context ended (%v) after StopRenewal, want it live until Stop", err)
	}
	if lost.Load() {
		t.Error("OnRenew reported the lease lost after StopRenewal")
	}
	if err := att.Stop(); err != nil {
		t.Errorf("Stop: got %v, want nil", err)
	}
}

// notReplicated is a store whose Complete writes the record, then reports
// that too few replicas acknowledged it.
type notReplicated struct {
	idem.Store
	releases *atomic.Int32
}

func (s notReplicated) Complete(ctx context.Context, l idem.Lease, r *idem.Response, ttl time.Duration) error {
	if err := s.Store.Complete(ctx, l, r, ttl); err != nil {
		return err
	}
	return &idem.StoreError{Op: "complete", Key: l.Key, Err: idem.ErrNotReplicated}
}

func (s notReplicated) Release(ctx context.Context, l idem.Lease) error {
	s.releases.Add(1)
	return s.Store.Release(ctx, l)
}

// A completion written but not replicated is not followed by a release
// (it would find the record completed: a wasted round trip), and replays.
func TestCompleteNotReplicated(t *testing.T) {
	mem := memstore.New(memstore.Options{})
	var releases atomic.Int32
	g, _ := idem.New(notReplicated{mem, &releases}, idem.Config{})
	ctx := context.Background()
	key, _ := idem.Scope{}.Key("k")
	att, _, err := g.Begin(ctx, key, idem.Fingerprint{})
	if err != nil {
		t.Fatal(err)
	}
	if err := att.Complete(ctx, &idem.Response{Status: 201}); !errors.Is(err, idem.ErrNotReplicated) {
		t.Fatalf("Complete: got %v, want ErrNotReplicated", err)
	}
	time.Sleep(20 * time.Millisecond) // a background release would have run
	if n := releases.Load(); n != 0 {
		t.Errorf("%d releases after a written completion, want 0", n)
	}
	if rec, _, _ := mem.Get(ctx, key); rec.State != idem.StateCompleted {
		t.Errorf("got a %v record, want completed", rec.State)
	}
}

// A lease lost only locally (no renewal got through in time, while the
// store still holds it) is released in the store by Release and Complete,
// so the key is free at once instead of at the end of the lease.
func TestLocallyLostLeaseReleased(t *testing.T) {
	for _, finish := range []string{"Release", "Complete"} {
		t.Run(finish, func(t *testing.T) {
			mem := memstore.New(memstore.Options{})
			// The store's lease is an hour; the guard's clock says 30ms, and
			// its renewals hang: it gives the lease up locally.
			g, _ := idem.New(hangingRenew{mem}, idem.Config{Lease: 30 * time.Millisecond})
			ctx := context.Background()
			key, _ := idem.Scope{}.Key("k")
			att, _, err := g.Begin(ctx, key, idem.Fingerprint{})
			if err != nil {
				t.Fatal(err)
			}
			if err := mem.Renew(ctx, att.Lease(), time.Hour); err != nil {
				t.Fatal(err)
			}
			select {
			case <-att.Context().Done():
			case <-time.After(5 * time.Second):
				t.Fatal("the guard never gave the lease up")
			}
			if finish == "Release" {
				err = att.Release(ctx)
			} else {
				err = att.Complete(ctx, &idem.Response{Status: 200})
			}
			if !errors.Is(err, idem.ErrLeaseLost) {
				t.Fatalf("%s: got %v, want ErrLeaseLost", finish, err)
			}
			deadline := time.Now().Add(5 * time.Second)
			for {
				rec, _, _ := mem.Get(ctx, key)
				if rec.State == idem.StateReleased {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("after %s: got a %v record, want it released in the store", finish, rec.State)
				}
				time.Sleep(5 * time.Millisecond)
			}
		})
	}
}

// TestOutcomeNames: every Outcome prints its name, the zero one too (it
// comes with an error, and lands in logs and test failures).
func TestOutcomeNames(t *testing.T) {
	for o, want := range map[idem.Outcome]string{
		idem.NoOutcome: "none", idem.Acquired: "acquired", idem.Replay: "replay",
		idem.InFlight: "in_flight", idem.Mismatch: "mismatch",
	} {
		if got := o.String(); got != want {
			t.Errorf("Outcome(%d).String(): got %q, want %q", uint8(o), got, want)
		}
	}
	if got := (idem.Acquisition{}).Outcome.String(); got != "none" {
		t.Errorf("the zero Acquisition's Outcome prints %q, want \"none\"", got)
	}
}

func TestWithLease(t *testing.T) {
	g, err := idem.New(memstore.New(memstore.Options{}), idem.Config{Lease: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	short, err := g.WithLease(50 * time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	if got := short.Config().Lease; got != 50*time.Millisecond {
		t.Errorf("WithLease(50ms).Config().Lease = %v", got)
	}
	if got := g.Config().Lease; got != time.Minute {
		t.Errorf("the original's lease changed to %v", got)
	}
	withLeaseKey, _ := idem.Scope{}.Key("with-lease")
	att, acq, err := short.Begin(t.Context(), withLeaseKey, idem.Fingerprint{})
	if err != nil || acq.Outcome != idem.Acquired {
		t.Fatalf("Begin: %v %v", acq.Outcome, err)
	}
	att.StopRenewal()
	if acq.Lease.TTL != 50*time.Millisecond {
		t.Errorf("the attempt's lease is %v, want 50ms", acq.Lease.TTL)
	}
	if _, err := g.WithLease(time.Millisecond); err == nil {
		t.Error("WithLease(1ms): no error, want one")
	}
}
