package idemgrpc_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemgrpc"
	"github.com/idemkit/idem/memstore"
)

// execution answers "run N" (N counts its executions), so that a replay
// of another caller's call shows.
func execution() handlerFunc {
	var n atomic.Int64
	return func(ctx context.Context, _ string, _ *structpb.Struct) (*wrapperspb.StringValue, error) {
		return wrapperspb.String(fmt.Sprintf("run %d", n.Add(1))), nil
	}
}

// API-key metadata are credentials (DefaultTenant): Alice's and Bob's
// calls with one key and one request each run, and each caller's retry
// replays its own result; likewise api-key and x-auth-token, and two
// authorization values are a caller of their own, not an anonymous one.
func TestTenantAPIKeyMetadata(t *testing.T) {
	eachStore(t, func(t *testing.T, store idem.Store) {
		s := newServer(t, store, idemgrpc.Config{}, execution())
		req := map[string]any{"amount": 100}
		callers := [][]string{
			{"x-api-key", "alice-secret"},
			{"x-api-key", "bob-secret"},
			{"api-key", "alice-secret"}, // another header: another credential
			{"x-auth-token", "carol-token"},
			{"authorization", "Bearer a", "authorization", "Bearer b"},
			{}, // anonymous
		}
		first := map[int]string{}
		for round := range 2 {
			for i, md := range callers {
				a := s.call(t.Context(), methodCharge, "shared-key", req, md...)
				if a.err != nil {
					t.Fatalf("caller %v: %v", md, a.err)
				}
				if round == 0 {
					if a.replayed() {
						t.Errorf("caller %v: got a replay of %q, want its own execution (another caller's result)", md, a.reply)
					}
					first[i] = a.reply
					continue
				}
				if !a.replayed() || a.reply != first[i] {
					t.Errorf("caller %v, retry: got %q replayed=%t, want the replay of its own %q", md, a.reply, a.replayed(), first[i])
				}
			}
		}
		wantRuns(t, s, int64(len(callers)))
	})
}

// One credential spelled five ways is one caller: the scheme's case and
// the whitespace around and inside the authorization value are not part
// of the credential (RFC 9110), so four of the five calls are replays.
// The credential itself keeps its case.
func TestTenantCredentialSpellings(t *testing.T) {
	eachStore(t, func(t *testing.T, store idem.Store) {
		var seen sync.Map // the values the handler was given, to show that they reached it as sent
		s := newServer(t, store, idemgrpc.Config{}, func(ctx context.Context, m string, req *structpb.Struct) (*wrapperspb.StringValue, error) {
			seen.Store(metadata.ValueFromIncomingContext(ctx, "authorization")[0], true)
			return charge(ctx, m, req)
		})
		req := map[string]any{"amount": 7}
		spellings := []string{"Bearer tokA", "bearer tokA", "Bearer  tokA", "Bearer tokA ", "  Bearer tokA", "BEARER tokA"}
		var reply string
		for i, auth := range spellings {
			a := s.call(t.Context(), methodCharge, "spelled", req, "authorization", auth)
			if a.err != nil {
				t.Fatalf("%q: %v", auth, a.err)
			}
			if i == 0 {
				reply = a.reply
				continue
			}
			if !a.replayed() || a.reply != reply {
				t.Errorf("%q: got %q replayed=%t, want the replay of %q (one caller)", auth, a.reply, a.replayed(), reply)
			}
		}
		wantRuns(t, s, 1)
		if _, ok := seen.Load("Bearer tokA"); !ok {
			t.Fatal("the handler never saw the first spelling")
		}
		// grpc-go passes the spaces on as sent (a tab it refuses to send).
		probe := newServer(t, memstore.New(memstore.Options{}), idemgrpc.Config{}, func(ctx context.Context, _ string, _ *structpb.Struct) (*wrapperspb.StringValue, error) {
			return wrapperspb.String(metadata.ValueFromIncomingContext(ctx, "authorization")[0]), nil
		})
		for _, auth := range spellings {
			if a := probe.call(t.Context(), methodCharge, "", nil, "authorization", auth); a.err != nil || a.reply != auth {
				t.Errorf("%q reached the server as %q (%v), want it as sent", auth, a.reply, a.err)
			}
		}
		if a := s.call(t.Context(), methodCharge, "spelled", req, "authorization", "Bearer TOKA"); a.err != nil || a.replayed() {
			t.Errorf("another credential (Bearer TOKA): got replayed=%t (%v), want its own execution", a.replayed(), a.err)
		}
		wantRuns(t, s, 2)
	})
}

// Metadata the handler sets in a metadata.MD literal with upper-case keys
// (which grpc-go sends as written, and an HTTP/2 client refuses) reach the
// client in lower case, on the call and on its replays; a key on the
// denylist is neither stored nor replayed in any case, header or trailer.
func TestMetadataKeyCase(t *testing.T) {
	eachStore(t, func(t *testing.T, store idem.Store) {
		s := newServer(t, store, idemgrpc.Config{ReplayMetadataDenylist: []string{"Set-Cookie", "x-secret"}},
			func(ctx context.Context, _ string, req *structpb.Struct) (*wrapperspb.StringValue, error) {
				if err := grpc.SetHeader(ctx, metadata.MD{"Set-Cookie": {"session=alice"}, "X-Session-Token": {"tok-1"},
					"Idempotent-Replayed": {"forged"}, "X-SECRET": {"s"}}); err != nil {
					return nil, err
				}
				if err := grpc.SetTrailer(ctx, metadata.MD{"SET-COOKIE": {"trailer=alice"}, "X-Receipt": {"r-1"}, "x-receipt": {"r-2"}}); err != nil {
					return nil, err
				}
				return wrapperspb.String("charged"), nil
			})
		first := s.call(t.Context(), methodCharge, "case", nil)
		if first.err != nil {
			t.Fatalf("first call: %v (a key in upper case on the wire)", first.err)
		}
		if got := first.header.Get("x-session-token"); len(got) != 1 || got[0] != "tok-1" {
			t.Errorf("first call: x-session-token %q, want [tok-1]", got)
		}
		replay := s.call(t.Context(), methodCharge, "case", nil)
		if replay.err != nil || !replay.replayed() {
			t.Fatalf("retry: got replayed=%t (%v), want the replay", replay.replayed(), replay.err)
		}
		for _, md := range []metadata.MD{replay.header, replay.trailer} {
			for k, vs := range md {
				if lk := strings.ToLower(k); lk == "set-cookie" || lk == "x-secret" {
					t.Errorf("replay: got %s: %q, want no denylisted metadata in any case", k, vs)
				}
			}
		}
		if got := replay.header.Get(idemgrpc.MetadataReplayed); len(got) != 1 || got[0] != "true" {
			t.Errorf("replay: idempotent-replayed %q, want only the interceptor's [true]", got)
		}
		if got := replay.header.Get("x-session-token"); len(got) != 1 || got[0] != "tok-1" {
			t.Errorf("replay: x-session-token %q, want [tok-1]", got)
		}
		if got := replay.trailer.Get("x-receipt"); len(got) != 2 {
			t.Errorf("replay: x-receipt %q, want both values of the keys that differ in case", got)
		}
		// Nor is it in the store.
		key, _ := idem.Scope{Method: methodCharge}.Key("case")
		rec, ok, err := store.Get(t.Context(), key)
		if err != nil || !ok || rec.Response == nil {
			t.Fatalf("stored record: %v, %t, %v", rec, ok, err)
		}
		for k := range rec.Response.Header {
			if lk := strings.ToLower(k); strings.Contains(lk, "set-cookie") || strings.Contains(lk, "x-secret") || strings.Contains(lk, "replayed") {
				t.Errorf("stored record: got header %q, want no denylisted metadata", k)
			}
		}
		wantRuns(t, s, 1)
	})
}

// A record stored before a key joined the denylist (or by v1.0) replays
// without it.
func TestDenylistAtReplay(t *testing.T) {
	store := memstore.New(memstore.Options{})
	h := func(ctx context.Context, _ string, _ *structpb.Struct) (*wrapperspb.StringValue, error) {
		grpc.SetHeader(ctx, metadata.Pairs("set-cookie", "session=alice", "x-charge", "ch_1"))
		grpc.SetTrailer(ctx, metadata.Pairs("set-cookie", "late=alice"))
		return wrapperspb.String("charged"), nil
	}
	before := newServer(t, store, idemgrpc.Config{}, h)
	if a := before.call(t.Context(), methodCharge, "k", nil); a.err != nil || len(a.header.Get("set-cookie")) != 1 {
		t.Fatalf("before: got %v, header %v; want set-cookie sent", a.err, a.header)
	}
	after := newServer(t, store, idemgrpc.Config{ReplayMetadataDenylist: []string{"SET-COOKIE"}}, h)
	a := after.call(t.Context(), methodCharge, "k", nil)
	if a.err != nil || !a.replayed() {
		t.Fatalf("after: got replayed=%t (%v), want the replay", a.replayed(), a.err)
	}
	if got := append(a.header.Get("set-cookie"), a.trailer.Get("set-cookie")...); len(got) != 0 || len(a.header.Get("x-charge")) != 1 {
		t.Errorf("after: got set-cookie %q and header %v, want the record replayed without set-cookie", got, a.header)
	}
	wantRuns(t, after, 0)
}

// syncBuffer is a log destination safe for the server's goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// Keyed calls that nothing identifies are reported: a WARN once per
// method, the counter idem.anonymous (layer grpc) and OnAnonymous for each
// one; identified calls and calls without a key are not.
func TestAnonymousReported(t *testing.T) {
	var logs syncBuffer
	reader := sdkmetric.NewManualReader()
	var reported atomic.Int64
	s := newServer(t, memstore.New(memstore.Options{}), idemgrpc.Config{
		Logger:        slog.New(slog.NewTextHandler(&logs, nil)),
		MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)),
		OnAnonymous:   func(context.Context, string) { reported.Add(1) },
	}, execution())
	for i := range 3 {
		for _, m := range []string{methodCharge, methodRefund} {
			if a := s.call(t.Context(), m, fmt.Sprintf("anon-%d", i), nil); a.err != nil {
				t.Fatal(a.err)
			}
		}
	}
	s.call(t.Context(), methodCharge, "", nil)                                     // no key
	s.call(t.Context(), methodCharge, "named", nil, "x-api-key", "alice-secret")   // identified
	s.call(t.Context(), methodCharge, "named", nil, "authorization", "Bearer bob") // identified
	wantRuns(t, s, 9)

	warnings := strings.Count(logs.String(), "level=WARN msg=\"idem: a keyed call carries no credential")
	if warnings != 2 || !strings.Contains(logs.String(), "method="+methodCharge) || !strings.Contains(logs.String(), "method="+methodRefund) {
		t.Errorf("got %d warnings, want one per method (2):\n%s", warnings, logs.String())
	}
	if got := reported.Load(); got != 6 {
		t.Errorf("OnAnonymous: got %d calls, want 6", got)
	}
	if got := anonymousCount(t, reader); got != 6 {
		t.Errorf("idem.anonymous{idem.layer=grpc}: got %d, want 6", got)
	}
}

// anonymousCount reads the counter idem.anonymous of layer grpc.
func anonymousCount(t *testing.T, reader *sdkmetric.ManualReader) int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	var n int64
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if d, ok := m.Data.(metricdata.Sum[int64]); ok && m.Name == "idem.anonymous" {
				for _, p := range d.DataPoints {
					if layer, _ := p.Attributes.Value("idem.layer"); layer.AsString() == "grpc" {
						n += p.Value
					}
				}
			}
		}
	}
	return n
}

// RefuseAnonymous: a keyed call that nothing identifies gets
// Unauthenticated (ReasonAnonymous), its handler not run and its key not
// claimed; it is counted. Identified calls, and calls without a key, run.
func TestRefuseAnonymous(t *testing.T) {
	eachStore(t, func(t *testing.T, store idem.Store) {
		reader := sdkmetric.NewManualReader()
		var outcomes sync.Map
		s := newServer(t, store, idemgrpc.Config{
			RefuseAnonymous: true,
			MeterProvider:   sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)),
			OnOutcome:       func(_ context.Context, _ string, o idemgrpc.Outcome) { outcomes.Store(o, true) },
		}, execution())
		for range 2 {
			a := s.call(t.Context(), methodCharge, "anon", map[string]any{"amount": 1})
			wantCode(t, "anonymous keyed call", a.err, codes.Unauthenticated, idemgrpc.ReasonAnonymous)
		}
		wantRuns(t, s, 0)
		if _, ok := outcomes.Load(idemgrpc.OutcomeRejected); !ok {
			t.Error("outcome: got no rejected, want the refusal reported as rejected")
		}
		key, _ := idem.Scope{Method: methodCharge}.Key("anon")
		if rec, ok, err := store.Get(t.Context(), key); err != nil || ok {
			t.Fatalf("the refused key: got a record %v (%t, %v), want none claimed", rec, ok, err)
		}
		if got := anonymousCount(t, reader); got != 2 {
			t.Errorf("idem.anonymous: got %d, want 2", got)
		}
		if a := s.call(t.Context(), methodCharge, "", nil); a.err != nil {
			t.Errorf("no key: got %v, want it passed through", a.err)
		}
		if a := s.call(t.Context(), methodCharge, "anon", map[string]any{"amount": 1}, "x-api-key", "alice-secret"); a.err != nil || a.replayed() {
			t.Errorf("with an API key: got replayed=%t (%v), want an execution", a.replayed(), a.err)
		}
		wantRuns(t, s, 2)
	})
}

// A call stored by v1.0 under a tenant that changed since (an API-key
// caller was anonymous; an odd spelling of authorization was its own
// tenant) replays after the upgrade (Config.V1Scopes), and runs again
// without the look-up.
func TestV1ScopesFallback(t *testing.T) {
	eachStore(t, func(t *testing.T, store idem.Store) {
		// As a store v1.0 used too: a *memstore.Store is never looked up
		// for v1.0's keys (it holds nothing of v1.0).
		store = struct{ idem.Store }{store}
		v1 := newServer(t, store, idemgrpc.Config{Tenant: idemgrpc.V1Tenant}, execution())
		req := map[string]any{"amount": 100}
		callers := [][]string{{"x-api-key", "alice-secret"}, {"authorization", "bearer  tokA"}}
		stored := map[int]string{}
		for i, md := range callers {
			a := v1.call(t.Context(), methodCharge, fmt.Sprintf("v1-key-%d", i), req, md...)
			if a.err != nil {
				t.Fatal(a.err)
			}
			stored[i] = a.reply
		}
		upgraded := newServer(t, store, idemgrpc.Config{}, execution())
		for i, md := range callers {
			a := upgraded.call(t.Context(), methodCharge, fmt.Sprintf("v1-key-%d", i), req, md...)
			if a.err != nil || !a.replayed() || a.reply != stored[i] {
				t.Errorf("caller %v after the upgrade: got %q replayed=%t (%v), want the replay of v1.0's %q", md, a.reply, a.replayed(), a.err, stored[i])
			}
		}
		wantRuns(t, upgraded, 0)
		// (v1.0 stored Alice's call as anonymous: until it expires, it
		// answers any caller with its key, as it did under v1.0. Records
		// stored since are scoped: TestTenantAPIKeyMetadata.)
		without := newServer(t, store, idemgrpc.Config{V1Scopes: -1}, execution())
		if a := without.call(t.Context(), methodCharge, "v1-key-1", req, callers[1]...); a.err != nil || a.replayed() {
			t.Errorf("V1Scopes -1: got a replay of %q, want the call run again (no look-up)", a.reply)
		}
	})
}
