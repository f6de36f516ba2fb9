package idemhttp

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"
)

// Defaults for Transport's zero fields.
const (
	transportDefaultMaxAttempts   = 5
	transportDefaultMaxElapsed    = 30 * time.Second
	transportDefaultMinBackoff    = 100 * time.Millisecond
	transportDefaultMaxBackoff    = 5 * time.Second
	transportDefaultMaxBodyBuffer = 1 << 20

	// transportMaxDrain bounds how much of a response that is about to be
	// retried is read so that its connection can be reused.
	transportMaxDrain = 64 << 10
)

// transportDefaultMethods are the methods a Transport covers by default.
var transportDefaultMethods = []string{http.MethodPost, http.MethodPatch}

// CheckRetry decides, after each attempt, whether the Transport tries again.
// ctx is the request's context; resp and err are what the attempt returned
// (exactly one is non-nil). A non-nil error stops the round trip: the
// Transport closes resp and returns that error instead.
type CheckRetry func(ctx context.Context, resp *http.Response, err error) (bool, error)

// Backoff returns how long to wait before the next attempt. attempt is the
// 0-based number of the attempt that just failed and resp its response (nil
// after a network error). The Transport passes its MinBackoff and MaxBackoff.
type Backoff func(minWait, maxWait time.Duration, attempt int, resp *http.Response) time.Duration

// Transport is an http.RoundTripper that gives each request of a covered
// method (POST and PATCH by default) an Idempotency-Key header and retries it
// on transient failures, sending the same key and the same body on every
// attempt, so that a server which deduplicates on the key runs the operation
// at most once however many attempts reach it.
//
// The zero value is ready to use; each field's zero value means its default.
// A Transport is safe for concurrent use; do not change its fields while it
// is in use.
//
// Requests of other methods go to Base unchanged: no key, no retry.
//
// The caller's request is never modified: the Transport sends a clone that
// carries the key. The response's Request field is that clone, so the key
// used can be read back with KeyFromResponse. A request that already has an
// Idempotency-Key keeps it as is. A request the http.Client makes to follow a
// 307 or 308 redirect reuses the key of the request that was redirected.
//
// Retries: after each attempt CheckRetry decides whether to try again (by
// default on network errors and on 409, 429, 502, 503 and 504). Before a
// retry the previous response body is drained (up to 64 KiB) and closed, and
// the Transport waits Backoff; cancelling the request's context during the
// wait ends the round trip at once with the context's error. The Transport
// stops after MaxAttempts attempts, or when the next wait would end after the
// MaxElapsed budget (or after the context's deadline, if sooner); it then
// returns the last response, unread, or, if the last attempt failed without a
// response, its error wrapped as "idemhttp: giving up after N attempts: ...".
//
// Bodies: a request with GetBody (as made by http.NewRequest from a
// *bytes.Buffer, *bytes.Reader or *strings.Reader) is replayed through
// GetBody. Any other body is read into memory, up to MaxBodyBuffer bytes, so
// it can be resent. A larger body is streamed and sent once, with its key but
// without retries: whatever that single attempt returns is returned.
type Transport struct {
	// Base sends each attempt. Default: http.DefaultTransport.
	Base http.RoundTripper

	// Methods are the methods that get a key and are retried, compared
	// case-sensitively as HTTP does. Default: POST and PATCH.
	Methods []string

	// NewKey returns the key of a request that has none. It must not
	// modify the request and must return a non-empty key. It is not called
	// when the request already has an Idempotency-Key header.
	// Default: a random UUIDv4.
	NewKey func(*http.Request) string

	// MaxAttempts bounds the attempts, the first one included; 1 disables
	// retries. Default: 5.
	MaxAttempts int

	// MaxElapsed bounds the whole round trip, waits included: no wait is
	// started that would end after it. It does not interrupt an attempt in
	// progress; use the request's context or http.Client.Timeout for that.
	// Default: 30s.
	MaxElapsed time.Duration

	// MinBackoff and MaxBackoff are passed to Backoff.
	// Defaults: 100ms and 5s.
	MinBackoff time.Duration
	MaxBackoff time.Duration

	// AttemptTimeout, when positive, bounds each attempt until its
	// response headers arrive, as urllib3's read timeout does: a slower
	// attempt is abandoned and, by DefaultCheckRetry, retried with the
	// same key. Against an idemhttp server the abandoned attempt's work
	// runs on to its end; the retry gets 409 (or waits, with Config.Wait)
	// while it runs and then its stored response. Reading the body is not
	// bounded by it; use the request's context for that. Default 0: no
	// bound but the request's context and Base's own timeouts.
	AttemptTimeout time.Duration

	// MaxBodyBuffer is how many bytes of a body without GetBody are kept
	// in memory so it can be resent. A larger body is sent once without
	// retries; a negative value never buffers. Default: 1 MiB.
	MaxBodyBuffer int64

	// CheckRetry decides whether an attempt is retried.
	// Default: DefaultCheckRetry.
	CheckRetry CheckRetry

	// Backoff decides how long to wait before a retry.
	// Default: DefaultBackoff.
	Backoff Backoff
}

// KeyFromResponse returns the Idempotency-Key of the request that produced
// resp, or "" if there is none. For a response from a Transport it is the key
// that was sent, generated or the caller's; it is handy for logs.
func KeyFromResponse(resp *http.Response) string {
	if resp == nil || resp.Request == nil {
		return ""
	}
	return resp.Request.Header.Get(HeaderKey)
}

// RoundTrip implements http.RoundTripper.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	base := t.Base
	if base == nil {
		base = http.DefaultTransport
	}
	if !t.covers(req.Method) {
		return base.RoundTrip(req)
	}

	key, err := t.key(req)
	if err != nil {
		transportCloseRequestBody(req)
		return nil, err
	}
	ctx := req.Context()
	out := req.Clone(ctx)
	if out.Header == nil {
		out.Header = make(http.Header)
	}
	out.Header.Set(HeaderKey, key)

	nextBody, replayable, err := t.prepareBody(req, out)
	if err != nil {
		return nil, err
	}
	if !replayable {
		return base.RoundTrip(out)
	}

	maxAttempts := positiveOr(t.MaxAttempts, transportDefaultMaxAttempts)
	maxElapsed := positiveOr(t.MaxElapsed, transportDefaultMaxElapsed)
	minBackoff := positiveOr(t.MinBackoff, transportDefaultMinBackoff)
	maxBackoff := positiveOr(t.MaxBackoff, transportDefaultMaxBackoff)
	checkRetry, backoff := t.CheckRetry, t.Backoff
	if checkRetry == nil {
		checkRetry = DefaultCheckRetry
	}
	if backoff == nil {
		backoff = DefaultBackoff
	}

	budgetEnd := time.Now().Add(maxElapsed)
	if d, ok := ctx.Deadline(); ok && d.Before(budgetEnd) {
		budgetEnd = d
	}

	for attempt := 1; ; attempt++ {
		areq := out
		if attempt > 1 {
			// A fresh shallow copy per attempt: the previous one may
			// still be referenced by Base (e.g. a body writer that
			// has not finished), so it is never mutated.
			areq = out.WithContext(ctx)
			if areq.Body, err = nextBody(); err != nil {
				return nil, fmt.Errorf("idemhttp: rewinding request body: %w", err)
			}
		}
		resp, err := t.send(base, areq)
		if err != nil && resp != nil {
			// Not allowed by the RoundTripper contract; keep the error.
			resp.Body.Close()
			resp = nil
		}

		retry, checkErr := checkRetry(ctx, resp, err)
		if checkErr != nil {
			if resp != nil {
				transportDrain(resp)
			}
			return nil, checkErr
		}
		if !retry {
			return resp, err
		}
		if attempt >= maxAttempts {
			return transportGiveUp(attempt, resp, err)
		}
		wait := max(backoff(minBackoff, maxBackoff, attempt-1, resp), 0)
		if wait > time.Until(budgetEnd) {
			return transportGiveUp(attempt, resp, err)
		}
		if resp != nil {
			transportDrain(resp)
		}
		timer := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			timer.Stop()
			return nil, ctx.Err()
		case <-timer.C:
		}
	}
}

// errAttemptTimeout is the cause of an attempt's cancellation after
// AttemptTimeout.
var errAttemptTimeout = errors.New("idemhttp: attempt timed out")

// send makes one attempt through base, bounded by AttemptTimeout until the
// response headers arrive.
func (t *Transport) send(base http.RoundTripper, req *http.Request) (*http.Response, error) {
	if t.AttemptTimeout <= 0 {
		return base.RoundTrip(req)
	}
	ctx, cancel := context.WithCancelCause(req.Context())
	timer := time.AfterFunc(t.AttemptTimeout, func() { cancel(errAttemptTimeout) })
	resp, err := base.RoundTrip(req.WithContext(ctx))
	fired := !timer.Stop()
	if fired { // whatever came back is cut off
		if resp != nil {
			resp.Body.Close()
			resp = nil
		}
		if err == nil {
			// The timer's func may not have cancelled ctx yet.
			err = errAttemptTimeout
		}
	}
	if err != nil {
		if fired || errors.Is(context.Cause(ctx), errAttemptTimeout) {
			err = fmt.Errorf("%w after %v: %w", errAttemptTimeout, t.AttemptTimeout, err)
		}
		cancel(nil)
		return resp, err
	}
	resp.Body = &cancelOnClose{ReadCloser: resp.Body, cancel: cancel}
	return resp, nil
}

// cancelOnClose ends an attempt's context once its body is closed.
type cancelOnClose struct {
	io.ReadCloser
	cancel context.CancelCauseFunc
}

func (b *cancelOnClose) Close() error {
	err := b.ReadCloser.Close()
	b.cancel(nil)
	return err
}

// positiveOr returns v, or def when v is not positive.
func positiveOr[T int | time.Duration](v, def T) T {
	if v <= 0 {
		return def
	}
	return v
}

// CloseIdleConnections closes the idle connections of Base, if it has such a
// method, as http.Client.CloseIdleConnections expects.
func (t *Transport) CloseIdleConnections() {
	type closeIdler interface{ CloseIdleConnections() }
	base := t.Base
	if base == nil {
		base = http.DefaultTransport
	}
	if c, ok := base.(closeIdler); ok {
		c.CloseIdleConnections()
	}
}

// covers reports whether requests of method get a key and retries.
func (t *Transport) covers(method string) bool {
	if method == "" {
		method = http.MethodGet
	}
	methods := t.Methods
	if methods == nil {
		methods = transportDefaultMethods
	}
	return slices.Contains(methods, method)
}

// key returns the key to send with req.
func (t *Transport) key(req *http.Request) (string, error) {
	if k := req.Header.Get(HeaderKey); k != "" {
		return k, nil
	}
	// The http.Client follows a 307/308 redirect with a new request built
	// from the caller's: keep the key the redirected request carried.
	if prev := req.Response; prev != nil && prev.Request != nil {
		if k := prev.Request.Header.Get(HeaderKey); k != "" {
			return k, nil
		}
	}
	if t.NewKey != nil {
		k := t.NewKey(req)
		if k == "" {
			return "", errors.New("idemhttp: NewKey returned an empty key")
		}
		return k, nil
	}
	id, err := uuid.NewRandom()
	if err != nil {
		return "", fmt.Errorf("idemhttp: generating key: %w", err)
	}
	return id.String(), nil
}

// prepareBody sets out's body for the first attempt and returns how to get
// the body of each later attempt. replayable is false when the body cannot
// be resent; out then carries the whole body, to be sent once.
func (t *Transport) prepareBody(req, out *http.Request) (nextBody func() (io.ReadCloser, error), replayable bool, err error) {
	switch {
	case req.Body == nil || req.Body == http.NoBody:
		body := req.Body
		return func() (io.ReadCloser, error) { return body, nil }, true, nil
	case req.GetBody != nil:
		return req.GetBody, true, nil
	}

	limit := t.MaxBodyBuffer
	if limit == 0 {
		limit = transportDefaultMaxBodyBuffer
	}
	if limit < 0 || req.ContentLength > limit {
		return nil, false, nil
	}
	buf, err := io.ReadAll(io.LimitReader(req.Body, limit+1))
	if err != nil {
		req.Body.Close()
		return nil, false, fmt.Errorf("idemhttp: reading request body: %w", err)
	}
	if int64(len(buf)) > limit {
		// Too large to keep: send what was read followed by the rest,
		// once. The original body is closed by Base, as usual.
		out.Body = transportPrefixedBody{io.MultiReader(bytes.NewReader(buf), req.Body), req.Body}
		return nil, false, nil
	}
	req.Body.Close()
	getBody := func() (io.ReadCloser, error) {
		if len(buf) == 0 {
			return http.NoBody, nil
		}
		return io.NopCloser(bytes.NewReader(buf)), nil
	}
	out.Body, _ = getBody()
	out.GetBody = getBody // lets Base replay it too, e.g. net/http on a stale connection
	if out.ContentLength <= 0 {
		out.ContentLength = int64(len(buf))
	}
	return getBody, true, nil
}

// transportPrefixedBody is a request body whose first bytes were already
// read: it reads them again, then the rest, and closes the original.
type transportPrefixedBody struct {
	io.Reader
	io.Closer
}

// transportCloseRequestBody closes req's body, which a RoundTripper must do
// even when it fails before sending.
func transportCloseRequestBody(req *http.Request) {
	if req.Body != nil {
		req.Body.Close()
	}
}

// transportDrain reads a bounded part of resp's body, so that its
// connection can be reused, and closes it.
func transportDrain(resp *http.Response) {
	io.CopyN(io.Discard, resp.Body, transportMaxDrain)
	resp.Body.Close()
}

// transportGiveUp returns the result of the last attempt when the Transport
// stops retrying: its response, or its error with the attempt count.
func transportGiveUp(attempts int, resp *http.Response, err error) (*http.Response, error) {
	if resp != nil {
		return resp, nil
	}
	noun := "attempts"
	if attempts == 1 {
		noun = "attempt"
	}
	return nil, fmt.Errorf("idemhttp: giving up after %d %s: %w", attempts, noun, err)
}

// DefaultCheckRetry is the default CheckRetry. It retries:
//
//   - errors from Base (connection refused or reset, EOF, timeouts, ...),
//     except those a retry cannot cure: an invalid URL, method or header, an
//     unsupported protocol scheme, a TLS certificate that does not verify;
//   - responses 409 Conflict (an idemhttp server answers it while the same
//     key is in flight), 429 Too Many Requests, 502 Bad Gateway, 503 Service
//     Unavailable and 504 Gateway Timeout.
//
// Nothing else is retried: other statuses, 500 included, are returned as
// they are. When ctx is done it returns ctx's error, which stops the round
// trip.
func DefaultCheckRetry(ctx context.Context, resp *http.Response, err error) (bool, error) {
	if ctxErr := ctx.Err(); ctxErr != nil {
		return false, ctxErr
	}
	if err != nil {
		return !transportPermanentError(err), nil
	}
	if resp == nil {
		return false, nil
	}
	switch resp.StatusCode {
	case http.StatusConflict, http.StatusTooManyRequests,
		http.StatusBadGateway, http.StatusServiceUnavailable, http.StatusGatewayTimeout:
		return true, nil
	}
	return false, nil
}

// transportPermanentTexts are the messages of net/http's errors about the
// request itself. net/http gives them no type, so their text is all there is
// to recognise them by.
var transportPermanentTexts = []string{
	"unsupported protocol scheme",
	"net/http: invalid header",
	"net/http: invalid trailer",
	"net/http: invalid method",
	"http: nil Request.URL",
	"http: no Host in request URL",
	"http: server gave HTTP response to HTTPS client",
}

// transportPermanentError reports whether err, returned by a RoundTripper,
// would be returned again by any retry.
func transportPermanentError(err error) bool {
	var (
		verifyErr    *tls.CertificateVerificationError
		authorityErr x509.UnknownAuthorityError
		hostnameErr  x509.HostnameError
		invalidErr   x509.CertificateInvalidError
		hostErr      url.InvalidHostError
		escapeErr    url.EscapeError
	)
	if errors.As(err, &verifyErr) || errors.As(err, &authorityErr) ||
		errors.As(err, &hostnameErr) || errors.As(err, &invalidErr) ||
		errors.As(err, &hostErr) || errors.As(err, &escapeErr) {
		return true
	}
	msg := err.Error()
	for _, s := range transportPermanentTexts {
		if strings.Contains(msg, s) {
			return true
		}
	}
	return false
}

// DefaultBackoff is the default Backoff: exponential with full jitter, a
// duration drawn uniformly from [0, min(maxWait, minWait·2^attempt)), which
// is 0 when that bound is not positive.
//
// If resp carries Retry-After, as delta-seconds or an HTTP-date, the wait is
// at least that long, even beyond maxWait: the server said when to come back.
// The Transport does not wait past its MaxElapsed budget; when Retry-After
// asks for longer it stops and returns that response.
func DefaultBackoff(minWait, maxWait time.Duration, attempt int, resp *http.Response) time.Duration {
	wait := transportJitter(minWait, maxWait, attempt)
	if after, ok := transportRetryAfter(resp, time.Now()); ok && after > wait {
		wait = after
	}
	return wait
}

// transportJitter draws uniformly from [0, min(maxWait, minWait·2^attempt)).
func transportJitter(minWait, maxWait time.Duration, attempt int) time.Duration {
	if minWait <= 0 || maxWait <= 0 {
		return 0
	}
	ceiling := maxWait
	if attempt < 0 {
		attempt = 0
	}
	if attempt < 63 {
		exp := minWait << attempt
		if exp>>attempt == minWait && exp > 0 && exp < ceiling { // no overflow
			ceiling = exp
		}
	}
	return time.Duration(rand.Int64N(int64(ceiling)))
}

// transportRetryAfter parses resp's Retry-After header (RFC 9110 §10.2.3):
// delta-seconds or an HTTP-date, relative to now. A date in the past means 0.
func transportRetryAfter(resp *http.Response, now time.Time) (time.Duration, bool) {
	if resp == nil {
		return 0, false
	}
	v := strings.TrimSpace(resp.Header.Get("Retry-After"))
	if v == "" {
		return 0, false
	}
	if secs, err := strconv.ParseUint(v, 10, 64); err == nil || errors.Is(err, strconv.ErrRange) {
		if err != nil || secs > math.MaxInt64/uint64(time.Second) {
			return time.Duration(math.MaxInt64), true
		}
		return time.Duration(secs) * time.Second, true
	}
	date, err := http.ParseTime(v)
	if err != nil {
		return 0, false
	}
	return max(date.Sub(now), 0), true
}
