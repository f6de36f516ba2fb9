package idem_test

import (
	"context"
	"errors"
	"testing"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
)

// plainStore hides the BatchStore methods of the store it holds.
type plainStore struct{ idem.Store }

func testKey(t *testing.T, s string) idem.Key {
	t.Helper()
	k, err := idem.Scope{Method: "POST", Route: "/batch"}.Key(s)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// TestBatchFallback: the package functions give a store without the
// extension the same answers, one call at a time.
func TestBatchFallback(t *testing.T) {
	ctx := context.Background()
	for name, s := range map[string]idem.Store{
		"batch":    memstore.New(memstore.Options{}),
		"fallback": plainStore{memstore.New(memstore.Options{})},
	} {
		t.Run(name, func(t *testing.T) {
			if _, got := s.(idem.BatchStore); got != (name == "batch") {
				t.Errorf("s.(idem.BatchStore): got %t, want %t", got, name == "batch")
			}
			a, b := testKey(t, "a"), testKey(t, "b")
			id := idem.NewLeaseID()
			got := idem.AcquireMany(ctx, s, []idem.AcquireRequest{
				{Key: a, LeaseID: id, TTL: time.Minute},
				{Key: a, LeaseID: idem.NewLeaseID(), TTL: time.Minute},
				{Key: b, LeaseID: idem.NewLeaseID(), TTL: 0},
				{Key: a, LeaseID: id, TTL: time.Minute},
			})
			if len(got) != 4 || got[0].Outcome != idem.Acquired || got[1].Outcome != idem.InFlight || got[2].Err == nil ||
				got[3].Outcome != idem.Acquired || got[3].Lease.Token != got[0].Lease.Token {
				t.Fatalf("AcquireMany: got %+v", got)
			}
			l := got[0].Lease
			errs := idem.CompleteMany(ctx, s, []idem.Completion{{Lease: l, Response: &idem.Response{Status: 201}, Retention: time.Minute}, {Lease: l, Response: &idem.Response{Status: 500}, Retention: time.Minute}})
			if len(errs) != 2 || errs[0] != nil || errs[1] != nil {
				t.Fatalf("CompleteMany: got %v", errs)
			}
			errs = idem.ReleaseMany(ctx, s, []idem.Lease{l})
			if len(errs) != 1 || !errors.Is(errs[0], idem.ErrLeaseLost) {
				t.Fatalf("ReleaseMany of a completed key: got %v, want ErrLeaseLost", errs)
			}
			if got := idem.AcquireMany(ctx, s, nil); got == nil || len(got) != 0 {
				t.Errorf("AcquireMany(nil): got %v, want an empty answer", got)
			}
			replay := idem.AcquireMany(ctx, s, []idem.AcquireRequest{{Key: a, LeaseID: idem.NewLeaseID(), TTL: time.Minute}})
			if replay[0].Outcome != idem.Replay || replay[0].Response.Status != 201 {
				t.Errorf("AcquireMany after CompleteMany: got %+v, want the replay of 201", replay[0])
			}
		})
	}
}

// TestGuardBatch: BeginMany and FinishMany answer as Begin and the
// Attempt's Complete and Release do, with or without telemetry.
func TestGuardBatch(t *testing.T) {
	for _, traced := range []bool{false, true} {
		name := "plain"
		cfg := idem.Config{Lease: time.Minute, MaxResponseSize: 8}
		var rec *tracetest.SpanRecorder
		if traced {
			name = "traced"
			rec = tracetest.NewSpanRecorder()
			cfg.TracerProvider = sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
		}
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			s := memstore.New(memstore.Options{})
			g, err := idem.New(s, cfg)
			if err != nil {
				t.Fatal(err)
			}
			k := []idem.Key{testKey(t, "0"), testKey(t, "1"), testKey(t, "2"), testKey(t, "3")}
			fp := idem.Fingerprint{1}
			begun := g.BeginMany(ctx, []idem.BeginRequest{{Key: k[0], Fingerprint: fp}, {Key: k[1]}, {Key: k[2]}, {Key: k[0], Fingerprint: fp}, {Key: k[3]}})
			for i, want := range []idem.Outcome{idem.Acquired, idem.Acquired, idem.Acquired, idem.InFlight, idem.Acquired} {
				b := begun[i]
				if b.Err != nil || b.Acquisition.Outcome != want || (b.Attempt != nil) != (want == idem.Acquired) {
					t.Fatalf("BeginMany answer %d: got %+v, want %v", i, b, want)
				}
			}
			if l, ok := idem.LeaseFromContext(begun[0].Attempt.Context()); !ok || l.Key != k[0] {
				t.Errorf("the attempt's context: got lease %+v, %t", l, ok)
			}
			// k3's lease is lost before it finishes.
			if err := s.Release(ctx, begun[4].Attempt.Lease()); err != nil {
				t.Fatal(err)
			}
			errs := g.FinishMany(ctx, []idem.Finish{
				{Attempt: begun[0].Attempt, Response: &idem.Response{Status: 201, Body: []byte("ok")}},
				{Attempt: begun[1].Attempt}, // release
				{Attempt: begun[2].Attempt, Response: &idem.Response{Status: 200, Body: []byte("longer than eight")}},
				{Attempt: begun[4].Attempt, Response: &idem.Response{Status: 200}},
			})
			if errs[0] != nil || errs[1] != nil || errs[2] != nil || !errors.Is(errs[3], idem.ErrLeaseLost) {
				t.Fatalf("FinishMany: got %v, want nil, nil, nil, ErrLeaseLost", errs)
			}
			if ctxErr := begun[0].Attempt.Context().Err(); ctxErr == nil {
				t.Error("a finished attempt's context is live")
			}
			if err := begun[0].Attempt.Complete(ctx, &idem.Response{Status: 200}); err == nil {
				t.Error("Complete after FinishMany: got nil, want the already-finished error")
			}
			again := g.BeginMany(ctx, []idem.BeginRequest{{Key: k[0], Fingerprint: fp}, {Key: k[0]}, {Key: k[1]}, {Key: k[2]}})
			for i, want := range []idem.Outcome{idem.Replay, idem.Mismatch, idem.Acquired, idem.Replay} {
				if again[i].Err != nil || again[i].Acquisition.Outcome != want {
					t.Fatalf("second BeginMany answer %d: got %+v, want %v", i, again[i], want)
				}
			}
			if r := again[0].Acquisition.Response; r.Status != 201 || string(r.Body) != "ok" {
				t.Errorf("replay of k0: got %+v", r)
			}
			if r := again[3].Acquisition.Response; !r.BodyOmitted || len(r.Body) != 0 {
				t.Errorf("replay of k2 (body over MaxResponseSize): got %+v, want the body omitted", r)
			}
			g.FinishMany(ctx, []idem.Finish{{Attempt: again[2].Attempt}})

			cancelled, cancel := context.WithCancel(ctx)
			cancel()
			for _, b := range g.BeginMany(cancelled, []idem.BeginRequest{{Key: k[3]}}) {
				var se *idem.StoreError
				if !errors.As(b.Err, &se) || !errors.Is(b.Err, context.Canceled) {
					t.Errorf("BeginMany with a cancelled context: got %v", b.Err)
				}
			}
			if traced {
				names := map[string]int{}
				for _, sp := range rec.Ended() {
					names[sp.Name()]++
				}
				if names["idem.acquire_many"] != 2 || names["idem.complete_many"] != 1 || names["idem.release_many"] < 1 {
					t.Errorf("spans: got %v, want two idem.acquire_many, one idem.complete_many and idem.release_many", names)
				}
			}
		})
	}
}

// TestGuardStoreIsTheGivenStore: with telemetry on, the Guard works through
// a wrapper that does batches whatever the store under it does; Store
// returns the given store, so that s.(idem.BatchStore) (what idemmsg asks
// before acquiring a batch in one step) tells the truth about the store.
func TestGuardStoreIsTheGivenStore(t *testing.T) {
	f := newOtelFixture()
	for name, s := range map[string]idem.Store{
		"batch":    memstore.New(memstore.Options{}),
		"fallback": plainStore{memstore.New(memstore.Options{})},
	} {
		g, err := idem.New(s, idem.Config{TracerProvider: f.tp, MeterProvider: f.mp})
		if err != nil {
			t.Fatal(err)
		}
		if g.Store() != s {
			t.Errorf("%s: Store: got %T, want the store given to New", name, g.Store())
		}
		if _, got := g.Store().(idem.BatchStore); got != (name == "batch") {
			t.Errorf("%s: Store().(idem.BatchStore): got %t, want %t", name, got, name == "batch")
		}
	}
}
