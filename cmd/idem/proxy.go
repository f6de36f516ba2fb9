package main

import (
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"path"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/blobstore"
	"github.com/idemkit/idem/idemhttp"
)

func init() {
	commands["proxy"] = command{summary: "sidecar reverse proxy that makes POST and PATCH idempotent", run: runProxy}
}

// Server limits. WriteTimeout is deliberately none: a covered request may
// legitimately run long (its lease is renewed meanwhile) and responses may
// stream; the upstream bounds its own work. A keyed request's client that
// stops reading is gone once a write to it (32 KiB at most) has not been
// taken for --client-write-timeout (idemhttp Config.ClientWriteTimeout, a
// deadline per write), so it does not hold its key; any other client that
// stops reading only holds its own connection. ReadTimeout bounds slow
// request bodies; ReadHeaderTimeout and MaxHeaderBytes stop slowloris
// clients.
const (
	readHeaderTimeout = 5 * time.Second
	maxHeaderBytes    = 1 << 20
	// drainGrace bounds the wait, after the connections were cut at the
	// end of --shutdown-timeout, for handlers to release their leases.
	drainGrace = 5 * time.Second
)

// ProblemBadGateway is the problem type of the proxy's 502 answer when
// the upstream cannot be reached or fails to answer. The default storage
// policy releases the key on 502: a retry forwards the request again.
const ProblemBadGateway = "urn:idem:problem:bad-gateway"

// ProblemUpstreamTimeout is the problem type of the proxy's 504 answer
// when the upstream ran past the route's --max-execution. The default
// storage policy releases the key on 504.
const ProblemUpstreamTimeout = "urn:idem:problem:upstream-timeout"

// proxyOptions are the proxy's flags.
type proxyOptions struct {
	listen, upstream, store, prefix string
	adminListen                     string
	logFormat, logLevel             string
	configFile                      string
	methods                         string
	shutdownTimeout                 time.Duration
	readTimeout, idleTimeout        time.Duration
	maxBody, maxResponse            byteSize
	settings                        routeSettings // from the flags; maxBody, maxResponse and methods filled after parsing
	blob                            string        // --blob URL; "" for none
	blobTimeout                     time.Duration
	blobSweep, blobSweepMinAge      time.Duration
	memoryLimit                     byteSize      // --memory-limit: memstore.Options.MaxBytes
	reapInterval                    time.Duration // --reap-interval; 0: no reaper
}

func runProxy(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var o proxyOptions
	o.maxBody, o.maxResponse = idemhttp.DefaultMaxBodySize, idemhttp.DefaultMaxResponseSize
	o.memoryLimit = defaultMemoryLimit
	fs := flag.NewFlagSet("idem proxy", flag.ContinueOnError)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), `usage: idem proxy --upstream URL [--listen ADDR] [--store STORE] [flags]

Forwards every request to --upstream. Requests of the covered methods that
carry an Idempotency-Key run once per key: repeats get the stored response
(Idempotent-Replayed: true), 409 while the first is in flight, 422 when the
key comes with another request. Every flag can be set as IDEM_<FLAG>
(--admin-listen is IDEM_ADMIN_LISTEN). Flags:

`)
		fs.PrintDefaults()
	}
	fs.StringVar(&o.listen, "listen", "127.0.0.1:8080", "address to serve the proxied traffic on")
	fs.StringVar(&o.upstream, "upstream", "", "base URL of the service behind the proxy, http://host:port[/path] (required)")
	fs.StringVar(&o.store, "store", "memory", storeFlagHelp)
	fs.StringVar(&o.prefix, "prefix", "", "key prefix (Redis) or namespace (PostgreSQL) of the records; default the store's own")
	fs.Var(&o.memoryLimit, "memory-limit", "with --store memory: the most its records may take, in bytes or with a unit (64MiB, 1GiB); when full, requests with a new key get 503 (store-full; with --fail-open they are forwarded without idempotency) until records expire, and stored keys still replay; 0: no limit (the process may run out of memory)")
	fs.DurationVar(&o.reapInterval, "reap-interval", defaultReapInterval, "with a postgres:// or tiered store: delete expired records this often (those expired for the store's grace: a minute, an hour for the tiered store); 0: never (another process must reap the table)")
	fs.BoolVar(&o.settings.requireKey, "require-key", false, "answer 400 to covered requests without an Idempotency-Key")
	fs.StringVar(&o.methods, "methods", "POST,PATCH", "comma-separated methods covered; others pass through untouched")
	fs.StringVar(&o.settings.tenantHeader, "tenant-header", "", "scope keys by this request header's value (set by a trusted gateway); default a hash of Authorization")
	fs.StringVar(&o.settings.tenantCookie, "tenant-cookie", "", "scope keys by a hash of this cookie (the session cookie of a web app); a request without it: a hash of Authorization; not with --tenant-header")
	fs.DurationVar(&o.settings.lease, "lease", idem.DefaultLease, "how long a crashed proxy blocks a key; renewed while the upstream works")
	fs.DurationVar(&o.settings.retention, "retention", idem.DefaultRetention, "how long a completed response is kept and replayed")
	fs.DurationVar(&o.settings.wait, "wait", 0, "wait up to this long for an in-flight duplicate's result instead of answering 409 at once")
	fs.DurationVar(&o.settings.maxExecution, "max-execution", 0, "cancel an upstream request still running after this long under its key (answered 504; the key is released); 0: no limit")
	fs.DurationVar(&o.settings.clientWriteTimeout, "client-write-timeout", idemhttp.DefaultClientWriteTimeout, "a keyed request's client that does not take a write of its response (32 KiB at most) within this long is gone, as if it had disconnected: the upstream's response is still read to its end and stored for the retry; 0: no limit (a client that stops reading holds its key)")
	fs.BoolVar(&o.settings.cancelOnDisconnect, "cancel-on-disconnect", false, "UNSAFE: a client that disconnects or times out cancels its upstream request and releases the key, so its retry runs the request again; default: the upstream request runs to its end and its response is stored for the retry")
	fs.BoolVar(&o.settings.failOpen, "fail-open", false, "forward requests without idempotency when the store fails (default: 503)")
	fs.Var(&o.maxBody, "max-body", "largest request body of a keyed request, in bytes or with a unit (64KiB, 1MiB); larger gets 413")
	fs.Var(&o.maxResponse, "max-response", "largest response body kept in the record (the inline limit), in bytes or with a unit; a larger one goes to --blob, or without it is completed without its body and its replays answer 500 response-not-kept (counted in idem_responses_not_kept_total)")
	fs.StringVar(&o.blob, "blob", "", blobFlagHelp)
	fs.DurationVar(&o.blobTimeout, "blob-timeout", idemhttp.DefaultBlobTimeout, "give up a blob write or read that makes no progress for this long (a write: the key completes without its body; a replay: 503 or an aborted response)")
	fs.DurationVar(&o.blobSweep, "blob-sweep", 0, "with --blob: delete orphaned and expired blobs this often (as idem gc does); 0: never (use idem gc or an S3 lifecycle rule)")
	fs.DurationVar(&o.blobSweepMinAge, "blob-sweep-min-age", blobstore.DefaultMinAge, "with --blob-sweep: leave blobs younger than this (0: none)")
	fs.StringVar(&o.adminListen, "admin-listen", "", "address for /metrics, /healthz and /readyz (off when empty)")
	fs.StringVar(&o.logFormat, "log-format", "json", "log format on stderr: json or text")
	fs.StringVar(&o.logLevel, "log-level", "info", "log level: debug, info, warn or error")
	fs.StringVar(&o.configFile, "config", "", "YAML (or JSON) file with per-route overrides (see docs/proxy.md)")
	fs.DurationVar(&o.shutdownTimeout, "shutdown-timeout", 30*time.Second, "on SIGTERM or SIGINT, how long in-flight requests may take to finish")
	fs.DurationVar(&o.readTimeout, "read-timeout", time.Minute, "longest time to read a whole request, body included (0: none)")
	fs.DurationVar(&o.idleTimeout, "idle-timeout", 2*time.Minute, "how long an idle keep-alive connection stays open")
	if err := parseFlags(fs, args, stderr); err != nil {
		return err
	}
	target, err := o.validate()
	if err != nil {
		return err
	}
	var routes []routeConfig
	if o.configFile != "" {
		if routes, err = loadProxyConfig(o.configFile, o.settings); err != nil {
			return usageError{"--config " + err.Error()}
		}
	}
	logger, err := newLogger(stderr, o.logFormat, o.logLevel)
	if err != nil {
		return err
	}
	// What net/http writes with the log package (its Transport's
	// "Unsolicited response received on idle HTTP channel", for one) goes
	// to the structured log too, at WARN, never as raw text beside it.
	slog.SetDefault(logger)
	slog.SetLogLoggerLevel(slog.LevelWarn)

	storeStats := newStoreMetrics(logger)
	rawStore, closeStore, err := openStoreWith(ctx, o.store, o.prefix, storeOptions{maxBytes: int64(o.memoryLimit),
		reapEvery: cmp.Or(o.reapInterval, -1), onReap: storeStats.onReap, logger: logger})
	if errors.As(err, new(usageError)) {
		return err
	} else if err != nil {
		return fmt.Errorf("--store %s: %w", storeForLog(o.store), err)
	}
	defer closeStore() // stops the reaper, then closes the connections
	metrics := newProxyMetrics()
	storeStats.register(metrics.reg, rawStore)
	store := newTimedStore(rawStore, metrics.store)

	var blobs *blobstore.Bucket
	if o.blob != "" {
		if blobs, err = openBlobs(ctx, o.blob); err != nil {
			return err
		}
		defer blobs.Close()
		metrics.initBlobSeries()
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		if err := blobs.Check(cctx); err != nil {
			// Not fatal: the store may come up later. Meanwhile new
			// keyed requests get 503 (or run, with --fail-open).
			logger.Warn("the blob store does not answer", "blob", blobs.String(), "error", err)
		}
		cancel()
	}
	p, err := newProxy(target, store, o.settings, routes, metrics, logger, blobOptions{blobs: blobs, timeout: o.blobTimeout})
	if err != nil {
		return err
	}
	if blobs != nil && o.blobSweep > 0 {
		sweepCtx, stopSweep := context.WithCancel(context.Background())
		defer stopSweep()
		go sweepLoop(sweepCtx, blobs, rawStore, o.blobSweep, o.blobSweepMinAge, metrics, logger)
	}
	srv := &http.Server{
		Handler:           p,
		ReadHeaderTimeout: readHeaderTimeout,
		ReadTimeout:       o.readTimeout,
		IdleTimeout:       o.idleTimeout,
		MaxHeaderBytes:    maxHeaderBytes,
		ErrorLog:          slog.NewLogLogger(logger.Handler(), slog.LevelWarn),
	}
	ln, err := net.Listen("tcp", o.listen)
	if err != nil {
		return err
	}
	serveErr := make(chan error, 2)
	go func() { serveErr <- srv.Serve(ln) }()

	var draining atomic.Bool
	var admin *http.Server
	adminAddr := ""
	if o.adminListen != "" {
		aln, err := net.Listen("tcp", o.adminListen)
		if err != nil {
			srv.Close()
			return err
		}
		admin = &http.Server{
			Handler:           adminHandler(metrics, rawStore, blobStoreOrNil(blobs), &draining),
			ReadHeaderTimeout: readHeaderTimeout,
			ReadTimeout:       10 * time.Second,
			WriteTimeout:      30 * time.Second,
			IdleTimeout:       o.idleTimeout,
			MaxHeaderBytes:    maxHeaderBytes,
			ErrorLog:          slog.NewLogLogger(logger.Handler(), slog.LevelWarn),
		}
		adminAddr = aln.Addr().String()
		go func() { serveErr <- admin.Serve(aln) }()
	}
	blobName, blobNS := "", ""
	if blobs != nil {
		blobName = blobs.String()
		// The namespace in the names of its blobs, for idem gc's report.
		blobNS = idem.BlobNamespace(store.Namespace()) + " (" + store.Namespace() + ")"
	}
	if o.store == "" || o.store == "memory" { // once every setting was found good
		logger.Warn(memoryStoreWarning, "memory_limit", o.memoryLimit.String())
	}
	logger.Info("idem proxy listening", "listen", ln.Addr().String(), "admin", adminAddr,
		"upstream", target.Redacted(), "store", storeForLog(o.store), "blob", blobName, "blob_namespace", blobNS, "routes", len(routes),
		"methods", o.settings.methods, "require_key", o.settings.requireKey, "lease", o.settings.lease.String())

	select {
	case err := <-serveErr:
		srv.Close()
		if admin != nil {
			admin.Close()
		}
		return fmt.Errorf("serving: %w", err)
	case <-ctx.Done():
	}

	// Stop accepting, let in-flight requests finish (their handlers
	// complete or release their keys), then close the store.
	draining.Store(true)
	logger.Info("shutting down: finishing in-flight requests", "timeout", o.shutdownTimeout.String(), "in_flight", p.inFlight.Load())
	sctx, cancel := context.WithTimeout(context.Background(), o.shutdownTimeout)
	defer cancel()
	shutdownErr := srv.Shutdown(sctx)
	if shutdownErr != nil {
		logger.Warn("in-flight requests did not finish in time; cancelling their upstream requests and closing their connections",
			"in_flight", p.inFlight.Load())
		p.stopWork()
		srv.Close()
	}
	// Handlers outlive Shutdown when it times out, and hijacked
	// connections are not waited for: give them a moment to release
	// their leases before the store goes.
	if !p.wait(drainGrace) {
		logger.Warn("handlers still running at exit (upgraded connections, or keyed requests whose keys stay blocked until their leases end)",
			"in_flight", p.inFlight.Load())
	}
	if admin != nil {
		actx, acancel := context.WithTimeout(context.Background(), time.Second)
		admin.Shutdown(actx)
		acancel()
	}
	if shutdownErr != nil {
		return fmt.Errorf("shutdown: in-flight requests cut off after %v", o.shutdownTimeout)
	}
	logger.Info("idem proxy stopped")
	return nil
}

// validate checks the flags and returns the upstream URL.
func (o *proxyOptions) validate() (*url.URL, error) {
	if o.upstream == "" {
		return nil, usageError{"--upstream is required (or IDEM_UPSTREAM): the URL of the service behind the proxy"}
	}
	if hostPort.MatchString(o.upstream) { // 127.0.0.1:9000: no scheme
		return nil, usageError{fmt.Sprintf("--upstream %s: want a URL: http://%s (or https://)", o.upstream, o.upstream)}
	}
	target, err := url.Parse(o.upstream)
	if err != nil {
		return nil, usageError{"--upstream: not a URL (the value is not shown: it may hold a password)"}
	}
	if target.User != nil {
		return nil, usageError{fmt.Sprintf("--upstream %q: credentials in the URL are not forwarded; the upstream sees the client's Authorization header", target.Redacted())}
	}
	if (target.Scheme != "http" && target.Scheme != "https") || target.Host == "" {
		return nil, usageError{fmt.Sprintf("--upstream %q: want an absolute http:// or https:// URL", target.Redacted())}
	}
	if target.RawQuery != "" || target.Fragment != "" {
		return nil, usageError{fmt.Sprintf("--upstream %q: a query or fragment makes no sense here", target.Redacted())}
	}
	if o.listen == "" {
		return nil, usageError{"--listen is empty"}
	}
	for _, l := range []struct{ name, addr string }{{"listen", o.listen}, {"admin-listen", o.adminListen}} {
		if _, _, err := net.SplitHostPort(l.addr); l.addr != "" && err != nil {
			return nil, usageError{fmt.Sprintf("--%s %q: want host:port, such as 127.0.0.1:8080 or :8080", l.name, l.addr)}
		}
	}
	if o.shutdownTimeout <= 0 {
		return nil, usageError{fmt.Sprintf("--shutdown-timeout %v: want a positive duration", o.shutdownTimeout)}
	}
	if o.readTimeout < 0 || o.idleTimeout < 0 {
		return nil, usageError{"--read-timeout and --idle-timeout must not be negative"}
	}
	if o.blobTimeout <= 0 || o.blobSweep < 0 || o.blobSweepMinAge < 0 {
		return nil, usageError{"--blob-timeout must be positive, --blob-sweep and --blob-sweep-min-age not negative"}
	}
	if o.reapInterval < 0 {
		return nil, usageError{fmt.Sprintf("--reap-interval %v: must not be negative (0: never)", o.reapInterval)}
	}
	if o.blob == "" && o.blobSweep > 0 {
		return nil, usageError{"--blob-sweep needs --blob"}
	}
	switch o.logFormat {
	case "json", "text":
	default:
		return nil, usageError{fmt.Sprintf("--log-format %q: want json or text", o.logFormat)}
	}
	o.settings.methods = parseMethods(o.methods)
	o.settings.maxBody = int64(o.maxBody)
	o.settings.maxResponse = int64(o.maxResponse)
	if err := o.settings.validate(func(n string) string { return "--" + n }); err != nil {
		return nil, usageError{err.Error()}
	}
	return target, nil
}

func newLogger(w io.Writer, format, level string) (*slog.Logger, error) {
	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(level)); err != nil {
		return nil, usageError{fmt.Sprintf("--log-level %q: want debug, info, warn or error", level)}
	}
	opts := &slog.HandlerOptions{Level: lvl}
	if format == "text" {
		return slog.New(slog.NewTextHandler(w, opts)), nil
	}
	return slog.New(slog.NewJSONHandler(w, opts)), nil
}

// storeForLog names the store without credentials, query or database
// path: its scheme and host; for the tiered store, both URLs so.
func storeForLog(spec string) string {
	if spec == "" || spec == "memory" {
		return "memory"
	}
	if f := strings.Fields(spec); len(f) > 1 {
		for i := range f {
			f[i] = storeForLog(f[i])
		}
		return strings.Join(f, " ")
	}
	u, err := url.Parse(spec)
	if err != nil {
		return "(unparsable)"
	}
	return u.Scheme + "://" + u.Host
}

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
}

// blobStoreOrNil is b as an idem.BlobStore, nil (not a nil *Bucket in an
// interface) when b is nil.
func blobStoreOrNil(b *blobstore.Bucket) idem.BlobStore {
	if b == nil {
		return nil
	}
	return b
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

func newProxy(target *url.URL, store idem.Store, defaults routeSettings, routes []routeConfig,
	metrics *proxyMetrics, logger *slog.Logger, blob blobOptions) (*proxy, error) {
	transport := http.DefaultTransport.(*http.Transport).Clone()
	transport.MaxIdleConnsPerHost = 256
	transport.TLSClientConfig = &tls.Config{MinVersion: tls.VersionTLS12}
	rp := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(target)
			pr.SetXForwarded()
		},
		Transport: sendOnce{transport},
		ErrorLog:  slog.NewLogLogger(logger.Handler(), slog.LevelWarn),
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			cause := context.Cause(r.Context())
			if errors.Is(cause, idem.ErrMaxExecution) {
				logger.LogAttrs(r.Context(), slog.LevelWarn, "upstream request cut off by --max-execution", slog.String("method", r.Method), slog.Any("error", err))
				idemhttp.WriteProblem(w, r, &idemhttp.Problem{Type: ProblemUpstreamTimeout, Title: "Gateway Timeout",
					Status: http.StatusGatewayTimeout, Detail: "The upstream service did not answer within the route's maximum execution time."})
				return
			}
			level := slog.LevelWarn
			if errors.Is(cause, context.Canceled) {
				level = slog.LevelDebug // the client left, on a route with cancel-on-disconnect
			}
			attrs := []slog.Attr{slog.String("method", r.Method), slog.String("path", r.URL.EscapedPath()), slog.Any("error", err)}
			if cause != nil && cause != err {
				attrs = append(attrs, slog.Any("cause", cause))
			}
			logger.LogAttrs(r.Context(), level, "upstream request failed", attrs...)
			idemhttp.WriteProblem(w, r, &idemhttp.Problem{Type: ProblemBadGateway, Title: "Bad Gateway",
				Status: http.StatusBadGateway, Detail: "The upstream service could not be reached or did not answer."})
		},
	}
	upstream := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		defer func() { metrics.upstream.Observe(time.Since(start).Seconds()) }() // aborted bodies too
		if r.ContentLength > 0 {
			r.Body = &declaredBody{ReadCloser: r.Body, left: r.ContentLength}
		}
		rp.ServeHTTP(w, r)
	})
	p := &proxy{logger: logger, metrics: metrics, blob: blob}
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

func newRoute(pattern string, s routeSettings, upstream http.Handler, store idem.Store, p *proxy) (*route, error) {
	rt := &route{name: pattern, covered: map[string]bool{}, tenant: tenantFunc(s.tenantHeader, s.tenantCookie), handler: upstream}
	if pattern == "" {
		rt.routeOf = func(r *http.Request) string { return r.URL.EscapedPath() }
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
		Route:           rt.routeOf,
		MaxBodySize:     s.maxBody,
		Lease:           s.lease,
		Retention:       s.retention,
		MaxResponseSize: int(s.maxResponse),
		Wait:            s.wait,
		FailOpen:        s.failOpen,
		MaxExecution:    s.maxExecution,
		StopContext:     p.stop,
		// 0 in the proxy is no limit; idemhttp's 0 is its default.
		ClientWriteTimeout: cmp.Or(s.clientWriteTimeout, -1),
		// Unsafe, off by default: see --cancel-on-disconnect.
		CancelOnDisconnect: s.cancelOnDisconnect,
		Logger:             p.logger,
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
	mw, err := idemhttp.NewMiddleware(store, cfg)
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

// tenantFunc scopes keys by the named header, "hdr:" + its value, or by
// idemhttp.DefaultTenant when there is no header name or the request
// lacks the header; or, with a cookie name, by idemhttp.TenantFromCookie.
// The header's raw value (not idemhttp.TenantFromHeader's hash) keeps the
// records of earlier releases reachable and idem inspect --tenant hdr:ID
// usable; Scope.Key hashes it, so no raw value reaches the store.
func tenantFunc(header, cookie string) func(*http.Request) string {
	if cookie != "" {
		return idemhttp.TenantFromCookie(cookie) // validated: one source per route
	}
	if header == "" {
		return idemhttp.DefaultTenant
	}
	return func(r *http.Request) string {
		switch vs := r.Header.Values(header); {
		case len(vs) == 1 && vs[0] != "":
			return "hdr:" + vs[0]
		case len(vs) > 1:
			// A client's own value beside the gateway's (a gateway that
			// appends rather than replaces): never the tenant of the
			// one value alone.
			return "hdr:" + strings.Join(vs, "\n")
		}
		return idemhttp.DefaultTenant(r)
	}
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
		// The key as its stored digest (what idem inspect --stored-key
		// takes), never the client's raw key.
		if ck, err := idemhttp.ParseKey(r.Header); err == nil {
			if k, err := (idem.Scope{Tenant: rt.tenant(r), Method: r.Method, Route: rt.routeOf(r)}).Key(ck); err == nil {
				attrs = append(attrs, slog.String("key", k.String()))
			}
		}
	}
	p.logger.LogAttrs(r.Context(), slog.LevelInfo, "request", attrs...)
}

// wait waits up to d for every handler to return.
func (p *proxy) wait(d time.Duration) bool {
	done := make(chan struct{})
	go func() { p.wg.Wait(); close(done) }()
	select {
	case <-done:
		return true
	case <-time.After(d):
		return false
	}
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

// sendOnce is the upstream transport of the proxy. It sends a request
// that runs under a lease exactly once, framed as the client framed it.
//
// net/http's Transport resends a request on its own when a reused
// connection breaks after the request was written, if the request looks
// safe to resend: it has no body (or can rewind it with GetBody), and
// its method is safe or it carries an Idempotency-Key header. The
// upstream may have acted on the first copy. So a leased request goes
// without GetBody; its body, if any, is wrapped so that its type does not
// look replayable, and goes with its Content-Length (the middleware read
// it whole and set ContentLength); a request without a body goes without
// one (Content-Length: 0 for POST, PUT and PATCH), and its Idempotency-Key
// and X-Idempotency-Key headers are sent under their lower-case names,
// which the upstream reads the same (header names are case-insensitive)
// but Transport does not take for a sign that it may resend. An empty
// chunked body would have done the same for the Transport, but servers
// that do not read chunked request bodies (Python's http.server) take its
// last chunk for the next request and answer it: a response desync.
// Requests without a lease are sent as they are.
type sendOnce struct{ base http.RoundTripper }

func (t sendOnce) RoundTrip(r *http.Request) (*http.Response, error) {
	if _, leased := idem.LeaseFromContext(r.Context()); !leased {
		if r.ContentLength < 0 && r.Body != nil && r.Body != http.NoBody {
			// A body streamed as the client sent it, chunked: an upstream
			// that does not read chunked bodies takes its chunks for the
			// next request and answers them. The connection is closed
			// after the response, so that such an answer never reaches
			// another request (a keyed one, whose key would store it).
			out := *r
			out.Close = true
			return t.base.RoundTrip(&out)
		}
		return t.base.RoundTrip(r)
	}
	out := *r
	out.GetBody = nil
	switch {
	case out.ContentLength == 0:
		if out.Body != nil {
			out.Body.Close()
		}
		out.Body = nil
		out.Header = hideReplayHints(out.Header)
	case out.Body != nil:
		out.Body = onceBody{out.Body}
	}
	return t.base.RoundTrip(&out)
}

// replayHints are the headers that make net/http's Transport resend a
// request without a body (Request.isReplayable).
var replayHints = []string{"Idempotency-Key", "X-Idempotency-Key"}

// hideReplayHints returns h, or a copy of h with each of replayHints
// under its lower-case name.
func hideReplayHints(h http.Header) http.Header {
	var out http.Header
	for _, name := range replayHints {
		v, ok := h[name]
		if !ok {
			continue
		}
		if out == nil {
			out = h.Clone()
		}
		delete(out, name)
		lower := strings.ToLower(name)
		out[lower] = append(out[lower], v...)
	}
	if out == nil {
		return h
	}
	return out
}

// onceBody hides the type of a request body from net/http, which would
// otherwise know that some body types can be read again.
type onceBody struct{ io.ReadCloser }

// declaredBody ends a request body of known length at that length: once
// it has been read, it answers io.EOF itself and reads the client's body
// no more.
//
// Without it, a response was sometimes cut in the middle of its body on
// a request whose body the proxy streams (no Idempotency-Key, or a method
// not covered): net/http's transport, having sent Content-Length bytes,
// reads the body once more to check that it holds no more; net/http's
// server, when the response header goes out, consumes what is left of the
// request body and closes it (unless the handler enabled full duplex). The
// upstream can answer as soon as it has the body, before that last read:
// the read then fails (http: invalid Read on closed Body), and the
// transport closes the upstream connection while the response streams
// through it (golang/go#40747). A keyed request's body was read by the
// middleware and is sent from memory: it never raced.
type declaredBody struct {
	io.ReadCloser
	left int64
}

func (b *declaredBody) Read(p []byte) (int, error) {
	if b.left <= 0 {
		return 0, io.EOF
	}
	if int64(len(p)) > b.left {
		p = p[:b.left]
	}
	n, err := b.ReadCloser.Read(p)
	b.left -= int64(n)
	return n, err
}

func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }
