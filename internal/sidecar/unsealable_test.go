package sidecar

import (
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemgrpc"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/sealtest"
	"github.com/idemkit/idem/memstore"
)

// lastKey is the record key of the request sealedRoute's upstream last
// ran.
var lastKey atomic.Value

// sealedRoute serves s's middleware over store with sealer (the
// settings do not carry one here: the Sealer is set on the Config they
// make), with a registry of its own.
func sealedRoute(t *testing.T, s Settings, store idem.Store, sealer idem.Sealer) *testRoute {
	t.Helper()
	if err := s.Validate(Underscored); err != nil {
		t.Fatal(err)
	}
	rt := &testRoute{reg: prometheus.NewRegistry()}
	env := Env{Metrics: NewMetrics(Underscored), Logger: slog.New(slog.DiscardHandler)}
	env.Metrics.Register(rt.reg)
	cfg := s.Config(func(*http.Request) string { return "t" }, nil, env)
	cfg.Seal = sealer
	mw, err := GRPCMiddleware(store, cfg)
	if err != nil {
		t.Fatal(err)
	}
	rt.srv = httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rt.runs.Add(1)
		if l, ok := idem.LeaseFromContext(r.Context()); ok {
			lastKey.Store(l.Key)
		}
		if IsGRPC(r) {
			w.Header().Set("Content-Type", "application/grpc")
			w.Header().Set("Grpc-Status", "0")
			w.WriteHeader(http.StatusOK)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})))
	t.Cleanup(rt.srv.Close)
	return rt
}

// A completed key whose sealed record does not open, behind the sidecar's
// middleware: 500 problem+json urn:idem:problem:response-unreadable
// whatever the profile (the profiles shape only a mismatch and a key in
// flight), DataLoss with reason IDEMPOTENT_RESPONSE_UNSEALABLE for a gRPC
// call, never forwarded again, counted as idem_requests_total{outcome="unsealable"}.
func TestUnsealableRecord(t *testing.T) {
	for _, profile := range Profiles {
		store := memstore.New(memstore.Options{})
		s := DefaultSettings()
		s.Profile = profile
		a := sealedRoute(t, s, store, sealtest.Ring(t, "a1"))
		for _, k := range []string{"h", "g"} {
			extra := []string{"Idempotency-Key", k}
			if k == "g" {
				extra = append(extra, "Content-Type", "application/grpc")
			}
			if got := a.post(t, "{}", extra...); got.status != http.StatusCreated && got.status != http.StatusOK {
				t.Fatalf("profile %q, first %s: %d", profile, k, got.status)
			}
		}
		b := sealedRoute(t, s, store, sealtest.Ring(t, "b1"))
		got := b.post(t, "{}", "Idempotency-Key", "h")
		if got.status != http.StatusInternalServerError || problemType(got) != idemhttp.ProblemResponseUnreadable || got.header.Get("Retry-After") != "" ||
			got.header.Get(idemhttp.HeaderReplayed) != "true" || !strings.Contains(got.body, "will not be executed again") {
			t.Errorf("profile %q: got %d %v %s, want 500 problem+json %s", profile, got.status, got.header, got.body, idemhttp.ProblemResponseUnreadable)
		}
		g := b.post(t, "{}", "Idempotency-Key", "g", "Content-Type", "application/grpc")
		if g.status != http.StatusOK || g.header.Get("Grpc-Status") != "15" || g.header.Get("Grpc-Status-Details-Bin") == "" {
			t.Errorf("profile %q, gRPC: got %d %v, want grpc-status 15 (DataLoss)", profile, g.status, g.header)
		}
		if code, reason := grpcCode(&idemhttp.Problem{Type: idemhttp.ProblemResponseUnreadable}); code != 15 || reason != idemgrpc.ReasonUnsealable {
			t.Errorf("grpcCode: %v %q", code, reason)
		}
		if n := b.runs.Load(); n != 0 {
			t.Errorf("profile %q: forwarded %d times, want 0", profile, n)
		}
		if n := b.metric(t, "idem_requests_total", "outcome", "unsealable"); n != 2 {
			t.Errorf(`profile %q: idem_requests_total{outcome="unsealable"} = %v, want 2`, profile, n)
		}
		if n := a.metric(t, "idem_requests_total", "outcome", "unsealable"); n != 0 {
			t.Errorf(`profile %q: the series unsealable on a fresh route = %v, want 0 (made at zero)`, profile, n)
		}
		// One byte altered, read with the ring that sealed it.
		if got := a.post(t, "{}", "Idempotency-Key", "x"); got.status != http.StatusCreated {
			t.Fatalf("profile %q, x: %d", profile, got.status)
		}
		sealtest.Flip(t, store, lastKey.Load().(idem.Key))
		if got := a.post(t, "{}", "Idempotency-Key", "x"); got.status != http.StatusInternalServerError || problemType(got) != idemhttp.ProblemResponseUnreadable ||
			a.runs.Load() != 3 || a.metric(t, "idem_requests_total", "outcome", "unsealable") != 1 {
			t.Errorf("profile %q, a flipped byte: got %d %s after %d runs, want 500 %s, 3 runs (h, g, x)", profile, got.status, got.body, a.runs.Load(), idemhttp.ProblemResponseUnreadable)
		}
	}
}
