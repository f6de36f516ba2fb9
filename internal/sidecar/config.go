package sidecar

import (
	"cmp"
	"context"
	"log/slog"
	"net/http"
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
}

// Config is the idemhttp.Config of a route with settings s, whose keys are
// scoped by tenant and route (nil: idemhttp's default, the path). The
// front end adds what is its own (a gRPC hook, say) before
// idemhttp.NewMiddleware.
func (s Settings) Config(tenant, route func(*http.Request) string, env Env) idemhttp.Config {
	m := env.Metrics
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
		OnBodyOmitted: func(*http.Request) { m.NotKept.Inc() },
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

// Middleware is the idemhttp middleware of a route with settings s (see
// Config), in front of the upstream's handler, gRPC calls answered and
// stored as gRPC (GRPCMiddleware).
func (s Settings) Middleware(store idem.Store, tenant, route func(*http.Request) string, env Env) (func(http.Handler) http.Handler, error) {
	return GRPCMiddleware(store, s.Config(tenant, route, env))
}
