package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/url"
	"strings"
	"time"

	"golang.org/x/net/http/httpguts"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/blobstore"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/logwriter"
	"github.com/idemkit/idem/internal/sidecar"
	"github.com/idemkit/idem/internal/webhook"
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

	keyHeader                           string // --key-header: settings.Key "header:NAME"
	fingerprintExclude, fingerprintOnly string // --fingerprint-exclude, --fingerprint-fields: comma-separated pointers
	replayAllow, replayDeny             string // --replay-headers-allow, --replay-headers-deny: comma-separated header names
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

// parseProxyFlags parses the proxy's flags (and their IDEM_ forms).
func parseProxyFlags(args []string, stderr io.Writer) (*proxyOptions, error) {
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
	fs.BoolVar(&o.settings.RequireKey, "require-key", false, "answer 400 to covered requests without an Idempotency-Key")
	fs.StringVar(&o.methods, "methods", "POST,PATCH", "comma-separated methods covered; others pass through untouched")
	fs.StringVar(&o.settings.TenantHeader, "tenant-header", "", "scope keys by this request header's value (set by a trusted gateway); default a hash of Authorization")
	fs.StringVar(&o.settings.TenantCookie, "tenant-cookie", "", "scope keys by a hash of this cookie (the session cookie of a web app); a request without it: a hash of Authorization; not with --tenant-header")
	fs.DurationVar(&o.settings.Lease, "lease", idem.DefaultLease, "how long a crashed proxy blocks a key; renewed while the upstream works")
	fs.DurationVar(&o.settings.Retention, "retention", idem.DefaultRetention, "how long a completed response is kept and replayed")
	fs.DurationVar(&o.settings.Wait, "wait", idemhttp.DefaultWait, "a request whose key is in flight (a copy of a request still running) waits up to this long for its result, and gets 409 only past it; 0: 409 at once")
	fs.DurationVar(&o.settings.MaxExecution, "max-execution", 0, "cancel an upstream request still running after this long under its key (answered 504; the key is released); 0: no limit")
	fs.DurationVar(&o.settings.ClientWriteTimeout, "client-write-timeout", idemhttp.DefaultClientWriteTimeout, "a keyed request's client that does not take a write of its response (32 KiB at most) within this long is gone, as if it had disconnected: the upstream's response is still read to its end and stored for the retry; 0: no limit (a client that stops reading holds its key)")
	fs.BoolVar(&o.settings.RefuseAnonymous, "refuse-anonymous", false, "refuse keyed requests that carry nothing identifying their caller (no Authorization, API-key header, client certificate, --tenant-header or --tenant-cookie) with 401 problem+json; default: serve them, logged once per route and counted in idem_anonymous_requests_total")
	fs.Var(&o.v1Scopes, "v1-scopes", "after an upgrade from idem v1.0: for this long after start, a keyed request that is new here also looks for the record v1.0 stored for it (v1.0 had no host in the key, read credentials as written, no API-key headers), so that it is replayed, not run again; costs one store read per new key; default: as long as --retention; off: never (a deployment that never ran v1.0); never with --store memory, which holds nothing of v1.0")
	fs.BoolVar(&o.settings.CancelOnDisconnect, "cancel-on-disconnect", false, "UNSAFE: a client that disconnects or times out cancels its upstream request and releases the key, so its retry runs the request again; default: the upstream request runs to its end and its response is stored for the retry")
	fs.StringVar(&o.keyHeader, "key-header", "", "read the idempotency key from this request header (a sender's own, such as X-GitHub-Delivery) instead of Idempotency-Key; not with --webhook, whose preset names its key; default Idempotency-Key")
	fs.StringVar(&o.settings.Webhook, "webhook", "", "verify each covered request's signature as this sender signs its webhooks ("+strings.Join(webhook.Names(), ", ")+") over the raw body, and take the key the preset names; one that does not verify gets 401 and is neither forwarded nor claimed; needs --webhook-secret-file or --webhook-secret-env (see docs/webhooks.md); default none")
	fs.StringVar(&o.settings.WebhookSecretFile, "webhook-secret-file", "", "with --webhook: the file of its signing secrets, one a line (several while one is rotated), read at start and again on SIGHUP; a secret is read from a file or a variable, never from a flag's value; not with --webhook-secret-env")
	fs.StringVar(&o.settings.WebhookSecretEnv, "webhook-secret-env", "", "with --webhook: the name of the environment variable that holds its signing secrets, one a line, read at start and again on SIGHUP; not with --webhook-secret-file")
	fs.DurationVar(&o.settings.WebhookTolerance, "webhook-tolerance", 0, "with --webhook stripe or standard-webhooks: how far a delivery's signed timestamp may be from now (a replay of an old delivery gets 401); 0 (the default): the preset's, 5m")
	fs.StringVar(&o.settings.Fingerprint, "fingerprint", "", "what of the body a retry must repeat to be the same request: raw (the bytes) or json (its canonical JSON, RFC 8785: key order and spacing do not matter); default raw")
	fs.StringVar(&o.fingerprintExclude, "fingerprint-exclude", "", "comma-separated JSON Pointers (RFC 6901, such as /attempt,/sent_at) left out of the body's fingerprint: a sender's retry counter or timestamp; implies --fingerprint json; not with --fingerprint-fields; default none")
	fs.StringVar(&o.fingerprintOnly, "fingerprint-fields", "", "comma-separated JSON Pointers (RFC 6901, such as /amount,/currency): the only fields of the body in its fingerprint; implies --fingerprint json; not with --fingerprint-exclude; default the whole body")
	fs.StringVar(&o.settings.Profile, "profile", "", "how a key sent with another request and a key in flight are answered: ietf (422 and 409 problem+json), acp (409 idempotency_conflict and idempotency_in_flight, the Agentic Commerce Protocol's) or stripe (400 and 409 idempotency_error, as Stripe answers); default ietf")
	fs.BoolVar(&o.settings.EchoKey, "echo-key", false, "answer every keyed request with its key in an Idempotency-Key header (executed, replayed and refused alike); default off")
	fs.BoolVar(&o.settings.LifetimeHeader, "lifetime-header", false, "answer every request of a covered method with the --retention in an Idempotency-Key-Lifetime header (an ISO 8601 duration, such as PT24H); default off")
	fs.StringVar(&o.replayAllow, "replay-headers-allow", "", "comma-separated response headers (such as Location,X-Request-Id): the only ones stored and replayed, besides Content-Type, Content-Encoding and gRPC's status; the first answer carries every header; default all but Set-Cookie, the hop-by-hop headers and --replay-headers-deny")
	fs.StringVar(&o.replayDeny, "replay-headers-deny", "", "comma-separated response headers (such as X-Session-Token) never stored nor replayed, whatever --replay-headers-allow says (Set-Cookie and the hop-by-hop headers never are); default none")
	fs.StringVar(&o.settings.Seal.Keys, "seal-keys", "", "seal every stored response at rest (AES-256-GCM, bound to its key) with the key ring in this `FILE`: one key a line, ID BASE64 (32 bytes, as openssl rand -base64 32 writes them), the first line the primary that seals, every line a key that opens; re-read on SIGHUP, so that a rotation (a new first line, then SIGHUP) needs no restart (see docs/proxy.md, \"Sealed records\"); default none: records are stored in clear")
	fs.StringVar(&o.settings.Seal.KMS, "seal-kms", "", "seal every stored response with data keys of this AWS KMS key (its `KEY_ARN`; envelope encryption, the data key cached, never stored in clear), with the usual AWS region, endpoint and credential settings; with --seal-keys too, KMS seals new records and the ring still opens the older ones; default none")
	fs.BoolVar(&o.settings.Seal.OpenOnly, "seal-open-only", false, "with --seal-keys or --seal-kms: store new responses in clear and still open the sealed ones (turning sealing off without losing the records sealed so far); default off")
	fs.BoolVar(&o.settings.FailOpen, "fail-open", false, "forward requests without idempotency when the store fails (default: 503)")
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
	fs.DurationVar(&o.tlsWatch, "tls-watch", sidecar.CertWatchInterval, "look at the files of --tls-cert, --tls-key, --tls-client-ca, --upstream-ca, --upstream-cert and --upstream-key this often, and load them when their contents changed; 0: only on SIGHUP")
	fs.StringVar(&o.upstreamTLS.CA, "upstream-ca", "", "with an https:// upstream: trust the CAs of this PEM file instead of the system's; re-read when the file changes and on SIGHUP")
	fs.StringVar(&o.upstreamTLS.Cert, "upstream-cert", "", "with an https:// upstream: present this PEM client certificate to it, with --upstream-key; re-read when the file changes and on SIGHUP")
	fs.StringVar(&o.upstreamTLS.Key, "upstream-key", "", "the PEM private key of --upstream-cert (unencrypted)")
	fs.StringVar(&o.adminListen, "admin-listen", "", "address for /metrics, /healthz and /readyz (off when empty)")
	fs.StringVar(&o.logFormat, "log-format", "json", "log format on stderr: json or text")
	fs.StringVar(&o.logLevel, "log-level", "info", "log level: debug, info, warn or error")
	fs.StringVar(&o.configFile, "config", "", "YAML (or JSON) file with per-route overrides (see docs/proxy.md); re-read on SIGHUP (a file that does not load is refused and the running routes kept)")
	fs.DurationVar(&o.shutdownTimeout, "shutdown-timeout", 30*time.Second, "on SIGTERM or SIGINT, how long in-flight requests may take to finish")
	fs.DurationVar(&o.readTimeout, "read-timeout", time.Minute, "longest time to read a whole request, body included (0: none)")
	fs.DurationVar(&o.idleTimeout, "idle-timeout", 2*time.Minute, "how long an idle keep-alive connection stays open")
	if err := parseFlags(fs, args, stderr); err != nil {
		return nil, err
	}
	return &o, nil
}

func runProxy(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	hup, stopHangups := sidecar.CatchHangups() // before anything that takes time: see ReloadOnHangup
	defer stopHangups()
	o, err := parseProxyFlags(args, stderr)
	if err != nil {
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
	sealer, err := sidecar.NewSealer(ctx, o.settings.Seal, settingFlag)
	if err != nil {
		return usageError{err.Error()}
	}
	logOut := logwriter.New(stderr) // one goroutine writes; lines logged meanwhile go together (internal/logwriter)
	defer logOut.Close()            // before the caller prints the error returned
	logger, err := startLogger(logOut, o.logFormat, o.logLevel)
	if err != nil {
		return err
	}
	t, err := o.loadTLS(target, logger)
	if err != nil {
		return err
	}
	lns, err := o.bindListeners() // before the store: a taken port opens nothing
	if err != nil {
		return err
	}
	b, err := o.openBackends(ctx, logger)
	if err != nil {
		lns.close()
		return err
	}
	defer b.close() // the sweep, the blob store, then the store (its reaper first)
	p, err := newProxy(target, t.upstream, b.store, o.settings, routes, b.metrics, logger, blobOptions{blobs: b.blobs, timeout: o.blobTimeout}, o.quota.tenants, o.v1Scopes.d, sealer)
	if err != nil {
		lns.close()
		return err
	}
	b.metrics.registerQuotaTenants(p.quotas)
	b.startSweep(o, logger)
	srv := o.serve(lns, p, b, t.certs, logger)
	// Reloads last until the proxy returns, not until SIGTERM: a SIGHUP while it drains must
	// not take SIGHUP's default action (exit) and cut the requests it is finishing.
	reloadCtx, stopReloads := context.WithCancel(context.Background())
	defer stopReloads()
	reloads := sidecar.WatchCerts(reloadCtx, o.tlsWatch, t.certs, t.upstreamCerts)
	if o.configFile != "" {
		reloads = append(reloads, sidecar.Reload{What: "config", Do: func() error { return p.reload(o.configFile, o.settings) }})
	} else if o.settings.Webhook != "" { // with --config, its reload reads them too
		reloads = append(reloads, sidecar.Reload{What: "webhook secrets", Do: func() error { return p.setRoutes(nil) }})
	}
	if sealer.Reloads() {
		reloads = append(reloads, sidecar.Reload{What: "seal keys", Do: func() error {
			if err := sealer.Reload(); err != nil {
				return err
			}
			logger.Info("seal keys loaded", "seal", sealer) // the ring's source, key count and primary, never a key
			return nil
		}})
	}
	sidecar.ReloadOnHangup(reloadCtx, hup, logger, reloads...)
	o.logStart(logger, target, srv, b, p, sealer)
	select {
	case err := <-srv.errs:
		srv.close()
		return fmt.Errorf("serving: %w", err)
	case <-ctx.Done():
	}
	return srv.shutdown(p, o.shutdownTimeout, logger)
}

// validate checks the flags and returns the upstream URL.
func (o *proxyOptions) validate() (*url.URL, error) {
	if o.upstream == "" {
		return nil, usageError{"--upstream is required (or IDEM_UPSTREAM): the URL of the service behind the proxy"}
	}
	if sidecar.IsHostPort(o.upstream) { // 127.0.0.1:9000: no scheme
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
	if err := pairOfFiles("tls-cert", o.tls.Cert, "tls-key", o.tls.Key); err != nil {
		return nil, err
	}
	if o.tls.CA != "" && o.tls.Cert == "" {
		return nil, usageError{"--tls-client-ca needs --tls-cert and --tls-key: client certificates are asked for in a TLS handshake"}
	}
	if o.tlsWatch < 0 {
		return nil, usageError{fmt.Sprintf("--tls-watch %v: must not be negative (0: only on SIGHUP)", o.tlsWatch)}
	}
	if err := pairOfFiles("upstream-cert", o.upstreamTLS.Cert, "upstream-key", o.upstreamTLS.Key); err != nil {
		return nil, err
	}
	if o.upstreamTLS != (sidecar.TLSFiles{}) && target.Scheme != "https" {
		return nil, usageError{fmt.Sprintf("--upstream-ca, --upstream-cert and --upstream-key need an https:// upstream; --upstream is %s://", target.Scheme)}
	}
	if _, isUnix, err := listenUnixURL(o.listen); err != nil {
		return nil, err
	} else if !isUnix {
		if err := checkListenAddr("listen", o.listen, "127.0.0.1:8080 or :8080, or unix:///path/to/idem.sock"); err != nil {
			return nil, err
		}
	}
	if o.adminListen != "" {
		if err := checkListenAddr("admin-listen", o.adminListen, "127.0.0.1:9090 or :9090"); err != nil {
			return nil, err
		}
		if _, port, _ := net.SplitHostPort(o.adminListen); o.adminListen == o.listen && port != "0" {
			return nil, usageError{fmt.Sprintf("--listen and --admin-listen are both %s: want two addresses", o.listen)}
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
	o.settings.Methods = sidecar.ParseMethods(o.methods)
	o.settings.MaxBody = int64(o.maxBody)
	o.settings.MaxResponse = int64(o.maxResponse)
	memoryBytes := int64(0) // the store's size, where the proxy knows it
	if o.store == "" || o.store == "memory" {
		memoryBytes = int64(o.memoryLimit)
	}
	if err := o.quota.resolve(&o.settings, memoryBytes); err != nil {
		return nil, err
	}
	if o.keyHeader != "" {
		if !httpguts.ValidHeaderFieldName(o.keyHeader) {
			return nil, usageError{fmt.Sprintf("--key-header %q: not a header name", o.keyHeader)}
		}
		o.settings.Key = "header:" + o.keyHeader
	}
	if o.settings.Webhook == "" { // Validate names the three together; the error starts with the one set, for IDEM_<FLAG>
		for _, f := range []struct{ flag, v string }{{"webhook-secret-file", o.settings.WebhookSecretFile}, {"webhook-secret-env", o.settings.WebhookSecretEnv}} {
			if f.v != "" {
				return nil, usageError{fmt.Sprintf("--%s needs --webhook (one of %s)", f.flag, strings.Join(webhook.Names(), ", "))}
			}
		}
	}
	o.settings.FingerprintExclude = commaList(o.fingerprintExclude)
	o.settings.FingerprintFields = commaList(o.fingerprintOnly)
	o.settings.ReplayHeadersAllow, o.settings.ReplayHeadersDeny = commaList(o.replayAllow), commaList(o.replayDeny)
	if err := o.settings.Validate(settingFlag); err != nil {
		return nil, usageError{err.Error()}
	}
	return target, nil
}

// settingFlag is the name function of Settings.Validate for the flags:
// the flag of a setting, --key-header for its key (the flags set only
// header keys).
func settingFlag(n string) string {
	if n == "key" {
		return "--key-header"
	}
	return flagName(n)
}

// commaList is a comma-separated list (JSON Pointers, header names),
// each item trimmed; nil for "". An empty item stays, for Validate to
// refuse.
func commaList(list string) []string {
	if list == "" {
		return nil
	}
	ptrs := strings.Split(list, ",")
	for i := range ptrs {
		ptrs[i] = strings.TrimSpace(ptrs[i])
	}
	return ptrs
}

// pairOfFiles checks that a certificate flag and its key flag are set
// together; the error starts with the flag that is set (so that it names
// IDEM_<FLAG> when that came from the environment).
func pairOfFiles(certFlag, cert, keyFlag, key string) error {
	switch {
	case cert != "" && key == "":
		return usageError{fmt.Sprintf("--%s needs --%s: want both (a PEM certificate and its key) or neither", certFlag, keyFlag)}
	case key != "" && cert == "":
		return usageError{fmt.Sprintf("--%s needs --%s: want both (a PEM certificate and its key) or neither", keyFlag, certFlag)}
	}
	return nil
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

// storeForLog names the store without credentials (sidecar.StoreForLog).
func storeForLog(spec string) string { return sidecar.StoreForLog(spec) }

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
