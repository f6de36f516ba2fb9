package idemhttp

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/idemkit/idem"
)

// Defaults for Config's zero fields.
const (
	DefaultMaxBodySize     = 1 << 20
	DefaultMaxResponseSize = idem.DefaultMaxResponseSize
)

// maxWaitPoll caps the pause between two store checks while waiting for a
// holder in another process.
const maxWaitPoll = 250 * time.Millisecond

// HeaderBodyOmitted is set to "true" on a replay whose body was larger than
// Config.MaxResponseSize when it was first produced and was not stored.
const HeaderBodyOmitted = "Idempotent-Replay-Body-Omitted"

// Config tunes the middleware. The zero value means the defaults.
type Config struct {
	// Methods are the methods the middleware covers; others pass through
	// untouched. Default POST and PATCH.
	Methods []string

	// RequireKey makes the Idempotency-Key header mandatory on covered
	// methods: a request without one gets 400. RequireKeyFunc, when set,
	// decides per request instead (for example per route).
	RequireKey     bool
	RequireKeyFunc func(*http.Request) bool

	// Tenant says whose request this is; keys of different tenants never
	// share a record. Default DefaultTenant (a hash of the Authorization
	// header, when there is one).
	Tenant func(*http.Request) string

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

	// MaxResponseSize is the largest response body stored. A larger body
	// still goes to the client; the key is completed without it, and a
	// replay carries the status and headers, an empty body and
	// Idempotent-Replay-Body-Omitted: true. Default 1 MiB.
	MaxResponseSize int

	// ShouldStore decides from the final status whether a response is
	// stored (and replayed from then on) or the key is released so the
	// request can be retried. Default DefaultShouldStore.
	ShouldStore func(r *http.Request, status int) bool

	// Wait, when positive, makes a request whose key is in flight wait up
	// to this long for the result instead of getting 409 at once. It wakes
	// as soon as this process finishes the key; for a holder in another
	// process it asks the store again after growing pauses (at most 250ms).
	Wait time.Duration

	// FailOpen runs the handler without idempotency when the store fails.
	// Default false: the request gets 503 and the handler does not run.
	FailOpen bool

	// ReplayHeaderDenylist names response headers never stored nor
	// replayed, besides Set-Cookie and the hop-by-hop headers, which are
	// always dropped.
	ReplayHeaderDenylist []string

	// ErrorHandler writes the middleware's own error answers. Default
	// WriteProblem (application/problem+json).
	ErrorHandler func(w http.ResponseWriter, r *http.Request, p *Problem)

	// Logger receives store failures and lost leases. Keys are logged as
	// their digest, never raw. Default slog.Default().
	Logger *slog.Logger

	// OnOutcome, when set, is called once for every request of a covered
	// method with what the middleware did with it (for metrics). It must
	// not block.
	OnOutcome func(r *http.Request, o Outcome)

	// OnRenew: see idem.Config.
	OnRenew func(key idem.Key, err error)
}

// Outcome is what the middleware did with a request of a covered method.
type Outcome string

const (
	OutcomePassedThrough Outcome = "passed_through" // no key, none required: handler ran unprotected
	OutcomeExecuted      Outcome = "executed"       // the handler ran under a lease
	OutcomeReplayed      Outcome = "replayed"       // the stored response was replayed
	OutcomeConflict      Outcome = "conflict"       // 409: in flight (after the wait, if any)
	OutcomeMismatch      Outcome = "mismatch"       // 422
	OutcomeRejected      Outcome = "rejected"       // 400 or 413: key missing or invalid, body too large or unreadable
	OutcomeStoreError    Outcome = "store_error"    // the store failed: 503, or the handler ran unprotected (FailOpen)
	OutcomeGone          Outcome = "gone"           // the client left before an answer
)

// DefaultTenant scopes keys by the caller's credentials: a hash of the
// Authorization header, or "" when there is none. Replace it when callers
// authenticate otherwise (cookies, mTLS): two callers with the same tenant
// can replay each other's results.
func DefaultTenant(r *http.Request) string {
	auth := r.Header.Get("Authorization")
	if auth == "" {
		return ""
	}
	sum := sha256.Sum256([]byte(auth))
	return "authz:" + base64.RawURLEncoding.EncodeToString(sum[:16])
}

// DefaultFingerprint hashes the method, path, query, Content-Type and body.
func DefaultFingerprint(r *http.Request, body []byte) idem.Fingerprint {
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
	"Upgrade", "Te", "Trailer", "Proxy-Authenticate", "Proxy-Authorization", HeaderReplayed,
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
	if cfg.Wait < 0 {
		return nil, fmt.Errorf("idemhttp: Config.Wait %v is negative", cfg.Wait)
	}
	if cfg.MaxBodySize == 0 {
		cfg.MaxBodySize = DefaultMaxBodySize
	}
	if cfg.MaxResponseSize == 0 {
		cfg.MaxResponseSize = DefaultMaxResponseSize
	}
	g, err := idem.New(store, idem.Config{Lease: cfg.Lease, Retention: cfg.Retention, MaxResponseSize: cfg.MaxResponseSize, OnRenew: cfg.OnRenew})
	if err != nil {
		return nil, err
	}
	if len(cfg.Methods) == 0 {
		cfg.Methods = []string{http.MethodPost, http.MethodPatch}
	}
	m := &middleware{cfg: cfg, g: g, methods: map[string]bool{}, deny: map[string]bool{}}
	for _, meth := range cfg.Methods {
		if meth == "" || strings.ToUpper(meth) != meth {
			return nil, fmt.Errorf("idemhttp: Config.Methods: %q is not an upper-case method", meth)
		}
		m.methods[meth] = true
	}
	for _, h := range slices.Concat(alwaysDenied, cfg.ReplayHeaderDenylist) {
		m.deny[http.CanonicalHeaderKey(h)] = true
	}
	if m.cfg.Tenant == nil {
		m.cfg.Tenant = DefaultTenant
	}
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
	if m.cfg.OnOutcome == nil {
		m.cfg.OnOutcome = func(*http.Request, Outcome) {}
	}
	return m.wrap, nil
}

type middleware struct {
	cfg     Config
	g       *idem.Guard
	methods map[string]bool
	deny    map[string]bool // canonical header names
	waiters waiters
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
		clientKey, err := ParseKey(r.Header)
		switch {
		case errors.Is(err, errKeyMissing):
			if m.required(r) {
				m.cfg.OnOutcome(r, OutcomeRejected)
				m.problem(w, r, problemKeyMissing)
				return
			}
			m.cfg.OnOutcome(r, OutcomePassedThrough)
			next.ServeHTTP(w, r)
			return
		case err != nil:
			m.cfg.OnOutcome(r, OutcomeRejected)
			m.problem(w, r, Problem{Type: ProblemKeyInvalid, Title: "Invalid Idempotency-Key", Status: http.StatusBadRequest,
				Detail: keyErrorDetail(err)})
			return
		}
		body, ok := m.readBody(w, r)
		if !ok {
			m.cfg.OnOutcome(r, OutcomeRejected)
			return
		}
		// ParseKey validated the key, so Key cannot fail.
		key, _ := idem.Scope{Tenant: m.cfg.Tenant(r), Method: r.Method, Route: route(r)}.Key(clientKey)
		m.serve(w, r, next, key, m.cfg.Fingerprint(r, body), body)
	})
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
		return r.URL.EscapedPath()
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
	buf := bytes.NewBuffer(make([]byte, 0, min(max(r.ContentLength, 0), 64<<10)))
	_, err := buf.ReadFrom(http.MaxBytesReader(w, r.Body, m.cfg.MaxBodySize))
	var tooBig *http.MaxBytesError
	switch {
	case errors.As(err, &tooBig):
		m.tooLarge(w, r)
		return nil, false
	case err != nil:
		m.problem(w, r, Problem{Type: "about:blank", Title: "Bad Request", Status: http.StatusBadRequest,
			Detail: "The request body could not be read."})
		return nil, false
	}
	return buf.Bytes(), true
}

func (m *middleware) tooLarge(w http.ResponseWriter, r *http.Request) {
	p := problemBodyTooLarge
	p.Detail = fmt.Sprintf("Requests with an Idempotency-Key may carry at most %d bytes of body.", m.cfg.MaxBodySize)
	m.problem(w, r, p)
}

// serve acquires the key and answers: run the handler, replay, 409, 422 or
// 503; with Config.Wait, an in-flight key is waited for first.
func (m *middleware) serve(w http.ResponseWriter, r *http.Request, next http.Handler, key idem.Key, fp idem.Fingerprint, body []byte) {
	deadline := time.Now().Add(m.cfg.Wait)
	pause := 5 * time.Millisecond
	for {
		att, acq, err := m.g.Begin(r.Context(), key, fp)
		if err != nil && r.Context().Err() != nil {
			m.cfg.OnOutcome(r, OutcomeGone)
			return // the client is gone (or an outer deadline passed): nobody to answer, nothing to run
		}
		if err != nil {
			m.cfg.OnOutcome(r, OutcomeStoreError)
			m.cfg.Logger.LogAttrs(r.Context(), slog.LevelWarn, "idem: store failed before the handler ran",
				slog.String("key", key.String()), slog.Bool("fail_open", m.cfg.FailOpen), slog.Any("error", err))
			if m.cfg.FailOpen {
				next.ServeHTTP(w, withBody(r, r.Context(), body))
				return
			}
			m.problem(w, r, problemStore)
			return
		}
		switch acq.Outcome {
		case idem.Acquired:
			m.cfg.OnOutcome(r, OutcomeExecuted)
			m.execute(w, withBody(r, att.Context(), body), next, att)
		case idem.Replay:
			m.cfg.OnOutcome(r, OutcomeReplayed)
			m.replay(w, acq.Response)
		case idem.Mismatch:
			m.cfg.OnOutcome(r, OutcomeMismatch)
			m.problem(w, r, problemMismatch)
		case idem.InFlight:
			left := time.Until(deadline)
			if left <= 0 {
				m.cfg.OnOutcome(r, OutcomeConflict)
				m.problem(w, r, problemInFlight)
				return
			}
			if !m.waiters.wait(r.Context(), key, min(pause, left, acq.RetryAfter+time.Millisecond)) {
				m.cfg.OnOutcome(r, OutcomeGone)
				return // the client is gone
			}
			pause = min(2*pause, maxWaitPoll)
			continue
		default: // a store answering something else is a broken store
			m.cfg.OnOutcome(r, OutcomeStoreError)
			m.cfg.Logger.LogAttrs(r.Context(), slog.LevelError, "idem: store gave an unknown outcome",
				slog.String("key", key.String()), slog.Any("outcome", acq.Outcome))
			m.problem(w, r, problemStore)
		}
		return
	}
}

// withBody returns a copy of r with ctx and the body that was read for
// the fingerprint.
func withBody(r *http.Request, ctx context.Context, body []byte) *http.Request {
	r = r.WithContext(ctx)
	r.Body = io.NopCloser(bytes.NewReader(body))
	return r
}

// execute runs the handler under the lease, then stores its response or
// releases the key according to ShouldStore. A panic releases the key and
// goes on. r carries the attempt's context.
func (m *middleware) execute(w http.ResponseWriter, r *http.Request, next http.Handler, att *idem.Attempt) {
	key := att.Lease().Key
	finish := context.WithoutCancel(r.Context())
	c := newCapture(w, m.cfg.MaxResponseSize)
	defer m.waiters.wake(key)
	defer func() {
		if p := recover(); p != nil {
			m.release(finish, att)
			panic(p)
		}
	}()
	next.ServeHTTP(c, r)
	header := c.finish()
	if c.hijacked || !m.cfg.ShouldStore(r, c.status) {
		m.release(finish, att)
		return
	}
	resp := &idem.Response{Status: c.status, Header: m.storable(header), Body: c.body, BodyOmitted: c.overflow}
	switch err := att.Complete(finish, resp); {
	case err == nil:
	case errors.Is(err, idem.ErrNotReplicated):
		m.cfg.Logger.LogAttrs(finish, slog.LevelWarn, "idem: response stored, but not on enough replicas; a failover may lose it",
			slog.String("key", key.String()), slog.Uint64("token", att.Lease().Token), slog.Any("error", err))
	default:
		m.cfg.Logger.LogAttrs(finish, slog.LevelWarn, "idem: handler ran but its response was not stored; a retry will run it again",
			slog.String("key", key.String()), slog.Uint64("token", att.Lease().Token), slog.Any("error", err))
	}
}

func (m *middleware) release(ctx context.Context, att *idem.Attempt) {
	switch err := att.Release(ctx); {
	case err == nil:
	case errors.Is(err, idem.ErrLeaseLost):
		m.cfg.Logger.LogAttrs(ctx, slog.LevelWarn, "idem: lease lost before the release; another request may hold the key",
			slog.String("key", att.Lease().Key.String()), slog.Any("error", err))
	default:
		m.cfg.Logger.LogAttrs(ctx, slog.LevelWarn, "idem: release failed; the key stays blocked until its lease ends",
			slog.String("key", att.Lease().Key.String()), slog.Any("error", err))
	}
}

// storable drops the headers that are never stored.
func (m *middleware) storable(h http.Header) http.Header {
	for _, c := range h.Values("Connection") { // headers the Connection header names
		for name := range strings.SplitSeq(c, ",") {
			delete(h, http.CanonicalHeaderKey(strings.TrimSpace(name)))
		}
	}
	for name := range h {
		if m.deny[name] {
			delete(h, name)
		}
	}
	return h
}

func (m *middleware) replay(w http.ResponseWriter, resp *idem.Response) {
	h := w.Header()
	for name, vs := range resp.Header {
		h[name] = vs
	}
	if _, ok := h["Content-Type"]; !ok {
		h["Content-Type"] = nil // the original had none: net/http must not sniff one
	}
	h.Set(HeaderReplayed, "true")
	if resp.BodyOmitted {
		h.Set(HeaderBodyOmitted, "true")
	}
	w.WriteHeader(resp.Status)
	w.Write(resp.Body)
}

func (m *middleware) problem(w http.ResponseWriter, r *http.Request, p Problem) {
	m.cfg.ErrorHandler(w, r, &p)
}
