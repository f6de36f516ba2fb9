package idemhttp

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/net/http/httpguts"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/engine"
	"github.com/idemkit/idem/internal/ident"
	"github.com/idemkit/idem/internal/quota"
	"github.com/idemkit/idem/internal/telemetry"
)

// Defaults for Config's zero fields.
const (
	DefaultMaxBodySize        = 1 << 20
	DefaultMaxResponseSize    = idem.DefaultMaxResponseSize
	DefaultClientWriteTimeout = 30 * time.Second
	// DefaultWait is how long a request whose key is in flight waits for
	// the holder's result before it gets 409 (Config.Wait).
	DefaultWait = engine.DefaultWait
)

// HeaderBodyOmitted is set to "true" on the replay of a response whose
// body was not kept: larger than Config.MaxResponseSize when it was first
// produced, with no blob store (or one that failed). Such a replay answers
// 500 with the problem ProblemResponseNotKept, never the stored status.
const HeaderBodyOmitted = "Idempotent-Replay-Body-Omitted"

// HeaderOriginalStatus carries, on a replay answered with
// ProblemResponseNotKept, the status the request was executed with.
const HeaderOriginalStatus = "Idempotent-Original-Status"

// Config tunes the middleware. The zero value means the defaults.
type Config struct {
	// Methods are the methods the middleware covers; others pass through
	// untouched. Default POST and PATCH.
	Methods []string

	// RequireKey makes the Idempotency-Key header (the key of KeySource)
	// mandatory on covered methods: a request without one gets 400. RequireKeyFunc, when set,
	// decides per request instead (for example per route).
	RequireKey     bool
	RequireKeyFunc func(*http.Request) bool

	// KeySource finds a request's key. Default (the zero KeySource): the
	// Idempotency-Key header (ParseKey). KeyFromHeader reads another
	// header, KeyFromJSON a field of a JSON body; a KeySource of one's own
	// can verify a request before it names its key (ErrKeyUnverified).
	// RequireKey and the answers to a missing or invalid key hold for
	// every source. A source that reads the body (KeySource.NeedsBody)
	// has every request of a covered method's body read first, keyed or
	// not, so a body over MaxBodySize gets 413 even without a key.
	KeySource KeySource

	// EchoKey sets the response header Idempotency-Key, with the key as
	// KeySource returned it (an Idempotency-Key header sent as an RFC 8941
	// string: unquoted), on every response to a request whose key was
	// read: executed (the handler's answer, fail-open included), replayed,
	// and the middleware's own answers (409, 422, 429, 503, the 413 of a
	// body read after the key, the 401 of RefuseAnonymous; not the answers
	// to a missing, invalid or unverified key, which has none). A replay
	// carries the retry's key, never a stored one: the header is never
	// stored, and one of that name the handler set (in any case, or as a
	// trailer) is replaced by it, neither sent nor stored. Default false.
	EchoKey bool

	// LifetimeHeader sets the response header Idempotency-Key-Lifetime
	// (HeaderKeyLifetime) on every response to a request of a covered
	// method, keyed or not, problems included: Retention as an ISO 8601
	// duration of whole seconds, rounded down, in hours, minutes and
	// seconds ("PT24H", "PT30M", "PT1H30M", "PT1M30S"; "PT0S" under a
	// second), the form of the Apache Iceberg REST catalog's
	// idempotency-key-lifetime. Like EchoKey's, the header is never stored,
	// and one the handler set is replaced by it. Default false.
	//
	// With EchoKey or LifetimeHeader, the handler of a covered method gets
	// a ResponseWriter that wraps the server's: it keeps Flush, Hijack,
	// io.ReaderFrom, and Unwrap for http.ResponseController, not
	// http.Pusher nor http.CloseNotifier.
	LifetimeHeader bool

	// OnKey, when set, is called once for every keyed request, with the
	// key its record is stored under (idem.Key, derived from the key
	// source's key and the scope: Tenant, method, Route, Authority), once
	// the body is read and before the key is claimed or Quota asked, so
	// that a front end can log it. It is not called for a request without
	// a key, with an invalid one, refused by the key source
	// (ErrKeyUnverified) or by RefuseAnonymous, or whose body is over
	// MaxBodySize. A record v1.0 stored for the request (V1Scopes) is
	// under another key. It must not block.
	OnKey func(r *http.Request, key idem.Key)

	// Tenant says whose request this is; keys of different tenants never
	// share a record. Default DefaultTenant (the Authorization header in
	// normal form and the API-key headers, else the TLS client
	// certificate, else ""). See also TenantFromCookie and
	// TenantFromHeader.
	//
	// When it returns "", the request is anonymous: it is reported
	// (OnAnonymous, the counter idem.anonymous, a WARN once per route),
	// refused with RefuseAnonymous, and, when it carries cookies (a
	// browser whose session cookie no source names), its record remembers
	// them as digests: a later request with the key replays only if it
	// carries the same identifying cookies, and otherwise gets 422, never
	// another client's response (see TrackingCookies). A Tenant that
	// returns a non-empty value opts out: it names the client, and cookies
	// no longer matter. But DefaultTenant's tenant of a request that only
	// an API-key header names has its cookies checked the same way (it is
	// not reported as anonymous): a publishable key may be the same in
	// every browser of a site.
	Tenant func(*http.Request) string

	// Authority is the host a request was sent to, part of its scope: two
	// virtual hosts behind one middleware never share a record. Default
	// DefaultAuthority (the Host header, normalised); a function that
	// returns "" leaves the host out (the scope of v1.0).
	Authority func(*http.Request) string

	// RefuseAnonymous refuses keyed requests that no tenant source
	// identifies (Tenant returned ""): 401 application/problem+json of
	// type ProblemAnonymous, before anything is read (but the body a
	// KeySource with NeedsBody reads first) or stored. Default
	// false: they are served, reported as anonymous.
	RefuseAnonymous bool

	// OnAnonymous, when set, is called for every keyed request that no
	// tenant source identifies, refused or not (for metrics). It must not
	// block.
	OnAnonymous func(r *http.Request)

	// TrackingCookies are the cookies that never identify an anonymous
	// caller (see Tenant): a retry whose tracking cookies changed still
	// replays. A name ending in "*" is a prefix. Default
	// DefaultTrackingCookies; an empty, non-nil slice makes every cookie
	// identifying.
	TrackingCookies []string

	// V1Scopes is how long after NewMiddleware a keyed request that
	// acquires its key also looks for a record under the key v1.0 derived
	// for it (v1.0 had no Host in the scope, read credentials as written,
	// no API-key headers, the path as escaped, and mixed an anonymous
	// request's cookies into its fingerprint), so that a request stored
	// before an upgrade is replayed after it, not run again. Zero means
	// the Retention (a record stored before the upgrade lives no longer
	// once the upgraded process runs); negative turns the look-up off,
	// for deployments that never ran v1.0. It costs one store read for
	// each request that acquires its key while it lasts; replays cost
	// nothing more. A *memstore.Store is never looked up: it holds only
	// what this process stored.
	V1Scopes time.Duration

	// Route names the operation. Default: the ServeMux pattern when one
	// matched (Request.Pattern, or the pattern of the wrapped
	// *http.ServeMux), else the URL path.
	Route func(*http.Request) string

	// Fingerprint summarises the request; a repeat with the same key and
	// another fingerprint gets 422. Default DefaultFingerprint.
	Fingerprint func(r *http.Request, body []byte) idem.Fingerprint

	// MaxBodySize is the largest request body read for the fingerprint.
	// A larger body gets 413 and no record is written. Default 1 MiB.
	MaxBodySize int64

	// Lease and Retention: see idem.Config (defaults 30s and 24h).
	Lease, Retention time.Duration

	// MaxResponseSize is the largest response body stored in the record
	// (the inline limit). A larger body still goes to the client; with
	// Blobs set it streams to the blob store as the handler writes it and
	// is replayed from there, else the key is completed without it: the
	// request is not run again, and its replays answer 500
	// application/problem+json of type ProblemResponseNotKept (with
	// Idempotent-Replayed: true, Idempotent-Replay-Body-Omitted: true and
	// Idempotent-Original-Status), until the record expires. The first
	// such response of each route is logged at WARN, and each is passed
	// to OnBodyOmitted. Default 1 MiB.
	MaxResponseSize int

	// Blobs, when set, keeps the bodies larger than MaxResponseSize (see
	// "Large responses" in the package documentation). Default nil: such
	// bodies are not stored. Blob names carry the store's namespace when
	// the store implements idem.Namespacer (the stores of this module do;
	// a wrapping store should forward it), so that blobstore.Sweep judges
	// them against the right records; without one they have none, and a
	// sweep leaves them alone unless told otherwise
	// (blobstore.SweepOptions.Unqualified).
	Blobs idem.BlobStore

	// Seal, when set, seals the responses stored at rest (and the blobs
	// written to Blobs: the middleware wraps Blobs with idem.SealBlobs,
	// so pass the store itself), and SealOpenOnly stores new ones in clear
	// while sealed ones still open: see idem.Config's fields of the same
	// names. A stored response that does not open is never replayed nor
	// run again: it is answered 500 ProblemResponseUnreadable (with
	// Idempotent-Replayed: true, no Retry-After), outcome
	// OutcomeUnsealable, and logged at ERROR with the key and the key id
	// (never content), FailOpen or not; a sealed blob that does not open
	// is answered 503 ProblemStoredBodyUnavailable, as for a corrupt one,
	// logged at ERROR with its key id.
	Seal         idem.Sealer
	SealOpenOnly bool

	// BlobTimeout bounds how long a blob operation (a write, the commit,
	// opening or reading for a replay) may go without progress before it
	// is given up: a write then stores the response without its body, a
	// replay answers 503 or is aborted. Default DefaultBlobTimeout (30s).
	BlobTimeout time.Duration

	// OnBlobError, when set, is called for every failed blob operation:
	// op is BlobOpWrite, BlobOpRead or BlobOpCheck, and err wraps
	// idem.ErrBlobNotFound or idem.ErrBlobCorrupt when the blob is missing
	// or corrupt (for metrics). It must not block.
	OnBlobError func(r *http.Request, op string, err error)

	// OnBodyOmitted, when set, is called for every response stored
	// without its body (larger than MaxResponseSize, and no Blobs or a
	// blob store that failed), just before it is stored; its replays
	// answer ProblemResponseNotKept. The request's outcome is still
	// OutcomeExecuted, and its replays' OutcomeReplayed. For metrics; it
	// must not block.
	OnBodyOmitted func(r *http.Request)

	// ShouldStore decides from the final status whether a response is
	// stored (and replayed from then on) or the key is released so the
	// request can be retried. Default DefaultShouldStore.
	ShouldStore func(r *http.Request, status int) bool

	// Wait bounds how long a request whose key is in flight (a copy of a
	// request still running) waits for the result before it gets 409. A
	// copy of a request this process is running (or asking the store
	// about) does not ask the store: it wakes as soon as this process
	// finishes the key, and is handed the response the holder stored, or
	// the replay the store gave it; for a holder in another process it
	// asks the store again after growing pauses (5ms,
	// doubling, at most 250ms apart: about 7 acquires within DefaultWait).
	// If the holder releases the key instead (a 5xx, a panic), the waiter
	// acquires it and runs the handler. Work that outlasts the wait still
	// answers 409, with Retry-After; a waiting copy holds its connection
	// and a goroutine meanwhile. Default DefaultWait; negative: 409 at
	// once, without waiting (the default before DefaultWait).
	Wait time.Duration

	// MaxExecution, when positive, bounds how long the handler may run
	// under its lease: past it, the handler's context is cancelled with
	// cause idem.ErrMaxExecution. What the handler then answers is stored
	// or released as usual (by default a 5xx releases the key, and a retry
	// runs the handler again). Default 0: no limit but the lease's loss.
	// Use one middleware per route for per-route limits.
	MaxExecution time.Duration

	// StopContext, when set, is the server's hard stop: once it is done,
	// the context of every handler still running under a lease is
	// cancelled with cause idem.ErrStopped. Cancel it when
	// http.Server.Shutdown has waited its grace period and returned. Default nil: a handler's
	// context is cancelled only by the lease's loss and MaxExecution.
	StopContext context.Context

	// CancelOnDisconnect restores the earlier behaviour: the handler's
	// context is the request's, cancelled when the client
	// disconnects or its deadline passes. UNSAFE for effects outside a
	// transaction: a client that times out cancels work that may already
	// have acted (a payment captured, a message sent); the handler then
	// usually fails, the key is released, and the client's retry runs the
	// work a second time. Use it only for handlers whose every effect is
	// rolled back with their context. Default false: the work belongs to
	// the key and runs to its end whatever the client does.
	CancelOnDisconnect bool

	// ClientWriteTimeout bounds how long a write to the client may wait
	// for the client to take it, while a handler runs under a lease. A
	// client that stops reading without disconnecting (its receive window
	// full) would otherwise hold the handler at its write, and so the key
	// in flight, for as long as it keeps the connection open. Past the
	// timeout it is gone, as if it had disconnected: the middleware stops
	// writing to it, the handler runs to its end without seeing an error,
	// and its response is stored for the retry.
	//
	// Each write is sent in pieces of at most 32 KiB, each under a write
	// deadline (http.ResponseController.SetWriteDeadline) that is lifted
	// once it returns, and so is each Flush: a client must take 32 KiB per
	// ClientWriteTimeout, and a handler that pauses between writes is not
	// affected. http.Server.WriteTimeout still applies (counted from when
	// the middleware got the request) and is not extended.
	// It needs a ResponseWriter that takes write deadlines (net/http's, on
	// HTTP/1 and HTTP/2, and wrappers with an Unwrap method); through
	// others, writes are unbounded. Replays are bounded the same way (a
	// client that stops reading a large replay holds no blob reader and no
	// goroutine past the timeout). Requests without a key and the
	// middleware's own answers are not affected, nor are the bytes net/http
	// still holds when the handler has returned (at most a few KiB; the
	// response is stored by then). Default DefaultClientWriteTimeout (30s);
	// negative: no bound.
	ClientWriteTimeout time.Duration

	// FailOpen runs the handler without idempotency when the store fails.
	// Default false: the request gets 503 and the handler does not run.
	// A request over its tenant's Quota gets 429 whatever FailOpen says.
	FailOpen bool

	// Quota limits what the keyed requests of one tenant may hold: its
	// keys in flight, stored records and bytes; a new key past a limit
	// gets 429 (ProblemQuotaExceeded) and nothing is claimed. See Quota.
	// Middlewares given the same *Quota share its counts. Default: when
	// store is a *memstore.Store with a MaxBytes, DefaultQuota of that
	// size (this middleware's own); otherwise none. NoQuota turns it off.
	Quota *Quota

	// OnQuotaExceeded, when set, is called for every request refused by
	// Quota, with the limit it hit: QuotaInFlight, QuotaRecords or
	// QuotaBytes (its outcome is OutcomeQuotaExceeded). For metrics; it
	// must not block.
	OnQuotaExceeded func(r *http.Request, limit string)

	// ReplayHeaderDenylist names response headers never stored nor
	// replayed, besides Set-Cookie and the hop-by-hop headers, which are
	// always dropped (and Idempotency-Key with EchoKey,
	// Idempotency-Key-Lifetime with LifetimeHeader). It wins over
	// ReplayHeaderAllowlist. It may not name Content-Encoding,
	// Grpc-Encoding or Grpc-Status: the stored body and its answer cannot
	// be read without them.
	ReplayHeaderDenylist []string

	// ReplayHeaderAllowlist, when not empty, names the only response
	// headers stored and replayed (and those of ReplayHeaderDenylist are
	// dropped still). Whatever it names, the headers that say what the
	// stored body is are kept with it: Content-Type, Content-Encoding (a
	// gzip body replayed without it would be bytes the client cannot
	// read), and gRPC's Grpc-Encoding, Grpc-Status, Grpc-Message and
	// Grpc-Status-Details-Bin (as headers of a trailers-only answer and
	// as trailers), so that a gRPC call behind the middleware still
	// replays as gRPC; Content-Length is not (net/http sends the stored
	// body's). Naming a header that is never stored (Set-Cookie, a
	// hop-by-hop header, Idempotent-Replayed) is an error.
	//
	// In both lists names match whatever their case, and a trailer
	// (http.TrailerPrefix) is matched by its name; an empty name or one
	// that is not an HTTP token is an error. The lists decide what is
	// stored, and what a record stored before they changed replays: the
	// answer to the request that ran the handler carries every header it
	// set.
	ReplayHeaderAllowlist []string

	// ErrorHandler writes the middleware's own error answers. Default
	// WriteProblem (application/problem+json).
	ErrorHandler func(w http.ResponseWriter, r *http.Request, p *Problem)

	// Logger receives store failures and lost leases. Keys are logged as
	// their digest, never raw. Default slog.Default().
	Logger *slog.Logger

	// OnOutcome, when set, is called once for every request of a covered
	// method with what the middleware did with it (for metrics); for a
	// request that ran the handler, once the handler has returned:
	// OutcomeReleased after the key was released, OutcomeExecuted just
	// before the response is stored (so that a retry replaying it finds
	// the execution counted). It must not block.
	OnOutcome func(r *http.Request, o Outcome)

	// OnRenew: see idem.Config.
	OnRenew func(key idem.Key, err error)

	// TracerProvider and MeterProvider, when set, report through
	// OpenTelemetry what idem.Config says of them, plus every request's
	// outcome in the counter idem.outcomes (layer "http") and as the
	// attribute idem.outcome of the request's span, and the events
	// idem.replay, idem.wait and idem.client_gone on that span (the span of
	// an outer tracing middleware such as otelhttp). Default nil: none of
	// it, at no cost.
	TracerProvider trace.TracerProvider
	MeterProvider  metric.MeterProvider
}

// DefaultFingerprint hashes the method, path (escaped, in normal form:
// "/acct/%70ay" is "/acct/pay"), query, Content-Type and body.
func DefaultFingerprint(r *http.Request, body []byte) idem.Fingerprint {
	return idem.SumFingerprint(body, r.Method, ident.Path(r.URL.EscapedPath()), r.URL.RawQuery, r.Header.Get("Content-Type"))
}

// v1Fingerprint is DefaultFingerprint as v1.0 released it.
func v1Fingerprint(r *http.Request, body []byte) idem.Fingerprint {
	return idem.SumFingerprint(body, r.Method, r.URL.EscapedPath(), r.URL.RawQuery, r.Header.Get("Content-Type"))
}

// DefaultShouldStore stores final answers and releases retryable ones:
// 2xx, 3xx and 4xx are stored, except 408, 409, 425 and 429, which say
// "try again"; 5xx are released.
func DefaultShouldStore(_ *http.Request, status int) bool {
	switch status {
	case http.StatusRequestTimeout, http.StatusConflict, http.StatusTooEarly, http.StatusTooManyRequests:
		return false
	}
	return status >= 200 && status < 500
}

// Headers never stored: they describe one connection, or must not be
// handed to whoever repeats the request.
var alwaysDenied = []string{
	"Set-Cookie", "Connection", "Keep-Alive", "Proxy-Connection", "Transfer-Encoding",
	"Upgrade", "Te", "Trailer", "Proxy-Authenticate", "Proxy-Authorization", HeaderReplayed, headerCallerCookies,
}

// answerHeaders say what a stored body is: an allowlist keeps them
// (Config.ReplayHeaderAllowlist). Of them, bodyReaders may not be denied:
// without them a replay is not the answer the first client read.
var (
	answerHeaders = []string{"Content-Type", "Content-Encoding", "Grpc-Encoding", "Grpc-Status", "Grpc-Message", "Grpc-Status-Details-Bin"}
	bodyReaders   = []string{"Content-Encoding", "Grpc-Encoding", "Grpc-Status"}
)

// headerLists sets m.deny and m.allow from cfg's replay header lists.
func (m *middleware) headerLists(cfg Config) error {
	for _, h := range alwaysDenied {
		m.deny[http.CanonicalHeaderKey(h)] = true
	}
	for _, h := range cfg.ReplayHeaderDenylist {
		if !httpguts.ValidHeaderFieldName(h) {
			return fmt.Errorf("idemhttp: Config.ReplayHeaderDenylist: %q is not a header name", h)
		}
		c := http.CanonicalHeaderKey(h)
		if slices.Contains(bodyReaders, c) {
			return fmt.Errorf("idemhttp: Config.ReplayHeaderDenylist: %s says how to read the stored body (a replay without it is not the answer the client got); drop it", c)
		}
		m.deny[c] = true
	}
	if len(cfg.ReplayHeaderAllowlist) == 0 {
		return nil
	}
	m.allow = map[string]bool{}
	for _, h := range cfg.ReplayHeaderAllowlist {
		if !httpguts.ValidHeaderFieldName(h) {
			return fmt.Errorf("idemhttp: Config.ReplayHeaderAllowlist: %q is not a header name", h)
		}
		c := http.CanonicalHeaderKey(h)
		if slices.ContainsFunc(alwaysDenied, func(d string) bool { return strings.EqualFold(d, c) }) {
			return fmt.Errorf("idemhttp: Config.ReplayHeaderAllowlist: %s is never stored (Set-Cookie, hop-by-hop headers and idem's own are dropped whatever the lists say); drop it", c)
		}
		m.allow[c] = true
	}
	for _, h := range answerHeaders {
		m.allow[h] = true
	}
	return nil
}

// dropped reports whether the header or trailer name (canonical, without
// http.TrailerPrefix) is never stored nor replayed.
func (m *middleware) dropped(name string) bool {
	return m.deny[name] || (m.allow != nil && !m.allow[name])
}

// Middleware returns net/http middleware that makes covered requests
// idempotent with store. It panics if cfg is invalid; NewMiddleware returns
// the error instead.
func Middleware(store idem.Store, cfg Config) func(http.Handler) http.Handler {
	mw, err := NewMiddleware(store, cfg)
	if err != nil {
		panic(err)
	}
	return mw
}

// NewMiddleware is Middleware with the configuration error returned.
func NewMiddleware(store idem.Store, cfg Config) (func(http.Handler) http.Handler, error) {
	if cfg.MaxBodySize < 0 {
		return nil, fmt.Errorf("idemhttp: Config.MaxBodySize %d is negative", cfg.MaxBodySize)
	}
	if cfg.BlobTimeout < 0 {
		return nil, fmt.Errorf("idemhttp: Config.BlobTimeout %v is negative", cfg.BlobTimeout)
	}
	if cfg.BlobTimeout == 0 {
		cfg.BlobTimeout = DefaultBlobTimeout
	}
	if cfg.MaxBodySize == 0 {
		cfg.MaxBodySize = DefaultMaxBodySize
	}
	if cfg.MaxResponseSize == 0 {
		cfg.MaxResponseSize = DefaultMaxResponseSize
	}
	if cfg.ClientWriteTimeout == 0 {
		cfg.ClientWriteTimeout = DefaultClientWriteTimeout
	}
	eng, err := engine.New(store, engine.Config{Name: "idemhttp", Lease: cfg.Lease, Retention: cfg.Retention,
		MaxResponseSize: cfg.MaxResponseSize, OnRenew: cfg.OnRenew, TracerProvider: cfg.TracerProvider, MeterProvider: cfg.MeterProvider,
		Wait: engine.WaitOrDefault(cfg.Wait, DefaultWait), MaxExecution: cfg.MaxExecution, StopContext: cfg.StopContext, FailOpen: cfg.FailOpen, Logger: cfg.Logger,
		V1Scopes: cfg.V1Scopes, Seal: cfg.Seal, SealOpenOnly: cfg.SealOpenOnly})
	if err != nil {
		return nil, err
	}
	if len(cfg.Methods) == 0 {
		cfg.Methods = []string{http.MethodPost, http.MethodPatch}
	}
	if cfg.KeySource.err != nil {
		return nil, cfg.KeySource.err
	}
	switch {
	case cfg.KeySource.Key == nil && cfg.KeySource.NeedsBody:
		return nil, errors.New("idemhttp: Config.KeySource has NeedsBody but no Key function; want both, or the zero KeySource for Idempotency-Key")
	case cfg.KeySource.Key == nil:
		cfg.KeySource = defaultKeySource
	}
	if cfg.Blobs != nil && cfg.Seal != nil {
		// The one place blobs are sealed, for every caller (idem proxy,
		// Caddy, the sidecar): as the records are, with the same Sealer.
		cfg.Blobs = idem.SealBlobs(cfg.Blobs, cfg.Seal, cfg.SealOpenOnly)
	}
	m := &middleware{cfg: cfg, key: cfg.KeySource, eng: eng, store: store, methods: map[string]bool{}, deny: map[string]bool{}, gate: &blobGate{bs: cfg.Blobs}}
	if cfg.Quota == nil {
		cfg.Quota = defaultQuota(store)
	}
	m.quota = cfg.Quota.counts()
	if n, ok := store.(idem.Namespacer); ok {
		m.blobNS = n
	}
	for _, meth := range cfg.Methods {
		if meth == "" || strings.ToUpper(meth) != meth {
			return nil, fmt.Errorf("idemhttp: Config.Methods: %q is not an upper-case method", meth)
		}
		m.methods[meth] = true
	}
	if err := m.headerLists(cfg); err != nil {
		return nil, err
	}
	// The middleware's own headers are the request's, never stored (see
	// stamped).
	if cfg.EchoKey {
		m.deny[HeaderKey] = true
	}
	if cfg.LifetimeHeader {
		m.deny[HeaderKeyLifetime] = true
		retention := cfg.Retention
		if retention == 0 {
			retention = idem.DefaultRetention // as engine.New's idem.New has it
		}
		m.lifetime = []string{isoDuration(retention)}
	}
	if m.cfg.Tenant == nil {
		m.cfg.Tenant = DefaultTenant
		m.defaultTenant = true
	}
	if m.cfg.Authority == nil {
		m.cfg.Authority = DefaultAuthority
	}
	if m.cfg.TrackingCookies == nil {
		m.cfg.TrackingCookies = DefaultTrackingCookies
	}
	m.cookies = newCookieMatcher(m.cfg.TrackingCookies)
	m.v1 = v1Derivation{tenant: cfg.Tenant, route: cfg.Route, fingerprint: cfg.Fingerprint}
	if m.cfg.Fingerprint == nil {
		m.cfg.Fingerprint = DefaultFingerprint
	}
	if m.cfg.ShouldStore == nil {
		m.cfg.ShouldStore = DefaultShouldStore
	}
	if m.cfg.ErrorHandler == nil {
		m.cfg.ErrorHandler = WriteProblem
	}
	if m.cfg.Logger == nil {
		m.cfg.Logger = slog.Default()
	}
	return m.wrap, nil
}

type middleware struct {
	cfg     Config
	key     KeySource // Config.KeySource, or the default
	eng     *engine.Engine
	store   idem.Store
	quota   *quota.Set // Config.Quota's counts; nil: no quota
	methods map[string]bool
	deny    map[string]bool // canonical header names
	allow   map[string]bool // canonical header names; nil: no allowlist
	gate    *blobGate       // whether Config.Blobs answers (unused without it)
	blobNS  idem.Namespacer // the store's, for blob names (asked per blob: a store id may be read late); nil if it has none
	cookies cookieMatcher   // Config.TrackingCookies
	// defaultTenant: Config.Tenant is DefaultTenant (its API-key tenants
	// also check cookies).
	defaultTenant bool
	v1            v1Derivation // the user's Config functions, for v1.0's keys
	// lifetime is the value of Idempotency-Key-Lifetime (LifetimeHeader),
	// shared by every response (stamped replaces it, never appends);
	// nil without it.
	lifetime []string
	// omitted and anonymous are the routes whose omitted body, and whose
	// anonymous keyed requests, were logged (once per route).
	omitted, anonymous telemetry.Once
}

func (m *middleware) wrap(next http.Handler) http.Handler {
	route := m.cfg.Route
	if route == nil {
		route = defaultRoute(next)
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !m.methods[r.Method] {
			next.ServeHTTP(w, r)
			return
		}
		if m.cfg.EchoKey || m.cfg.LifetimeHeader {
			s := &stamped{w: w, lifetime: m.lifetime}
			m.handle(s, r, next, route, s)
			s.end()
			return
		}
		m.handle(w, r, next, route, nil)
	})
}

// handle serves a request of a covered method; s, when not nil, is w, to
// be told the key to echo.
func (m *middleware) handle(w http.ResponseWriter, r *http.Request, next http.Handler, route func(*http.Request) string, s *stamped) {
	start := time.Now()
	// A source that reads the body has it read first, for every
	// request; the others are asked for the key before anything is
	// read, so that an unkeyed request passes through untouched.
	var body []byte
	if m.key.NeedsBody {
		var ok bool
		if body, ok = m.readBody(w, r); !ok {
			m.outcome(r, OutcomeRejected)
			return
		}
	}
	clientKey, err := m.key.Key(r, body)
	if err == nil && !m.key.v1 {
		err = validateAs(clientKey, "the idempotency key")
	}
	if err == nil && s != nil && m.cfg.EchoKey {
		s.key = s.echo(clientKey)
	}
	if err != nil {
		p, missing := m.keyProblem(err)
		if missing && !m.required(r) {
			m.outcome(r, OutcomePassedThrough)
			if m.key.NeedsBody {
				r = withBody(r, r.Context(), body, nil)
			}
			next.ServeHTTP(w, r)
			return
		}
		m.outcome(r, OutcomeRejected)
		m.problem(w, r, p)
		return
	}
	var tenant, v1Authz string
	if m.defaultTenant {
		tenant, v1Authz = defaultTenant(r) // Config.Tenant's answer, with what v1.0's shares
	} else {
		tenant = m.cfg.Tenant(r)
	}
	if tenant == "" && !m.anonymousCaller(w, r) {
		return
	}
	if !m.key.NeedsBody {
		var ok bool
		if body, ok = m.readBody(w, r); !ok {
			m.outcome(r, OutcomeRejected)
			return
		}
	}
	rt := route(r)
	// The key was validated, so Key cannot fail.
	key, _ := idem.Scope{Tenant: tenant, Method: r.Method, Route: rt, Authority: m.cfg.Authority(r)}.Key(clientKey)
	req := request{key: key, fp: m.cfg.Fingerprint(r, body), route: rt, clientKey: clientKey}
	if tenant == "" || (m.defaultTenant && ident.OnlyAPIKeys(tenant)) {
		// Nothing names the client, or only an API key that may be a
		// publishable one every browser of a site sends: its cookies,
		// if any, must match for a replay (see Config.Tenant).
		req.cookies = m.cookies.callerCookies(r)
	}
	req.tenant, req.v1Authz = tenant, v1Authz
	if m.cfg.OnKey != nil {
		m.cfg.OnKey(r, key)
	}
	m.serve(w, r, next, req, body, start)
}

// anonymousCaller reports a keyed request that no tenant source
// identifies, and refuses it (false) with RefuseAnonymous.
func (m *middleware) anonymousCaller(w http.ResponseWriter, r *http.Request) bool {
	if m.cfg.OnAnonymous != nil {
		m.cfg.OnAnonymous(r)
	}
	m.eng.Anonymous(r.Context())
	if m.cfg.RefuseAnonymous {
		m.outcome(r, OutcomeRejected)
		m.problem(w, r, problemAnonymous)
		return false
	}
	// Once per path in normal form: escapes of one path (/a, /%61) are one.
	if route := ident.Path(r.URL.EscapedPath()); m.anonymous.First(route) {
		m.cfg.Logger.LogAttrs(r.Context(), slog.LevelWarn, "idem: keyed request from an unidentified caller: callers that send the same key share its record; "+
			"set a tenant source or refuse them (RefuseAnonymous, --refuse-anonymous); logged once per route",
			slog.String("route", route), slog.String("method", r.Method))
	}
	return true
}

// v1Derivation derives the key and fingerprint v1.0 gave a request, from
// the user's Config functions (nil: the defaults of v1.0), for
// Config.V1Scopes.
type v1Derivation struct {
	tenant, route func(*http.Request) string
	fingerprint   func(*http.Request, []byte) idem.Fingerprint
}

func (v v1Derivation) derive(r *http.Request, req request, body []byte) (idem.Key, idem.Fingerprint) {
	var tenant string
	switch {
	case v.tenant == nil:
		if auth := r.Header.Get("Authorization"); auth != "" && auth == req.v1Authz {
			// v1DefaultTenant(r) is "authz:" and the hash of auth,
			// which req.tenant is (see defaultTenant).
			tenant = req.tenant
		} else {
			tenant = v1DefaultTenant(r)
		}
	default:
		// A tenant source of this package falls back to DefaultTenant,
		// whose answer changed: v1.0's fell back to v1.0's.
		if tenant = v.tenant(r); tenant == DefaultTenant(r) {
			tenant = v1DefaultTenant(r)
		}
	}
	route := req.route
	if v.route == nil && route == ident.Path(r.URL.EscapedPath()) {
		// The default route fell back to the path, which v1.0 took as
		// escaped (a ServeMux pattern is as it was).
		route = r.URL.EscapedPath()
	}
	fingerprint := v.fingerprint
	if fingerprint == nil {
		fingerprint = v1Fingerprint
	}
	fp := fingerprint(r, body)
	if tenant == "" {
		fp, _ = v1CookieFingerprint(r, fp)
	}
	key, _ := idem.Scope{Tenant: tenant, Method: r.Method, Route: route}.Key(req.clientKey)
	return key, fp
}

func defaultRoute(next http.Handler) func(*http.Request) string {
	mux, _ := next.(*http.ServeMux)
	return func(r *http.Request) string {
		if r.Pattern != "" {
			return r.Pattern
		}
		if mux != nil {
			if _, p := mux.Handler(r); p != "" {
				return p
			}
		}
		return ident.Path(r.URL.EscapedPath())
	}
}

func (m *middleware) required(r *http.Request) bool {
	if m.cfg.RequireKeyFunc != nil {
		return m.cfg.RequireKeyFunc(r)
	}
	return m.cfg.RequireKey
}

// readBody reads the whole request body, up to MaxBodySize; past it the
// request gets 413 and nothing is stored.
func (m *middleware) readBody(w http.ResponseWriter, r *http.Request) ([]byte, bool) {
	if r.ContentLength > m.cfg.MaxBodySize {
		m.tooLarge(w, r)
		return nil, false
	}
	// The declared length is a hint only: an outer middleware may have
	// replaced the body (decompressing it, say), and a client that
	// declares a length and sends nothing must not pin that much memory.
	// bytes.MinRead more than the hint, as bytes.Buffer.ReadFrom keeps
	// free, so that a body of the declared length (the usual case) is
	// read into this one allocation, EOF included.
	//
	// The reads are those of bytes.Buffer.ReadFrom through
	// http.MaxBytesReader, without either: each asks at most a byte more
	// than the limit leaves, and one that gets more is over the limit.
	buf := make([]byte, 0, min(max(r.ContentLength, 0), 64<<10)+bytes.MinRead)
	left := m.cfg.MaxBodySize
	for {
		if cap(buf)-len(buf) < bytes.MinRead {
			buf = append(make([]byte, 0, max(2*cap(buf), len(buf)+bytes.MinRead)), buf...)
		}
		p := buf[len(buf):cap(buf)]
		if int64(len(p))-1 > left {
			p = p[:left+1]
		}
		n, err := r.Body.Read(p)
		if n < 0 {
			panic(errNegativeRead)
		}
		if int64(n) > left {
			pastLimit(w)
			m.tooLarge(w, r)
			return nil, false
		}
		left -= int64(n)
		buf = buf[:len(buf)+n]
		if err == io.EOF {
			return buf, true
		}
		switch {
		case err != nil && maxBytes(err):
			// An outer limit (http.MaxBytesHandler, a proxy's), smaller
			// than ours: too large all the same. Its reader told the
			// server already.
			m.tooLarge(w, r)
			return nil, false
		case err != nil:
			m.problem(w, r, Problem{Type: "about:blank", Title: "Bad Request", Status: http.StatusBadRequest,
				Detail: "The request body could not be read."})
			return nil, false
		}
	}
}

// maxBytes reports whether err is an *http.MaxBytesError (its own
// function: the target of errors.As is allocated only for an error).
func maxBytes(err error) bool {
	var tooBig *http.MaxBytesError
	return errors.As(err, &tooBig)
}

// errNegativeRead is bytes.Buffer's panic for a reader that returned a
// negative count.
var errNegativeRead = errors.New("bytes.Buffer: reader returned negative count from Read")

// pastLimit tells w's server what http.MaxBytesReader tells it when a
// request body passes its limit (net/http's writer closes the connection
// after the answer, the rest of the body unread): through a MaxBytesReader
// of limit 0 asked for one byte, which it gets.
func pastLimit(w http.ResponseWriter) {
	var one [1]byte
	http.MaxBytesReader(w, overLimit{}, 0).Read(one[:])
}

// overLimit is an endless body.
type overLimit struct{}

func (overLimit) Read(p []byte) (int, error) { return len(p), nil }
func (overLimit) Close() error               { return nil }

func (m *middleware) tooLarge(w http.ResponseWriter, r *http.Request) {
	p := problemBodyTooLarge
	p.Detail = fmt.Sprintf("Requests with an Idempotency-Key may carry at most %d bytes of body.", m.cfg.MaxBodySize)
	if m.key.NeedsBody {
		// The body names the key: every request of the method is read.
		p.Detail = fmt.Sprintf("Requests of this method may carry at most %d bytes of body.", m.cfg.MaxBodySize)
	}
	m.problem(w, r, p)
}

// request is what the middleware derived from a keyed request.
type request struct {
	key       idem.Key
	fp        idem.Fingerprint
	route     string              // Config.Route's answer
	clientKey string              // the Idempotency-Key, for v1.0's key
	cookies   map[string][]string // no tenant: the cookies that identify the caller
	tenant    string              // Config.Tenant's answer, for the Quota
	// v1Authz, when not "", is the Authorization value whose v1.0
	// tenant is tenant (defaultTenant).
	v1Authz string
}

// serve acquires the key and answers: run the handler, replay, 409, 422 or
// 503; with Config.Wait, an in-flight key is waited for first. start is
// when the middleware got the request.
func (m *middleware) serve(w http.ResponseWriter, r *http.Request, next http.Handler, req request, body []byte, start time.Time) {
	// The work's context keeps the request's values, not its cancellation:
	// once acquired, the key's work runs to its end whatever the client
	// does (unless CancelOnDisconnect).
	parent := r.Context()
	if !m.cfg.CancelOnDisconnect {
		parent = context.WithoutCancel(parent)
	}
	ticket, ok := m.admit(w, r, req.tenant, req.key, start)
	if !ok {
		return // 429: over the tenant's quota, nothing claimed
	}
	d := m.eng.Acquire(r.Context(), parent, req.key, req.fp, "")
	if (d.Outcome == engine.OutcomeExecuted || d.Outcome == engine.OutcomeMismatch) && m.key.v1 && m.eng.FallingBack() {
		old, oldFP := m.v1.derive(r, req, body)
		d = m.eng.Fallback(r.Context(), d, req.key, req.fp, old, oldFP)
	}
	if d.Outcome != engine.OutcomeExecuted {
		ticket.Release() // nothing claimed
	}
	switch d.Outcome {
	case engine.OutcomeExecuted:
		ticket = m.takeOver(ticket, req.tenant)
		toBlob := m.cfg.Blobs != nil
		if toBlob {
			if err := m.gate.check(r.Context()); err != nil {
				// The blob store does not answer: a large response
				// could not be stored. Fail closed, as for the store,
				// unless FailOpen: then the handler runs, and a body
				// too large for the record is not stored.
				m.blobError(r, BlobOpCheck, err)
				m.cfg.Logger.LogAttrs(r.Context(), slog.LevelWarn, "idem: blob store unavailable before the handler ran",
					slog.String("key", req.key.String()), slog.Bool("fail_open", m.cfg.FailOpen), slog.Any("error", err))
				if !m.cfg.FailOpen {
					m.eng.Release(context.WithoutCancel(r.Context()), d.Attempt)
					ticket.Release()
					m.outcome(r, OutcomeStoreError)
					m.problem(w, r, problemBlobStore)
					return
				}
				toBlob = false
			}
		}
		m.execute(w, r, body, next, d, req, toBlob, start, ticket)
	case engine.OutcomeReplayed:
		if !sameCaller(d.Response.Header.Get(headerCallerCookies), req.cookies) {
			// Stored for a caller with other cookies.
			m.outcome(r, OutcomeMismatch)
			m.problem(w, r, problemMismatchCookies)
			return
		}
		m.replayStored(w, r, req.key, d.Response, start)
	case engine.OutcomeMismatch:
		m.outcome(r, OutcomeMismatch)
		m.problem(w, r, problemMismatch)
	case engine.OutcomeInFlight:
		m.outcome(r, OutcomeInFlight)
		m.problem(w, r, problemInFlight)
	case engine.OutcomeGone:
		m.outcome(r, OutcomeGone) // nobody to answer, nothing to run
	case engine.OutcomeUnsealable:
		// It ran once; its result cannot be read. Never run again, not
		// even with FailOpen: the store did not fail.
		m.outcome(r, OutcomeUnsealable)
		w.Header().Set(HeaderReplayed, "true")
		m.problem(w, r, problemUnreadable)
	default: // engine.OutcomeStoreError
		m.outcome(r, OutcomeStoreError)
		switch {
		case d.Unknown:
		case m.cfg.FailOpen:
			next.ServeHTTP(w, withBody(r, r.Context(), body, nil))
			return
		case errors.Is(d.Err, idem.ErrStoreFull):
			m.problem(w, r, problemStoreFull)
			return
		}
		m.problem(w, r, problemStore)
	}
}

// outcome reports what the middleware did with r: telemetry, then
// Config.OnOutcome.
func (m *middleware) outcome(r *http.Request, o Outcome) {
	m.eng.Report(r.Context(), engine.Outcome(o))
	if m.cfg.OnOutcome != nil {
		m.cfg.OnOutcome(r, o)
	}
}

// withBody returns a copy of r with ctx and the body that was read for
// the fingerprint. The body is now of known length: ContentLength says
// it, and the client's Transfer-Encoding is gone, so that a handler that
// forwards r (httputil.ReverseProxy, an http.Client) sends it with its
// Content-Length, never as a chunked body the next server may not read.
// The body is io.NopCloser of a *bytes.Reader, which net/http's client
// knows to be in memory: it sends such a body in one write with the
// header. Its reader is rd when not nil (a field of an object the caller
// allocates anyway), else a new one.
func withBody(r *http.Request, ctx context.Context, body []byte, rd *bytes.Reader) *http.Request {
	r = r.WithContext(ctx)
	r.ContentLength = int64(len(body))
	r.TransferEncoding = nil
	if len(body) == 0 {
		r.Body = http.NoBody
	} else {
		if rd == nil {
			rd = new(bytes.Reader)
		}
		rd.Reset(body)
		r.Body = io.NopCloser(rd)
	}
	return r
}

// execute runs the handler under the lease of d, with the work's context
// and the body read for the fingerprint, then stores its response or
// releases the key according to ShouldStore. The work reports the
// outcome, executed or released. A panic, in the handler or after it,
// releases the key (work.End) and goes on: net/http aborts the response.
func (m *middleware) execute(w http.ResponseWriter, r *http.Request, body []byte, next http.Handler, d engine.Decision, req request, toBlob bool, start time.Time,
	ticket quota.Ticket) {
	key, att, outer := req.key, d.Attempt, r
	x := &execution{m: m, r: outer}
	work := &x.work
	m.eng.StartIn(work, d, x)
	var stored *idem.Response // the quota's: the work ended with this record, or released its key
	defer func() {
		if stored != nil {
			ticket.Stored(recordSize(stored), att.Retention())
		} else {
			ticket.Release()
		}
	}()
	defer work.End()
	c := newCapture(w, m.cfg.MaxResponseSize)
	r = withBody(r, work.Ctx, body, &c.reqBody)
	finish := work.Finish
	c.cw = m.clientWrites(r, start)
	if toBlob {
		c.toBlob = func() *spill {
			if !m.cfg.ShouldStore(r, c.status) {
				return nil // released anyway: no blob to write
			}
			return m.newSpill(att.Context(), r, att.Lease())
		}
		defer func() { c.spill.abort() }() // after a panic: the blob is not kept (a committed one stays)
	}
	next.ServeHTTP(c, r)
	header := c.finish()
	if c.hijacked || !m.cfg.ShouldStore(r, c.status) {
		c.spill.abort()
		work.Release()
		return
	}
	rec := cookieRecord(req.cookies, header) // before storable drops Set-Cookie
	c.resp = idem.Response{Status: c.status, Header: m.storable(header), Body: c.body, BodyOmitted: c.overflow}
	resp := &c.resp
	if rec != "" {
		resp.Header[headerCallerCookies] = []string{rec}
	}
	if c.spill != nil {
		// The blob is written whole before Complete: a completed record
		// never points to a blob that is not there.
		if ref, err := c.spill.commit(); err != nil {
			resp.BodyOmitted = true
			work.Failed("idem: the response body could not be written to the blob store; the key completes without it", err)
		} else {
			resp.Blob = ref
			resp.Header.Del("Content-Length") // a replay sends the blob's size
		}
	}
	if resp.BodyOmitted {
		m.bodyOmitted(finish, outer, req.route, key)
	}
	err := work.Complete(resp)
	if !errors.Is(err, idem.ErrLeaseLost) {
		stored = resp // or maybe stored (a lost reply): counted until its retention would end
	}
	if resp.Blob != nil && errors.Is(err, idem.ErrLeaseLost) {
		// Not stored for sure (other errors may hide a completion whose
		// reply was lost: the sweep decides those by the record).
		m.deleteBlob(finish, resp.Blob.Name)
	}
	if c.gone != nil {
		telemetry.Event(finish, telemetry.EventClientGone)
		work.ClientGone(c.gone)
	}
}

// execution is the engine's Work of an executed request and what its
// report needs, in one allocation: it is the Work's Reporter.
type execution struct {
	work engine.Work
	m    *middleware
	r    *http.Request // the request as the middleware got it
}

// Report reports the work's outcome, executed or released.
func (x *execution) Report(o engine.Outcome) { x.m.outcome(x.r, Outcome(o)) }

// storable drops the headers that are never stored. Names are matched
// whatever their case: a handler may write a map key as it likes
// (h["set-cookie"]), and net/http sends it as written.
func (m *middleware) storable(h http.Header) http.Header {
	var named map[string]bool // the headers a Connection header names
	for name, vs := range h {
		if !strings.EqualFold(name, "Connection") {
			continue
		}
		for _, c := range vs {
			for n := range strings.SplitSeq(c, ",") {
				if named == nil {
					named = map[string]bool{}
				}
				named[http.CanonicalHeaderKey(strings.TrimSpace(n))] = true
			}
		}
	}
	for name := range h {
		if c := trailerless(name); m.dropped(c) || named[c] {
			delete(h, name)
		}
	}
	return h
}

// trailerless is the canonical name of a stored header or trailer
// (http.TrailerPrefix and its name): a trailer is denied as the header of
// its name is.
func trailerless(name string) string {
	return http.CanonicalHeaderKey(strings.TrimPrefix(name, http.TrailerPrefix))
}

// clientWrites bounds the writes to r's client by ClientWriteTimeout,
// never past the server's WriteTimeout counted from start.
func (m *middleware) clientWrites(r *http.Request, start time.Time) clientWrites {
	cw := clientWrites{timeout: m.cfg.ClientWriteTimeout}
	if srv, ok := r.Context().Value(http.ServerContextKey).(*http.Server); ok && srv.WriteTimeout > 0 && cw.on() {
		cw.limit = start.Add(srv.WriteTimeout)
	}
	return cw
}

// replayStored answers with a stored response, from the record or, in a
// blob store, streamed from there. Its writes are bounded as the
// handler's are (ClientWriteTimeout): a client that stops reading a
// replay holds no blob reader and no goroutine for longer.
func (m *middleware) replayStored(w http.ResponseWriter, r *http.Request, key idem.Key, resp *idem.Response, start time.Time) {
	cw := m.clientWrites(r, start)
	if resp.Blob != nil {
		m.replayBlob(w, r, key, resp, cw)
		return
	}
	if resp.BodyOmitted {
		m.replayNotKept(w, r, resp)
		return
	}
	m.outcome(r, OutcomeReplayed)
	telemetry.Event(r.Context(), telemetry.EventReplay)
	m.replayHeader(w, resp)
	w.WriteHeader(resp.Status)
	cw.write(w, http.NewResponseController(w), resp.Body)
}

// replayHeader sets the stored header of resp on w, and idem's own.
func (m *middleware) replayHeader(w http.ResponseWriter, resp *idem.Response) {
	h := w.Header()
	// The values are copied, into one array of this replay's own (its
	// last element Idempotent-Replayed's): code after this may write into
	// a header value in place (Caddy's header replace does), and resp may
	// be shared (the requests of this process handed one response, a
	// store that caches what it decoded). Each entry is clipped: an Add
	// appends to a new array, never into its neighbour.
	n := 1
	for _, vs := range resp.Header {
		n += len(vs)
	}
	vals := make([]string, 0, n)
	for name, vs := range resp.Header {
		if name == headerCallerCookies || m.dropped(trailerless(name)) {
			// Denied headers again, whatever their case: a record stored
			// before a name was denied (v1.0 stored h["set-cookie"]), or
			// before an allowlist left it out.
			continue
		}
		if len(vs) == 0 {
			h[name] = slices.Clip(vs) // nothing to write into
			continue
		}
		// A trailer (http.TrailerPrefix) goes out after the body:
		// net/http sends such keys as trailers once the handler has
		// returned.
		i := len(vals)
		vals = append(vals, vs...)
		h[name] = vals[i:len(vals):len(vals)]
	}
	if _, ok := h["Content-Type"]; !ok {
		h["Content-Type"] = nil // the original had none: net/http must not sniff one
	}
	vals = append(vals, "true")
	h[HeaderReplayed] = vals[len(vals)-1 : len(vals) : len(vals)]
}

// replayNotKept answers for a stored response whose body was not kept:
// 500 problem+json saying that the request ran, with what status, and why
// its body cannot be replayed. Its outcome is OutcomeReplayed: the work
// ran once and this is the key's answer.
func (m *middleware) replayNotKept(w http.ResponseWriter, r *http.Request, resp *idem.Response) {
	m.outcome(r, OutcomeReplayed)
	telemetry.Event(r.Context(), telemetry.EventReplay)
	h := w.Header()
	h.Set(HeaderReplayed, "true")
	h.Set(HeaderBodyOmitted, "true")
	h.Set(HeaderOriginalStatus, strconv.Itoa(resp.Status))
	why := "no blob store is configured to keep larger bodies"
	if m.cfg.Blobs != nil {
		why = "the blob store for larger bodies failed or did not answer when it was written"
	}
	p := problemNotKept
	p.StatusExecuted = resp.Status
	p.Detail = fmt.Sprintf("This request was executed (status %d) and will not be executed again, but its response body was larger "+
		"than the limit for stored responses and was not kept: %s. It cannot be replayed; a retry with this key gets this answer until the record expires.",
		resp.Status, why)
	m.problem(w, r, p)
}

// bodyOmitted reports a response stored without its body: OnBodyOmitted,
// and, without a blob store, a warning once per route (a failed blob
// store logs each of its failures itself).
func (m *middleware) bodyOmitted(ctx context.Context, r *http.Request, route string, key idem.Key) {
	if m.cfg.OnBodyOmitted != nil {
		m.cfg.OnBodyOmitted(r)
	}
	if m.cfg.Blobs != nil || !m.omitted.First(route) {
		return
	}
	m.cfg.Logger.LogAttrs(ctx, slog.LevelWarn, "idem: a response larger than the limit was stored without its body: "+
		"its replays answer 500 (response-not-kept); set a blob store (Config.Blobs, idem proxy --blob) or raise the limit "+
		"(Config.MaxResponseSize, --max-response); logged once per route",
		slog.String("route", route), slog.Int("max_response_size", m.cfg.MaxResponseSize), slog.String("key", key.String()))
}

func (m *middleware) problem(w http.ResponseWriter, r *http.Request, p Problem) {
	m.cfg.ErrorHandler(w, r, &p)
}
