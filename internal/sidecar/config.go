package sidecar

import (
	"cmp"
	"context"
	"log/slog"
	"net/http"
	"path"
	"strings"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
)

// Env is what every route of a sidecar shares, beside its Settings: where
// it counts and logs, when its work is cut off, its quota, blob store and
// v1.0 look-ups.
type Env struct {
	Metrics *Metrics
	Logger  *slog.Logger
	// Stop is idemhttp Config.StopContext: its end cancels the work still
	// running (idem proxy past --shutdown-timeout; Caddy once the config
	// that made the handler is stopped).
	Stop context.Context
	// Quota is the route's idemhttp.Quota (QuotaLimits.New, or one the
	// front end keeps across reloads); nil: idemhttp.NoQuota.
	Quota       *idemhttp.Quota
	Blobs       idem.BlobStore // nil: none
	BlobTimeout time.Duration  // 0: idemhttp.DefaultBlobTimeout
	V1Scopes    time.Duration  // idemhttp Config.V1Scopes
	// OnOutcome, when set, also receives each request's outcome (after it
	// was counted in idem_requests_total), for the front end's log line.
	OnOutcome func(*http.Request, idemhttp.Outcome)
	// OnKey, when set, receives each keyed request's stored key (what
	// idem inspect --stored-key takes) before it is claimed, for the front
	// end's log line: never the client's raw key (idemhttp Config.OnKey).
	OnKey func(*http.Request, idem.Key)
	// Seal seals the responses the route stores and opens the sealed
	// ones it replays (NewSealer, from Settings.Seal: one per process);
	// nil: none are sealed, and a sealed one is answered as unreadable.
	Seal *Sealer
	// now is the clock webhook signatures' timestamps are checked
	// against; nil: time.Now. Tests set it to their fixtures' signing
	// time.
	now func() time.Time
}

// Config is the idemhttp.Config of a route with settings s, whose keys are
// scoped by tenant and route (nil: idemhttp's default, the path). On a
// webhook route (s.Webhook) the tenant is the sender, "webhook:" + the
// preset's name, whatever tenant says: the signature, not the caller's
// headers, says who sent it; its authority is "", not the Host header,
// which the caller chooses; and its route is webhookRoute's. Its fingerprint is s.Fingerprint's, its
// ErrorHandler s.Profile's (ProfileErrorHandler). Its KeySource is left
// zero: KeySource, which reads the webhook secrets and can fail, makes
// it, and Middleware sets it. The front end adds what is its own (a gRPC
// hook, say) before idemhttp.NewMiddleware.
func (s Settings) Config(tenant, route func(*http.Request) string, env Env) idemhttp.Config {
	m := env.Metrics
	if s.Webhook != "" {
		sender := "webhook:" + s.Webhook
		tenant = func(*http.Request) string { return sender }
		route = webhookRoute(route)
	}
	cfg := idemhttp.Config{
		Methods:         s.Methods,
		RequireKey:      s.RequireKey,
		Tenant:          tenant,
		Route:           route,
		RefuseAnonymous: s.RefuseAnonymous,
		OnAnonymous:     func(*http.Request) { m.Anonymous.Inc() },
		V1Scopes:        env.V1Scopes,
		MaxBodySize:     s.MaxBody,
		Lease:           s.Lease,
		Retention:       s.Retention,
		MaxResponseSize: int(s.MaxResponse),
		// 0 in the sidecars is no wait and no limit; idemhttp's 0 is its
		// default.
		Wait:               cmp.Or(s.Wait, -1),
		ClientWriteTimeout: cmp.Or(s.ClientWriteTimeout, -1),
		FailOpen:           s.FailOpen,
		MaxExecution:       s.MaxExecution,
		StopContext:        env.Stop,
		// Unsafe, off by default: see idemhttp Config.CancelOnDisconnect.
		CancelOnDisconnect: s.CancelOnDisconnect,
		Logger:             env.Logger,
		Quota:              cmp.Or(env.Quota, idemhttp.NoQuota),
		OnQuotaExceeded:    m.OnQuotaExceeded,
		OnOutcome: func(r *http.Request, o idemhttp.Outcome) {
			m.Requests.WithLabelValues(string(o)).Inc()
			if env.OnOutcome != nil {
				env.OnOutcome(r, o)
			}
		},
		OnRenew:     m.OnRenew,
		BlobTimeout: env.BlobTimeout,
		// idem_responses_not_kept_total: replays of these answer 500.
		OnBodyOmitted:         func(*http.Request) { m.NotKept.Inc() },
		Fingerprint:           s.fingerprint(),
		ErrorHandler:          ProfileErrorHandler(s.Profile, nil),
		EchoKey:               s.EchoKey,
		LifetimeHeader:        s.LifetimeHeader,
		OnKey:                 env.OnKey,
		ReplayHeaderAllowlist: s.ReplayHeadersAllow,
		ReplayHeaderDenylist:  s.ReplayHeadersDeny,
	}
	if s.Webhook != "" {
		// The Host header is the caller's to choose, and signs nothing:
		// scoped by it, a captured delivery sent again under another Host
		// would be a new key and run again. The sender (the tenant above)
		// and the route say whose delivery it is.
		cfg.Authority = func(*http.Request) string { return "" }
	}
	if env.Seal != nil {
		cfg.Seal, cfg.SealOpenOnly = env.Seal, s.Seal.OpenOnly
	}
	if env.Blobs != nil {
		cfg.Blobs = env.Blobs
		cfg.OnBlobError = m.OnBlobError
	}
	if s.StoreStatuses != nil {
		statuses := map[int]bool{}
		for _, st := range s.StoreStatuses {
			statuses[st] = true
		}
		cfg.ShouldStore = func(_ *http.Request, status int) bool { return statuses[status] }
	}
	return cfg
}

// webhookRoute is the route of a webhook route's scope: route's (nil: the
// path), cleaned (no empty or dot segments) and lower-cased, so that a
// captured delivery sent again to /Hooks/Stripe, //hooks/stripe or
// /hooks/./stripe, which a matcher may send to the same route (Caddy's
// path matcher ignores case), is the same key and not run again. (The
// proxy's --config routes have their pattern as route already.)
func webhookRoute(route func(*http.Request) string) func(*http.Request) string {
	if route == nil {
		route = Route
	}
	return func(r *http.Request) string {
		p := route(r)
		if strings.HasPrefix(p, "/") {
			p = path.Clean(p)
		}
		return strings.ToLower(p)
	}
}

// fingerprint is the Config.Fingerprint of s.Fingerprint,
// FingerprintExclude and FingerprintFields; nil: idemhttp's default, the
// raw body. (The idemhttp functions panic on a malformed pointer, which
// Validate refuses.)
func (s Settings) fingerprint() func(*http.Request, []byte) idem.Fingerprint {
	switch {
	case len(s.FingerprintFields) > 0:
		return idemhttp.FingerprintJSONFields(s.FingerprintFields...)
	case len(s.FingerprintExclude) > 0 || s.Fingerprint == "json":
		return idemhttp.FingerprintJSON(s.FingerprintExclude...)
	}
	return nil
}

// Middleware is the idemhttp middleware of a route with settings s (see
// Config, with keySource's key source), in front of the upstream's
// handler, gRPC calls answered and stored as gRPC (GRPCMiddleware: a gRPC
// call gets its gRPC status whatever s.Profile). It reads the webhook
// secrets, each time it is called; its error is one line that names what
// failed (a secrets file or variable, never a secret). On a webhook route
// a request of a method s does not cover is answered 405 (with Allow) and
// counted as rejected, never passed to the upstream unverified: the front
// ends send every request of such a route through it
// (RefusesUncovered).
func (s Settings) Middleware(store idem.Store, tenant, route func(*http.Request) string, env Env) (func(http.Handler) http.Handler, error) {
	cfg := s.Config(tenant, route, env)
	now := env.now
	if now == nil {
		now = time.Now
	}
	var err error
	if cfg.KeySource, err = s.keySource(env.Metrics, now); err != nil {
		return nil, err
	}
	mw, err := GRPCMiddleware(store, cfg)
	if err != nil || !s.RefusesUncovered() {
		return mw, err
	}
	covered := map[string]bool{}
	for _, m := range s.Methods {
		covered[m] = true
	}
	allow := strings.Join(s.Methods, ", ")
	return func(next http.Handler) http.Handler {
		h := mw(next)
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if covered[r.Method] {
				h.ServeHTTP(w, r)
				return
			}
			cfg.OnOutcome(r, idemhttp.OutcomeRejected)
			w.Header().Set("Allow", allow)
			idemhttp.WriteProblem(w, r, &idemhttp.Problem{Type: ProblemMethodNotAllowed, Title: "Method not allowed",
				Status: http.StatusMethodNotAllowed,
				Detail: "This route receives " + s.Webhook + " webhooks, whose signatures are checked on " + allow + " only; the request was not processed."})
		})
	}, nil
}

// ProblemMethodNotAllowed is the problem type of a webhook route's answer
// to a method it does not cover (405).
const ProblemMethodNotAllowed = "urn:idem:problem:method-not-allowed"

// RefusesUncovered reports whether a request of a method s does not cover
// must still go through s's Middleware, which refuses it (a webhook
// route), rather than straight to the upstream.
func (s Settings) RefusesUncovered() bool { return s.Webhook != "" }
