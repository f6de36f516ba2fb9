package idemhttp_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/memstore"
)

// The middleware reports each request's outcome as a metric and on the
// request's span (here started by an outer handler, as otelhttp would),
// with events for a replay and a wait.
func TestMiddlewareTelemetry(t *testing.T) {
	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	release := make(chan struct{})
	var blocking atomic.Bool
	mw := idemhttp.Middleware(memstore.New(memstore.Options{}), idemhttp.Config{
		TracerProvider: tp, MeterProvider: mp, Wait: 5 * time.Second, Logger: quietLogger()})
	h := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if blocking.Load() {
			<-release
		}
		w.WriteHeader(http.StatusCreated)
	}))
	s := &server{}
	s.Server = newTracedServer(t, tp, h)

	s.do(t, "POST", "/pay", "k1", "{}")          // executed
	s.do(t, "POST", "/pay", "k1", "{}")          // replayed
	s.do(t, "POST", "/pay", "k1", `{"other":1}`) // mismatch
	blocking.Store(true)
	first := s.goDo(t, "POST", "/pay", "k2", "{}")
	time.Sleep(100 * time.Millisecond)
	waiter := s.goDo(t, "POST", "/pay", "k2", "{}") // waits, then replays
	time.Sleep(100 * time.Millisecond)
	close(release)
	<-first
	if a := <-waiter; a.status != http.StatusCreated {
		t.Fatalf("waiter: got %d, want 201", a.status)
	}

	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	got := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != "idem.outcomes" {
				continue
			}
			for _, p := range m.Data.(metricdata.Sum[int64]).DataPoints {
				layer, _ := p.Attributes.Value("idem.layer")
				outcome, _ := p.Attributes.Value("idem.outcome")
				got[layer.AsString()+"/"+outcome.AsString()] += p.Value
			}
		}
	}
	want := map[string]int64{"http/executed": 2, "http/replayed": 2, "http/mismatch": 1}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("idem.outcomes %s: got %d, want %d (all: %v)", k, got[k], v, got)
		}
	}
	var events []string
	var outcomes []string
	for _, sp := range spans.Ended() {
		if sp.Name() != "request" {
			continue
		}
		for _, e := range sp.Events() {
			events = append(events, e.Name)
		}
		for _, kv := range sp.Attributes() {
			if kv.Key == "idem.outcome" {
				outcomes = append(outcomes, kv.Value.AsString())
			}
		}
	}
	for _, e := range []string{"idem.replay", "idem.wait"} {
		if !slices.Contains(events, e) {
			t.Errorf("request span events: got %v, want %s among them", events, e)
		}
	}
	if len(outcomes) != 5 {
		t.Errorf("request spans' idem.outcome: got %v, want one per request (5)", outcomes)
	}
}

// newTracedServer serves h behind a handler that starts a span per
// request, as otelhttp does.
func newTracedServer(t *testing.T, tp *sdktrace.TracerProvider, h http.Handler) *httptest.Server {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx, span := tp.Tracer("test").Start(r.Context(), "request")
		defer span.End()
		h.ServeHTTP(w, r.WithContext(ctx))
	}))
	t.Cleanup(srv.Close)
	return srv
}
