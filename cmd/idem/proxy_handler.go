package main

import (
	"cmp"
	"context"
	"crypto/tls"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"path"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/blobstore"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/sidecar"
)

// proxy is the proxy's handler: it picks the route of each request, runs
// it through that route's middleware to the upstream, and logs it.
type proxy struct {
	mux      *http.ServeMux // the --config patterns, each with its *route; nil without a file
	def      *route         // requests no pattern matches
	logger   *slog.Logger
	metrics  *proxyMetrics
	inFlight atomic.Int64
	wg       sync.WaitGroup
	// stop is every route's idemhttp Config.StopContext: stopWork cancels
	// the upstream requests still running once --shutdown-timeout passed.
	stop     context.Context
	stopWork context.CancelFunc
	blob     blobOptions
	v1Scopes time.Duration // every route's idemhttp Config.V1Scopes (--v1-scopes)
	// quota is the per-tenant quota of the routes whose quota settings
	// are the flags'; quotas lists it and those of the --config routes
	// with quota settings of their own (each its own counts).
	quota        *idemhttp.Quota
	quotas       []*idemhttp.Quota
	quotaTenants int
}

// blobOptions is the blob store every route's middleware keeps large
// bodies in (--blob), and its timeout; blobs is nil without --blob.
type blobOptions struct {
	blobs   *blobstore.Bucket
	timeout time.Duration
}

// route is one middleware configuration in front of the upstream.
type route struct {
	name    string          // the pattern, or "" for the defaults
	covered map[string]bool // methods the middleware covers
	handler http.Handler    // the middleware around the upstream, or the upstream alone
	tenant  func(*http.Request) string
	routeOf func(*http.Request) string // idemhttp Config.Route
}

// ServeHTTP lets a route be registered on the ServeMux; the proxy only
// uses the mux to find routes and calls them itself.
func (rt *route) ServeHTTP(w http.ResponseWriter, r *http.Request) { rt.handler.ServeHTTP(w, r) }

// reqInfo carries what the middleware reported about a request to the
// proxy's log line: its outcome, the same word as in idem_requests_total.
type reqInfo struct{ outcome string }

type reqInfoKey struct{}

// newProxy builds the proxy's handler: a route for the defaults and one
// per --config route, each a middleware in front of the same upstream.
func newProxy(target *url.URL, upstreamTLS *tls.Config, store idem.Store, defaults routeSettings, routes []routeConfig,
	metrics *proxyMetrics, logger *slog.Logger, blob blobOptions, quotaTenants int, v1Scopes time.Duration) (*proxy, error) {
	upstream := newUpstream(target, upstreamTLS, metrics, logger)
	p := &proxy{logger: logger, metrics: metrics, blob: blob, quotaTenants: quotaTenants, v1Scopes: v1Scopes}
	p.quota = quotaOf(defaults, quotaTenants)
	p.quotas = []*idemhttp.Quota{p.quota}
	p.stop, p.stopWork = context.WithCancel(context.Background())
	var err error
	if p.def, err = newRoute("", defaults, upstream, store, p); err != nil {
		return nil, err
	}
	if len(routes) > 0 {
		p.mux = http.NewServeMux()
		for _, rc := range routes {
			rt, err := newRoute(rc.pattern, rc.settings, upstream, store, p)
			if err != nil {
				return nil, err
			}
			p.mux.Handle(rc.pattern, rt) // validated by loadProxyConfig
		}
	}
	return p, nil
}

// routeFunc is the idemhttp Config.Route of a route: nil for the default
// route, whose route is the path, as idemhttp's default (which also knows
// the escaped path that v1.0 took, for Config.V1Scopes); else routeOf.
func routeFunc(pattern string, routeOf func(*http.Request) string) func(*http.Request) string {
	if pattern == "" {
		return nil
	}
	return routeOf
}

func newRoute(pattern string, s routeSettings, upstream http.Handler, store idem.Store, p *proxy) (*route, error) {
	rt := &route{name: pattern, covered: map[string]bool{}, tenant: sidecar.TenantFunc(s.tenantHeader, s.tenantCookie), handler: upstream}
	if pattern == "" {
		// The path the upstream will see (idemhttp's default route).
		rt.routeOf = sidecar.Route
	} else {
		rt.routeOf = func(*http.Request) string { return pattern }
	}
	for _, m := range s.methods {
		rt.covered[m] = true
	}
	if len(s.methods) == 0 {
		return rt, nil // nothing covered: straight to the upstream
	}
	cfg := idemhttp.Config{
		Methods:         s.methods,
		RequireKey:      s.requireKey,
		Tenant:          rt.tenant,
		Route:           routeFunc(pattern, rt.routeOf),
		RefuseAnonymous: s.refuseAnonymous,
		OnAnonymous:     func(*http.Request) { p.metrics.anonymous.Inc() },
		V1Scopes:        p.v1Scopes,
		MaxBodySize:     s.maxBody,
		Lease:           s.lease,
		Retention:       s.retention,
		MaxResponseSize: int(s.maxResponse),
		Wait:            cmp.Or(s.wait, -1), // 0 in the proxy is no wait; idemhttp's 0 is its default
		FailOpen:        s.failOpen,
		MaxExecution:    s.maxExecution,
		StopContext:     p.stop,
		// 0 in the proxy is no limit; idemhttp's 0 is its default.
		ClientWriteTimeout: cmp.Or(s.clientWriteTimeout, -1),
		// Unsafe, off by default: see --cancel-on-disconnect.
		CancelOnDisconnect: s.cancelOnDisconnect,
		Logger:             p.logger,
		Quota:              p.quota,
		OnQuotaExceeded:    p.metrics.onQuotaExceeded,
		OnOutcome: func(r *http.Request, o idemhttp.Outcome) {
			if info, ok := r.Context().Value(reqInfoKey{}).(*reqInfo); ok {
				info.outcome = string(o)
			}
			p.metrics.requests.WithLabelValues(string(o)).Inc()
		},
		OnRenew:     p.metrics.onRenew,
		BlobTimeout: p.blob.timeout,
		// idem_responses_not_kept_total: replays of these answer 500.
		OnBodyOmitted: func(*http.Request) { p.metrics.notKept.Inc() },
	}
	if s.ownQuota {
		cfg.Quota = quotaOf(s, p.quotaTenants)
		p.quotas = append(p.quotas, cfg.Quota)
	}
	if p.blob.blobs != nil {
		cfg.Blobs = p.blob.blobs
		cfg.OnBlobError = p.metrics.onBlobError
	}
	if s.storeStatuses != nil {
		statuses := map[int]bool{}
		for _, st := range s.storeStatuses {
			statuses[st] = true
		}
		cfg.ShouldStore = func(_ *http.Request, status int) bool { return statuses[status] }
	}
	mw, err := sidecar.GRPCMiddleware(store, cfg) // gRPC calls answered and stored as gRPC
	if err != nil {
		where := "the flags"
		if pattern != "" {
			where = fmt.Sprintf("route %q", pattern)
		}
		return nil, usageError{fmt.Sprintf("%s: %v", where, err)}
	}
	rt.handler = mw(upstream)
	return rt, nil
}

// find returns the route of r: the --config route whose pattern matches
// it as ServeMux would, or the defaults. A request ServeMux would redirect
// (a path to clean, a missing trailing slash) or answer 405 for gets the
// defaults, and is forwarded as it is.
func (p *proxy) find(r *http.Request) *route {
	if p.mux != nil {
		// Match the cleaned path, so that //payments/7 or /x/../payments/7
		// cannot step around a route's settings (ServeMux would redirect
		// them, and many upstreams clean paths themselves).
		if c := cleanPath(r.URL.Path); c != r.URL.Path {
			u := *r.URL
			u.Path, u.RawPath = c, ""
			rc := *r
			rc.URL = &u
			r = &rc
		}
		if h, _ := p.mux.Handler(r); h != nil {
			if rt, ok := h.(*route); ok {
				return rt
			}
		}
	}
	return p.def
}

// cleanPath is path.Clean that keeps a trailing slash, as net/http does.
func cleanPath(p string) string {
	if p == "" {
		return "/"
	}
	c := path.Clean("/" + strings.TrimPrefix(p, "/"))
	if strings.HasSuffix(p, "/") && c != "/" {
		c += "/"
	}
	return c
}

func (p *proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	p.wg.Add(1)
	p.inFlight.Add(1)
	defer func() {
		p.inFlight.Add(-1)
		p.wg.Done()
	}()
	start := time.Now()
	rt := p.find(r)
	info := &reqInfo{}
	if !rt.covered[r.Method] {
		info.outcome = outcomeNotCovered
		p.metrics.requests.WithLabelValues(outcomeNotCovered).Inc()
	}
	sw := &statusWriter{ResponseWriter: w, ctx: r.Context()}
	defer func() {
		// ReverseProxy panics with http.ErrAbortHandler when the upstream
		// fails in the middle of a body: log that request too, then let
		// the panic abort the connection. A replay that broke off
		// (replay_failed) is not the upstream's doing.
		if v := recover(); v != nil {
			aborted := info.outcome != string(idemhttp.OutcomeReplayFailed)
			if aborted {
				p.metrics.upstreamAborted.Inc()
			}
			p.logRequest(r, rt, info, sw, start, aborted)
			panic(v)
		}
	}()
	rt.handler.ServeHTTP(sw, r.WithContext(context.WithValue(r.Context(), reqInfoKey{}, info)))
	if sw.gone {
		p.metrics.clientGone.WithLabelValues(info.outcome).Inc()
	}
	p.logRequest(r, rt, info, sw, start, false)
}

// logRequest writes the request's log line. Its outcome is the label the
// request was counted under in idem_requests_total; client_gone and
// upstream_aborted are facts beside it, each with a counter of its own.
func (p *proxy) logRequest(r *http.Request, rt *route, info *reqInfo, sw *statusWriter, start time.Time, upstreamAborted bool) {
	if !p.logger.Enabled(r.Context(), slog.LevelInfo) {
		return
	}
	status := sw.status
	if upstreamAborted {
		status = http.StatusBadGateway
	}
	attrs := []slog.Attr{
		slog.String("method", r.Method),
		slog.String("path", r.URL.EscapedPath()),
		slog.String("route", rt.name),
		slog.String("outcome", info.outcome),
		slog.Int("status", cmp.Or(status, http.StatusOK)),
		slog.Int64("bytes", sw.written),
		durationMS(time.Since(start)),
	}
	if sw.gone {
		attrs = append(attrs, slog.Bool("client_gone", true))
	}
	if upstreamAborted {
		attrs = append(attrs, slog.Bool("upstream_aborted", true))
	}
	if rt.covered[r.Method] {
		if k, ok := sidecar.StoredKey(r, rt.tenant, rt.routeOf); ok {
			attrs = append(attrs, slog.String("key", k.String()))
		}
	}
	p.logger.LogAttrs(r.Context(), slog.LevelInfo, "request", attrs...)
}

// durationMS is a request's duration for the log, in milliseconds.
func durationMS(d time.Duration) slog.Attr {
	return slog.Float64("duration_ms", float64(d.Microseconds())/1000)
}

// statusWriter records the status and size of a response for the log,
// and whether the client was gone before it had the whole response: a
// write to it failed (it disconnected, or did not take a write within
// --client-write-timeout), or it had left (ctx ended) before a part of
// the response was handed to the connection. A client that leaves after
// the last write, as curl does once it has read the whole body, is not
// gone. Unwrap gives http.ResponseController (and so ReverseProxy's
// flushes and upgrades) the connection's writer.
type statusWriter struct {
	http.ResponseWriter
	ctx     context.Context // the client's request context
	status  int
	written int64
	gone    bool
}

func (w *statusWriter) WriteHeader(code int) {
	if w.status == 0 && code >= 200 {
		w.status = code
	}
	w.gone = w.gone || w.ctx.Err() != nil
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	w.gone = w.gone || w.ctx.Err() != nil
	n, err := w.ResponseWriter.Write(b)
	w.written += int64(n)
	w.gone = w.gone || err != nil
	return n, err
}

func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }
