package idemlambda

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"time"

	"github.com/aws/aws-lambda-go/events"
	"github.com/aws/aws-lambda-go/lambdacontext"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/telemetry"
)

// Config tunes Wrap. Key is required; the zero value of every other field
// means its default.
type Config[E any] struct {
	// Key returns the event's idempotency key: 1 to 255 printable ASCII
	// bytes (idem.ValidateKey). Required. APIGatewayKey, APIGatewayV2Key
	// and PayloadKey are ready-made. An error that wraps
	// idem.ErrMissingKey says the event has no key: the invocation fails
	// with a *KeyError, and the handler does not run, unless
	// AllowMissingKey is set. Any other error fails the invocation with a
	// *KeyError too.
	Key func(E) (string, error)

	// AllowMissingKey runs the handler unprotected (no record, no lease)
	// for an event whose Key reports idem.ErrMissingKey. Default false:
	// such an event fails with a *KeyError.
	AllowMissingKey bool

	// Payload selects the part of the event that must be the same every
	// time a key is used: its JSON encoding (encoding/json) is hashed into
	// the record's fingerprint, and an event that reuses a key with
	// another payload fails with a *MismatchError (matching
	// idem.ErrMismatch) and does not run. Select the request, not what
	// changes on every delivery (API Gateway's requestContext holds a
	// request id and a time). Default nil: for an API Gateway event
	// (events.APIGatewayProxyRequest or events.APIGatewayV2HTTPRequest,
	// or a pointer to one) the request's method, path, query,
	// Content-Type and body, as idemhttp.DefaultFingerprint hashes them;
	// for other events no check, a reused key is replayed whatever the
	// event holds.
	Payload func(E) any

	// Tenant says who is calling; the keys of two tenants never share a
	// record (idem.Scope.Tenant). "" is a caller that nothing identifies:
	// all such callers share one scope, a WARN is logged once per route,
	// and RefuseAnonymous refuses them. Default: for an API Gateway
	// event, APIGatewayTenant or APIGatewayV2Tenant (the authorizer's
	// principal, else the Authorization and API-key headers, else the
	// client certificate); for other events "" (an invocation through the
	// Lambda API is authorised by IAM, and its event names no caller), and
	// those are not counted as anonymous unless Tenant is set.
	Tenant func(ctx context.Context, e E) string

	// RefuseAnonymous refuses a keyed request whose Tenant is "": the
	// handler does not run and nothing is stored. When O is an HTTP
	// response (events.APIGatewayProxyResponse,
	// events.APIGatewayV2HTTPResponse, events.ALBTargetGroupResponse,
	// events.LambdaFunctionURLResponse, or a pointer to one), the
	// invocation answers 401 application/problem+json of type
	// ProblemAnonymous; otherwise it fails with an *AnonymousError.
	// Requests without a key (AllowMissingKey) are not affected. Default
	// false: anonymous keyed requests run, sharing one scope.
	RefuseAnonymous bool

	// Name scopes the keys: two wrapped handlers with the same Name share
	// records. Keys are idem.Scope{Tenant: Tenant, Method: "lambda",
	// Route: Name}; for an API Gateway event, the method is "lambda " and
	// the request's method, and the route Name, a space and the route API
	// Gateway matched (the resource "/orders/{id}" of a REST API, the
	// route key's path of an HTTP API, else the path). Default: the
	// function's name (lambdacontext.FunctionName, from
	// AWS_LAMBDA_FUNCTION_NAME).
	Name string

	// DeadlineMargin is how long past the invocation's deadline a lease
	// bounded by the deadline lasts (see the package documentation).
	// Default DefaultDeadlineMargin; negative is an error.
	DeadlineMargin time.Duration

	// Wait, when positive, is how long an invocation whose key is in
	// flight elsewhere polls (5ms to 250ms apart, and never past its own
	// deadline) for that invocation to finish, replaying its result if it
	// completes and running the handler if it releases the key. Default
	// 0: it fails at once with an *idem.InFlightError.
	Wait time.Duration

	// Guard configures the records: Lease, Retention, MaxResponseSize,
	// CompleteRetry, OnRenew and the OpenTelemetry providers (see
	// idem.Config). The lease is the longest an invocation holds its key
	// without renewal; CompleteRetry defaults to the lease here, not to 0.
	Guard idem.Config

	// Logger receives a line when a result could not be stored (the
	// handler ran; a retry may run it again). Default slog.Default().
	Logger *slog.Logger
}

// KeyError is the error of an invocation whose idempotency key could not
// be taken from the event: missing (it wraps idem.ErrMissingKey), invalid
// (idem.ErrInvalidKey), or Config.Key failed. The handler did not run.
// Lambda reports its errorType as "KeyError".
type KeyError struct{ Err error }

func (e *KeyError) Error() string { return "idemlambda: idempotency key: " + e.Err.Error() }

func (e *KeyError) Unwrap() error { return e.Err }

// MismatchError is the error of an invocation whose key was used before
// with another payload (Config.Payload). It matches idem.ErrMismatch. The
// handler did not run. Lambda reports its errorType as "MismatchError".
type MismatchError struct{}

func (*MismatchError) Error() string { return idem.ErrMismatch.Error() }

// Is makes errors.Is(err, idem.ErrMismatch) true.
func (*MismatchError) Is(target error) bool { return target == idem.ErrMismatch }

// ErrResultOmitted is returned to a repeat of an invocation whose result
// was not stored because its JSON encoding was larger than the guard's
// MaxResponseSize: the handler ran and will not run again for the key
// within the retention, but its result cannot be replayed.
var ErrResultOmitted = errors.New("idemlambda: the stored result was larger than Config.Guard.MaxResponseSize and was not kept")

// Wrap returns h made idempotent: the first invocation with a key runs h
// under a lease and stores its result, encoded as JSON (an HTTP
// response without its Set-Cookie and hop-by-hop headers); a repeat
// from the same caller within the guard's retention gets that result,
// decoded from the stored bytes, without running h. What happens while the key is in flight, when h
// fails and when the store fails is in the package documentation.
//
// h's context carries the lease and its fencing token (FencingToken,
// idem.LeaseFromContext) and is cancelled if the lease is lost.
func Wrap[E, O any](store idem.Store, cfg Config[E], h func(context.Context, E) (O, error)) (func(context.Context, E) (O, error), error) {
	if cfg.Key == nil {
		return nil, errors.New("idemlambda: Wrap: Config.Key is nil; use APIGatewayKey, APIGatewayV2Key, PayloadKey or a function of your own")
	}
	if h == nil {
		return nil, errors.New("idemlambda: Wrap: nil handler")
	}
	if cfg.Wait < 0 {
		return nil, fmt.Errorf("idemlambda: Config.Wait %v is negative", cfg.Wait)
	}
	gs, err := newGuards(store, cfg.Guard, cfg.DeadlineMargin)
	if err != nil {
		return nil, err
	}
	name := cfg.Name
	if name == "" {
		name = lambdacontext.FunctionName
	}
	w := &wrapper[E, O]{
		cfg:   cfg,
		h:     h,
		gs:    gs,
		scope: idem.Scope{Method: "lambda", Route: name},
		log:   cfg.Logger,
	}
	if w.log == nil {
		w.log = slog.Default()
	}
	return w.invoke, nil
}

type wrapper[E, O any] struct {
	cfg    Config[E]
	h      func(context.Context, E) (O, error)
	gs     *guards
	scope  idem.Scope
	log    *slog.Logger
	warned telemetry.Once // method and route of the anonymous WARNs logged
}

// scopeOf returns the scope of e and its HTTP request, if it is one.
func (w *wrapper[E, O]) scopeOf(ctx context.Context, e E) (idem.Scope, *httpRequest) {
	scope := w.scope
	req, isHTTP := httpRequestOf(any(e))
	if isHTTP {
		scope.Method = "lambda " + req.method
		scope.Route = w.scope.Route + " " + req.route
	}
	switch {
	case w.cfg.Tenant != nil:
		scope.Tenant = w.cfg.Tenant(ctx, e)
	case isHTTP:
		scope.Tenant = req.tenant()
	}
	if !isHTTP {
		return scope, nil
	}
	return scope, &req
}

// anonymous logs the first keyed request of a route whose caller nothing
// identifies.
func (w *wrapper[E, O]) anonymous(ctx context.Context, scope idem.Scope) {
	if !w.warned.First(scope.Method + " " + scope.Route) {
		return
	}
	w.log.WarnContext(ctx, "idemlambda: a keyed request whose caller nothing identifies (no authorizer principal, no Authorization, no API key): "+
		"the anonymous callers of this route share its keys' records; put an authorizer in front, set Config.Tenant, or Config.RefuseAnonymous to refuse them (logged once per route)",
		"method", scope.Method, "route", scope.Route, "refused", w.cfg.RefuseAnonymous)
}

// jsonHeader is the header of every stored result: the record encoding
// keeps {Content-Type: application/json} in one bit.
var jsonHeader = http.Header{"Content-Type": {"application/json"}}

func (w *wrapper[E, O]) invoke(ctx context.Context, e E) (O, error) {
	var zero O
	ck, err := w.cfg.Key(e)
	if err != nil {
		if errors.Is(err, idem.ErrMissingKey) && w.cfg.AllowMissingKey {
			return w.h(ctx, e)
		}
		return zero, &KeyError{Err: err}
	}
	scope, req := w.scopeOf(ctx, e)
	key, err := scope.Key(ck)
	if err != nil {
		return zero, &KeyError{Err: err}
	}
	if scope.Tenant == "" && (req != nil || w.cfg.Tenant != nil) {
		w.anonymous(ctx, scope)
		if w.cfg.RefuseAnonymous {
			if refusal(&zero) {
				return zero, nil
			}
			return zero, &AnonymousError{}
		}
	}
	var fp idem.Fingerprint
	if w.cfg.Payload == nil && req != nil {
		fp = req.fingerprint()
	} else if fp, err = fingerprint(w.cfg.Payload, e); err != nil {
		return zero, err
	}
	att, acq, bounded, err := begin(ctx, w.gs, key, fp, w.cfg.Wait)
	var se *idem.SealError
	if errors.As(err, &se) {
		logUnsealable(ctx, w.log, se, "")
		if unreadable(&zero) {
			return zero, nil
		}
		return zero, se
	}
	if err != nil {
		return zero, err
	}
	switch acq.Outcome {
	case idem.Replay:
		return decode[O](acq.Response)
	case idem.InFlight:
		return zero, &idem.InFlightError{RetryAfter: acq.RetryAfter}
	case idem.Mismatch:
		return zero, &MismatchError{}
	}
	if bounded {
		att.StopRenewal()
	}
	// Finishing must not be cut short by the invocation's deadline: the
	// store's own timeouts and the lease bound it.
	finish := context.WithoutCancel(ctx)
	done := false
	defer func() {
		if !done { // h panicked: free the key, let the panic go on
			att.Release(finish)
		}
	}()
	out, herr := w.h(att.Context(), e)
	done = true
	if herr != nil {
		// Errors are not stored: the key is released so that a retry runs
		// the handler again.
		if rerr := att.Release(finish); rerr != nil {
			w.log.WarnContext(ctx, "idemlambda: release after a handler error failed; the key is free once the lease ends",
				"key", key.String(), "error", rerr)
		}
		return out, herr
	}
	// Set-Cookie and the hop-by-hop headers go to this caller only.
	kept, typed := storable(out)
	body, err := json.Marshal(kept)
	if err != nil {
		att.Release(finish)
		return out, fmt.Errorf("idemlambda: result %T does not encode as JSON: %w", out, err)
	}
	if !typed && req != nil {
		body = stripJSON(body)
	}
	if err := att.Complete(finish, &idem.Response{Status: http.StatusOK, Header: jsonHeader, Body: body}); err != nil {
		w.log.WarnContext(ctx, "idemlambda: the handler ran but its result was not stored; a retry may run it again",
			"key", key.String(), "error", err)
	}
	return out, nil
}

// logUnsealable logs, at ERROR, a completed record whose sealed result
// does not open: its key and key id (and the SQS record's messageId),
// never content.
func logUnsealable(ctx context.Context, log *slog.Logger, se *idem.SealError, messageID string) {
	attrs := []slog.Attr{slog.String("key", se.Key.String()), slog.String("key_id", se.KeyID), slog.Any("error", se.Err)}
	if messageID != "" {
		attrs = append([]slog.Attr{slog.String("messageId", messageID)}, attrs...)
	}
	log.LogAttrs(ctx, slog.LevelError, "idemlambda: the stored result is sealed and cannot be opened (altered, or under a key id not in the ring); "+
		"the handler ran once and is neither replayed nor run again", attrs...)
}

// waitMargin is how long before the invocation's deadline Config.Wait
// stops polling.
const waitMargin = 20 * time.Millisecond

// begin acquires key with the Guard that fits ctx, polling while the key
// is in flight for at most wait.
func begin(ctx context.Context, gs *guards, key idem.Key, fp idem.Fingerprint, wait time.Duration) (*idem.Attempt, idem.Acquisition, bool, error) {
	end := time.Now().Add(wait)
	delay := 5 * time.Millisecond
	for {
		g, bounded, err := gs.forCtx(ctx)
		if err != nil {
			return nil, idem.Acquisition{}, false, err
		}
		att, acq, err := g.Begin(ctx, key, fp)
		if err != nil || acq.Outcome != idem.InFlight {
			return att, acq, bounded, err
		}
		left := time.Until(end)
		if dl, ok := ctx.Deadline(); ok {
			// Stop a little before the deadline: an acquire sent at the
			// deadline fails with it, and the caller should hear that the
			// key is in flight, not that the store call timed out.
			left = min(left, time.Until(dl)-waitMargin)
		}
		if left <= 0 {
			return att, acq, bounded, nil
		}
		t := time.NewTimer(min(delay, left, max(acq.RetryAfter, time.Millisecond)))
		select {
		case <-ctx.Done():
			t.Stop()
			return att, acq, bounded, nil
		case <-t.C:
		}
		delay = min(delay*2, 250*time.Millisecond)
	}
}

// decode returns the stored result.
func decode[O any](resp *idem.Response) (O, error) {
	var out O
	if resp == nil || resp.BodyOmitted || resp.Blob != nil {
		return out, ErrResultOmitted
	}
	if err := json.Unmarshal(resp.Body, &out); err != nil {
		return out, fmt.Errorf("idemlambda: the stored result does not decode as %T (did the handler's result type change?): %w", out, err)
	}
	return out, nil
}

// fingerprint returns the fingerprint of payload(e), or the zero one.
func fingerprint[E any](payload func(E) any, e E) (idem.Fingerprint, error) {
	if payload == nil {
		return idem.Fingerprint{}, nil
	}
	b, err := json.Marshal(payload(e))
	if err != nil {
		return idem.Fingerprint{}, fmt.Errorf("idemlambda: Config.Payload's value does not encode as JSON: %w", err)
	}
	return idem.SumFingerprint(b, "idemlambda/payload/v1"), nil
}

// FencingToken returns the fencing token of the lease held by the
// invocation running with ctx (the Token of idem.LeaseFromContext). It
// strictly increases per key across holders: a system of record that
// keeps the largest token it accepted and refuses smaller ones refuses
// the writes of an invocation that outlived its lease.
func FencingToken(ctx context.Context) (uint64, bool) {
	l, ok := idem.LeaseFromContext(ctx)
	return l.Token, ok
}

// APIGatewayKey returns the Idempotency-Key header of an API Gateway REST
// API (or v1 payload) request, parsed as idemhttp.ParseKey does (a bare
// token or an RFC 8941 string). Header names are matched whatever their
// case; MultiValueHeaders is read when API Gateway sent it, Headers
// otherwise. No header: an error wrapping idem.ErrMissingKey; more than
// one: idem.ErrInvalidKey.
func APIGatewayKey(e events.APIGatewayProxyRequest) (string, error) {
	h := http.Header{}
	if len(e.MultiValueHeaders) > 0 {
		for name, vs := range e.MultiValueHeaders {
			for _, v := range vs {
				h.Add(name, v)
			}
		}
	} else {
		for name, v := range e.Headers {
			h.Add(name, v)
		}
	}
	return idemhttp.ParseKey(h)
}

// APIGatewayV2Key is APIGatewayKey for an HTTP API (payload 2.0) request.
// API Gateway joins repeated headers with commas there, so a key sent
// twice arrives as one value and is taken whole (a bare key may hold a
// comma), the same on every retry.
func APIGatewayV2Key(e events.APIGatewayV2HTTPRequest) (string, error) {
	h := http.Header{}
	for name, v := range e.Headers {
		h.Add(name, v)
	}
	return idemhttp.ParseKey(h)
}

// SQSMessageID returns the message id of an SQS message: the default key
// of WrapSQS. An empty id is an error wrapping idem.ErrMissingKey.
func SQSMessageID(m events.SQSMessage) (string, error) {
	if m.MessageId == "" {
		return "", fmt.Errorf("%w: the SQS message has no messageId", idem.ErrMissingKey)
	}
	return m.MessageId, nil
}

// PayloadKey returns a Key function that derives the key from a part of
// the event: the SHA-256 of part(e)'s JSON encoding, in base64url (43
// characters). It is for events that carry no key of their own, where
// equal content means the same operation (Powertools' default key is
// the whole event). A part that encodes as null is a missing key.
func PayloadKey[E any](part func(E) any) func(E) (string, error) {
	return func(e E) (string, error) {
		b, err := json.Marshal(part(e))
		if err != nil {
			return "", fmt.Errorf("idemlambda: PayloadKey: the selected part does not encode as JSON: %w", err)
		}
		if string(b) == "null" {
			return "", fmt.Errorf("%w: the selected part of the event is null", idem.ErrMissingKey)
		}
		sum := sha256.Sum256(b)
		return base64.RawURLEncoding.EncodeToString(sum[:]), nil
	}
}
