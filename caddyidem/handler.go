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
	// reapBatch is the most records one statement of the reaper deletes.
	reapBatch = 1000
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

	covered  map[string]bool
	mw       func(http.Handler) http.Handler
	tenant   func(*http.Request) string
	storeKey string // in the stores pool; "" when none was taken
	blobKey  string // in the stores pool; "" when none was taken
	quotaKey string // in the stores pool; "" when none was taken
	logger   *slog.Logger
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
// with what it wants.
func (h *Handler) Validate() error {
	switch {
	case h.Lease != 0 && time.Duration(h.Lease) < 10*time.Millisecond:
		return fmt.Errorf("lease %v: want at least 10ms", time.Duration(h.Lease))
	case h.Retention != 0 && time.Duration(h.Retention) < time.Second:
		return fmt.Errorf("retention %v: want at least 1s", time.Duration(h.Retention))
	case h.MaxExecution < 0:
		return fmt.Errorf("max_execution %v: must not be negative (0: no limit)", time.Duration(h.MaxExecution))
	case h.Wait != nil && *h.Wait < 0:
		return fmt.Errorf("wait %v: must not be negative (0: no wait, 409 at once)", time.Duration(*h.Wait))
	case h.ClientWriteTimeout != nil && *h.ClientWriteTimeout < 0:
		return fmt.Errorf("client_write_timeout %v: must not be negative (0: no limit)", time.Duration(*h.ClientWriteTimeout))
	case h.ReapInterval != nil && *h.ReapInterval < 0:
		return fmt.Errorf("reap_interval %v: must not be negative (0: never)", time.Duration(*h.ReapInterval))
	case h.BlobTimeout < 0:
		return fmt.Errorf("blob_timeout %v: must not be negative", time.Duration(h.BlobTimeout))
	case h.MemoryLimit != nil && *h.MemoryLimit < 0:
		return fmt.Errorf("memory_limit %d: must not be negative (0: no limit)", *h.MemoryLimit)
	case h.QuotaInFlight != nil && *h.QuotaInFlight < 0:
		return fmt.Errorf("quota_in_flight %d: must not be negative (0: no limit)", *h.QuotaInFlight)
	case h.QuotaRecords != nil && *h.QuotaRecords < 0:
		return fmt.Errorf("quota_records %d: must not be negative (0: no limit)", *h.QuotaRecords)
	case h.QuotaBytes != nil && *h.QuotaBytes < 0:
		return fmt.Errorf("quota_bytes %d: must not be negative (0: no limit)", *h.QuotaBytes)
	case h.MaxBody < 0:
		return fmt.Errorf("max_body %d: want at least 1 byte", h.MaxBody)
	case h.MaxResponse < 0 || h.MaxResponse > idem.MaxEncodedBody:
		return fmt.Errorf("max_response %d: want 1 to %d bytes", h.MaxResponse, idem.MaxEncodedBody)
	case strings.ContainsAny(h.Prefix, "{}"):
		return fmt.Errorf("prefix %q: must not contain '{' or '}' (Redis keys put the stored key in braces)", h.Prefix)
	}
	for _, m := range h.Methods {
		if !httpguts.ValidHeaderFieldName(m) || strings.ToUpper(m) != m {
			return fmt.Errorf("methods: %q is not an upper-case HTTP method", m)
		}
	}
	if h.TenantHeader != "" && !httpguts.ValidHeaderFieldName(h.TenantHeader) {
		return fmt.Errorf("tenant_header %q: not a header name", h.TenantHeader)
	}
	if h.TenantCookie != "" && !httpguts.ValidHeaderFieldName(h.TenantCookie) {
		return fmt.Errorf("tenant_cookie %q: not a cookie name", h.TenantCookie)
	}
	if h.TenantHeader != "" && h.TenantCookie != "" {
		return fmt.Errorf("tenant_header %q and tenant_cookie %q: set one tenant source, not both", h.TenantHeader, h.TenantCookie)
	}
	for _, st := range h.StoreStatuses {
		if st < 200 || st > 599 {
			return fmt.Errorf("store_statuses: %d is not a final HTTP status (200-599)", st)
		}
	}
	return nil
}

// Provision opens the store (and blob store), shared with every handler
// of the process that names the same ones, so that a config reload keeps
// the memory store's records and the connections; and builds the
// idemhttp middleware.
func (h *Handler) Provision(ctx caddy.Context) error {
	if err := h.Validate(); err != nil { // Caddy validates after provisioning: check before opening anything
		return err
	}
	h.logger = ctx.Slogger()
	m := registerMetrics(ctx.GetMetricsRegistry())

	methods := h.Methods
	if len(methods) == 0 {
		methods = []string{http.MethodPost, http.MethodPatch}
	}
	h.covered = map[string]bool{}
	for _, meth := range methods {
		h.covered[meth] = true
	}
	memLimit := int64(DefaultMemoryLimit)
	if h.MemoryLimit != nil {
		memLimit = *h.MemoryLimit
	}
	reap := DefaultReapInterval
	if h.ReapInterval != nil {
		reap = time.Duration(*h.ReapInterval)
	}
	store, key, err := takeStore(ctx, storeSpec{url: h.Store, prefix: h.Prefix, memLimit: memLimit, reapEvery: reap}, h.logger)
	if err != nil {
		return err
	}
	h.storeKey = key
	if isMemory(h.Store) {
		h.logger.Warn("idempotency: store memory keeps the records in this process: a restart forgets every key " +
			"(its repeats run again), and other instances have their own; use redis://, postgres:// or mysql:// in production")
	}

	h.tenant = sidecar.TenantFunc(h.TenantHeader, h.TenantCookie)
	cfg := idemhttp.Config{
		Methods:    methods,
		RequireKey: h.RequireKey,
		Tenant:     h.tenant,
		// Route: idemhttp's default, the path the upstream will see
		// (sidecar.Route), as idem proxy's without --config, so that a
		// Caddy and a proxy on the same store and prefix share their
		// records.
		RefuseAnonymous: h.RefuseAnonymous,
		OnAnonymous:     func(*http.Request) { m.anonymous.Inc() },
		MaxBodySize:     h.MaxBody,
		Lease:           time.Duration(h.Lease),
		Retention:       time.Duration(h.Retention),
		MaxResponseSize: int(h.MaxResponse),
		Wait:            h.idemWait(),
		FailOpen:        h.FailOpen,
		MaxExecution:    time.Duration(h.MaxExecution),
		// The config's context ends once Caddy stopped its servers (after
		// their grace period on a reload or a stop): the work still
		// running then is cancelled, as idem proxy does past
		// --shutdown-timeout.
		StopContext:        ctx,
		CancelOnDisconnect: h.CancelOnDisconnect,
		Logger:             h.logger,
		OnOutcome: func(r *http.Request, o idemhttp.Outcome) {
			m.requests.WithLabelValues(string(o)).Inc()
			logField(r, zap.String("idempotency_outcome", string(o)))
		},
		OnRenew:         m.onRenew,
		BlobTimeout:     time.Duration(h.BlobTimeout),
		OnBodyOmitted:   func(*http.Request) { m.notKept.Inc() },
		OnQuotaExceeded: m.onQuotaExceeded,
	}
	cfg.Quota, h.quotaKey = takeQuota(key, h.quotaLimits(memLimit))
	if h.ClientWriteTimeout != nil {
		cfg.ClientWriteTimeout = cmp.Or(time.Duration(*h.ClientWriteTimeout), -1) // 0 here is no limit; idemhttp's 0 is its default
	}
	if h.StoreStatuses != nil {
		statuses := map[int]bool{}
		for _, st := range h.StoreStatuses {
			statuses[st] = true
		}
		cfg.ShouldStore = func(_ *http.Request, status int) bool { return statuses[status] }
	}
	if h.Blob != "" {
		blobs, key, err := takeBlobs(ctx, h.Blob)
		if err != nil {
			return err
		}
		h.blobKey = key
		cfg.Blobs = blobs
		cfg.OnBlobError = m.onBlobError
		m.initBlobSeries()
	}
	mw, err := sidecar.GRPCMiddleware(store, cfg) // gRPC calls answered and stored as gRPC
	if err != nil {
		return err
	}
	h.mw = mw
	return nil
}

// idemWait is idemhttp's Config.Wait for h.Wait: unset is idemhttp's
// default (its 0); 0 is no wait (its negative), as idem proxy's --wait 0.
func (h *Handler) idemWait() time.Duration {
	if h.Wait == nil {
		return 0
	}
	return cmp.Or(time.Duration(*h.Wait), -1)
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
	if !h.covered[r.Method] {
		metrics.requests.WithLabelValues(outcomeNotCovered).Inc()
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
	// The key as its stored digest, as idem proxy logs it.
	if k, ok := sidecar.StoredKey(r, h.tenant, sidecar.Route); ok {
		logField(r, zap.String("idempotency_key", k.String()))
	}
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

// quotaLimits are the limits of an idemhttp.Quota.
type quotaLimits struct {
	inFlight, records int
	bytes             int64
}

// quotaLimits is h's quota: the fields set, else with the memory store
// idemhttp.DefaultQuota of its limit, else none.
func (h *Handler) quotaLimits(memLimit int64) quotaLimits {
	var l quotaLimits
	if isMemory(h.Store) {
		if q := idemhttp.DefaultQuota(memLimit); q != nil {
			l.inFlight, l.bytes = q.InFlight, q.Bytes
		}
	}
	if h.QuotaInFlight != nil {
		l.inFlight = *h.QuotaInFlight
	}
	if h.QuotaRecords != nil {
		l.records = *h.QuotaRecords
	}
	if h.QuotaBytes != nil {
		l.bytes = *h.QuotaBytes
	}
	return l
}

// sharedQuota is a quota in the pool: the counts of the handlers on one
// store with the same limits, kept across reloads as the store is.
type sharedQuota struct{ q *idemhttp.Quota }

func (sharedQuota) Destruct() error { return nil }

// takeQuota returns the quota of the store storeKey names with limits l,
// made when no handler has it, and its key in the pool ("" for none: l
// limits nothing).
func takeQuota(storeKey string, l quotaLimits) (*idemhttp.Quota, string) {
	if l.inFlight <= 0 && l.records <= 0 && l.bytes <= 0 {
		return idemhttp.NoQuota, ""
	}
	key := fmt.Sprintf("quota\x00%s\x00%d\x00%d\x00%d", storeKey, l.inFlight, l.records, l.bytes)
	v, _, _ := pool.LoadOrNew(key, func() (caddy.Destructor, error) {
		return sharedQuota{&idemhttp.Quota{InFlight: l.inFlight, Records: l.records, Bytes: l.bytes}}, nil
	})
	return v.(sharedQuota).q, key
}
