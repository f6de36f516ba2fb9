package idemlambda_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-lambda-go/events"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemlambda"
	"github.com/idemkit/idem/internal/sealtest"
)

// outcomes records what OnOutcome was called with.
type outcomes struct {
	mu  sync.Mutex
	got []idemlambda.Outcome
}

func (o *outcomes) add(_ context.Context, oc idemlambda.Outcome) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.got = append(o.got, oc)
}

func (o *outcomes) take() []idemlambda.Outcome {
	o.mu.Lock()
	defer o.mu.Unlock()
	g := o.got
	o.got = nil
	return g
}

// Every invocation ends in one Outcome, the words idemhttp and idemgrpc
// use, given to OnOutcome and counted in idem.outcomes under layer
// "lambda".
func TestWrapOutcomes(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	s := newStore(&clock{})
	rec := &outcomes{}
	f := &fn{}
	cfg := orderConfig()
	cfg.OnOutcome = rec.add
	cfg.MeterProvider = sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	h := wrap(t, s, cfg, f)
	ctx := withDeadline(10 * time.Second)
	step := func(name string, want idemlambda.Outcome, call func()) {
		t.Helper()
		call()
		if got := rec.take(); len(got) != 1 || got[0] != want {
			t.Errorf("%s: OnOutcome got %v, want [%s]", name, got, want)
		}
	}
	step("first", idemlambda.OutcomeExecuted, func() { h(ctx, order{Key: "k", Amount: 1}) })
	step("repeat", idemlambda.OutcomeReplayed, func() { h(ctx, order{Key: "k", Amount: 1}) })
	step("another payload", idemlambda.OutcomeMismatch, func() { h(ctx, order{Key: "k", Amount: 2}) })
	step("no key", idemlambda.OutcomeRejected, func() { h(ctx, order{Key: "", Amount: 1}) })
	step("invalid key", idemlambda.OutcomeRejected, func() { h(ctx, order{Key: "bad\x01", Amount: 1}) })
	f.fail.Store(true)
	step("handler error", idemlambda.OutcomeReleased, func() { h(ctx, order{Key: "f", Amount: 1}) })
	f.fail.Store(false)

	held := &fn{hold: make(chan struct{}), started: make(chan struct{}, 1)}
	hcfg := cfg
	hcfg.Wait = -1
	hh := wrap(t, s, hcfg, held)
	done := make(chan struct{})
	go func() { hh(ctx, order{Key: "busy", Amount: 1}); close(done) }()
	<-held.started
	step("in flight", idemlambda.OutcomeInFlight, func() { hh(ctx, order{Key: "busy", Amount: 1}) })
	close(held.hold)
	<-done
	rec.take() // the held one's executed

	allow := cfg
	allow.AllowMissingKey = true
	step("no key, AllowMissingKey", idemlambda.OutcomePassedThrough, func() { wrap(t, s, allow, f)(ctx, order{Amount: 1}) })

	step("panic", idemlambda.OutcomeReleased, func() {
		p, _ := idemlambda.Wrap(s, cfg, func(context.Context, order) (receipt, error) { panic("boom") })
		defer func() { recover() }()
		p(ctx, order{Key: "p", Amount: 1})
	})

	for outcome, want := range map[string]int64{"executed": 2, "replayed": 1, "mismatch": 1, "rejected": 2, "released": 2,
		"in_flight": 1, "passed_through": 1} {
		if got := sealtest.Outcomes(t, reader, "lambda", outcome); got != want {
			t.Errorf("idem.outcomes{layer=lambda, outcome=%s}: got %d, want %d", outcome, got, want)
		}
	}
	if got := sealtest.Outcomes(t, reader, "guard", "executed"); got != 0 {
		t.Errorf("idem.outcomes{layer=guard}: got %d, want 0 (the invocations are the lambda layer's)", got)
	}
}

// A store that fails before the handler runs is store_error; an API
// Gateway request refused as anonymous is rejected, and counted in
// idem.anonymous.
func TestWrapOutcomesStoreAndAnonymous(t *testing.T) {
	rec := &outcomes{}
	cfg := orderConfig()
	cfg.OnOutcome = rec.add
	down := failingStore{newStore(&clock{})}
	if _, err := wrap(t, down, cfg, &fn{})(withDeadline(10*time.Second), order{Key: "k", Amount: 1}); err == nil {
		t.Fatal("store down: no error")
	}
	if got := rec.take(); len(got) != 1 || got[0] != idemlambda.OutcomeStoreError {
		t.Errorf("store down: OnOutcome got %v, want [store_error]", got)
	}

	reader := sdkmetric.NewManualReader()
	ah := &apiHandler{}
	acfg := idemlambda.Config[events.APIGatewayProxyRequest]{Namespace: "fn", Key: idemlambda.APIGatewayKey, RefuseAnonymous: true,
		OnOutcome: rec.add, MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))}
	ha, err := idemlambda.Wrap(newStore(&clock{}), acfg, ah.v1)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := ha(withDeadline(10*time.Second), events.APIGatewayProxyRequest{HTTPMethod: "POST", Path: "/orders",
		Headers: map[string]string{"Idempotency-Key": "a1"}})
	if err != nil || resp.StatusCode != 401 || ah.runs != 0 {
		t.Fatalf("anonymous: %+v %v after %d runs, want 401 and no run", resp, err, ah.runs)
	}
	if got := rec.take(); len(got) != 1 || got[0] != idemlambda.OutcomeRejected {
		t.Errorf("anonymous: OnOutcome got %v, want [rejected]", got)
	}
	if got := sealtest.Outcomes(t, reader, "lambda", "rejected"); got != 1 {
		t.Errorf("idem.outcomes{layer=lambda, outcome=rejected}: got %d, want 1", got)
	}
}

// failingStore fails every acquire, as an unreachable store does.
type failingStore struct{ idem.Store }

func (failingStore) Acquire(context.Context, idem.AcquireRequest) (idem.Acquisition, error) {
	return idem.Acquisition{}, errors.New("connection refused")
}

// Each SQS record's outcome is given to OnOutcome with the record, and
// counted under layer "lambda".
func TestWrapSQSOutcomes(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	s := newStore(&clock{})
	var mu sync.Mutex
	got := map[string]idemlambda.Outcome{}
	cfg := idemlambda.SQSConfig{Namespace: "fn", MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)),
		OnOutcome: func(_ context.Context, m events.SQSMessage, o idemlambda.Outcome) {
			mu.Lock()
			defer mu.Unlock()
			if prev, ok := got[m.MessageId+"/"+m.Body]; ok {
				t.Errorf("record %s/%s: a second outcome %s after %s", m.MessageId, m.Body, o, prev)
			}
			got[m.MessageId+"/"+m.Body] = o
		}}
	h, err := idemlambda.WrapSQS(s, cfg, func(ctx context.Context, m events.SQSMessage) error {
		if m.Body == "bad" {
			return errors.New("cannot ship")
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx := withDeadline(10 * time.Second)
	h(ctx, events.SQSEvent{Records: []events.SQSMessage{{MessageId: "done", Body: "ok"}}})
	clear(got)
	resp, _ := h(ctx, events.SQSEvent{Records: []events.SQSMessage{
		{MessageId: "m1", Body: "ok"}, {MessageId: "m2", Body: "bad"}, {MessageId: "", Body: "nokey"},
		{MessageId: "done", Body: "ok"}, {MessageId: "m1", Body: "dup"},
	}})
	want := map[string]idemlambda.Outcome{"m1/ok": idemlambda.OutcomeExecuted, "m2/bad": idemlambda.OutcomeReleased,
		"/nokey": idemlambda.OutcomeRejected, "done/ok": idemlambda.OutcomeReplayed, "m1/dup": idemlambda.OutcomeReplayed}
	for k, w := range want {
		if got[k] != w {
			t.Errorf("record %s: got %q, want %q (all: %v)", k, got[k], w, got)
		}
	}
	if f := failures(resp); f != "m2," {
		t.Errorf("batchItemFailures: got %q, want %q", f, "m2,")
	}
	for outcome, want := range map[string]int64{"executed": 2, "replayed": 2, "released": 1, "rejected": 1} {
		if n := sealtest.Outcomes(t, reader, "lambda", outcome); n != want {
			t.Errorf("idem.outcomes{layer=lambda, outcome=%s}: got %d, want %d", outcome, n, want)
		}
	}
}

// Config.Wait's zero value is DefaultWait (500ms), as in idemhttp and
// idemgrpc: a copy of an invocation that finishes within it gets its
// result; one that finishes later, an *idem.InFlightError after about
// DefaultWait. A negative Wait fails at once.
func TestWaitDefault(t *testing.T) {
	if idemlambda.DefaultWait != 500*time.Millisecond {
		t.Fatalf("DefaultWait: got %v, want 500ms", idemlambda.DefaultWait)
	}
	run := func(t *testing.T, wait, work time.Duration) (receipt, error, time.Duration, *fn) {
		s := newStore(&clock{})
		f := &fn{hold: make(chan struct{}), started: make(chan struct{}, 1)}
		cfg := orderConfig()
		cfg.Wait = wait
		h := wrap(t, s, cfg, f)
		ctx := withDeadline(30 * time.Second)
		go h(ctx, order{Key: "k", Amount: 1})
		<-f.started
		go func() { time.Sleep(work); close(f.hold) }()
		start := time.Now()
		r, err := h(ctx, order{Key: "k", Amount: 1})
		return r, err, time.Since(start), f
	}
	t.Run("zero waits for a holder that finishes within DefaultWait", func(t *testing.T) {
		r, err, _, f := run(t, 0, 100*time.Millisecond)
		if err != nil || r.ID != 1 || f.runs.Load() != 1 {
			t.Fatalf("got %+v %v after %d runs, want the first run's result replayed", r, err, f.runs.Load())
		}
	})
	t.Run("zero stops at DefaultWait", func(t *testing.T) {
		_, err, took, _ := run(t, 0, 3*time.Second)
		if !errors.Is(err, idem.ErrInFlight) || took < idemlambda.DefaultWait-50*time.Millisecond || took > 2*time.Second {
			t.Fatalf("got %v after %v, want in flight after about %v", err, took, idemlambda.DefaultWait)
		}
	})
	t.Run("negative answers at once", func(t *testing.T) {
		_, err, took, _ := run(t, -1, time.Second)
		if !errors.Is(err, idem.ErrInFlight) || took > 200*time.Millisecond {
			t.Fatalf("got %v after %v, want in flight at once", err, took)
		}
	})
}

// A Lambda user's key errors are idemlambda's and say where the key was
// expected; an empty key from Config.Key is a missing key, not a key.
func TestKeyErrors(t *testing.T) {
	ctx := withDeadline(10 * time.Second)
	s := newStore(&clock{})
	ah := &apiHandler{}
	h, _ := idemlambda.Wrap(s, idemlambda.Config[events.APIGatewayProxyRequest]{Namespace: "fn", Key: idemlambda.APIGatewayKey}, ah.v1)
	h2, _ := idemlambda.Wrap(s, idemlambda.Config[events.APIGatewayV2HTTPRequest]{Namespace: "fn", Key: idemlambda.APIGatewayV2Key},
		func(context.Context, events.APIGatewayV2HTTPRequest) (events.APIGatewayV2HTTPResponse, error) {
			ah.runs++
			return events.APIGatewayV2HTTPResponse{StatusCode: 201}, nil
		})
	_, e1 := h(ctx, events.APIGatewayProxyRequest{HTTPMethod: "POST", Path: "/orders"})
	_, e2 := h(ctx, events.APIGatewayProxyRequest{HTTPMethod: "POST", Path: "/orders", MultiValueHeaders: map[string][]string{"idempotency-key": {"a", "b"}}})
	_, e3 := h2(ctx, events.APIGatewayV2HTTPRequest{})
	_, e4 := idemlambda.SQSMessageID(events.SQSMessage{})
	cfg := orderConfig()
	_, e5 := wrap(t, s, cfg, &fn{})(ctx, order{Key: "", Amount: 1})
	_, e6 := wrap(t, s, cfg, &fn{})(ctx, order{Key: strings.Repeat("x", 256), Amount: 1})
	cfg.Key = func(order) (string, error) { return "", errors.New("no order id in the event") }
	_, e7 := wrap(t, s, cfg, &fn{})(ctx, order{Amount: 1})
	for _, c := range []struct {
		name string
		err  error
		is   error
		msg  string
	}{
		{"v1 no header", e1, idem.ErrMissingKey, "idemlambda: no Idempotency-Key header in the API Gateway REST API request's headers"},
		{"v1 two headers", e2, idem.ErrInvalidKey, "idemlambda: the API Gateway REST API request's more than one Idempotency-Key header"},
		{"v2 no header", e3, idem.ErrMissingKey, "idemlambda: no Idempotency-Key header in the API Gateway HTTP API request's headers"},
		{"SQS no messageId", e4, idem.ErrMissingKey, "idemlambda: the SQS message has no messageId"},
		{"Config.Key empty", e5, idem.ErrMissingKey, `idemlambda: Config.Key returned an empty key: the event has none`},
		{"Config.Key too long", e6, idem.ErrInvalidKey, "idemlambda: Config.Key's key must be 1 to 255 printable ASCII bytes (idem: invalid idempotency key: 256 bytes, more than 255)"},
		{"Config.Key failed", e7, nil, "idemlambda: Config.Key: no order id in the event"},
	} {
		if c.err == nil || c.err.Error() != c.msg || (c.is != nil && !errors.Is(c.err, c.is)) || strings.Contains(c.err.Error(), "idemhttp") {
			t.Errorf("%s: got %v, want %q (matching %v)", c.name, c.err, c.msg, c.is)
		}
	}
	if ah.runs != 0 {
		t.Errorf("%d runs, want none", ah.runs)
	}
	// An empty key is missing: AllowMissingKey runs the handler
	// unprotected.
	allow := orderConfig()
	allow.AllowMissingKey = true
	f := &fn{}
	if _, err := wrap(t, s, allow, f)(ctx, order{Key: "", Amount: 1}); err != nil || f.runs.Load() != 1 {
		t.Fatalf("empty key with AllowMissingKey: %v after %d runs, want an unprotected run", err, f.runs.Load())
	}
}

// flakyComplete fails the first n completions, as a store that is away
// for a moment does.
type flakyComplete struct {
	idem.Store
	mu sync.Mutex
	n  int
}

func (s *flakyComplete) Complete(ctx context.Context, l idem.Lease, resp *idem.Response, retention time.Duration) error {
	s.mu.Lock()
	fail := s.n > 0
	s.n--
	s.mu.Unlock()
	if fail {
		return &idem.StoreError{Op: "complete", Key: l.Key, Err: errors.New("connection reset")}
	}
	return s.Store.Complete(ctx, l, resp, retention)
}

// Config.CompleteRetry has idemmsg's zero value: 0 tries a failed
// completion again within the lease (the result is kept, a repeat
// replays it); a negative value does not retry (the key is released, a
// repeat runs again). The user's value is the one used.
func TestCompleteRetry(t *testing.T) {
	for _, c := range []struct {
		name     string
		retry    time.Duration
		wantRuns int64
	}{{"zero: within the lease", 0, 1}, {"negative: no retry", -1, 2}} {
		t.Run(c.name, func(t *testing.T) {
			s := &flakyComplete{Store: newStore(&clock{}), n: 2}
			f := &fn{}
			cfg := orderConfig()
			cfg.CompleteRetry = c.retry
			h := wrap(t, s, cfg, f)
			ctx := withDeadline(10 * time.Second)
			for range 2 {
				if _, err := h(ctx, order{Key: "k", Amount: 1}); err != nil {
					t.Fatal(err)
				}
			}
			if f.runs.Load() != c.wantRuns {
				t.Fatalf("got %d runs, want %d", f.runs.Load(), c.wantRuns)
			}
		})
	}
}
