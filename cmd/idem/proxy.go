package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/blobstore"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/logwriter"
	"github.com/idemkit/idem/internal/sidecar"
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
	v1Scopes                        v1Scopes      // --v1-scopes
	quota                           quotaFlags    // --quota-*; resolved into settings by validate

	tls         sidecar.TLSFiles // --tls-cert, --tls-key, --tls-client-ca
	upstreamTLS sidecar.TLSFiles // --upstream-cert, --upstream-key, --upstream-ca
	tlsWatch    time.Duration    // --tls-watch; 0: on SIGHUP only
}

// The flags of the TLS files, as errors name them.
var (
	tlsFlags         = sidecar.TLSFiles{Cert: "--tls-cert", Key: "--tls-key", CA: "--tls-client-ca"}
	upstreamTLSFlags = sidecar.TLSFiles{Cert: "--upstream-cert", Key: "--upstream-key", CA: "--upstream-ca"}
)

// v1Scopes is --v1-scopes: how long after start the keys v1.0 derived are
// looked up too (idemhttp Config.V1Scopes): "" (the default) as long as
// the retention, "off" never, else a positive duration.
type v1Scopes struct {
	d   time.Duration // idemhttp's: 0 the retention, negative never
	set string
}

func (v *v1Scopes) String() string { return v.set }

func (v *v1Scopes) Set(s string) error {
	if s == "off" {
		v.d, v.set = -1, s
		return nil
	}
	d, err := time.ParseDuration(s)
	if err != nil || d <= 0 {
		return errors.New("want a positive duration, such as 24h, or off")
	}
	v.d, v.set = d, s
	return nil
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
(Idempotent-Replayed: true), wait for it while the first is in flight (409
past --wait), 422 when the key comes with another request. Every flag can be set as IDEM_<FLAG>
(--admin-listen is IDEM_ADMIN_LISTEN). Flags:

`)
		fs.PrintDefaults()
	}
	fs.StringVar(&o.listen, "listen", "127.0.0.1:8080", "address to serve the proxied traffic on (HTTP/1.1 and h2c; with --tls-cert, TLS with HTTP/1.1 and HTTP/2): host:port, or unix:///path/idem.sock (a unix socket of mode 0660, removed on exit)")
	fs.StringVar(&o.upstream, "upstream", "", "base URL of the service behind the proxy (required): http://host:port[/path], https://, h2c://host:port[/path] (cleartext HTTP/2), unix:///path/app.sock (HTTP/1.1 on a unix socket) or h2c+unix:///path/app.sock")
	fs.StringVar(&o.store, "store", "memory", storeFlagHelp)
	fs.StringVar(&o.prefix, "prefix", "", "key prefix (Redis) or namespace (PostgreSQL) of the records; default the store's own")
	fs.Var(&o.memoryLimit, "memory-limit", "with --store memory: the most its records may take, in bytes or with a unit (64MiB, 1GiB); when full, requests with a new key get 503 (store-full; with --fail-open they are forwarded without idempotency) until records expire, and stored keys still replay; each tenant may fill an eighth of it (--quota-bytes); 0: no limit (the process may run out of memory)")
	fs.DurationVar(&o.reapInterval, "reap-interval", defaultReapInterval, "with a postgres://, mysql:// or tiered store: delete expired records this often (those expired for the store's grace: a minute, an hour for the tiered store); 0: never (another process must reap the table)")
	fs.BoolVar(&o.settings.requireKey, "require-key", false, "answer 400 to covered requests without an Idempotency-Key")
	fs.StringVar(&o.methods, "methods", "POST,PATCH", "comma-separated methods covered; others pass through untouched")
	fs.StringVar(&o.settings.tenantHeader, "tenant-header", "", "scope keys by this request header's value (set by a trusted gateway); default a hash of Authorization")
	fs.StringVar(&o.settings.tenantCookie, "tenant-cookie", "", "scope keys by a hash of this cookie (the session cookie of a web app); a request without it: a hash of Authorization; not with --tenant-header")
	fs.DurationVar(&o.settings.lease, "lease", idem.DefaultLease, "how long a crashed proxy blocks a key; renewed while the upstream works")
	fs.DurationVar(&o.settings.retention, "retention", idem.DefaultRetention, "how long a completed response is kept and replayed")
	fs.DurationVar(&o.settings.wait, "wait", idemhttp.DefaultWait, "a request whose key is in flight (a copy of a request still running) waits up to this long for its result, and gets 409 only past it; 0: 409 at once")
	fs.DurationVar(&o.settings.maxExecution, "max-execution", 0, "cancel an upstream request still running after this long under its key (answered 504; the key is released); 0: no limit")
	fs.DurationVar(&o.settings.clientWriteTimeout, "client-write-timeout", idemhttp.DefaultClientWriteTimeout, "a keyed request's client that does not take a write of its response (32 KiB at most) within this long is gone, as if it had disconnected: the upstream's response is still read to its end and stored for the retry; 0: no limit (a client that stops reading holds its key)")
	fs.BoolVar(&o.settings.refuseAnonymous, "refuse-anonymous", false, "refuse keyed requests that carry nothing identifying their caller (no Authorization, API-key header, client certificate, --tenant-header or --tenant-cookie) with 401 problem+json; default: serve them, logged once per route and counted in idem_anonymous_requests_total")
	fs.Var(&o.v1Scopes, "v1-scopes", "after an upgrade from idem v1.0: for this long after start, a keyed request that is new here also looks for the record v1.0 stored for it (v1.0 had no host in the key, read credentials as written, no API-key headers), so that it is replayed, not run again; costs one store read per new key; default: as long as --retention; off: never (a deployment that never ran v1.0)")
	fs.BoolVar(&o.settings.cancelOnDisconnect, "cancel-on-disconnect", false, "UNSAFE: a client that disconnects or times out cancels its upstream request and releases the key, so its retry runs the request again; default: the upstream request runs to its end and its response is stored for the retry")
	fs.BoolVar(&o.settings.failOpen, "fail-open", false, "forward requests without idempotency when the store fails (default: 503)")
	o.quota.register(fs)
	fs.Var(&o.maxBody, "max-body", "largest request body of a keyed request, in bytes or with a unit (64KiB, 1MiB); larger gets 413")
	fs.Var(&o.maxResponse, "max-response", "largest response body kept in the record (the inline limit), in bytes or with a unit; a larger one goes to --blob, or without it is completed without its body and its replays answer 500 response-not-kept (counted in idem_responses_not_kept_total)")
	fs.StringVar(&o.blob, "blob", "", blobFlagHelp)
	fs.DurationVar(&o.blobTimeout, "blob-timeout", idemhttp.DefaultBlobTimeout, "give up a blob write or read that makes no progress for this long (a write: the key completes without its body; a replay: 503 or an aborted response)")
	fs.DurationVar(&o.blobSweep, "blob-sweep", 0, "with --blob: delete orphaned and expired blobs this often (as idem gc does); 0: never (use idem gc or an S3 lifecycle rule)")
	fs.DurationVar(&o.blobSweepMinAge, "blob-sweep-min-age", blobstore.DefaultMinAge, "with --blob-sweep: leave blobs younger than this (0: none)")
	fs.StringVar(&o.tls.Cert, "tls-cert", "", "serve TLS (HTTP/1.1 and HTTP/2 by ALPN) with this PEM certificate (its chain, leaf first), with --tls-key; re-read when the file changes and on SIGHUP")
	fs.StringVar(&o.tls.Key, "tls-key", "", "the PEM private key of --tls-cert (unencrypted)")
	fs.StringVar(&o.tls.CA, "tls-client-ca", "", "with --tls-cert: require a client certificate signed by a CA of this PEM file (mTLS); the certificate is the tenant when no credential or --tenant-header/--tenant-cookie names the client")
	fs.DurationVar(&o.tlsWatch, "tls-watch", sidecar.CertWatchInterval, "look at the files of --tls-cert, --tls-key, --tls-client-ca, --upstream-cert and --upstream-key this often, and load them when their contents changed; 0: only on SIGHUP")
	fs.StringVar(&o.upstreamTLS.CA, "upstream-ca", "", "with an https:// upstream: trust the CAs of this PEM file instead of the system's")
	fs.StringVar(&o.upstreamTLS.Cert, "upstream-cert", "", "with an https:// upstream: present this PEM client certificate to it, with --upstream-key; re-read when the file changes and on SIGHUP")
	fs.StringVar(&o.upstreamTLS.Key, "upstream-key", "", "the PEM private key of --upstream-cert (unencrypted)")
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
	// A line per request: written by one goroutine, the lines logged while
	// a write is under way go together in the next (internal/logwriter),
	// not a write(2) each.
	logOut := logwriter.New(stderr)
	defer logOut.Close() // before the caller prints the error returned
	logger, err := newLogger(logOut, o.logFormat, o.logLevel)
	if err != nil {
		return err
	}
	// What net/http writes with the log package (its Transport's
	// "Unsolicited response received on idle HTTP channel", for one) goes
	// to the structured log too, at WARN, never as raw text beside it.
	slog.SetDefault(logger)
	slog.SetLogLoggerLevel(slog.LevelWarn)
	// The TLS files are read before anything opens: one that does not
	// load is a usage error, as a bad flag is.
	var certs *sidecar.CertSource
	if o.tls.Cert != "" {
		if certs, err = sidecar.NewCertSource(o.tls, tlsFlags, logger); err != nil {
			return usageError{err.Error()}
		}
	}
	upstreamTLS, upstreamCerts, err := sidecar.UpstreamTLS(o.upstreamTLS, upstreamTLSFlags, logger)
	if err != nil {
		return usageError{err.Error()}
	}

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
	p, err := newProxy(target, upstreamTLS, store, o.settings, routes, metrics, logger, blobOptions{blobs: blobs, timeout: o.blobTimeout}, o.quota.tenants, o.v1Scopes.d)
	if err != nil {
		return err
	}
	metrics.registerQuotaTenants(p.quotas)
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
	// HTTP/1.1 and, on the same listener, HTTP/2: by ALPN over TLS, else
	// cleartext by prior knowledge (h2c: a connection that opens with
	// HTTP/2's preface).
	srv.Protocols = new(http.Protocols)
	srv.Protocols.SetHTTP1(true)
	srv.Protocols.SetHTTP2(certs != nil)
	srv.Protocols.SetUnencryptedHTTP2(certs == nil)
	ln, listenAddr, err := listenProxy(o.listen)
	if err != nil {
		return err
	}
	serveErr := make(chan error, 2)
	// Reloads last until the proxy returns, not until SIGTERM: a SIGHUP
	// while it drains must not take SIGHUP's default action (exit) and
	// cut the requests it is finishing.
	reloadCtx, stopReloads := context.WithCancel(context.Background())
	defer stopReloads()
	reloads := sidecar.WatchCerts(reloadCtx, o.tlsWatch, certs, upstreamCerts)
	if certs != nil {
		srv.TLSConfig = certs.Config()
		go func() { serveErr <- srv.ServeTLS(ln, "", "") }()
	} else {
		go func() { serveErr <- srv.Serve(ln) }()
	}
	sidecar.ReloadOnHangup(reloadCtx, logger, reloads...)

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
	logger.Info("idem proxy listening", "listen", listenAddr, "tls", tlsMode(o.tls), "admin", adminAddr,
		"upstream", target.Redacted(), "store", storeForLog(o.store), "blob", blobName, "blob_namespace", blobNS, "routes", len(routes),
		"methods", o.settings.methods, "require_key", o.settings.requireKey, "lease", o.settings.lease.String(), "quota", p.quota.String())

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
	if ok, err := checkUpstreamURL(target); err != nil {
		return nil, err
	} else if !ok && ((target.Scheme != "http" && target.Scheme != "https") || target.Host == "") {
		return nil, usageError{fmt.Sprintf("--upstream %q: want an absolute http://, https:// or h2c:// URL, or unix:///path/to/app.sock", target.Redacted())}
	}
	if target.RawQuery != "" || target.Fragment != "" {
		return nil, usageError{fmt.Sprintf("--upstream %q: a query or fragment makes no sense here", target.Redacted())}
	}
	if o.listen == "" {
		return nil, usageError{"--listen is empty"}
	}
	if (o.tls.Cert == "") != (o.tls.Key == "") {
		return nil, usageError{"--tls-cert and --tls-key go together: want both (a PEM certificate and its key) or neither"}
	}
	if o.tls.CA != "" && o.tls.Cert == "" {
		return nil, usageError{"--tls-client-ca needs --tls-cert and --tls-key: client certificates are asked for in a TLS handshake"}
	}
	if o.tlsWatch < 0 {
		return nil, usageError{fmt.Sprintf("--tls-watch %v: must not be negative (0: only on SIGHUP)", o.tlsWatch)}
	}
	if (o.upstreamTLS.Cert == "") != (o.upstreamTLS.Key == "") {
		return nil, usageError{"--upstream-cert and --upstream-key go together: want both (a PEM certificate and its key) or neither"}
	}
	if o.upstreamTLS != (sidecar.TLSFiles{}) && target.Scheme != "https" {
		return nil, usageError{fmt.Sprintf("--upstream-ca, --upstream-cert and --upstream-key need an https:// upstream; --upstream is %s://", target.Scheme)}
	}
	if _, isUnix, err := listenUnixURL(o.listen); err != nil {
		return nil, err
	} else if _, _, err := net.SplitHostPort(o.listen); !isUnix && err != nil {
		return nil, usageError{fmt.Sprintf("--listen %q: want host:port, such as 127.0.0.1:8080 or :8080, or unix:///path/to/idem.sock", o.listen)}
	}
	if _, _, err := net.SplitHostPort(o.adminListen); o.adminListen != "" && err != nil {
		return nil, usageError{fmt.Sprintf("--admin-listen %q: want host:port, such as 127.0.0.1:9090 or :9090", o.adminListen)}
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
	memoryBytes := int64(0) // the store's size, where the proxy knows it
	if o.store == "" || o.store == "memory" {
		memoryBytes = int64(o.memoryLimit)
	}
	if err := o.quota.resolve(&o.settings, memoryBytes); err != nil {
		return nil, err
	}
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

// tlsMode is the listener's TLS for the start's log line: off, tls, or
// mtls (client certificates required).
func tlsMode(f sidecar.TLSFiles) string {
	switch {
	case f.CA != "":
		return "mtls"
	case f.Cert != "":
		return "tls"
	}
	return "off"
}

// storeForLog names the store without credentials or query: its scheme,
// host and path (a Redis database index, a PostgreSQL database); for the
// tiered store, both URLs so.
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
	return u.Scheme + "://" + u.Host + u.EscapedPath()
}

// blobStoreOrNil is b as an idem.BlobStore, nil (not a nil *Bucket in an
// interface) when b is nil.
func blobStoreOrNil(b *blobstore.Bucket) idem.BlobStore {
	if b == nil {
		return nil
	}
	return b
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
