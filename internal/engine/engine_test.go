package engine

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
)

// waitingFor returns once n requests wait for a key in e.
func waitingFor(t *testing.T, e *Engine, n int64) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for e.waiters.Waiting() < n {
		if time.Now().After(deadline) {
			t.Fatalf("%d requests wait, want %d", e.waiters.Waiting(), n)
		}
		time.Sleep(time.Millisecond)
	}
}

func newEngine(t *testing.T, cfg Config) *Engine {
	t.Helper()
	return newEngineOn(t, memstore.New(memstore.Options{}), cfg)
}

func newEngineOn(t *testing.T, store idem.Store, cfg Config) *Engine {
	t.Helper()
	cfg.Name = "idemtest"
	cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	e, err := New(store, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return e
}

func key(t *testing.T, k string) idem.Key {
	t.Helper()
	key, err := idem.Scope{Method: "test"}.Key(k)
	if err != nil {
		t.Fatal(err)
	}
	return key
}

// A request's life: run, then replay; another fingerprint is a mismatch.
func TestAcquireDecisions(t *testing.T) {
	e := newEngine(t, Config{})
	ctx := t.Context()
	k, fp, other := key(t, "k"), idem.Fingerprint{1}, idem.Fingerprint{2}
	d := e.Acquire(ctx, ctx, k, fp, "")
	if d.Outcome != OutcomeExecuted || d.Attempt == nil {
		t.Fatalf("first: got %+v, want executed with an attempt", d)
	}
	if d := e.Acquire(ctx, ctx, k, fp, ""); d.Outcome != OutcomeInFlight || d.RetryAfter <= 0 {
		t.Fatalf("while held, no wait: got %+v, want in_flight with a RetryAfter", d)
	}
	w := e.Start(d, nil)
	if err := w.Complete(&idem.Response{Status: 201, Body: []byte("done")}); err != nil {
		t.Fatal(err)
	}
	w.End()
	if d := e.Acquire(ctx, ctx, k, fp, ""); d.Outcome != OutcomeReplayed || string(d.Response.Body) != "done" {
		t.Fatalf("after Complete: got %+v, want the replay", d)
	}
	if d := e.Acquire(ctx, ctx, k, other, ""); d.Outcome != OutcomeMismatch {
		t.Fatalf("other fingerprint: got %+v, want mismatch", d)
	}
}

// With Wait, a duplicate is handed the holder's response; a released key
// is acquired again; a client gone while it waits is gone.
func TestAcquireWait(t *testing.T) {
	e := newEngine(t, Config{Wait: 5 * time.Second})
	ctx := t.Context()
	waiting := func() { waitingFor(t, e, 1) } // the waiter waits for the holder
	k, fp := key(t, "w"), idem.Fingerprint{1}
	d := e.Acquire(ctx, ctx, k, fp, "")
	w := e.Start(d, nil)
	got := make(chan Decision, 1)
	go func() { got <- e.Acquire(ctx, ctx, k, fp, "") }()
	waiting()
	w.Complete(&idem.Response{Status: 200, Body: []byte("handed")})
	w.End()
	// Handed over (the same *Response), or read from the store if the
	// waiter was between two store checks when it was stored.
	if d := <-got; d.Outcome != OutcomeReplayed || string(d.Response.Body) != "handed" {
		t.Fatalf("waiter: got %+v, want the replay", d)
	}

	k = key(t, "released")
	d = e.Acquire(ctx, ctx, k, fp, "")
	w = e.Start(d, nil)
	go func() { got <- e.Acquire(ctx, ctx, k, fp, "") }()
	waiting()
	w.Release()
	w.End()
	d = <-got
	if d.Outcome != OutcomeExecuted {
		t.Fatalf("waiter after a release: got %+v, want executed", d)
	}
	// Still held: the waiter's client leaves.
	gone, cancel := context.WithCancel(ctx)
	time.AfterFunc(50*time.Millisecond, cancel)
	if d := e.Acquire(gone, context.WithoutCancel(gone), k, fp, ""); d.Outcome != OutcomeGone {
		t.Fatalf("client gone while waiting: got %+v, want gone", d)
	}

	// Still held: a request with a deadline nearer than the wait hears
	// "in flight" before its deadline, not nothing at it.
	start := time.Now()
	short, cancelShort := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancelShort()
	if d := e.Acquire(short, context.WithoutCancel(short), k, fp, ""); d.Outcome != OutcomeInFlight {
		t.Fatalf("deadline nearer than the wait: got %+v, want in_flight", d)
	}
	if short.Err() != nil {
		t.Fatalf("deadline nearer than the wait: answered after the deadline (%v)", time.Since(start))
	}
	e.Release(ctx, d.Attempt)
}

// A client gone before the key was acquired: nothing runs, and the key is
// released for its retry.
func TestAcquireClientGone(t *testing.T) {
	e := newEngine(t, Config{})
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	k := key(t, "g")
	if d := e.Acquire(ctx, context.WithoutCancel(ctx), k, idem.Fingerprint{}, ""); d.Outcome != OutcomeGone {
		t.Fatalf("got %+v, want gone", d)
	}
	d := e.Acquire(t.Context(), t.Context(), k, idem.Fingerprint{}, "")
	if d.Outcome != OutcomeExecuted {
		t.Fatalf("retry: got %+v, want executed (the key released)", d)
	}
	e.Release(t.Context(), d.Attempt)
}

// The work context: MaxExecution and StopContext cancel it with their
// causes; Finish outlives it.
func TestWorkContext(t *testing.T) {
	stop, stopNow := context.WithCancel(context.Background())
	defer stopNow()
	e := newEngine(t, Config{MaxExecution: 30 * time.Millisecond, StopContext: stop})
	ctx := t.Context()
	d := e.Acquire(ctx, ctx, key(t, "max"), idem.Fingerprint{}, "")
	w := e.Start(d, nil)
	<-w.Ctx.Done()
	if err := context.Cause(w.Ctx); !errors.Is(err, idem.ErrMaxExecution) {
		t.Fatalf("past MaxExecution: cause %v, want idem.ErrMaxExecution", err)
	}
	if w.Finish.Err() != nil {
		t.Fatalf("Finish: %v, want live", w.Finish.Err())
	}
	w.Release()
	w.End()

	d = e.Acquire(ctx, ctx, key(t, "stop"), idem.Fingerprint{}, "")
	w = e.Start(d, nil)
	stopNow()
	<-w.Ctx.Done()
	if err := context.Cause(w.Ctx); !errors.Is(err, idem.ErrStopped) {
		t.Fatalf("StopContext: cause %v, want idem.ErrStopped", err)
	}
	w.Release()
	w.End()
}

func TestNewValidates(t *testing.T) {
	for _, cfg := range []Config{{Wait: -1}, {MaxExecution: -1}} {
		cfg.Name = "idemtest"
		if _, err := New(memstore.New(memstore.Options{}), cfg); err == nil {
			t.Errorf("New(%+v): got nil error, want one", cfg)
		}
	}
	if _, err := New(nil, Config{Name: "idemtest"}); err == nil {
		t.Error("New(nil store): got nil error, want one")
	}
}

// A panic after Start, before Complete or Release: End releases the key
// and reports OutcomeReleased, once; the panic goes on. A report that
// panics (the adapter's OnOutcome) is not made again, and its key is
// released too.
// reportFunc is a func as a Reporter.
type reportFunc func(Outcome)

func (f reportFunc) Report(o Outcome) { f(o) }

func TestEndAfterPanic(t *testing.T) {
	e := newEngine(t, Config{})
	ctx := t.Context()
	var got []Outcome
	report := func(o Outcome) { got = append(got, o) }
	run := func(k idem.Key, report func(Outcome), work func(w *Work)) (p any) {
		d := e.Acquire(ctx, ctx, k, idem.Fingerprint{}, "")
		if d.Outcome != OutcomeExecuted {
			t.Fatalf("%v: got %+v, want executed", k, d)
		}
		defer func() { p = recover() }()
		w := e.Start(d, reportFunc(report))
		defer w.End()
		work(w)
		return nil
	}
	acquired := func(k idem.Key) {
		t.Helper()
		d := e.Acquire(ctx, ctx, k, idem.Fingerprint{}, "")
		if d.Outcome != OutcomeExecuted {
			t.Fatalf("retry: got %+v, want executed (the key released)", d)
		}
		e.Release(ctx, d.Attempt)
	}

	k := key(t, "panic")
	if p := run(k, report, func(*Work) { panic("work") }); p != "work" {
		t.Fatalf("recovered %v, want the work's panic", p)
	}
	if len(got) != 1 || got[0] != OutcomeReleased {
		t.Fatalf("outcomes: got %v, want [released]", got)
	}
	acquired(k)

	// The report of Complete panics: nothing is stored, the key is
	// released, and nothing more is reported.
	got = nil
	k = key(t, "report")
	p := run(k, func(o Outcome) { report(o); panic("report") }, func(w *Work) {
		w.Complete(&idem.Response{Status: 200})
	})
	if p != "report" || len(got) != 1 || got[0] != OutcomeExecuted {
		t.Fatalf("recovered %v, outcomes %v; want the report's panic, [executed]", p, got)
	}
	acquired(k)

	// Completed, then a panic: the response stays stored.
	got = nil
	k = key(t, "late")
	run(k, report, func(w *Work) {
		w.Complete(&idem.Response{Status: 200})
		panic("late")
	})
	if len(got) != 1 || got[0] != OutcomeExecuted {
		t.Fatalf("outcomes: got %v, want [executed]", got)
	}
	if d := e.Acquire(ctx, ctx, k, idem.Fingerprint{}, ""); d.Outcome != OutcomeReplayed {
		t.Fatalf("after the late panic: got %+v, want the replay", d)
	}
}

// A key released without a Work (the client left at the acquire, an
// adapter's check failed) wakes the requests that wait for it.
func TestReleaseWakesWaiters(t *testing.T) {
	e := newEngine(t, Config{Wait: time.Minute})
	ctx := t.Context()
	k, fp := key(t, "wake"), idem.Fingerprint{1}
	d := e.Acquire(ctx, ctx, k, fp, "")
	got := make(chan Decision, 1)
	go func() { got <- e.Acquire(ctx, ctx, k, fp, "") }()
	waitingFor(t, e, 1)
	e.Release(ctx, d.Attempt)
	select {
	case d = <-got:
	case <-time.After(30 * time.Second):
		t.Fatal("the waiter was not woken by the release (it would wait out the minute)")
	}
	if d.Outcome != OutcomeExecuted {
		t.Fatalf("waiter: got %v, want executed", d.Outcome)
	}
	e.Release(ctx, d.Attempt)
}

// countStore counts the Acquires that found the key in flight.
type countStore struct {
	idem.Store
	inFlight atomic.Int64
}

func (s *countStore) Acquire(ctx context.Context, req idem.AcquireRequest) (idem.Acquisition, error) {
	acq, err := s.Store.Acquire(ctx, req)
	if err == nil && acq.Outcome == idem.InFlight {
		s.inFlight.Add(1)
	}
	return acq, err
}

// A copy of a request that a request of this process holds does not ask
// the store while the holder runs, not even once: it is handed the
// response when the holder is done. (Polling from waiters.FirstPause
// would ask about seven times in 300ms; asking first, once.) A request
// of another fingerprint asks the store, which says mismatch.
func TestWaitForLocalHolderDoesNotPoll(t *testing.T) {
	store := &countStore{Store: memstore.New(memstore.Options{})}
	e := newEngineOn(t, store, Config{Wait: time.Minute})
	ctx := t.Context()
	k, fp := key(t, "local"), idem.Fingerprint{1}
	d := e.Acquire(ctx, ctx, k, fp, "")
	w := e.Start(d, nil)
	got := make(chan Decision, 1)
	go func() { got <- e.Acquire(ctx, ctx, k, fp, "") }()
	time.Sleep(300 * time.Millisecond) // the holder's work
	if d := e.Acquire(ctx, ctx, k, idem.Fingerprint{2}, ""); d.Outcome != OutcomeMismatch {
		t.Fatalf("another fingerprint while held: got %v, want mismatch", d.Outcome)
	}
	if err := w.Complete(&idem.Response{Status: 201, Body: []byte("handed")}); err != nil {
		t.Fatal(err)
	}
	w.End()
	if d := <-got; d.Outcome != OutcomeReplayed || string(d.Response.Body) != "handed" {
		t.Fatalf("waiter: got %+v, want the replay", d)
	}
	if n := store.inFlight.Load(); n != 0 {
		t.Errorf("the waiter found the key in flight %d times, want 0: it asked the store while this process held the key", n)
	}

	// Once the holder is done, nothing of it stays behind: a waiter for
	// a key held elsewhere (here: acquired on the store directly) polls.
	k2 := key(t, "elsewhere")
	if _, err := store.Store.Acquire(ctx, idem.AcquireRequest{Key: k2, LeaseID: idem.NewLeaseID(), Fingerprint: fp, TTL: time.Minute}); err != nil {
		t.Fatal(err)
	}
	store.inFlight.Store(0)
	e2 := newEngineOn(t, store, Config{Wait: 300 * time.Millisecond})
	if d := e2.Acquire(ctx, ctx, k2, fp, ""); d.Outcome != OutcomeInFlight {
		t.Fatalf("held elsewhere: got %v, want in_flight after the wait", d.Outcome)
	}
	if n := store.inFlight.Load(); n < 3 {
		t.Errorf("held elsewhere: the store was asked %d times within the wait, want it polled", n)
	}
}

// gateStore counts Acquires; the first waits for gate to close.
type gateStore struct {
	idem.Store
	gate  chan struct{}
	calls atomic.Int64
}

func (s *gateStore) Acquire(ctx context.Context, req idem.AcquireRequest) (idem.Acquisition, error) {
	if s.calls.Add(1) == 1 {
		<-s.gate
	}
	return s.Store.Acquire(ctx, req)
}

// Copies of a request that arrive together (a retry storm) ask the store
// once in all: the first asks, the others wait for it and are handed its
// response, whether it ran the work or the store had the key completed.
// A copy of another fingerprint asks the store, which says mismatch.
func TestCopiesArrivingTogetherAskTheStoreOnce(t *testing.T) {
	ctx := t.Context()
	const copies = 8
	for _, completed := range []bool{false, true} {
		store := &gateStore{Store: memstore.New(memstore.Options{}), gate: make(chan struct{})}
		e := newEngineOn(t, store, Config{Wait: time.Minute})
		k, fp := key(t, fmt.Sprint("storm-", completed)), idem.Fingerprint{1}
		if completed {
			g, err := idem.New(store.Store, idem.Config{})
			if err != nil {
				t.Fatal(err)
			}
			att, _, err := g.Begin(ctx, k, fp)
			if err != nil {
				t.Fatal(err)
			}
			if err := att.Complete(ctx, &idem.Response{Status: 201, Body: []byte("stored")}); err != nil {
				t.Fatal(err)
			}
		}
		got := make(chan Decision, copies)
		for range copies {
			go func() { got <- e.Acquire(ctx, ctx, k, fp, "") }()
		}
		waitingFor(t, e, copies-1) // the first is at the store's gate
		close(store.gate)
		want := "stored"
		if !completed {
			d := <-got
			if d.Outcome != OutcomeExecuted {
				t.Fatalf("first copy: got %v, want executed", d.Outcome)
			}
			w := e.Start(d, nil)
			if err := w.Complete(&idem.Response{Status: 201, Body: []byte("ran")}); err != nil {
				t.Fatal(err)
			}
			w.End()
			want = "ran"
		}
		for i := range copies - btoi(!completed) {
			if d := <-got; d.Outcome != OutcomeReplayed || string(d.Response.Body) != want {
				t.Fatalf("completed=%v: copy %d: got %v %q, want replayed %q", completed, i, d.Outcome, bodyOf(d), want)
			}
		}
		if d := e.Acquire(ctx, ctx, k, idem.Fingerprint{2}, ""); d.Outcome != OutcomeMismatch {
			t.Fatalf("completed=%v: another fingerprint: got %v, want mismatch", completed, d.Outcome)
		}
		// The copies' store calls: the first's, and the mismatched one's.
		if n := store.calls.Load(); n != 2 {
			t.Errorf("completed=%v: the store was asked %d times, want 2 (the first copy, the other fingerprint)", completed, n)
		}
	}
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

func bodyOf(d Decision) string {
	if d.Response == nil {
		return ""
	}
	return string(d.Response.Body)
}

// panicOnceStore panics on its first Acquire (a store's bug), then
// answers as its Store does.
type panicOnceStore struct {
	idem.Store
	panicked atomic.Bool
}

func (s *panicOnceStore) Acquire(ctx context.Context, req idem.AcquireRequest) (idem.Acquisition, error) {
	if s.panicked.CompareAndSwap(false, true) {
		panic("store bug")
	}
	return s.Store.Acquire(ctx, req)
}

// A store that panics in the Acquire of a request that asked for its
// copies leaves nothing behind: the next request for the key acquires it
// at once, not after the wait (nobody would answer the copies).
func TestPanicInAcquireLeavesNoAsk(t *testing.T) {
	store := &panicOnceStore{Store: memstore.New(memstore.Options{})}
	e := newEngineOn(t, store, Config{Wait: time.Minute})
	ctx := t.Context()
	k, fp := key(t, "panic"), idem.Fingerprint{1}
	func() {
		defer func() {
			if recover() == nil {
				t.Error("the store's panic did not reach the caller")
			}
		}()
		e.Acquire(ctx, ctx, k, fp, "")
	}()
	done := make(chan Decision, 1)
	go func() { done <- e.Acquire(ctx, ctx, k, fp, "") }()
	select {
	case d := <-done:
		if d.Outcome != OutcomeExecuted {
			t.Fatalf("after the panic: got %v, want executed", d.Outcome)
		}
		e.Release(ctx, d.Attempt)
	case <-time.After(30 * time.Second):
		t.Fatal("the request after the store's panic waited for an answer nobody will give")
	}
}

// callStore counts Acquires.
type callStore struct {
	idem.Store
	calls atomic.Int64
}

func (s *callStore) Acquire(ctx context.Context, req idem.AcquireRequest) (idem.Acquisition, error) {
	s.calls.Add(1)
	return s.Store.Acquire(ctx, req)
}

// With the key held by another process, the copies that arrive one after
// another each poll the store at their own pace: a new arrival asking the
// store does not wake the copies already polling (which would make every
// arrival cost a store call per waiting copy).
func TestRemoteHolderArrivalsDoNotWakePollers(t *testing.T) {
	mem := memstore.New(memstore.Options{})
	store := &callStore{Store: mem}
	e := newEngineOn(t, store, Config{Wait: 2 * time.Second})
	ctx := t.Context()
	k, fp := key(t, "remote"), idem.Fingerprint{1}
	other, err := idem.New(mem, idem.Config{Lease: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	if _, acq, err := other.Begin(ctx, k, fp); err != nil || acq.Outcome != idem.Acquired {
		t.Fatalf("the other process: %v, %v; want acquired", acq.Outcome, err)
	}
	const arrivals = 100
	var wg sync.WaitGroup
	for range arrivals { // one copy every 10ms for a second
		wg.Go(func() {
			if d := e.Acquire(ctx, ctx, k, fp, ""); d.Outcome != OutcomeInFlight {
				t.Errorf("copy: got %v, want in_flight after the wait", d.Outcome)
			}
		})
		time.Sleep(10 * time.Millisecond)
	}
	wg.Wait()
	// Alone, a copy asks about 12 times in its 2s (5ms to 250ms apart).
	n := store.calls.Load()
	t.Logf("%d copies asked the store %d times (%.1f each)", arrivals, n, float64(n)/arrivals)
	if n > 20*arrivals {
		t.Errorf("%d store calls for %d copies: the arrivals woke the copies polling", n, arrivals)
	}
}

// Fallback: a record under v1.0's key answers for today's key (its
// replay, a mismatch, or in flight, with today's key released); a
// mismatch that v1.0's fingerprint explains replays; nothing is looked
// up with V1Scopes negative.
func TestFallback(t *testing.T) {
	store := sharedStore{memstore.New(memstore.Options{})}
	e := newEngineOn(t, store, Config{})
	ctx := t.Context()
	fp, oldFP := idem.Fingerprint{1}, idem.Fingerprint{9}
	store1 := func(k idem.Key, fp idem.Fingerprint, body string) {
		d := e.Acquire(ctx, ctx, k, fp, "")
		w := e.Start(d, nil)
		if err := w.Complete(&idem.Response{Status: 201, Body: []byte(body)}); err != nil {
			t.Fatal(err)
		}
		w.End()
	}
	old, now := key(t, "v1"), key(t, "now")
	store1(old, oldFP, "v1.0's")
	d := e.Fallback(ctx, e.Acquire(ctx, ctx, now, fp, ""), now, fp, old, oldFP)
	if d.Outcome != OutcomeReplayed || string(d.Response.Body) != "v1.0's" {
		t.Fatalf("a v1.0 record: got %+v, want its replay", d)
	}
	if d := e.Fallback(ctx, e.Acquire(ctx, ctx, now, fp, ""), now, fp, old, idem.Fingerprint{7}); d.Outcome != OutcomeMismatch {
		t.Fatalf("a v1.0 record of another request: got %+v, want mismatch", d)
	}
	// Today's key was released each time: a request that finds no v1.0
	// record runs.
	if d := e.Fallback(ctx, e.Acquire(ctx, ctx, now, fp, ""), now, fp, key(t, "none"), oldFP); d.Outcome != OutcomeExecuted {
		t.Fatalf("no v1.0 record: got %+v, want executed", d)
	} else {
		e.Release(ctx, d.Attempt)
	}
	// In flight under v1.0's key.
	held := key(t, "held")
	if d := e.Acquire(ctx, ctx, held, oldFP, ""); d.Outcome != OutcomeExecuted {
		t.Fatal(d)
	}
	if d := e.Fallback(ctx, e.Acquire(ctx, ctx, now, fp, ""), now, fp, held, oldFP); d.Outcome != OutcomeInFlight || d.RetryAfter <= 0 {
		t.Fatalf("v1.0's key in flight: got %+v, want in_flight with a RetryAfter", d)
	}
	// One key, stored with v1.0's fingerprint (an anonymous caller's
	// cookies were in it): the mismatch is v1.0's replay.
	same := key(t, "same")
	store1(same, oldFP, "cookies")
	mm := e.Acquire(ctx, ctx, same, fp, "")
	if mm.Outcome != OutcomeMismatch {
		t.Fatal(mm)
	}
	if d := e.Fallback(ctx, mm, same, fp, same, oldFP); d.Outcome != OutcomeReplayed || string(d.Response.Body) != "cookies" {
		t.Fatalf("a mismatch v1.0's fingerprint explains: got %+v, want the replay", d)
	}
	if d := e.Fallback(ctx, mm, same, fp, same, idem.Fingerprint{5}); d.Outcome != OutcomeMismatch {
		t.Fatalf("a mismatch v1.0's fingerprint does not explain: got %+v, want mismatch", d)
	}
	off := newEngineOn(t, store, Config{V1Scopes: -1})
	if d := off.Fallback(ctx, off.Acquire(ctx, ctx, key(t, "off"), fp, ""), key(t, "off"), fp, old, oldFP); d.Outcome != OutcomeExecuted {
		t.Fatalf("V1Scopes negative: got %+v, want executed (no look-up)", d)
	}
}

// sharedStore is a memory store as a store that v1.0 processes used too
// (Redis, PostgreSQL): an engine looks up v1.0's keys in it, as it never
// does in a *memstore.Store, which only this process (this version) wrote.
type sharedStore struct{ idem.Store }

// unwrapper is a wrapper that keeps its store's records as they are (as
// idem proxy's metrics do): the engine looks through it.
type unwrapper struct{ idem.Store }

func (u unwrapper) Unwrap() idem.Store { return u.Store }

// A memory store holds nothing of v1.0: its engine never falls back,
// whatever V1Scopes says; any other store is looked up as V1Scopes says.
func TestFallbackNeverOnMemstore(t *testing.T) {
	for _, c := range []struct {
		store    idem.Store
		v1Scopes time.Duration
		want     bool
	}{
		{memstore.New(memstore.Options{}), 0, false},
		{memstore.New(memstore.Options{}), time.Hour, false},
		{sharedStore{memstore.New(memstore.Options{})}, 0, true},
		{sharedStore{memstore.New(memstore.Options{})}, time.Hour, true},
		{sharedStore{memstore.New(memstore.Options{})}, -1, false},
		{unwrapper{memstore.New(memstore.Options{})}, 0, false},
		{unwrapper{sharedStore{memstore.New(memstore.Options{})}}, 0, true},
	} {
		if got := newEngineOn(t, c.store, Config{V1Scopes: c.v1Scopes}).FallingBack(); got != c.want {
			t.Errorf("%T, V1Scopes %v: FallingBack() = %v, want %v", c.store, c.v1Scopes, got, c.want)
		}
	}
}
