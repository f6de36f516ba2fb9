package idemlambda

import (
	"cmp"
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
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/engine"
	"github.com/idemkit/idem/internal/telemetry"
)

// Defaults for Config's zero fields.
const (
	// DefaultWait is how long an invocation whose key is in flight waits
	// for the holder's result (Config.Wait): idemhttp's and idemgrpc's
	// DefaultWait.
	DefaultWait = engine.DefaultWait
)

// Config tunes Wrap. Key is required; the zero value of every other field
// means its default.
type Config[E any] struct {
	// Key returns the event's idempotency key: 1 to 255 printable ASCII
	// bytes (idem.ValidateKey). Required. APIGatewayKey, APIGatewayV2Key
	// and PayloadKey are ready-made. An error that wraps
	// idem.ErrMissingKey, or an empty key, says the event has no key: the
	// invocation fails with a *KeyError, and the handler does not run,
	// unless AllowMissingKey is set. Any other error, and a key that is
	// not valid, fail the invocation with a *KeyError too.
	Key func(E) (string, error)

	// AllowMissingKey runs the handler unprotected (no record, no lease)
	// for an event that has no key (Key returns "" or an error wrapping
	// idem.ErrMissingKey). Default false: such an event fails with a
	// *KeyError.
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

	// Namespace scopes the keys: two wrapped handlers with the same
	// Namespace share records. Keys are idem.Scope{Tenant: Tenant, Method:
	// "lambda", Route: Namespace}; for an API Gateway event, the method is
	// "lambda " and the request's method, and the route Namespace, a space
	// and the route API Gateway matched (the resource "/orders/{id}" of a
	// REST API, the route key's path of an HTTP API, else the path).
	// Default: the function's name (lambdacontext.FunctionName, from
	// AWS_LAMBDA_FUNCTION_NAME).
	Namespace string

	// Lease is the longest an invocation holds its key without renewing
	// it (see the package documentation for a lease bounded by the
	// invocation's deadline). Default 30s (idem.Config.Lease); at least
	// 10ms.
	Lease time.Duration

	// DeadlineMargin is how long past the invocation's deadline a lease
	// bounded by the deadline lasts (see the package documentation).
	// Default DefaultDeadlineMargin; negative is an error.
	DeadlineMargin time.Duration

	// Retention is how long a stored result is kept and replayed. Default
	// 24h (idem.Config.Retention).
	Retention time.Duration

	// MaxResponseSize is the largest JSON encoding of a result that is
	// stored, in bytes: a larger result is returned to its invocation,
	// and a repeat gets ErrResultOmitted (the handler does not run
	// again). Default 1 MiB (idem.Config.MaxResponseSize).
	MaxResponseSize int

	// CompleteRetry is how long storing a result is tried again when the
	// store fails after the handler ran, before the key is released: the
	// handler's effect is applied, and a released key would run it again
	// on Lambda's or the client's retry. The tries stop before the lease
	// may end (see idem.Config.CompleteRetry). Default: Lease, which means
	// as long as the lease allows. Negative: no retry.
	CompleteRetry time.Duration

	// Wait bounds how long an invocation whose key is in flight elsewhere
	// polls (5ms to 250ms apart, and never past its own deadline) for that
	// invocation to finish, replaying its result if it completes and
	// running the handler if it releases the key. Work that outlasts the
	// wait still fails with an *idem.InFlightError. Default DefaultWait
	// (idemhttp's and idemgrpc's); negative: an *idem.InFlightError at
	// once, without waiting.
	Wait time.Duration

	// OnRenew, when set, is called after each background lease renewal
	// (see idem.Config.OnRenew). It must not block.
	OnRenew func(key idem.Key, err error)

	// Seal, when set, seals the results stored at rest, and SealOpenOnly
	// stores new ones in clear while sealed ones still open: see
	// idem.Config's fields of the same names, and the package
	// documentation for a repeat whose sealed result does not open.
	Seal         idem.Sealer
	SealOpenOnly bool

	// TracerProvider and MeterProvider, when set, report through
	// OpenTelemetry what idem.Config says of them, plus each invocation's
	// outcome in the counter idem.outcomes (layer "lambda") and as the
	// attribute idem.outcome of the caller's span, and the keyed requests
	// nothing identifies in idem.anonymous. Default nil: none of it, at no
	// cost.
	TracerProvider trace.TracerProvider
	MeterProvider  metric.MeterProvider

	// OnOutcome, when set, is called once for every invocation with what
	// the wrapper did with it (for metrics); for an invocation that ran
	// the handler, once the handler has returned: OutcomeReleased after
	// the key was released, OutcomeExecuted just before the result is
	// stored (so that a repeat replaying it finds the execution counted).
	// It must not block.
	OnOutcome func(ctx context.Context, o Outcome)

	// Logger receives a line when a result could not be stored (the
	// handler ran; a retry may run it again), the first anonymous keyed
	// request of each route and the results sealed that do not open.
	// Default slog.Default().
	Logger *slog.Logger
}

// KeyError is the error of an invocation whose idempotency key could not
// be taken from the event: missing (it wraps idem.ErrMissingKey: Config.Key
// said so or returned ""), invalid (idem.ErrInvalidKey), or Config.Key
// failed. Its message says where the key was expected. The handler did
// not run. Lambda reports its errorType as "KeyError".
type KeyError struct{ Err error }

func (e *KeyError) Error() string {
	if ke, ok := errors.AsType[*engine.KeyError](e.Err); ok {
		return "idemlambda: " + ke.Text()
	}
	return "idemlambda: Config.Key: " + e.Err.Error()
}

func (e *KeyError) Unwrap() error { return e.Err }

// keyError returns the error of a key that is missing or invalid for why
// (where the key was expected and what is wrong), wrapping err.
func keyError(why string, err error) error {
	return &engine.KeyError{Pkg: "idemlambda", Why: why, Err: err}
}

// clientKey returns the key of e: Config.Key's, an empty one missing.
func clientKey[E any](key func(E) (string, error), e E) (string, error) {
	ck, err := key(e)
	switch {
	case err != nil:
		return "", err
	case ck == "":
		return "", keyError("Config.Key returned an empty key: the event has none", idem.ErrMissingKey)
	}
	if err := idem.ValidateKey(ck); err != nil {
		return "", keyError("Config.Key's key must be 1 to 255 printable ASCII bytes", err)
	}
	return ck, nil
}

// MismatchError is the error of an invocation whose key was used before
// with another payload (Config.Payload). It matches idem.ErrMismatch. The
// handler did not run. Lambda reports its errorType as "MismatchError".
type MismatchError struct{}

func (*MismatchError) Error() string { return idem.ErrMismatch.Error() }

// Is makes errors.Is(err, idem.ErrMismatch) true.
func (*MismatchError) Is(target error) bool { return target == idem.ErrMismatch }

// ErrResultOmitted is returned to a repeat of an invocation whose result
// was not stored because its JSON encoding was larger than
// Config.MaxResponseSize: the handler ran and will not run again for the
// key within the retention, but its result cannot be replayed.
var ErrResultOmitted = errors.New("idemlambda: the stored result was larger than Config.MaxResponseSize and was not kept")

// guardConfig is the idem.Config of the flat fields Config and SQSConfig
// share, CompleteRetry's zero value the lease.
func guardConfig(lease, retention time.Duration, maxResponse int, completeRetry time.Duration, onRenew func(idem.Key, error),
	seal idem.Sealer, sealOpenOnly bool, tp trace.TracerProvider, mp metric.MeterProvider) idem.Config {
	if completeRetry == 0 {
		// The work ran, and a retry of the invocation would run it again:
		// try a failed completion again as long as the lease allows.
		completeRetry = cmp.Or(lease, idem.DefaultLease)
	}
	return idem.Config{Lease: lease, Retention: retention, MaxResponseSize: maxResponse, CompleteRetry: max(completeRetry, 0),
		OnRenew: onRenew, Seal: seal, SealOpenOnly: sealOpenOnly, TracerProvider: tp, MeterProvider: mp}
}

// Wrap returns h made idempotent: the first invocation with a key runs h
// under a lease and stores its result, encoded as JSON (an HTTP
// response without its Set-Cookie and hop-by-hop headers); a repeat
// from the same caller within Config.Retention gets that result,
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
	gs, err := newGuards(store, guardConfig(cfg.Lease, cfg.Retention, cfg.MaxResponseSize, cfg.CompleteRetry, cfg.OnRenew,
		cfg.Seal, cfg.SealOpenOnly, cfg.TracerProvider, cfg.MeterProvider), cfg.DeadlineMargin)
	if err != nil {
		return nil, err
	}
	tel, err := telemetry.New(cfg.TracerProvider, cfg.MeterProvider)
	if err != nil {
		return nil, err
	}
	w := &wrapper[E, O]{
		cfg:   cfg,
		h:     h,
		gs:    gs,
		tel:   tel,
		wait:  engine.WaitOrDefault(cfg.Wait, DefaultWait),
		scope: idem.Scope{Method: "lambda", Route: cmp.Or(cfg.Namespace, lambdacontext.FunctionName)},
		log:   cmp.Or(cfg.Logger, slog.Default()),
	}
	return w.invoke, nil
}

type wrapper[E, O any] struct {
	cfg    Config[E]
	h      func(context.Context, E) (O, error)
	gs     *guards
	tel    *telemetry.T // nil without providers
	wait   time.Duration
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

// anonymous counts a keyed request whose caller nothing identifies, and
// logs the first of each route.
func (w *wrapper[E, O]) anonymous(ctx context.Context, scope idem.Scope) {
	w.tel.Anonymous(ctx, layer)
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

// report tells the telemetry and Config.OnOutcome what the invocation
// became.
func (w *wrapper[E, O]) report(ctx context.Context, o Outcome) {
	report(ctx, w.tel, w.cfg.OnOutcome, o)
}

func (w *wrapper[E, O]) invoke(ctx context.Context, e E) (O, error) {
	var zero O
	ck, err := clientKey(w.cfg.Key, e)
	if err != nil {
		if errors.Is(err, idem.ErrMissingKey) && w.cfg.AllowMissingKey {
			w.report(ctx, OutcomePassedThrough)
			return w.h(ctx, e)
		}
		w.report(ctx, OutcomeRejected)
		return zero, &KeyError{Err: err}
	}
	scope, req := w.scopeOf(ctx, e)
	key, err := scope.Key(ck)
	if err != nil {
		w.report(ctx, OutcomeRejected)
		return zero, &KeyError{Err: err}
	}
	if scope.Tenant == "" && (req != nil || w.cfg.Tenant != nil) {
		w.anonymous(ctx, scope)
		if w.cfg.RefuseAnonymous {
			w.report(ctx, OutcomeRejected)
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
		w.report(ctx, OutcomeRejected)
		return zero, err
	}
	att, acq, bounded, err := begin(ctx, w.gs, key, fp, w.wait)
	var se *idem.SealError
	if errors.As(err, &se) {
		logUnsealable(ctx, w.log, se, "")
		w.report(ctx, OutcomeUnsealable)
		if unreadable(&zero) {
			return zero, nil
		}
		return zero, se
	}
	if err != nil {
		w.report(ctx, OutcomeStoreError)
		return zero, err
	}
	switch acq.Outcome {
	case idem.Replay:
		out, err := decode[O](acq.Response)
		if err != nil && !errors.Is(err, ErrResultOmitted) {
			w.report(ctx, OutcomeStoreError)
		} else {
			w.report(ctx, OutcomeReplayed)
		}
		return out, err
	case idem.InFlight:
		w.report(ctx, OutcomeInFlight)
		return zero, &idem.InFlightError{RetryAfter: acq.RetryAfter}
	case idem.Mismatch:
		w.report(ctx, OutcomeMismatch)
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
			w.report(ctx, OutcomeReleased)
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
		w.report(ctx, OutcomeReleased)
		return out, herr
	}
	// Set-Cookie and the hop-by-hop headers go to this caller only.
	kept, typed := storable(out)
	body, err := json.Marshal(kept)
	if err != nil {
		att.Release(finish)
		w.report(ctx, OutcomeReleased)
		return out, fmt.Errorf("idemlambda: result %T does not encode as JSON: %w", out, err)
	}
	if !typed && req != nil {
		body = stripJSON(body)
	}
	w.report(ctx, OutcomeExecuted)
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
// is in flight for at most wait (0: not at all).
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
	return apiGatewayKey(h, "REST API")
}

// apiGatewayKey is idemhttp.ParseKey, its errors idemlambda's, naming the
// API Gateway request of kind where the key was expected.
func apiGatewayKey(h http.Header, kind string) (string, error) {
	k, err := idemhttp.ParseKey(h)
	if err == nil {
		return k, nil
	}
	if errors.Is(err, idem.ErrMissingKey) {
		return "", keyError("no "+idemhttp.HeaderKey+" header in the API Gateway "+kind+" request's headers", idem.ErrMissingKey)
	}
	if ke, ok := errors.AsType[*engine.KeyError](err); ok {
		return "", keyError("the API Gateway "+kind+" request's "+ke.Text(), ke.Err)
	}
	return "", keyError("the API Gateway "+kind+" request's "+idemhttp.HeaderKey+" header", err)
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
	return apiGatewayKey(h, "HTTP API")
}

// SQSMessageID returns the message id of an SQS message: the default key
// of WrapSQS. An empty id is an error wrapping idem.ErrMissingKey.
func SQSMessageID(m events.SQSMessage) (string, error) {
	if m.MessageId == "" {
		return "", keyError("the SQS message has no messageId", idem.ErrMissingKey)
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
			return "", keyError("PayloadKey: the selected part does not encode as JSON", err)
		}
		if string(b) == "null" {
			return "", keyError("PayloadKey: the selected part of the event is null", idem.ErrMissingKey)
		}
		sum := sha256.Sum256(b)
		return base64.RawURLEncoding.EncodeToString(sum[:]), nil
	}
}
