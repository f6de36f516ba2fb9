package caddyidem

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
	"golang.org/x/net/http/httpguts"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/sidecar"
)

func init() {
	caddy.RegisterModule(Handler{})
}

// Defaults of the fields that idem proxy also has, with its defaults.
const (
	// DefaultMemoryLimit is MemoryLimit's default for the memory store:
	// idem proxy's --memory-limit.
	DefaultMemoryLimit = 128 << 20
	// DefaultReapInterval is ReapInterval's default: idem proxy's
	// --reap-interval.
	DefaultReapInterval = time.Minute
)

// Handler is the idempotency handler, module http.handlers.idempotency.
// Requests of the covered methods that carry an Idempotency-Key run the
// rest of the route (reverse_proxy, usually) once per key; a repeat gets
// the stored response, byte for byte, with Idempotent-Replayed: true.
// Its fields are idem proxy's flags, under the names of its --config file;
// a zero field takes idem proxy's default.
type Handler struct {
	// Store is where records live: "memory" (the default: this process
	// only, forgotten on restart), a Redis URL (redis://, rediss://,
	// valkey://, with the Cluster and Sentinel forms of redisstore.Open),
	// a PostgreSQL URL (postgres://; the table is created if missing), a
	// MySQL or MariaDB URL (mysql://[user[:pass]@]host[:port]/db[?params],
	// params being go-sql-driver/mysql's; the tables are created if
	// missing), or a Redis URL and a PostgreSQL URL separated by a space
	// (the tiered store). As idem proxy's --store.
	Store string `json:"store,omitempty"`

	// Prefix is the Redis key prefix or the PostgreSQL or MySQL namespace
	// (idem proxy's --prefix). Must not contain { or }.
	Prefix string `json:"prefix,omitempty"`

	// MemoryLimit bounds the memory store's records, in bytes (--memory-limit).
	// Default DefaultMemoryLimit; 0: no limit.
	MemoryLimit *int64 `json:"memory_limit,omitempty"`

	// ReapInterval is how often expired PostgreSQL or MySQL records are
	// deleted (--reap-interval). Default DefaultReapInterval; 0: never.
	ReapInterval *caddy.Duration `json:"reap_interval,omitempty"`

	// Methods are the covered methods; others pass through untouched
	// (counted not_covered). Default POST and PATCH.
	Methods []string `json:"methods,omitempty"`

	// RequireKey answers 400 to covered requests without a key.
	RequireKey bool `json:"require_key,omitempty"`

	// TenantHeader scopes keys by this request header's value, as idem
	// proxy's --tenant-header (records are shared with proxies on the same
	// store). Default: a hash of Authorization (idemhttp.DefaultTenant).
	TenantHeader string `json:"tenant_header,omitempty"`

	// TenantCookie scopes keys by a hash of this cookie
	// (idemhttp.TenantFromCookie). Not with TenantHeader.
	TenantCookie string `json:"tenant_cookie,omitempty"`

	// Lease is how long a crashed Caddy blocks a key; renewed while the
	// work runs. Default idem.DefaultLease (30s); at least 10ms.
	Lease caddy.Duration `json:"lease,omitempty"`

	// Retention is how long a completed response is replayed. Default
	// idem.DefaultRetention (24h); at least 1s.
	Retention caddy.Duration `json:"retention,omitempty"`

	// Wait bounds how long a request whose key is in flight waits for the
	// result before it gets 409 (idemhttp Config.Wait), as idem proxy's
	// --wait. Unset: idemhttp.DefaultWait (500ms); 0 (the Caddyfile's
	// wait 0 or wait off, JSON's "wait": 0): no wait, 409 at once.
	Wait *caddy.Duration `json:"wait,omitempty"`

	// FailOpen runs the route without idempotency when the store fails
	// (default: 503, nothing forwarded).
	FailOpen bool `json:"fail_open,omitempty"`

	// MaxBody is the largest request body of a keyed request, in bytes;
	// larger gets 413. Default idemhttp.DefaultMaxBodySize (1 MiB).
	MaxBody int64 `json:"max_body,omitempty"`

	// MaxResponse is the largest response body kept in the record, in
	// bytes; a larger one goes to Blob, or is completed without its body
	// (replays answer 500 response-not-kept). Default
	// idemhttp.DefaultMaxResponseSize (1 MiB); at most idem.MaxEncodedBody.
	MaxResponse int64 `json:"max_response,omitempty"`

	// StoreStatuses, when set, are the only statuses stored (and
	// replayed); others release the key. Default idemhttp.DefaultShouldStore
	// (2xx and 4xx but 408, 409, 425, 429). An empty list set explicitly
	// stores nothing.
	StoreStatuses []int `json:"store_statuses,omitempty"`

	// MaxExecution, when positive, cancels work still running after this
	// long under its key (the key is released).
	MaxExecution caddy.Duration `json:"max_execution,omitempty"`

	// ClientWriteTimeout: a keyed request's client that does not take a
	// write (32 KiB at most) within this long is gone, and the response is
	// still read to its end and stored. Default
	// idemhttp.DefaultClientWriteTimeout (30s); 0: no limit.
	ClientWriteTimeout *caddy.Duration `json:"client_write_timeout,omitempty"`

	// CancelOnDisconnect is UNSAFE: a client that leaves cancels its work
	// and releases the key, so its retry runs the work again
	// (idemhttp.Config.CancelOnDisconnect).
	CancelOnDisconnect bool `json:"cancel_on_disconnect,omitempty"`

	// RefuseAnonymous answers 401 problem+json to keyed requests that
	// carry nothing identifying their caller (no Authorization, API-key
	// header, client certificate, TenantHeader or TenantCookie), as idem
	// proxy's --refuse-anonymous. Default: served, logged once per route
	// and counted (idem_anonymous_requests_total).
	RefuseAnonymous bool `json:"refuse_anonymous,omitempty"`

	// Blob is the blob store of response bodies larger than MaxResponse:
	// s3://…, file:///DIR or mem:// (blobstore.Open). Default none.
	Blob string `json:"blob,omitempty"`

	// BlobTimeout gives up a blob operation that makes no progress for
	// this long. Default idemhttp.DefaultBlobTimeout (30s).
	BlobTimeout caddy.Duration `json:"blob_timeout,omitempty"`

	// QuotaInFlight, QuotaRecords and QuotaBytes are each tenant's limits
	// (idemhttp.Quota; idem proxy's --quota-in-flight, --quota-records,
	// --quota-bytes): a request with a new key past one gets 429
	// (urn:idem:problem:quota-exceeded) with Retry-After, and nothing
	// runs. Unset with store memory: idemhttp.DefaultQuota of
	// MemoryLimit (32 in flight, an eighth of the limit in bytes, no
	// bound on records); unset with another store, or 0: no limit. The
	// handlers of one process on the same store with the same limits
	// share one count (kept across reloads).
	QuotaInFlight *int   `json:"quota_in_flight,omitempty"`
	QuotaRecords  *int   `json:"quota_records,omitempty"`
	QuotaBytes    *int64 `json:"quota_bytes,omitempty"`

	// KeyHeader reads the idempotency key from this request header (a
	// sender's own, such as X-GitHub-Delivery) instead of
	// Idempotency-Key, as idem proxy's --key-header. Not with Key.
	KeyHeader string `json:"key_header,omitempty"`

	// Key is where the key is: header:NAME (a header) or json:/pointer (a
	// field of a JSON body, RFC 6901), as a route of idem proxy's
	// --config. Default the Idempotency-Key header. Not with KeyHeader,
	// nor with Webhook, whose preset names its key.
	Key string `json:"key,omitempty"`

	// Webhook verifies each covered request's signature as this sender
	// signs its webhooks (github, shopify, standard-webhooks, stripe),
	// over the raw body, before the preset's key is claimed; one that
	// does not verify gets 401 and the rest of the route does not run
	// (idem proxy's --webhook; docs/webhooks.md). Its secrets, one a line,
	// are read from WebhookSecretFile or the environment variable
	// WebhookSecretEnv (exactly one), never from the config itself, when
	// the handler is provisioned (at start and on each config load).
	Webhook           string `json:"webhook,omitempty"`
	WebhookSecretFile string `json:"webhook_secret_file,omitempty"`
	WebhookSecretEnv  string `json:"webhook_secret_env,omitempty"`

	// WebhookTolerance bounds a signed timestamp's distance from now
	// (stripe, standard-webhooks). Default the preset's, 5m.
	WebhookTolerance caddy.Duration `json:"webhook_tolerance,omitempty"`

	// Fingerprint is what of the body a retry must repeat: raw (its
	// bytes, the default) or json (its canonical JSON, RFC 8785).
	// FingerprintExclude (pointers left out) and FingerprintFields (the
	// only pointers in it) imply json; at most one of them is set.
	Fingerprint        string   `json:"fingerprint,omitempty"`
	FingerprintExclude []string `json:"fingerprint_exclude,omitempty"`
	FingerprintFields  []string `json:"fingerprint_fields,omitempty"`

	// Profile is how a mismatch and a key in flight are answered: ietf
	// (the default: 422 and 409 problem+json), acp or stripe (idem
	// proxy's --profile).
	Profile string `json:"profile,omitempty"`

	// EchoKey answers every keyed request with its key in an
	// Idempotency-Key header (idem proxy's --echo-key).
	EchoKey bool `json:"echo_key,omitempty"`

	// LifetimeHeader answers every request of a covered method with the
	// retention in an Idempotency-Key-Lifetime header, an ISO 8601
	// duration (idem proxy's --lifetime-header).
	LifetimeHeader bool `json:"lifetime_header,omitempty"`

	// ReplayHeadersAllow, when set, names the only response headers
	// stored and replayed, besides those that say what the stored body is
	// (Content-Type, Content-Encoding, gRPC's status and encoding); the
	// first answer carries every header. ReplayHeadersDeny names headers
	// never stored nor replayed, and wins over the allowlist. Set-Cookie,
	// the hop-by-hop headers and idem's own are never stored. As idem
	// proxy's --replay-headers-allow and --replay-headers-deny.
	ReplayHeadersAllow []string `json:"replay_headers_allow,omitempty"`
	ReplayHeadersDeny  []string `json:"replay_headers_deny,omitempty"`

	// SealKeys is a key ring file that seals every stored response at
	// rest (AES-256-GCM, bound to its key): one key a line, "ID BASE64"
	// (32-byte keys), the first line the primary that seals, every line a
	// key that opens. It is read when the handler is provisioned (at
	// start and on each config load): a rotation is a new first line,
	// then a config reload. As idem proxy's --seal-keys (a Caddy and a
	// proxy with the same ring, store and prefix read each other's
	// records). Default none: records are stored in clear.
	SealKeys string `json:"seal_keys,omitempty"`

	// SealKMS is the ARN of an AWS KMS key whose data keys seal the
	// stored responses, as idem proxy's --seal-kms.
	SealKMS string `json:"seal_kms,omitempty"`

	// SealOpenOnly, with SealKeys or SealKMS, stores new responses in
	// clear and still opens the sealed ones (turning sealing off without
	// losing the records sealed so far), as idem proxy's --seal-open-only.
	SealOpenOnly bool `json:"seal_open_only,omitempty"`

	covered map[string]bool
	// refusesUncovered: mw answers the methods it does not cover too (a
	// webhook route: sidecar.Settings.RefusesUncovered).
	refusesUncovered bool
	mw               func(http.Handler) http.Handler
	storeKey         string // in the stores pool; "" when none was taken
	blobKey          string // in the stores pool; "" when none was taken
	quotaKey         string // in the stores pool; "" when none was taken
	logger           *slog.Logger
}

// CaddyModule returns the Caddy module information.
func (Handler) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.idempotency",
		New: func() caddy.Module { return new(Handler) },
	}
}

// Interface guards.
var (
	_ caddy.Provisioner           = (*Handler)(nil)
	_ caddy.Validator             = (*Handler)(nil)
	_ caddy.CleanerUpper          = (*Handler)(nil)
	_ caddyhttp.MiddlewareHandler = (*Handler)(nil)
)

// Validate reports the first bad field, named as the Caddyfile names it,
// with what it wants: the fields of the store here, the route's settings
// as idem proxy checks them (sidecar.Settings.Validate).
func (h *Handler) Validate() error {
	switch {
	case h.ReapInterval != nil && *h.ReapInterval < 0:
		return fmt.Errorf("reap_interval %v: must not be negative (0: never)", time.Duration(*h.ReapInterval))
	case h.BlobTimeout < 0:
		return fmt.Errorf("blob_timeout %v: must not be negative", time.Duration(h.BlobTimeout))
	case h.MemoryLimit != nil && *h.MemoryLimit < 0:
		return fmt.Errorf("memory_limit %d: must not be negative (0: no limit)", *h.MemoryLimit)
	case strings.ContainsAny(h.Prefix, "{}"):
		return fmt.Errorf("prefix %q: must not contain '{' or '}' (Redis keys put the stored key in braces)", h.Prefix)
	}
	for _, m := range h.Methods {
		// JSON's methods are taken as written (the Caddyfile upper-cases
		// them).
		if sidecar.CheckMethod(m) != nil {
			return fmt.Errorf("methods: %q is not an upper-case HTTP method", m)
		}
	}
	switch {
	case h.KeyHeader != "" && !httpguts.ValidHeaderFieldName(h.KeyHeader):
		return fmt.Errorf("key_header %q: not a header name", h.KeyHeader)
	case h.KeyHeader != "" && h.Key != "":
		return fmt.Errorf("key_header %q and key %q: set one key source, not both", h.KeyHeader, h.Key)
	}
	return h.settings().Validate(h.settingName)
}

// settingName is the name function of Settings.Validate: the Caddyfile's
// name of a setting, key_header for the key when that set it.
func (h *Handler) settingName(n string) string {
	if n == "key" && h.KeyHeader != "" {
		return "key_header"
	}
	return sidecar.Underscored(n)
}

// settings are h's route settings, a zero field taking idem proxy's
// default.
func (h *Handler) settings() sidecar.Settings {
	s := sidecar.DefaultSettings()
	if len(h.Methods) > 0 {
		s.Methods = h.Methods
	}
	s.RequireKey, s.FailOpen = h.RequireKey, h.FailOpen
	s.TenantHeader, s.TenantCookie = h.TenantHeader, h.TenantCookie
	s.Lease = cmp.Or(time.Duration(h.Lease), s.Lease)
	s.Retention = cmp.Or(time.Duration(h.Retention), s.Retention)
	s.Wait = durationOr(h.Wait, s.Wait)
	s.ClientWriteTimeout = durationOr(h.ClientWriteTimeout, s.ClientWriteTimeout)
	s.MaxBody = cmp.Or(h.MaxBody, s.MaxBody)
	s.MaxResponse = cmp.Or(h.MaxResponse, s.MaxResponse)
	s.StoreStatuses = h.StoreStatuses
	s.MaxExecution = time.Duration(h.MaxExecution)
	s.CancelOnDisconnect, s.RefuseAnonymous = h.CancelOnDisconnect, h.RefuseAnonymous
	s.Key = h.Key
	if h.KeyHeader != "" {
		s.Key = "header:" + h.KeyHeader
	}
	s.Webhook, s.WebhookSecretFile, s.WebhookSecretEnv = h.Webhook, h.WebhookSecretFile, h.WebhookSecretEnv
	s.WebhookTolerance = time.Duration(h.WebhookTolerance)
	s.Fingerprint, s.FingerprintExclude, s.FingerprintFields = h.Fingerprint, h.FingerprintExclude, h.FingerprintFields
	s.Profile, s.EchoKey, s.LifetimeHeader = h.Profile, h.EchoKey, h.LifetimeHeader
	s.ReplayHeadersAllow, s.ReplayHeadersDeny = h.ReplayHeadersAllow, h.ReplayHeadersDeny
	s.Seal = sidecar.SealSettings{Keys: h.SealKeys, KMS: h.SealKMS, OpenOnly: h.SealOpenOnly}
	// The quota: the fields set, else with the memory store
	// idemhttp.DefaultQuota of its limit, else none.
	q := sidecar.DefaultQuota(0)
	if isMemory(h.Store) {
		q = sidecar.DefaultQuota(h.memoryLimit())
	}
	q.InFlight = valueOr(h.QuotaInFlight, q.InFlight)
	q.Records = valueOr(h.QuotaRecords, q.Records)
	q.Bytes = valueOr(h.QuotaBytes, q.Bytes)
	s.SetQuota(q)
	return s
}

// idemWait is the idemhttp Config.Wait of h's settings.
func (h *Handler) idemWait() time.Duration { return h.settings().Config(nil, nil, sidecar.Env{}).Wait }

// memoryLimit is the memory store's limit: MemoryLimit, or its default.
func (h *Handler) memoryLimit() int64 { return valueOr(h.MemoryLimit, DefaultMemoryLimit) }

// valueOr is *p, or def when p is nil.
func valueOr[T any](p *T, def T) T {
	if p == nil {
		return def
	}
	return *p
}

// durationOr is *d, or def when d is nil: a set 0 stays 0.
func durationOr(d *caddy.Duration, def time.Duration) time.Duration {
	if d == nil {
		return def
	}
	return time.Duration(*d)
}

// Provision opens the store (and blob store) and takes the quota, shared
// with every handler of the process that names the same ones, so that a
// config reload keeps the memory store's records, the connections and the
// quota's counts; and builds the idemhttp middleware of h's settings.
func (h *Handler) Provision(ctx caddy.Context) error {
	if err := h.Validate(); err != nil { // Caddy validates after provisioning: check before opening anything
		return err
	}
	h.logger = ctx.Slogger()
	m := registerMetrics(ctx.GetMetricsRegistry())
	s := h.settings()
	h.covered = map[string]bool{}
	for _, meth := range s.Methods {
		h.covered[meth] = true
	}
	h.refusesUncovered = s.RefusesUncovered()
	// The ring is read on each provisioning, before anything is opened:
	// a config reload rotates it.
	sealer, err := sidecar.NewSealer(ctx, s.Seal, h.settingName)
	if err != nil {
		return err
	}
	if sealer != nil {
		h.logger.Info("idempotency: stored responses are sealed", "seal", sealer) // the ring's file, key count and primary, never a key
	}
	store, key, err := takeStore(ctx, storeSpec{url: h.Store, prefix: h.Prefix, memLimit: h.memoryLimit(),
		reapEvery: durationOr(h.ReapInterval, DefaultReapInterval)}, h.logger)
	if err != nil {
		return err
	}
	h.storeKey = key
	if isMemory(h.Store) {
		h.logger.Warn("idempotency: store memory keeps the records in this process: a restart forgets every key " +
			"(its repeats run again), and other instances have their own; use redis://, postgres:// or mysql:// in production")
	}
	env := sidecar.Env{Metrics: m, Logger: h.logger, BlobTimeout: time.Duration(h.BlobTimeout), Seal: sealer,
		// The config's context ends once Caddy stopped its servers (after
		// their grace period on a reload or a stop): the work still
		// running then is cancelled, as idem proxy does past
		// --shutdown-timeout.
		Stop: ctx,
		OnOutcome: func(r *http.Request, o idemhttp.Outcome) {
			logField(r, zap.String("idempotency_outcome", string(o)))
		},
		// The key as its stored digest, as idem proxy logs it.
		OnKey: func(r *http.Request, k idem.Key) {
			logField(r, zap.String("idempotency_key", k.String()))
		}}
	env.Quota, h.quotaKey = takeQuota(key, s.Quota())
	if h.Blob != "" {
		if env.Blobs, h.blobKey, err = takeBlobs(ctx, h.Blob); err != nil {
			return err
		}
		m.InitBlobSeries()
	}
	// Route: idemhttp's default, the path the upstream will see
	// (sidecar.Route), as idem proxy's without --config, so that a Caddy
	// and a proxy on the same store and prefix share their records.
	h.mw, err = s.Middleware(store, sidecar.TenantFunc(s.TenantHeader, s.TenantCookie), nil, env)
	return err
}

// Cleanup gives back the store and the blob store: the last handler that
// used one closes it.
func (h *Handler) Cleanup() error {
	var errs []error
	if h.storeKey != "" {
		if _, err := pool.Delete(h.storeKey); err != nil {
			errs = append(errs, err)
		}
		h.storeKey = ""
	}
	if h.quotaKey != "" {
		if _, err := pool.Delete(h.quotaKey); err != nil {
			errs = append(errs, err)
		}
		h.quotaKey = ""
	}
	if h.blobKey != "" {
		if _, err := pool.Delete(h.blobKey); err != nil {
			errs = append(errs, err)
		}
		h.blobKey = ""
	}
	return errors.Join(errs...)
}

// nextFailed carries the error of the rest of the route out of the
// middleware as a panic, which releases the key (idemhttp: a panic
// releases it), and is turned back into the error for Caddy.
type nextFailed struct{ err error }

// ServeHTTP runs the rest of the route (next) through the idemhttp
// middleware. An error from next (reverse_proxy's 502 when the upstream
// cannot be reached, say) releases the key, and goes to Caddy as it came,
// for its error handling (handle_errors) to answer: it is never stored.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) (err error) {
	if !h.covered[r.Method] && !h.refusesUncovered {
		metrics.Requests.WithLabelValues(outcomeNotCovered).Inc()
		logField(r, zap.String("idempotency_outcome", outcomeNotCovered))
		return next.ServeHTTP(w, r)
	}
	defer func() {
		if v := recover(); v != nil {
			nf, ok := v.(nextFailed)
			if !ok {
				panic(v)
			}
			err = nf.err
		}
	}()
	h.mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, leased := idem.LeaseFromContext(r.Context())
		if leased && r.ContentLength == 0 {
			r.Header = sidecar.HideReplayHints(r.Header)
		}
		if err := next.ServeHTTP(w, r); err != nil {
			panic(nextFailed{err}) // under a key, it releases the key on its way out
		}
	})).ServeHTTP(w, r)
	return nil
}

// logField adds f to the request's access log line.
func logField(r *http.Request, f zap.Field) {
	if extra, ok := r.Context().Value(caddyhttp.ExtraLogFieldsCtxKey).(*caddyhttp.ExtraLogFields); ok {
		extra.Set(f)
	}
}

// isMemory reports whether spec names the memory store.
func isMemory(spec string) bool { return spec == "" || spec == "memory" }

// sharedQuota is a quota in the pool: the counts of the handlers on one
// store with the same limits, kept across reloads as the store is.
type sharedQuota struct{ q *idemhttp.Quota }

func (sharedQuota) Destruct() error { return nil }

// takeQuota returns the quota of the store storeKey names with limits l,
// made when no handler has it, and its key in the pool ("" for none: l
// limits nothing).
func takeQuota(storeKey string, l sidecar.QuotaLimits) (*idemhttp.Quota, string) {
	if l.None() {
		return idemhttp.NoQuota, ""
	}
	key := "quota\x00" + storeKey + "\x00" + l.String()
	v, _, _ := pool.LoadOrNew(key, func() (caddy.Destructor, error) {
		return sharedQuota{l.New(0)}, nil
	})
	return v.(sharedQuota).q, key
}
