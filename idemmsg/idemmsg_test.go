package idemmsg_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemmsg"
	"github.com/idemkit/idem/internal/redisserver"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/redisstore"
)

var srv *redisserver.Server

func TestMain(m *testing.M) { os.Exit(redistest.Run(m, &srv)) }

// stores runs f once per store: memory and a private redis-server.
func stores(t *testing.T, f func(t *testing.T, store idem.Store)) {
	t.Run("memstore", func(t *testing.T) { f(t, memstore.New(memstore.Options{})) })
	t.Run("redisstore", func(t *testing.T) {
		c := redis.NewClient(&redis.Options{Addr: srv.Addr()})
		t.Cleanup(func() { c.Close() })
		s, err := redisstore.New(c, redisstore.Options{Prefix: fmt.Sprintf("idemmsg-test:%s:%d:", t.Name(), time.Now().UnixNano())})
		if err != nil {
			t.Fatal(err)
		}
		f(t, s)
	})
}

func newDedup(t *testing.T, store idem.Store, cfg idemmsg.Config) *idemmsg.Deduplicator {
	t.Helper()
	d, err := idemmsg.New(store, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func handle(t *testing.T, d *idemmsg.Deduplicator, dl idemmsg.Delivery, fn func(context.Context) error) idemmsg.Result {
	t.Helper()
	res, err := d.Handle(context.Background(), dl, fn)
	if err != nil {
		t.Fatalf("Handle(%+v): %v", dl, err)
	}
	return res
}

func ok(context.Context) error { return nil }

func TestOutcomes(t *testing.T) {
	stores(t, func(t *testing.T, store idem.Store) {
		d := newDedup(t, store, idemmsg.Config{Namespace: "orders/g1", MaxFailures: 3, Lease: time.Second})
		var runs atomic.Int32
		count := func(context.Context) error { runs.Add(1); return nil }

		// Executed, then Replayed.
		if res := handle(t, d, idemmsg.Delivery{Key: "m1", Attempt: 1}, count); res.Outcome != idemmsg.Executed || res.Err != nil {
			t.Fatalf("first delivery: got %+v, want executed", res)
		}
		if res := handle(t, d, idemmsg.Delivery{Key: "m1", Attempt: 2}, count); res.Outcome != idemmsg.Replayed {
			t.Fatalf("second delivery: got %v, want replayed", res.Outcome)
		}
		if got := runs.Load(); got != 1 {
			t.Fatalf("handler ran %d times, want 1", got)
		}

		// Released: the key is free, and the next delivery runs again.
		boom := errors.New("boom")
		res := handle(t, d, idemmsg.Delivery{Key: "m2", Attempt: 1}, func(context.Context) error { return boom })
		if res.Outcome != idemmsg.Released || !errors.Is(res.Err, boom) {
			t.Fatalf("failing delivery: got %+v, want released with boom", res)
		}
		if res := handle(t, d, idemmsg.Delivery{Key: "m2", Attempt: 2}, count); res.Outcome != idemmsg.Executed {
			t.Fatalf("retry after failure: got %v, want executed", res.Outcome)
		}

		// InFlight while another consumer holds the key.
		started, release := make(chan struct{}), make(chan struct{})
		done := make(chan idemmsg.Result)
		go func() {
			res, _ := d.Handle(context.Background(), idemmsg.Delivery{Key: "m3", Attempt: 1}, func(context.Context) error {
				close(started)
				<-release
				return nil
			})
			done <- res
		}()
		<-started
		res = handle(t, d, idemmsg.Delivery{Key: "m3", Attempt: 1}, count)
		if res.Outcome != idemmsg.InFlight || res.RetryAfter <= 0 || res.RetryAfter > time.Second {
			t.Fatalf("concurrent delivery: got %+v, want in_flight with 0 < RetryAfter <= 1s", res)
		}
		close(release)
		if res := <-done; res.Outcome != idemmsg.Executed {
			t.Fatalf("holder: got %v, want executed", res.Outcome)
		}
		if got := runs.Load(); got != 2 {
			t.Fatalf("handler ran %d times, want 2", got)
		}
	})
}

func TestDeadLetter(t *testing.T) {
	stores(t, func(t *testing.T, store idem.Store) {
		d := newDedup(t, store, idemmsg.Config{Namespace: "q", MaxFailures: 3})
		var runs atomic.Int32
		poison := func(context.Context) error { runs.Add(1); return fmt.Errorf("bad payload %d", runs.Load()) }
		for attempt := 1; attempt <= 2; attempt++ {
			if res := handle(t, d, idemmsg.Delivery{Key: "p", Attempt: attempt}, poison); res.Outcome != idemmsg.Released {
				t.Fatalf("attempt %d: got %v, want released", attempt, res.Outcome)
			}
		}
		res := handle(t, d, idemmsg.Delivery{Key: "p", Attempt: 3}, poison)
		if res.Outcome != idemmsg.DeadLettered || res.Err == nil || res.Err.Error() != "bad payload 3" {
			t.Fatalf("attempt 3: got %+v, want dead_lettered with 'bad payload 3'", res)
		}
		// Later deliveries, whatever their count, are dead-lettered without
		// running, with the kept error.
		for _, attempt := range []int{1, 4} {
			res := handle(t, d, idemmsg.Delivery{Key: "p", Attempt: attempt}, poison)
			var dle *idemmsg.DeadLetterError
			if res.Outcome != idemmsg.DeadLettered || !errors.As(res.Err, &dle) || dle.Text != "bad payload 3" {
				t.Fatalf("redelivery (attempt %d): got %+v, want dead_lettered with kept 'bad payload 3'", attempt, res)
			}
		}
		if got := runs.Load(); got != 3 {
			t.Fatalf("handler ran %d times, want 3", got)
		}
		// The stored record tells the outcome apart.
		k, _ := d.Key("p")
		rec, found, err := store.Get(context.Background(), k)
		if err != nil || !found {
			t.Fatalf("Get: found %v, err %v", found, err)
		}
		if rec.Response.Status != idemmsg.StatusDeadLettered || rec.Response.Header.Get(idemmsg.OutcomeHeader) != "dead-lettered" {
			t.Fatalf("stored response: got %d %v, want %d with %s: dead-lettered",
				rec.Response.Status, rec.Response.Header, idemmsg.StatusDeadLettered, idemmsg.OutcomeHeader)
		}
		// MaxFailures 1 dead-letters on the first failure; a long error
		// text is cut.
		d1 := newDedup(t, store, idemmsg.Config{Namespace: "q1", MaxFailures: 1})
		long := strings.Repeat("x", 2*idemmsg.MaxErrorText)
		handle(t, d1, idemmsg.Delivery{Key: "p"}, func(context.Context) error { return errors.New(long) })
		res = handle(t, d1, idemmsg.Delivery{Key: "p"}, ok)
		if res.Outcome != idemmsg.DeadLettered || len(res.Err.Error()) != idemmsg.MaxErrorText {
			t.Fatalf("MaxFailures 1: got %v with %d-byte error, want dead_lettered with %d bytes",
				res.Outcome, len(res.Err.Error()), idemmsg.MaxErrorText)
		}
	})
}

func TestConcurrentDeliveries(t *testing.T) {
	stores(t, func(t *testing.T, store idem.Store) {
		d := newDedup(t, store, idemmsg.Config{Namespace: "q", Lease: 5 * time.Second})
		var runs atomic.Int32
		const n = 32
		var wg sync.WaitGroup
		outcomes := make([]idemmsg.Outcome, n)
		errs := make([]error, n)
		start := make(chan struct{})
		for i := range n {
			wg.Go(func() {
				<-start
				res, err := d.Handle(context.Background(), idemmsg.Delivery{Key: "same", Attempt: 1}, func(context.Context) error {
					runs.Add(1)
					time.Sleep(20 * time.Millisecond)
					return nil
				})
				outcomes[i], errs[i] = res.Outcome, err
			})
		}
		close(start)
		wg.Wait()
		if got := runs.Load(); got != 1 {
			t.Fatalf("handler ran %d times, want 1", got)
		}
		executed := 0
		for i, o := range outcomes {
			if errs[i] != nil {
				t.Fatalf("delivery %d: %v", i, errs[i])
			}
			switch o {
			case idemmsg.Executed:
				executed++
			case idemmsg.InFlight, idemmsg.Replayed:
			default:
				t.Fatalf("delivery %d: got %v, want executed, in_flight or replayed", i, o)
			}
		}
		if executed != 1 {
			t.Fatalf("got %d executed, want 1", executed)
		}
	})
}

func TestPanicReleases(t *testing.T) {
	stores(t, func(t *testing.T, store idem.Store) {
		d := newDedup(t, store, idemmsg.Config{Namespace: "q"})
		func() {
			defer func() {
				if r := recover(); r != "kaboom" {
					t.Fatalf("recovered %v, want kaboom", r)
				}
			}()
			d.Handle(context.Background(), idemmsg.Delivery{Key: "k", Attempt: 1}, func(context.Context) error { panic("kaboom") })
			t.Fatal("Handle returned, want panic")
		}()
		// Released: the next delivery runs at once (not InFlight).
		if res := handle(t, d, idemmsg.Delivery{Key: "k", Attempt: 2}, ok); res.Outcome != idemmsg.Executed {
			t.Fatalf("after panic: got %v, want executed", res.Outcome)
		}
	})
}

func TestFencingToken(t *testing.T) {
	stores(t, func(t *testing.T, store idem.Store) {
		d := newDedup(t, store, idemmsg.Config{Namespace: "q"})
		var tokens []uint64
		want, _ := d.Key("k")
		grab := func(fail bool) func(ctx context.Context) error {
			return func(ctx context.Context) error {
				l, found := idem.LeaseFromContext(ctx)
				if !found || l.Key != want || l.Token == 0 {
					t.Errorf("LeaseFromContext: got %+v, %v; want the lease of %v", l, found, want)
				}
				tokens = append(tokens, l.Token)
				if fail {
					return errors.New("retry")
				}
				return nil
			}
		}
		handle(t, d, idemmsg.Delivery{Key: "k", Attempt: 1}, grab(true))
		handle(t, d, idemmsg.Delivery{Key: "k", Attempt: 2}, grab(false))
		if len(tokens) != 2 || tokens[1] <= tokens[0] {
			t.Fatalf("tokens %v: want two, strictly increasing", tokens)
		}
	})
}

func TestLeaseRenewedWhileHandlerRuns(t *testing.T) {
	stores(t, func(t *testing.T, store idem.Store) {
		var renewals atomic.Int32
		// A lease long enough that a renewal (every third of it) is not
		// lost to scheduling delays on a loaded machine.
		d := newDedup(t, store, idemmsg.Config{Namespace: "q", Lease: 300 * time.Millisecond,
			OnRenew: func(idem.Key, error) { renewals.Add(1) }})
		var other idemmsg.Result
		res := handle(t, d, idemmsg.Delivery{Key: "slow", Attempt: 1}, func(ctx context.Context) error {
			time.Sleep(750 * time.Millisecond) // more than two leases
			other, _ = d.Handle(context.Background(), idemmsg.Delivery{Key: "slow", Attempt: 1}, ok)
			return context.Cause(ctx)
		})
		if res.Outcome != idemmsg.Executed || other.Outcome != idemmsg.InFlight || renewals.Load() == 0 {
			t.Fatalf("got %v, other delivery %v, %d renewals; want executed, in_flight, some renewals",
				res.Outcome, other.Outcome, renewals.Load())
		}
	})
}

func TestStoreDown(t *testing.T) {
	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1, DialTimeout: 200 * time.Millisecond})
	defer c.Close()
	s, err := redisstore.New(c, redisstore.Options{Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	d := newDedup(t, s, idemmsg.Config{Namespace: "q"})
	ran := false
	res, err := d.Handle(context.Background(), idemmsg.Delivery{Key: "k", Attempt: 1}, func(context.Context) error { ran = true; return nil })
	var se *idem.StoreError
	if !errors.As(err, &se) || res != (idemmsg.Result{}) || ran {
		t.Fatalf("got %+v, %v (ran %v); want zero Result, *idem.StoreError, not run", res, err, ran)
	}
	// A cancelled context is a StoreError too, and nothing runs.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	d2 := newDedup(t, memstore.New(memstore.Options{}), idemmsg.Config{})
	_, err = d2.Handle(ctx, idemmsg.Delivery{Key: "k"}, func(context.Context) error { ran = true; return nil })
	if !errors.As(err, &se) || ran {
		t.Fatalf("cancelled context: got %v (ran %v), want *idem.StoreError, not run", err, ran)
	}
}

func TestKeyValidation(t *testing.T) {
	d := newDedup(t, memstore.New(memstore.Options{}), idemmsg.Config{})
	for _, key := range []string{"", strings.Repeat("k", idem.MaxKeyLen+1), "bad\nkey"} {
		ran := false
		res, err := d.Handle(context.Background(), idemmsg.Delivery{Key: key, Attempt: 1}, func(context.Context) error { ran = true; return nil })
		if !errors.Is(err, idem.ErrInvalidKey) || res.Outcome != idemmsg.NoOutcome || ran {
			t.Errorf("key %q: got %+v, %v (ran %v); want idem.ErrInvalidKey, not run", key, res, err, ran)
		}
	}
	if res := handle(t, d, idemmsg.Delivery{Key: strings.Repeat("k", idem.MaxKeyLen)}, ok); res.Outcome != idemmsg.Executed {
		t.Errorf("255-byte key: got %v, want executed", res.Outcome)
	}
}

func TestNamespaceScopes(t *testing.T) {
	store := memstore.New(memstore.Options{})
	a := newDedup(t, store, idemmsg.Config{Namespace: "orders/billing"})
	b := newDedup(t, store, idemmsg.Config{Namespace: "orders/shipping"})
	for _, d := range []*idemmsg.Deduplicator{a, b} {
		if res := handle(t, d, idemmsg.Delivery{Key: "m"}, ok); res.Outcome != idemmsg.Executed {
			t.Fatalf("got %v, want executed in each namespace", res.Outcome)
		}
	}
}

func TestFingerprint(t *testing.T) {
	d := newDedup(t, memstore.New(memstore.Options{}), idemmsg.Config{
		Fingerprint: func(dl idemmsg.Delivery) idem.Fingerprint { return idem.SumFingerprint(dl.Body) },
	})
	handle(t, d, idemmsg.Delivery{Key: "m", Body: []byte("a")}, ok)
	if res := handle(t, d, idemmsg.Delivery{Key: "m", Body: []byte("a")}, ok); res.Outcome != idemmsg.Replayed {
		t.Fatalf("same body: got %v, want replayed", res.Outcome)
	}
	if _, err := d.Handle(context.Background(), idemmsg.Delivery{Key: "m", Body: []byte("b")}, ok); !errors.Is(err, idem.ErrMismatch) {
		t.Fatalf("other body: got %v, want idem.ErrMismatch", err)
	}
	// Without Fingerprint, identical keys with other content are duplicates.
	d2 := newDedup(t, memstore.New(memstore.Options{}), idemmsg.Config{})
	handle(t, d2, idemmsg.Delivery{Key: "m", Body: []byte("a")}, ok)
	if res := handle(t, d2, idemmsg.Delivery{Key: "m", Body: []byte("b")}, ok); res.Outcome != idemmsg.Replayed {
		t.Fatalf("no fingerprint: got %v, want replayed", res.Outcome)
	}
}

func TestNewValidates(t *testing.T) {
	if _, err := idemmsg.New(nil, idemmsg.Config{}); err == nil {
		t.Error("nil store: got nil error")
	}
	var typedNil *memstore.Store
	if _, err := idemmsg.New(typedNil, idemmsg.Config{}); err == nil {
		t.Error("typed nil store: got nil error")
	}
	s := memstore.New(memstore.Options{})
	if _, err := idemmsg.New(s, idemmsg.Config{MaxFailures: -1}); err == nil {
		t.Error("negative MaxFailures: got nil error")
	}
	if _, err := idemmsg.New(s, idemmsg.Config{Lease: time.Millisecond}); err == nil {
		t.Error("1ms lease: got nil error")
	}
	d := newDedup(t, s, idemmsg.Config{})
	if c := d.Config(); c.Lease != idem.DefaultLease || c.Retention != idem.DefaultRetention || c.MaxFailures != idemmsg.DefaultMaxFailures {
		t.Errorf("defaults: got %+v", c)
	}
}

// A handler stopped from outside on its last allowed attempt (the consumer
// shutting down) failed for a reason that is not the message's: it is
// Released (the key freed), never dead-lettered, and the next delivery runs.
func TestCancelledHandlerNotDeadLettered(t *testing.T) {
	d := newDedup(t, memstore.New(memstore.Options{}), idemmsg.Config{MaxFailures: 1})
	ctx, cancel := context.WithCancel(context.Background())
	res, _ := d.Handle(ctx, idemmsg.Delivery{Key: "k", Attempt: 1}, func(ctx context.Context) error {
		cancel() // shutdown while the handler runs
		<-ctx.Done()
		return ctx.Err()
	})
	if res.Outcome != idemmsg.Released {
		t.Fatalf("cancelled handler: got %v, want Released", res.Outcome)
	}
	ran := false
	res, err := d.Handle(context.Background(), idemmsg.Delivery{Key: "k", Attempt: 2}, func(context.Context) error { ran = true; return nil })
	if err != nil || res.Outcome != idemmsg.Executed || !ran {
		t.Fatalf("next delivery: got %v, ran %t, %v; want Executed", res.Outcome, ran, err)
	}
}

// TestOutcomeNames: every Outcome prints its name, the zero one (the
// Outcome of the Result that comes with an error) too.
func TestOutcomeNames(t *testing.T) {
	for o, want := range map[idemmsg.Outcome]string{
		idemmsg.NoOutcome: "none", idemmsg.Executed: "executed", idemmsg.Replayed: "replayed",
		idemmsg.InFlight: "in_flight", idemmsg.Released: "released", idemmsg.DeadLettered: "dead_lettered",
	} {
		if got := o.String(); got != want {
			t.Errorf("Outcome(%d).String(): got %q, want %q", uint8(o), got, want)
		}
	}
	if idemmsg.NoOutcome.Ack() {
		t.Error("NoOutcome.Ack(): got true, want false")
	}
}

// TestStoredRecordsKeepTheirForm: the records an earlier release wrote (the
// literal status and header, not the constants) are read as before: an
// executed key as Replayed, a dead-lettered one as DeadLettered with its
// kept text. Renaming the outcomes changed no stored value.
func TestStoredRecordsKeepTheirForm(t *testing.T) {
	store := memstore.New(memstore.Options{})
	d := newDedup(t, store, idemmsg.Config{Namespace: "q"})
	g, err := idem.New(store, idem.Config{})
	if err != nil {
		t.Fatal(err)
	}
	for msgKey, resp := range map[string]*idem.Response{
		"done": {Status: 200},
		"dead": {Status: 500, Header: map[string][]string{"Idem-Outcome": {"dead-lettered"}}, Body: []byte("poison")},
	} {
		key, err := d.Key(msgKey)
		if err != nil {
			t.Fatal(err)
		}
		att, acq, err := g.Begin(context.Background(), key, idem.Fingerprint{})
		if err != nil || acq.Outcome != idem.Acquired {
			t.Fatalf("Begin %s: got %v, %v", msgKey, acq.Outcome, err)
		}
		if err := att.Complete(context.Background(), resp); err != nil {
			t.Fatal(err)
		}
	}
	ran := false
	fn := func(context.Context) error { ran = true; return nil }
	if res := handle(t, d, idemmsg.Delivery{Key: "done"}, fn); res.Outcome != idemmsg.Replayed || res.Err != nil {
		t.Errorf("executed key: got %v, %v; want replayed", res.Outcome, res.Err)
	}
	res := handle(t, d, idemmsg.Delivery{Key: "dead"}, fn)
	if res.Outcome != idemmsg.DeadLettered || res.Err == nil || res.Err.Error() != "poison" {
		t.Errorf("dead-lettered key: got %v, %v; want dead_lettered, poison", res.Outcome, res.Err)
	}
	if ran {
		t.Error("the handler ran for a completed key")
	}
	if idemmsg.StatusExecuted != 200 || idemmsg.StatusDeadLettered != 500 || idemmsg.OutcomeHeader != "Idem-Outcome" {
		t.Errorf("stored constants: got %d, %d, %q; want 200, 500, Idem-Outcome",
			idemmsg.StatusExecuted, idemmsg.StatusDeadLettered, idemmsg.OutcomeHeader)
	}
}
