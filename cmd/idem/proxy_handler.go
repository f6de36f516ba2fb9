package main

import (
	"cmp"
	"context"
	"crypto/tls"
	"errors"
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
	// routes is the --config file's route table, swapped whole by a
	// reload (SIGHUP): a request keeps the table, and so the route, it
	// started with.
	routes   atomic.Pointer[routeTable]
	defaults routeSettings // the flags' settings, of routeTable.def
	logger   *slog.Logger
	metrics  *proxyMetrics
	inFlight atomic.Int64
	wg       sync.WaitGroup
	// stop is every route's idemhttp Config.StopContext: stopWork cancels
	// the upstream requests still running once --shutdown-timeout passed.
	stop     context.Context
	stopWork context.CancelFunc
	upstream http.Handler
	store    idem.Store
	blob     blobOptions
	v1Scopes time.Duration // --v1-scopes, counted from started (v1ScopesLeft)
	started  time.Time
	// quota is the per-tenant quota of the routes whose quota settings
	// are the flags': made once, so that its counts outlive reloads.
	quota        *idemhttp.Quota
	quotaTenants int
	// seal is every route's sealer (--seal-keys, --seal-kms): made once,
	// its ring re-read on SIGHUP; nil without sealing.
	seal *sidecar.Sealer
}

// routeTable is the routes of a --config file, and the flags' route.
type routeTable struct {
	mux *http.ServeMux // the patterns, each with its *route; nil without a file
	n   int
	// def takes the requests no pattern matches: the flags' settings. It
	// is made again by a reload only when they name a webhook, whose
	// secrets are read when the route is made.
	def *route
	// quotas are the quotas of the routes with quota settings of their
	// own, by pattern and limits: a reload that keeps a route's pattern
	// and limits keeps its counts; one that changes them starts new ones.
	quotas map[string]*idemhttp.Quota
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
	// refusesUncovered: the middleware answers the methods it does not
	// cover too (a webhook route: sidecar.Settings.RefusesUncovered).
	refusesUncovered bool
}

// ServeHTTP lets a route be registered on the ServeMux; the proxy only
// uses the mux to find routes and calls them itself.
func (rt *route) ServeHTTP(w http.ResponseWriter, r *http.Request) { rt.handler.ServeHTTP(w, r) }

// reqInfo carries what the middleware reported about a request to the
// proxy's log line: its outcome, the same word as in idem_requests_total,
// and its stored key (idem inspect --stored-key), never the raw key; the
// key's text is made only for a line that is written (logRequest).
type reqInfo struct {
	outcome string
	key     idem.Key
	keyed   bool // key was reported
}

type reqInfoKey struct{}

// newProxy builds the proxy's handler: a route for the defaults and one
// per --config route, each a middleware in front of the same upstream.
func newProxy(target *url.URL, upstreamTLS *tls.Config, store idem.Store, defaults routeSettings, routes []routeConfig,
	metrics *proxyMetrics, logger *slog.Logger, blob blobOptions, quotaTenants int, v1Scopes time.Duration, sealer *sidecar.Sealer) (*proxy, error) {
	p := &proxy{logger: logger, metrics: metrics, upstream: newUpstream(target, upstreamTLS, metrics, logger), store: store,
		defaults: defaults, blob: blob, quotaTenants: quotaTenants, v1Scopes: v1Scopes, started: time.Now(), seal: sealer}
	p.quota = defaults.Quota().New(quotaTenants)
	p.stop, p.stopWork = context.WithCancel(context.Background())
	if err := p.setRoutes(routes); err != nil {
		return nil, err
	}
	return p, nil
}

// setRoutes puts the routes of a --config file in place of the running
// ones, or leaves them when one is refused. The flags' route is made the
// first time, and again when the flags name a webhook (its secrets are
// read again: a SIGHUP rotates them).
func (p *proxy) setRoutes(routes []routeConfig) error {
	t := &routeTable{n: len(routes), quotas: map[string]*idemhttp.Quota{}}
	prev := p.routes.Load()
	if prev != nil && p.defaults.Webhook == "" {
		t.def = prev.def
	} else {
		def, err := p.newRoute("", p.defaults, nil)
		if err != nil {
			return err
		}
		t.def = def
	}
	if len(routes) > 0 {
		t.mux = http.NewServeMux()
		for _, rc := range routes {
			rt, err := p.newRoute(rc.pattern, rc.settings, func(name string) *idemhttp.Quota {
				if q := prev.quota(name); q != nil {
					t.quotas[name] = q
					return q
				}
				t.quotas[name] = rc.settings.Quota().New(p.quotaTenants)
				return t.quotas[name]
			})
			if err != nil {
				return err
			}
			t.mux.Handle(rc.pattern, rt) // validated by loadProxyConfig
		}
	}
	p.routes.Store(t)
	return nil
}

// v1ScopesLeft is idemhttp Config.V1Scopes for a route made now with
// retention: what is left of --v1-scopes since the proxy started, so that
// a reload does not start the look-ups of v1.0's keys again.
func (p *proxy) v1ScopesLeft(retention time.Duration) time.Duration {
	if p.v1Scopes < 0 {
		return -1
	}
	if d := cmp.Or(p.v1Scopes, retention) - time.Since(p.started); d > 0 {
		return d
	}
	return -1
}

// reload reads the --config file at path again and puts its routes in
// place of the running ones (sidecar.Reload's Do): requests under way keep
// the route they started with. A file that does not load is refused, and
// the running routes kept.
func (p *proxy) reload(path string, defaults routeSettings) error {
	routes, err := loadProxyConfig(path, defaults)
	if err != nil {
		return errors.New("--config " + err.Error())
	}
	return p.setRoutes(routes)
}

// quota is the quota t keeps under name; nil for none (or a nil t).
func (t *routeTable) quota(name string) *idemhttp.Quota {
	if t == nil {
		return nil
	}
	return t.quotas[name]
}

// quotas are the proxy's quotas: the flags', and those of the running
// --config routes with quota settings of their own.
func (p *proxy) quotas() []*idemhttp.Quota {
	qs := []*idemhttp.Quota{p.quota}
	for _, q := range p.routes.Load().quotas {
		qs = append(qs, q)
	}
	return qs
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

// newRoute makes the route of pattern ("" for the flags'). A route with
// quota settings of its own takes its quota from ownQuota, given the
// name under which its counts are kept.
func (p *proxy) newRoute(pattern string, s routeSettings, ownQuota func(name string) *idemhttp.Quota) (*route, error) {
	rt := &route{name: pattern, covered: map[string]bool{}, tenant: sidecar.TenantFunc(s.TenantHeader, s.TenantCookie), handler: p.upstream}
	if pattern == "" {
		// The path the upstream will see (idemhttp's default route).
		rt.routeOf = sidecar.Route
	} else {
		rt.routeOf = func(*http.Request) string { return pattern }
	}
	for _, m := range s.Methods {
		rt.covered[m] = true
	}
	if len(s.Methods) == 0 {
		return rt, nil // nothing covered: straight to the upstream
	}
	rt.refusesUncovered = s.RefusesUncovered()
	env := sidecar.Env{Metrics: p.metrics.Metrics, Logger: p.logger, Stop: p.stop, Quota: p.quota,
		BlobTimeout: p.blob.timeout, V1Scopes: p.v1ScopesLeft(s.Retention), Seal: p.seal,
		OnOutcome: func(r *http.Request, o idemhttp.Outcome) {
			if info, ok := r.Context().Value(reqInfoKey{}).(*reqInfo); ok {
				info.outcome = string(o)
			}
		},
		OnKey: func(r *http.Request, k idem.Key) {
			if info, ok := r.Context().Value(reqInfoKey{}).(*reqInfo); ok {
				info.key, info.keyed = k, true
			}
		}}
	if s.OwnQuota {
		env.Quota = ownQuota(pattern + "\x00" + s.Quota().String())
	}
	if p.blob.blobs != nil {
		env.Blobs = p.blob.blobs
	}
	mw, err := s.Middleware(p.store, rt.tenant, routeFunc(pattern, rt.routeOf), env)
	if err != nil {
		where := "the flags"
		if pattern != "" {
			where = fmt.Sprintf("route %q", pattern)
		}
		return nil, usageError{fmt.Sprintf("%s: %v", where, err)}
	}
	rt.handler = mw(p.upstream)
	return rt, nil
}

// find returns the route of r: the --config route whose pattern matches
// it as ServeMux would, or the defaults. A request ServeMux would redirect
// (a path to clean, a missing trailing slash) or answer 405 for gets the
// defaults, and is forwarded as it is.
func (p *proxy) find(r *http.Request) *route {
	t := p.routes.Load()
	if mux := t.mux; mux != nil {
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
		if h, _ := mux.Handler(r); h != nil {
			if rt, ok := h.(*route); ok {
				return rt
			}
		}
	}
	return t.def
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

// reqState is what the proxy keeps of a request it serves, in one
// allocation: the status writer, what the middleware reports, and the
// log line's attributes.
type reqState struct {
	sw   statusWriter
	info reqInfo
	// tail holds the log line's attributes past the route and outcome
	// (logRequest), at most six.
	tail [6]slog.Attr
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
	st := &reqState{sw: statusWriter{ResponseWriter: w, ctx: r.Context()}}
	info, sw := &st.info, &st.sw
	uncovered := !rt.covered[r.Method] && !rt.refusesUncovered
	if uncovered {
		info.outcome = outcomeNotCovered
		p.metrics.Requests.WithLabelValues(outcomeNotCovered).Inc()
	}
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
			p.logRequest(r, rt, st, start, aborted)
			panic(v)
		}
	}()
	next := r
	if !uncovered || r.ContentLength > 0 {
		// The middleware reports the outcome and the key to info through
		// the request's context. A request of a method it does not cover
		// it passes on, reporting nothing: that one goes as it is, unless
		// it has a body, which the upstream's handler replaces
		// (newUpstream) and so must find in a copy, not in the server's
		// request (net/http's server looks at that one's body after the
		// handler returns).
		next = r.WithContext(context.WithValue(r.Context(), reqInfoKey{}, info))
	}
	rt.handler.ServeHTTP(sw, next)
	if sw.gone {
		p.metrics.clientGone.WithLabelValues(info.outcome).Inc()
	}
	p.logRequest(r, rt, st, start, false)
}

// logRequest writes the request's log line. Its outcome is the label the
// request was counted under in idem_requests_total; client_gone and
// upstream_aborted are facts beside it, each with a counter of its own.
//
// The attributes after the outcome go in a group without a name, which
// the JSON and text handlers write inline, as if each were given on its
// own (the line is the same): a record holds five attributes without an
// allocation, and the group's are in st.
func (p *proxy) logRequest(r *http.Request, rt *route, st *reqState, start time.Time, upstreamAborted bool) {
	if !p.logger.Enabled(r.Context(), slog.LevelInfo) {
		return
	}
	info, sw := &st.info, &st.sw
	status := sw.status
	if upstreamAborted {
		status = http.StatusBadGateway
	}
	tail := append(st.tail[:0],
		slog.Int("status", cmp.Or(status, http.StatusOK)),
		slog.Int64("bytes", sw.written),
		durationMS(time.Since(start)),
	)
	if sw.gone {
		tail = append(tail, slog.Bool("client_gone", true))
	}
	if upstreamAborted {
		tail = append(tail, slog.Bool("upstream_aborted", true))
	}
	if info.keyed {
		tail = append(tail, slog.String("key", info.key.String()))
	}
	p.logger.LogAttrs(r.Context(), slog.LevelInfo, "request",
		slog.String("method", r.Method),
		slog.String("path", r.URL.EscapedPath()),
		slog.String("route", rt.name),
		slog.String("outcome", info.outcome),
		slog.Attr{Value: slog.GroupValue(tail...)},
	)
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
