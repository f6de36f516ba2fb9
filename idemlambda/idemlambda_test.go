package idemlambda_test

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-lambda-go/events"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemlambda"
	"github.com/idemkit/idem/memstore"
)

// clock is a store clock that tests move forward.
type clock struct{ off atomic.Int64 }

func (c *clock) now() time.Time          { return time.Now().Add(time.Duration(c.off.Load())) }
func (c *clock) advance(d time.Duration) { c.off.Add(int64(d)) }
func newStore(c *clock) *memstore.Store  { return memstore.New(memstore.Options{Clock: c.now}) }
func apiKey(ck string) idem.Key          { return mustKey(idem.Scope{Method: "lambda", Route: "fn"}, ck) }
func sqsKey(ck string) idem.Key          { return mustKey(idem.Scope{Method: "lambda/sqs", Route: "fn"}, ck) }
func withDeadline(d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	_ = cancel // released when the test process ends; the deadline is the point
	return ctx
}

func mustKey(s idem.Scope, ck string) idem.Key {
	k, err := s.Key(ck)
	if err != nil {
		panic(err)
	}
	return k
}

// countingStore counts the store calls.
type countingStore struct {
	idem.Store
	acquires, gets atomic.Int64
}

func (s *countingStore) Acquire(ctx context.Context, r idem.AcquireRequest) (idem.Acquisition, error) {
	s.acquires.Add(1)
	return s.Store.Acquire(ctx, r)
}

func (s *countingStore) Get(ctx context.Context, k idem.Key) (idem.Record, bool, error) {
	s.gets.Add(1)
	return s.Store.Get(ctx, k)
}

type order struct {
	Key    string `json:"key"`
	Amount int    `json:"amount"`
	Note   string `json:"note,omitempty"` // not part of the payload
}

type receipt struct {
	ID     int    `json:"id"`
	Amount int    `json:"amount"`
	Token  uint64 `json:"token"`
}

// fn is a handler that counts its runs and can be held or made to fail.
type fn struct {
	runs    atomic.Int64
	fail    atomic.Bool
	hold    chan struct{} // when not nil, each run waits for it
	started chan struct{} // when not nil, each run signals it
}

func (f *fn) handle(ctx context.Context, o order) (receipt, error) {
	n := f.runs.Add(1)
	if f.started != nil {
		f.started <- struct{}{}
	}
	if f.hold != nil {
		<-f.hold
	}
	if f.fail.Load() {
		return receipt{}, errors.New("payment declined")
	}
	tok, _ := idemlambda.FencingToken(ctx)
	return receipt{ID: int(n), Amount: o.Amount, Token: tok}, nil
}

func orderConfig() idemlambda.Config[order] {
	return idemlambda.Config[order]{
		Namespace: "fn",
		Key:       func(o order) (string, error) { return o.Key, nil },
		Payload:   func(o order) any { return o.Amount },
		Wait:      -1, // in flight: at once, so that the tests see the holder's state (TestWaitDefault tests the default)
	}
}

func wrap(t *testing.T, s idem.Store, cfg idemlambda.Config[order], f *fn) func(context.Context, order) (receipt, error) {
	t.Helper()
	h, err := idemlambda.Wrap(s, cfg, f.handle)
	if err != nil {
		t.Fatal(err)
	}
	return h
}

// Powertools: "idempotency record states" (INPROGRESS, COMPLETED; EXPIRED
// is internal). The record is in flight while the handler runs, completed
// after, and a repeat gets the first result, byte for byte.
func TestPowertoolsRecordStates(t *testing.T) {
	c := &clock{}
	s := newStore(c)
	f := &fn{hold: make(chan struct{}), started: make(chan struct{})}
	h := wrap(t, s, orderConfig(), f)
	ctx := withDeadline(10 * time.Second)
	var first receipt
	done := make(chan error)
	go func() {
		var err error
		first, err = h(ctx, order{Key: "k1", Amount: 5})
		done <- err
	}()
	<-f.started
	rec, ok, err := s.Get(ctx, apiKey("k1"))
	if err != nil || !ok || rec.State != idem.StateInFlight {
		t.Fatalf("while the handler runs: record %v %v %v, want in_flight", rec.State, ok, err)
	}
	close(f.hold)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	rec, ok, err = s.Get(ctx, apiKey("k1"))
	if err != nil || !ok || rec.State != idem.StateCompleted {
		t.Fatalf("after: record %v %v %v, want completed", rec.State, ok, err)
	}
	want, _ := json.Marshal(first)
	if string(rec.Response.Body) != string(want) {
		t.Fatalf("stored %q, want the result's JSON %q", rec.Response.Body, want)
	}
	again, err := h(ctx, order{Key: "k1", Amount: 5, Note: "retry"})
	if err != nil || again != first || f.runs.Load() != 1 {
		t.Fatalf("repeat: %+v %v after %d runs, want %+v replayed after 1 run", again, err, f.runs.Load(), first)
	}
}

// Powertools: "expired records" (expires_after_seconds). After the
// retention the key is new and the handler runs again.
func TestPowertoolsExpiredRecords(t *testing.T) {
	c := &clock{}
	s := newStore(c)
	f := &fn{}
	cfg := orderConfig()
	cfg.Retention = time.Hour
	h := wrap(t, s, cfg, f)
	ctx := withDeadline(10 * time.Second)
	r1, err := h(ctx, order{Key: "k", Amount: 1})
	if err != nil {
		t.Fatal(err)
	}
	c.advance(59 * time.Minute)
	if r, err := h(ctx, order{Key: "k", Amount: 1}); err != nil || r != r1 {
		t.Fatalf("within the retention: %+v %v, want the replay %+v", r, err, r1)
	}
	c.advance(2 * time.Minute)
	r2, err := h(ctx, order{Key: "k", Amount: 1})
	if err != nil || f.runs.Load() != 2 || r2.ID != 2 {
		t.Fatalf("after the retention: %+v %v after %d runs, want a second run", r2, err, f.runs.Load())
	}
	if r2.Token <= r1.Token {
		t.Fatalf("fencing token %d after %d: want it larger", r2.Token, r1.Token)
	}
}

// Powertools: "in-progress expiration tied to the remaining time". The
// lease of an invocation that has less time left than the configured
// lease lasts until its deadline plus the margin: never less (it cannot
// end while the invocation may still run), not much more (a killed
// invocation's key becomes free then).
func TestPowertoolsInProgressExpiration(t *testing.T) {
	c := &clock{}
	s := newStore(c)
	f := &fn{hold: make(chan struct{}), started: make(chan struct{}, 1)}
	defer close(f.hold)
	const margin = 500 * time.Millisecond
	cfg := orderConfig()
	cfg.DeadlineMargin = margin
	h := wrap(t, s, cfg, f)
	ctx := withDeadline(3 * time.Second)
	dl, _ := ctx.Deadline()
	go h(ctx, order{Key: "k", Amount: 1}) // "killed": never returns
	<-f.started
	before := time.Until(dl)
	rec, ok, err := s.Get(context.Background(), apiKey("k"))
	after := time.Until(dl)
	if err != nil || !ok || rec.State != idem.StateInFlight {
		t.Fatalf("record %v %v %v, want in_flight", rec.State, ok, err)
	}
	if rec.TTL < after+margin-time.Millisecond || rec.TTL > before+margin+100*time.Millisecond+5*time.Millisecond {
		t.Fatalf("lease left %v with %v to the deadline and a %v margin: want the deadline plus the margin", rec.TTL, after, margin)
	}
	// Just before the lease ends, another invocation is refused...
	c.advance(rec.TTL - 50*time.Millisecond)
	ctx2 := withDeadline(3 * time.Second)
	if _, err := h(ctx2, order{Key: "k", Amount: 1}); !errors.Is(err, idem.ErrInFlight) {
		t.Fatalf("before the lease ends: %v, want in flight", err)
	}
	// ...and once it ended, the key is free: the work runs once more.
	c.advance(100 * time.Millisecond)
	f2 := &fn{}
	h2 := wrap(t, s, cfg, f2)
	r, err := h2(ctx2, order{Key: "k", Amount: 1})
	if err != nil || f2.runs.Load() != 1 {
		t.Fatalf("after the lease: %+v %v, want a run", r, err)
	}
}

// An invocation with more time left than the configured lease takes that
// lease and renews it: it keeps its key past one lease.
func TestLongInvocationRenewsItsLease(t *testing.T) {
	s := newStore(&clock{})
	f := &fn{hold: make(chan struct{}), started: make(chan struct{}, 1)}
	cfg := orderConfig()
	cfg.Lease = 150 * time.Millisecond
	h := wrap(t, s, cfg, f)
	done := make(chan error)
	go func() { _, err := h(withDeadline(time.Minute), order{Key: "k", Amount: 1}); done <- err }()
	<-f.started
	rec, _, _ := s.Get(context.Background(), apiKey("k"))
	if rec.TTL > 150*time.Millisecond {
		t.Fatalf("lease %v for an invocation with a minute left: want the configured 150ms, renewed", rec.TTL)
	}
	time.Sleep(500 * time.Millisecond) // several leases
	second := make(chan error, 1)
	go func() { _, err := h(withDeadline(time.Minute), order{Key: "k", Amount: 1}); second <- err }()
	select {
	case err := <-second:
		if !errors.Is(err, idem.ErrInFlight) {
			close(f.hold)
			t.Fatalf("after three leases of a live invocation: %v, want in flight (renewed)", err)
		}
	case <-time.After(5 * time.Second): // it runs, held like the first
		close(f.hold)
		t.Fatalf("after three leases of a live invocation: a second invocation ran, want in flight (renewed)")
	}
	close(f.hold)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if f.runs.Load() != 1 {
		t.Fatalf("%d runs, want 1", f.runs.Load())
	}
}

// Powertools: "handling concurrent executions with the same payload"
// (IdempotencyAlreadyInProgressError). The second invocation fails with
// an *idem.InFlightError, or, with Config.Wait, waits and replays.
func TestPowertoolsConcurrentInvocations(t *testing.T) {
	s := newStore(&clock{})
	f := &fn{hold: make(chan struct{}), started: make(chan struct{}, 1)}
	cfg := orderConfig()
	h := wrap(t, s, cfg, f)
	cfg.Wait = 5 * time.Second
	hw := wrap(t, s, cfg, f)
	ctx := withDeadline(10 * time.Second)
	var first receipt
	done := make(chan error)
	go func() {
		var err error
		first, err = h(ctx, order{Key: "k", Amount: 1})
		done <- err
	}()
	<-f.started
	_, err := h(ctx, order{Key: "k", Amount: 1})
	var inflight *idem.InFlightError
	if !errors.As(err, &inflight) || inflight.RetryAfter <= 0 {
		t.Fatalf("concurrent invocation: %v, want an *idem.InFlightError with RetryAfter", err)
	}
	waited := make(chan receipt)
	go func() {
		r, err := hw(ctx, order{Key: "k", Amount: 1})
		if err != nil {
			t.Error(err)
		}
		waited <- r
	}()
	time.Sleep(50 * time.Millisecond) // let it poll
	close(f.hold)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if r := <-waited; r != first || f.runs.Load() != 1 {
		t.Fatalf("waiting invocation got %+v after %d runs, want the replay of %+v", r, f.runs.Load(), first)
	}
}

// Powertools: "payload validation" (payload_validation_jmespath,
// IdempotencyValidationError). A key reused with another payload fails;
// a change outside the payload is a replay.
func TestPowertoolsPayloadValidation(t *testing.T) {
	s := newStore(&clock{})
	f := &fn{}
	h := wrap(t, s, orderConfig(), f)
	ctx := withDeadline(10 * time.Second)
	r1, err := h(ctx, order{Key: "k", Amount: 10})
	if err != nil {
		t.Fatal(err)
	}
	_, err = h(ctx, order{Key: "k", Amount: 99})
	var mm *idemlambda.MismatchError
	if !errors.As(err, &mm) || !errors.Is(err, idem.ErrMismatch) {
		t.Fatalf("another amount under the key: %v, want a *MismatchError matching idem.ErrMismatch", err)
	}
	if r, err := h(ctx, order{Key: "k", Amount: 10, Note: "changed"}); err != nil || r != r1 {
		t.Fatalf("a change outside the payload: %+v %v, want the replay", r, err)
	}
	if f.runs.Load() != 1 {
		t.Fatalf("%d runs, want 1", f.runs.Load())
	}
}

// Powertools: "choosing a payload subset for idempotency"
// (event_key_jmespath). PayloadKey keys by a part of the event.
func TestPowertoolsEventKeySubset(t *testing.T) {
	s := newStore(&clock{})
	f := &fn{}
	cfg := orderConfig()
	cfg.Key = idemlambda.PayloadKey(func(o order) any { return []any{o.Key, o.Amount} })
	h := wrap(t, s, cfg, f)
	ctx := withDeadline(10 * time.Second)
	r1, _ := h(ctx, order{Key: "user-1", Amount: 3})
	r2, _ := h(ctx, order{Key: "user-1", Amount: 3, Note: "other"})
	if r1 != r2 || f.runs.Load() != 1 {
		t.Fatalf("same subset: %+v then %+v after %d runs, want one run", r1, r2, f.runs.Load())
	}
	h(ctx, order{Key: "user-1", Amount: 4})
	if f.runs.Load() != 2 {
		t.Fatalf("another subset: %d runs, want 2", f.runs.Load())
	}
	cfg.Key = idemlambda.PayloadKey(func(o order) any { return nil })
	if _, err := wrap(t, s, cfg, f)(ctx, order{Key: "x"}); !errors.Is(err, idem.ErrMissingKey) {
		t.Fatalf("a null subset: %v, want a missing key", err)
	}
}

// Powertools: "raise on no idempotency key" (raise_on_no_idempotency_key).
// idemlambda refuses by default; AllowMissingKey runs unprotected.
func TestPowertoolsRaiseOnNoIdempotencyKey(t *testing.T) {
	s := newStore(&clock{})
	runs := 0
	handler := func(ctx context.Context, e events.APIGatewayProxyRequest) (events.APIGatewayProxyResponse, error) {
		runs++
		if _, ok := idemlambda.FencingToken(ctx); ok {
			t.Error("an unprotected run has a lease")
		}
		return events.APIGatewayProxyResponse{StatusCode: 201}, nil
	}
	cfg := idemlambda.Config[events.APIGatewayProxyRequest]{Namespace: "fn", Key: idemlambda.APIGatewayKey}
	h, err := idemlambda.Wrap(s, cfg, handler)
	if err != nil {
		t.Fatal(err)
	}
	ctx := withDeadline(10 * time.Second)
	_, err = h(ctx, events.APIGatewayProxyRequest{Headers: map[string]string{"Other": "x"}})
	var ke *idemlambda.KeyError
	if !errors.As(err, &ke) || !errors.Is(err, idem.ErrMissingKey) || runs != 0 {
		t.Fatalf("no key: %v after %d runs, want a *KeyError matching idem.ErrMissingKey, no run", err, runs)
	}
	_, err = h(ctx, events.APIGatewayProxyRequest{Headers: map[string]string{"Idempotency-Key": "bad\x01key"}})
	if !errors.As(err, &ke) || !errors.Is(err, idem.ErrInvalidKey) || runs != 0 {
		t.Fatalf("invalid key: %v, want a *KeyError matching idem.ErrInvalidKey", err)
	}
	cfg.AllowMissingKey = true
	h, _ = idemlambda.Wrap(s, cfg, handler)
	for range 2 {
		if _, err := h(ctx, events.APIGatewayProxyRequest{}); err != nil {
			t.Fatal(err)
		}
	}
	if runs != 2 {
		t.Fatalf("AllowMissingKey: %d runs of two keyless events, want 2 (unprotected)", runs)
	}
}

// Powertools: "exceptions are not stored". A handler error (or panic)
// releases the key and is returned; the next invocation runs again.
func TestPowertoolsExceptionsNotStored(t *testing.T) {
	s := newStore(&clock{})
	f := &fn{}
	h := wrap(t, s, orderConfig(), f)
	ctx := withDeadline(10 * time.Second)
	f.fail.Store(true)
	if _, err := h(ctx, order{Key: "k", Amount: 1}); err == nil || err.Error() != "payment declined" {
		t.Fatalf("handler error: %v, want it returned as it is", err)
	}
	if rec, ok, _ := s.Get(ctx, apiKey("k")); ok && rec.State != idem.StateReleased {
		t.Fatalf("after a handler error the record is %v, want released", rec.State)
	}
	f.fail.Store(false)
	if r, err := h(ctx, order{Key: "k", Amount: 1}); err != nil || r.ID != 2 {
		t.Fatalf("retry after an error: %+v %v, want a second run", r, err)
	}
	// A panic frees the key too.
	p, _ := idemlambda.Wrap(s, orderConfig(), func(context.Context, order) (receipt, error) { panic("boom") })
	func() {
		defer func() { recover() }()
		p(ctx, order{Key: "p", Amount: 1})
	}()
	if rec, ok, _ := s.Get(ctx, apiKey("p")); ok && rec.State != idem.StateReleased {
		t.Fatalf("after a panic the record is %v, want released", rec.State)
	}
}

// Powertools: "caching" (use_local_cache). idemlambda keeps no local
// copy: a repeat is one Acquire on the store (no separate read), so a
// record purged from the store is never replayed from a stale cache.
func TestPowertoolsLocalCache(t *testing.T) {
	s := &countingStore{Store: newStore(&clock{})}
	f := &fn{}
	h := wrap(t, s, orderConfig(), f)
	ctx := withDeadline(10 * time.Second)
	h(ctx, order{Key: "k", Amount: 1})
	a0 := s.acquires.Load()
	for range 3 {
		if _, err := h(ctx, order{Key: "k", Amount: 1}); err != nil {
			t.Fatal(err)
		}
	}
	if n := s.acquires.Load() - a0; n != 3 || s.gets.Load() != 0 {
		t.Fatalf("3 repeats made %d acquires and %d reads, want 3 and 0", n, s.gets.Load())
	}
	if ok, err := s.Delete(ctx, apiKey("k")); !ok || err != nil {
		t.Fatalf("delete: %v %v", ok, err)
	}
	if r, _ := h(ctx, order{Key: "k", Amount: 1}); r.ID != 2 {
		t.Fatalf("after a purge: %+v, want a new run (no stale local replay)", r)
	}
}

// Powertools: "batch processing with SQS" (BatchProcessor with
// idempotent_function, partial batch responses).
func TestPowertoolsBatchSQS(t *testing.T) {
	s := newStore(&clock{})
	var mu sync.Mutex
	runs := map[string]int{}
	h, err := idemlambda.WrapSQS(s, idemlambda.SQSConfig{Namespace: "fn"}, func(ctx context.Context, m events.SQSMessage) error {
		mu.Lock()
		runs[m.MessageId]++
		mu.Unlock()
		if _, ok := idemlambda.FencingToken(ctx); !ok {
			t.Error("no lease in the record's context")
		}
		if m.Body == "fail" {
			return errors.New("cannot handle " + m.MessageId)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx := withDeadline(10 * time.Second)
	ev := events.SQSEvent{Records: []events.SQSMessage{
		{MessageId: "m1", Body: "ok"}, {MessageId: "m2", Body: "fail"}, {MessageId: "m3", Body: "ok"},
		{MessageId: "m1", Body: "ok"}, // the same message twice in one batch
		{MessageId: "", Body: "ok"},   // no key
	}}
	resp, err := h(ctx, ev)
	if err != nil {
		t.Fatal(err)
	}
	got := failures(resp)
	if want := "m2,"; got != want { // the keyless record's id is ""
		t.Fatalf("batchItemFailures %q, want %q (the failing record and the keyless one; the second m1 shares the first's success)", got, want)
	}
	if runs["m1"] != 1 || runs["m2"] != 1 || runs["m3"] != 1 || runs[""] != 0 {
		t.Fatalf("runs %v, want one each, none for the keyless record", runs)
	}
	// SQS delivers the failed ones again, with the others (a retry of the
	// whole batch): only the failed one runs.
	resp, _ = h(ctx, events.SQSEvent{Records: ev.Records[:3]})
	if got := failures(resp); got != "m2" || runs["m1"] != 1 || runs["m3"] != 1 || runs["m2"] != 2 {
		t.Fatalf("redelivery: failures %q, runs %v; want only m2 run again", got, runs)
	}
}

func failures(r events.SQSEventResponse) string {
	s := ""
	for i, f := range r.BatchItemFailures {
		if i > 0 {
			s += ","
		}
		s += f.ItemIdentifier
	}
	return s
}

// A FIFO batch stops at the first failure: later records are reported
// failed, not run, and their keys are free for the redelivery.
func TestSQSFIFOStopsAtFirstFailure(t *testing.T) {
	s := newStore(&clock{})
	var ran []string
	h, _ := idemlambda.WrapSQS(s, idemlambda.SQSConfig{Namespace: "fn", FIFO: true}, func(ctx context.Context, m events.SQSMessage) error {
		ran = append(ran, m.MessageId)
		if m.Body == "fail" {
			return errors.New("no")
		}
		return nil
	})
	ctx := withDeadline(10 * time.Second)
	resp, _ := h(ctx, events.SQSEvent{Records: []events.SQSMessage{{MessageId: "a"}, {MessageId: "b", Body: "fail"}, {MessageId: "c"}}})
	if got := failures(resp); got != "b,c" || len(ran) != 2 {
		t.Fatalf("failures %q after running %v, want b,c after a and b", got, ran)
	}
	if rec, ok, _ := s.Get(ctx, sqsKey("c")); ok && rec.State != idem.StateReleased {
		t.Fatalf("the record not run is %v, want released", rec.State)
	}
	resp, _ = h(ctx, events.SQSEvent{Records: []events.SQSMessage{{MessageId: "b"}, {MessageId: "c"}}})
	if got := failures(resp); got != "" || len(ran) != 4 {
		t.Fatalf("redelivery: failures %q after running %v, want none", got, ran)
	}
}

// API Gateway's header names are matched whatever their case.
func TestAPIGatewayKeyHeaderCase(t *testing.T) {
	for _, name := range []string{"Idempotency-Key", "idempotency-key", "IDEMPOTENCY-KEY", "idempotency-KEY"} {
		k, err := idemlambda.APIGatewayKey(events.APIGatewayProxyRequest{Headers: map[string]string{name: "abc"}})
		if k != "abc" || err != nil {
			t.Errorf("v1 %s: %q %v", name, k, err)
		}
		k, err = idemlambda.APIGatewayKey(events.APIGatewayProxyRequest{
			Headers:           map[string]string{name: "ignored-when-multi"},
			MultiValueHeaders: map[string][]string{name: {"abc"}},
		})
		if k != "abc" || err != nil {
			t.Errorf("v1 multi %s: %q %v", name, k, err)
		}
		k, err = idemlambda.APIGatewayV2Key(events.APIGatewayV2HTTPRequest{Headers: map[string]string{name: `"quoted key"`}})
		if k != "quoted key" || err != nil {
			t.Errorf("v2 %s: %q %v", name, k, err)
		}
	}
	_, err := idemlambda.APIGatewayKey(events.APIGatewayProxyRequest{MultiValueHeaders: map[string][]string{"idempotency-key": {"a", "b"}}})
	if !errors.Is(err, idem.ErrInvalidKey) {
		t.Errorf("two keys: %v, want invalid", err)
	}
	k, err := idemlambda.APIGatewayV2Key(events.APIGatewayV2HTTPRequest{Headers: map[string]string{"idempotency-key": "a,b"}})
	if k != "a,b" || err != nil {
		t.Errorf("v2 joined keys: %q %v, want the value whole", k, err)
	}
	_, err = idemlambda.APIGatewayV2Key(events.APIGatewayV2HTTPRequest{Headers: map[string]string{"x": "y"}})
	if !errors.Is(err, idem.ErrMissingKey) {
		t.Errorf("v2 without the header: %v, want missing", err)
	}
}

// The handler's context carries the lease's fencing token, and a new
// holder of the key gets a larger one.
func TestFencingTokenGrows(t *testing.T) {
	s := newStore(&clock{})
	f := &fn{}
	h := wrap(t, s, orderConfig(), f)
	ctx := withDeadline(10 * time.Second)
	f.fail.Store(true)
	h(ctx, order{Key: "k", Amount: 1})
	f.fail.Store(false)
	r, _ := h(ctx, order{Key: "k", Amount: 1})
	rec, _, _ := s.Get(ctx, apiKey("k"))
	if r.Token == 0 || r.Token != rec.Token {
		t.Fatalf("token %d in the handler, %d in the record", r.Token, rec.Token)
	}
	var seen []uint64
	g, _ := idemlambda.Wrap(s, orderConfig(), func(ctx context.Context, o order) (receipt, error) {
		tok, _ := idemlambda.FencingToken(ctx)
		seen = append(seen, tok)
		return receipt{}, errors.New("again")
	})
	g(ctx, order{Key: "t", Amount: 1})
	g(ctx, order{Key: "t", Amount: 1})
	if len(seen) != 2 || seen[1] <= seen[0] {
		t.Fatalf("tokens %v across two holders, want increasing", seen)
	}
}

func TestWrapRejectsBadConfig(t *testing.T) {
	s := newStore(&clock{})
	h := func(context.Context, order) (receipt, error) { return receipt{}, nil }
	if _, err := idemlambda.Wrap(s, idemlambda.Config[order]{}, h); err == nil {
		t.Error("no Key: accepted")
	}
	cfg := orderConfig()
	cfg.DeadlineMargin = -time.Second
	if _, err := idemlambda.Wrap(s, cfg, h); err == nil {
		t.Error("negative margin: accepted")
	}
	if _, err := idemlambda.Wrap(nil, orderConfig(), h); err == nil {
		t.Error("nil store: accepted")
	}
}

// Config.Wait never waits past the invocation's deadline: the invocation
// then fails with the in-flight error.
func TestWaitStopsAtTheDeadline(t *testing.T) {
	s := newStore(&clock{})
	f := &fn{hold: make(chan struct{}), started: make(chan struct{}, 1)}
	defer close(f.hold)
	cfg := orderConfig()
	cfg.Wait = time.Hour
	h := wrap(t, s, cfg, f)
	go h(withDeadline(time.Minute), order{Key: "k", Amount: 1})
	<-f.started
	_, err := h(withDeadline(200*time.Millisecond), order{Key: "k", Amount: 1})
	if !errors.Is(err, idem.ErrInFlight) {
		t.Fatalf("waiting past the deadline: %v, want in flight", err)
	}
}

// A record whose key another invocation holds (in flight elsewhere: SQS
// delivered it twice, to two instances) is reported failed, not run: SQS
// delivers it again later, and then it replays.
func TestSQSRecordInFlightElsewhere(t *testing.T) {
	s := newStore(&clock{})
	started, hold := make(chan struct{}, 1), make(chan struct{})
	var runs atomic.Int32
	h, err := idemlambda.WrapSQS(s, idemlambda.SQSConfig{Namespace: "fn"}, func(ctx context.Context, m events.SQSMessage) error {
		runs.Add(1)
		started <- struct{}{}
		<-hold
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx := withDeadline(10 * time.Second)
	ev := events.SQSEvent{Records: []events.SQSMessage{{MessageId: "m1", Body: "ok"}}}
	first := make(chan events.SQSEventResponse, 1)
	go func() {
		resp, _ := h(ctx, ev)
		first <- resp
	}()
	<-started
	resp, err := h(ctx, ev)
	if err != nil {
		t.Fatal(err)
	}
	if got := failures(resp); got != "m1" || runs.Load() != 1 {
		t.Fatalf("while another invocation runs it: failures %q after %d runs, want m1 after 1", got, runs.Load())
	}
	close(hold)
	if got := failures(<-first); got != "" {
		t.Fatalf("the first invocation: failures %q, want none", got)
	}
	if resp, _ := h(ctx, ev); failures(resp) != "" || runs.Load() != 1 {
		t.Fatalf("redelivery after it completed: failures %q after %d runs, want none after 1 (a replay)", failures(resp), runs.Load())
	}
}

// A message delivered twice in one batch runs once, and its second copy
// shares the first's answer: reported failed when the first failed (it
// would otherwise be deleted, its work never done).
func TestSQSDuplicateSharesFailure(t *testing.T) {
	s := newStore(&clock{})
	var runs atomic.Int32
	h, err := idemlambda.WrapSQS(s, idemlambda.SQSConfig{Namespace: "fn"}, func(ctx context.Context, m events.SQSMessage) error {
		runs.Add(1)
		return errors.New("cannot handle " + m.MessageId)
	})
	if err != nil {
		t.Fatal(err)
	}
	resp, err := h(withDeadline(10*time.Second), events.SQSEvent{Records: []events.SQSMessage{{MessageId: "m1", Body: "x"}, {MessageId: "m1", Body: "x"}}})
	if err != nil {
		t.Fatal(err)
	}
	if got := failures(resp); got != "m1,m1" || runs.Load() != 1 {
		t.Fatalf("failures %q after %d runs, want m1,m1 (both copies) after 1", got, runs.Load())
	}
}
