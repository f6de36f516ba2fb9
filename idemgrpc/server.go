package idemgrpc

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/protoadapt"
	"google.golang.org/protobuf/reflect/protoregistry"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/engine"
	"github.com/idemkit/idem/internal/ident"
	"github.com/idemkit/idem/internal/telemetry"
)

// DefaultMaxResponseSize is Config.MaxResponseSize's default: grpc-go's
// default limit on a message a client receives, so that every response a
// default client can receive is stored.
const DefaultMaxResponseSize = 4 << 20

// DefaultWait is how long a call whose key is in flight waits for the
// holder's outcome before it gets Aborted (Config.Wait): the same as
// idemhttp's, so that the middleware, the proxy and the interceptor treat
// a copy alike.
const DefaultWait = engine.DefaultWait

const (
	// maxInFlightDelay caps the RetryInfo delay of an in-flight answer:
	// the holder usually finishes long before its lease ends.
	maxInFlightDelay = time.Second
	// storeRetryDelay is the RetryInfo delay of a store failure.
	storeRetryDelay = time.Second
)

// Config tunes the server interceptor. The zero value means the defaults.
type Config struct {
	// Methods are the full method names ("/package.Service/Method") the
	// interceptor covers; other methods pass through untouched, key or
	// not. MethodFunc, when set, decides instead. Default: every unary
	// method. A covered call without a key passes through untouched too,
	// unless a key is required.
	Methods    []string
	MethodFunc func(fullMethod string) bool

	// RequireKey makes a key mandatory on covered methods: a call without
	// one gets InvalidArgument. RequireKeyFunc, when set, decides per call
	// instead (for example per method). Default false.
	RequireKey     bool
	RequireKeyFunc func(ctx context.Context, fullMethod string) bool

	// Key, when set, takes the key from the request message: it returns
	// the key and true, or false when the request carries none (an empty
	// AIP-155 request_id, say). A key it returns takes precedence over the
	// idempotency-key metadata, which is read only when it returns false.
	// The key must be 1 to 255 printable ASCII characters, as in metadata
	// (idem.ValidateKey), or the call gets InvalidArgument. Default nil: metadata only.
	Key func(ctx context.Context, fullMethod string, req any) (string, bool)

	// Tenant says whose call this is; keys of different tenants never
	// share a record. Default DefaultTenant: the authorization metadata in
	// normal form and the API-key metadata (x-api-key, api-key,
	// x-auth-token), each as a hash, else a hash of the peer's TLS client
	// certificate. Set it from the authenticated identity where
	// credentials rotate or are elsewhere, e.g. the account id your
	// authentication interceptor (which must run before this one) put in
	// the context.
	//
	// When it returns "", the keyed call is anonymous: such calls share
	// one scope (a caller who sends a key another such caller used gets
	// that caller's stored response). Each one is reported (OnAnonymous,
	// the counter idem.anonymous, a WARN once per method), and refused
	// with RefuseAnonymous.
	Tenant func(ctx context.Context) string

	// RefuseAnonymous refuses keyed calls that no tenant source
	// identifies (Tenant returned ""): Unauthenticated (reason
	// ReasonAnonymous), before the request is fingerprinted or anything
	// is stored; the handler does not run. Calls without a key pass as
	// ever. Default false: they are served, reported as anonymous.
	RefuseAnonymous bool

	// OnAnonymous, when set, is called for every keyed call of a covered
	// method that no tenant source identifies, refused or not (for
	// metrics). It must not block.
	OnAnonymous func(ctx context.Context, fullMethod string)

	// Fingerprint summarises the request; a repeat with the same key and
	// another fingerprint gets FailedPrecondition. An error makes the call
	// fail with Internal, the handler not run. Default DefaultFingerprint
	// (the method and the deterministic proto encoding of the request).
	Fingerprint func(fullMethod string, req any) (idem.Fingerprint, error)

	// Lease and Retention: see idem.Config (defaults 30s and 24h).
	Lease, Retention time.Duration

	// MaxResponseSize is the largest response stored, in bytes of its
	// encoding (the message, or the status with its details). A larger
	// one still goes to the client; the key is completed without it, and
	// a replay gets DataLoss (reason ReasonResponseOmitted) with the
	// header and trailer metadata. Default DefaultMaxResponseSize (4 MiB);
	// at most idem.MaxEncodedBody.
	MaxResponseSize int

	// Seal, when set, seals the responses stored at rest, and SealOpenOnly
	// stores new ones in clear while sealed ones still open: see
	// idem.Config's fields of the same names. A stored response that does
	// not open is never replayed nor run again: DataLoss with reason
	// ReasonUnsealable (and idempotent-replayed: true), outcome
	// OutcomeUnsealable, logged at ERROR with the key and the key id,
	// FailOpen or not.
	Seal         idem.Sealer
	SealOpenOnly bool

	// ShouldStore decides from the handler's final code whether its
	// outcome is stored (and replayed from then on) or the key is
	// released so the call can be run again. ctx is the handler's context
	// (grpc.Method(ctx) names the method). Default DefaultShouldStore.
	ShouldStore func(ctx context.Context, code codes.Code) bool

	// Wait bounds how long a call whose key is in flight (a copy of a call
	// still running) waits for the result before it gets Aborted. A copy
	// of a call this process is running (or asking the store about) does
	// not ask the store: it wakes as soon as this process finishes the
	// key, and is handed the outcome the holder stored; for a holder in
	// another process it asks the store again after growing pauses (5ms,
	// doubling, at most 250ms apart). If the holder releases the key
	// instead, the waiter acquires it and runs the handler. Work that
	// outlasts the wait still answers Aborted, with its retry delay; a
	// waiting call holds a goroutine meanwhile, and its own deadline
	// still applies. Default DefaultWait (idemhttp's); negative: Aborted
	// at once, without waiting (the default before DefaultWait).
	Wait time.Duration

	// MaxExecution, when positive, bounds how long the handler may run
	// under its lease: past it, the handler's context is cancelled with
	// cause idem.ErrMaxExecution. What the handler then returns is stored
	// or released as usual (a DeadlineExceeded or Canceled status releases
	// the key by default, and a retry runs the handler again). Default 0:
	// no limit but the lease's loss.
	MaxExecution time.Duration

	// StopContext, when set, is the server's hard stop: once it is done,
	// the context of every handler still running under a lease is
	// cancelled with cause idem.ErrStopped. Cancel it when GracefulStop has
	// waited long enough. Default nil: a handler's context is cancelled
	// only by the lease's loss and MaxExecution.
	StopContext context.Context

	// FailOpen runs the handler without idempotency when the store fails.
	// Default false: the call gets Unavailable and the handler does not
	// run.
	FailOpen bool

	// V1Scopes is how long after the interceptor is made a keyed call that
	// acquires its key also looks for a record under the key v1.0 derived
	// for it, when that differs (v1.0 read authorization as written, gave
	// several values no tenant, and did not read the API-key metadata), so
	// that a call stored before an upgrade is replayed after it, not run
	// again. A record v1.0 stored for a caller it could not identify (an
	// API-key caller included) answers, until it expires, any caller with
	// its key, as it did under v1.0; records stored since are scoped. Zero
	// means the Retention; negative turns the look-up off. It costs one
	// store read for each call that acquires its key while it lasts;
	// replays cost nothing more. A *memstore.Store is never looked up: it
	// holds only what this process stored.
	V1Scopes time.Duration

	// ReplayMetadataDenylist names header and trailer metadata keys never
	// stored nor replayed, besides idempotent-replayed and
	// idempotent-replay-body-omitted, which are always dropped. Keys are
	// compared in any case: a handler's metadata.MD{"Set-Cookie": ...}
	// is "set-cookie". A record stored before a key joined the list is
	// replayed without it.
	ReplayMetadataDenylist []string

	// Types resolves the stored response's message type on replay, by its
	// full name. Default protoregistry.GlobalTypes, where generated code
	// registers every message. A response whose type it cannot resolve is
	// not stored (the key is released and the error logged).
	Types protoregistry.MessageTypeResolver

	// Logger receives store failures, lost leases and responses that
	// could not be stored. Keys are logged as their digest, never raw.
	// Default slog.Default().
	Logger *slog.Logger

	// OnOutcome, when set, is called once for every call of a covered
	// method with what the interceptor did with it (for metrics); for a
	// call that ran the handler, once the handler has returned:
	// OutcomeReleased after the key was released, OutcomeExecuted just
	// before the outcome is stored. It must not block.
	OnOutcome func(ctx context.Context, fullMethod string, o Outcome)

	// OnRenew: see idem.Config.
	OnRenew func(key idem.Key, err error)

	// TracerProvider and MeterProvider, when set, report through
	// OpenTelemetry what idem.Config says of them, plus every call's
	// outcome in the counter idem.outcomes (layer "grpc") and as the
	// attribute idem.outcome of the call's span (the span of an outer
	// tracing interceptor, such as otelgrpc's stats handler), and the
	// events idem.replay and idem.wait on that span. Default nil: none of
	// it, at no cost.
	TracerProvider trace.TracerProvider
	MeterProvider  metric.MeterProvider
}

// DefaultShouldStore stores the outcomes that a retry of the same request
// would get again, and releases those that say "try again":
//
//	stored:   OK, InvalidArgument, NotFound, AlreadyExists, PermissionDenied,
//	          FailedPrecondition, OutOfRange
//	released: Canceled, Unknown, DeadlineExceeded, ResourceExhausted,
//	          Aborted, Unimplemented, Internal, Unavailable, DataLoss,
//	          Unauthenticated
//
// Unauthenticated is released because the client's remedy is to refresh
// its credentials and send the same call again; Unimplemented because it
// says the server, not the request, is lacking. Errors that are not gRPC
// statuses count as Unknown (as grpc-go sends them), and context errors as
// Canceled and DeadlineExceeded.
func DefaultShouldStore(_ context.Context, code codes.Code) bool {
	switch code {
	case codes.OK, codes.InvalidArgument, codes.NotFound, codes.AlreadyExists,
		codes.PermissionDenied, codes.FailedPrecondition, codes.OutOfRange:
		return true
	}
	return false
}

// DefaultFingerprint hashes the full method name and the deterministic
// proto encoding of req (proto.MarshalOptions{Deterministic: true}, so map
// fields in any order give one fingerprint). req must be a proto message.
func DefaultFingerprint(fullMethod string, req any) (idem.Fingerprint, error) {
	m := messageV2Of(req)
	if m == nil {
		return idem.Fingerprint{}, fmt.Errorf("idemgrpc: request of type %T is not a proto message; set Config.Fingerprint", req)
	}
	// The encoding is hashed and dropped: it goes in a buffer of the
	// pool's, given back once hashed (the bytes of Marshal, MarshalAppend
	// to an empty buffer).
	buf := fingerprintBuffers.Get().(*[]byte)
	defer putFingerprintBuffer(buf)
	b, err := deterministic.MarshalAppend((*buf)[:0], m)
	*buf = b
	if err != nil {
		return idem.Fingerprint{}, fmt.Errorf("idemgrpc: encoding the %T request: %w", req, err)
	}
	return idem.SumFingerprint(b, fullMethod), nil
}

// fingerprintBuffers are DefaultFingerprint's buffers. Its encoding of a
// request never leaves it (SumFingerprint reads it, then it is given
// back); those larger than maxPooledFingerprint are dropped.
var fingerprintBuffers = sync.Pool{New: func() any { return new([]byte) }}

const maxPooledFingerprint = 64 << 10

func putFingerprintBuffer(buf *[]byte) {
	if cap(*buf) > maxPooledFingerprint {
		return
	}
	*buf = (*buf)[:0]
	fingerprintBuffers.Put(buf)
}

// DefaultTenant scopes keys by the caller's credentials, as
// idemhttp.DefaultTenant does: the authorization metadata, in its normal
// form (the scheme's case and the whitespace around and inside it do not
// matter, RFC 9110 section 11.4; several values are read together), and
// the API-key metadata x-api-key, api-key and x-auth-token, each as a hash
// ("authz:...", "apikey:..."; a call with several has all of them, and is
// a caller of its own); else a hash of the TLS client certificate the
// peer presented ("cert:...", with credentials.NewTLS and ClientAuth at
// RequestClientCert or above: the handshake proves the client holds the
// certificate's key); else "", an anonymous caller (see Config.Tenant).
// A client that refreshes its token between two retries becomes a new
// tenant and runs the call again; prefer a stable account id where
// tokens rotate.
//
// A single authorization value in normal form ("Bearer tok") and no API
// key gives the tenant v1.0 gave it.
func DefaultTenant(ctx context.Context) string {
	if t := ident.Tenant(func(name string) []string {
		return metadata.ValueFromIncomingContext(ctx, metadataName(name))
	}); t != "" {
		return t
	}
	if p, ok := peer.FromContext(ctx); ok {
		if info, ok := p.AuthInfo.(credentials.TLSInfo); ok && len(info.State.PeerCertificates) > 0 {
			return ident.Cert(info.State.PeerCertificates[0].Raw)
		}
	}
	return ""
}

// credentialNames maps the canonical header names ident.Tenant reads to
// their metadata keys, which are lower case.
var credentialNames = func() map[string]string {
	m := map[string]string{"Authorization": "authorization"}
	for _, h := range ident.APIKeyHeaders {
		m[h] = strings.ToLower(h)
	}
	return m
}()

// metadataName is the metadata key of the header name ident.Tenant asks
// for.
func metadataName(name string) string {
	if k, ok := credentialNames[name]; ok {
		return k
	}
	return strings.ToLower(name)
}

// v1Tenant is DefaultTenant as v1.0 released it: the authorization value
// hashed as written, "" with more than one, API-key metadata ignored. The
// key of a record stored by v1.0 under DefaultTenant has this tenant.
func v1Tenant(ctx context.Context) string {
	vs := metadata.ValueFromIncomingContext(ctx, "authorization")
	if len(vs) == 1 {
		sum := sha256.Sum256([]byte(vs[0]))
		return "authz:" + base64.RawURLEncoding.EncodeToString(sum[:16])
	}
	if len(vs) > 1 {
		return ""
	}
	if p, ok := peer.FromContext(ctx); ok {
		if info, ok := p.AuthInfo.(credentials.TLSInfo); ok && len(info.State.PeerCertificates) > 0 {
			sum := sha256.Sum256(info.State.PeerCertificates[0].Raw)
			return "cert:" + base64.RawURLEncoding.EncodeToString(sum[:16])
		}
	}
	return ""
}

// messageV2Of returns v as a proto message, or nil.
func messageV2Of(v any) proto.Message {
	switch m := v.(type) {
	case proto.Message:
		return m
	case protoadapt.MessageV1:
		return protoadapt.MessageV2Of(m)
	}
	return nil
}

// Metadata never stored: the interceptor's own markers.
var alwaysDenied = []string{MetadataReplayed, MetadataBodyOmitted}

// UnaryServerInterceptor returns a grpc.UnaryServerInterceptor that makes
// covered unary calls idempotent with store. It panics if cfg is invalid
// or store is nil; NewUnaryServerInterceptor returns the error instead.
// Install it after the interceptors that authenticate (Config.Tenant needs
// their identity) and those whose metadata must not be stored (request
// ids, tracing).
func UnaryServerInterceptor(store idem.Store, cfg Config) grpc.UnaryServerInterceptor {
	i, err := NewUnaryServerInterceptor(store, cfg)
	if err != nil {
		panic(err)
	}
	return i
}

// NewUnaryServerInterceptor is UnaryServerInterceptor with the
// configuration error returned.
func NewUnaryServerInterceptor(store idem.Store, cfg Config) (grpc.UnaryServerInterceptor, error) {
	if cfg.MaxResponseSize < 0 {
		return nil, fmt.Errorf("idemgrpc: Config.MaxResponseSize %d is negative", cfg.MaxResponseSize)
	}
	if cfg.MaxResponseSize == 0 {
		cfg.MaxResponseSize = DefaultMaxResponseSize
	}
	eng, err := engine.New(store, engine.Config{Name: "idemgrpc", Lease: cfg.Lease, Retention: cfg.Retention,
		MaxResponseSize: cfg.MaxResponseSize, OnRenew: cfg.OnRenew, TracerProvider: cfg.TracerProvider, MeterProvider: cfg.MeterProvider,
		Wait: engine.WaitOrDefault(cfg.Wait, DefaultWait), MaxExecution: cfg.MaxExecution, StopContext: cfg.StopContext, FailOpen: cfg.FailOpen, Logger: cfg.Logger,
		V1Scopes: cfg.V1Scopes, Seal: cfg.Seal, SealOpenOnly: cfg.SealOpenOnly})
	if err != nil {
		return nil, err
	}
	s := &server{cfg: cfg, eng: eng, deny: map[string]bool{}}
	if len(cfg.Methods) > 0 {
		s.methods = map[string]bool{}
		for _, m := range cfg.Methods {
			if !validMethod(m) {
				return nil, fmt.Errorf("idemgrpc: Config.Methods: %q is not a full method name (\"/package.Service/Method\")", m)
			}
			s.methods[m] = true
		}
	}
	for _, k := range alwaysDenied {
		s.deny[k] = true
	}
	for _, k := range cfg.ReplayMetadataDenylist {
		s.deny[strings.ToLower(k)] = true
	}
	s.userTenant = s.cfg.Tenant
	if s.cfg.Tenant == nil {
		s.cfg.Tenant = DefaultTenant
	}
	if s.cfg.Fingerprint == nil {
		s.cfg.Fingerprint = DefaultFingerprint
	}
	if s.cfg.ShouldStore == nil {
		s.cfg.ShouldStore = DefaultShouldStore
	}
	if s.cfg.Types == nil {
		s.cfg.Types = protoregistry.GlobalTypes
	}
	if s.cfg.Logger == nil {
		s.cfg.Logger = slog.Default()
	}
	return s.intercept, nil
}

// validMethod reports whether m looks like "/package.Service/Method".
func validMethod(m string) bool {
	svc, meth, ok := strings.Cut(strings.TrimPrefix(m, "/"), "/")
	return strings.HasPrefix(m, "/") && ok && svc != "" && meth != "" && !strings.Contains(meth, "/")
}

type server struct {
	cfg     Config
	eng     *engine.Engine
	methods map[string]bool // nil: every method
	deny    map[string]bool // lower-case metadata keys
	// anonymous holds the methods whose anonymous keyed calls were
	// logged (once per method).
	anonymous telemetry.Once
	// userTenant is the Config.Tenant the user set (nil: DefaultTenant),
	// for the keys of v1.0 (Config.V1Scopes).
	userTenant func(context.Context) string
}

func (s *server) covers(method string) bool {
	switch {
	case s.cfg.MethodFunc != nil:
		return s.cfg.MethodFunc(method)
	case s.methods != nil:
		return s.methods[method]
	}
	return true
}

func (s *server) required(ctx context.Context, method string) bool {
	if s.cfg.RequireKeyFunc != nil {
		return s.cfg.RequireKeyFunc(ctx, method)
	}
	return s.cfg.RequireKey
}

func (s *server) clientKey(ctx context.Context, method string, req any) (string, error) {
	if s.cfg.Key != nil {
		if k, ok := s.cfg.Key(ctx, method, req); ok {
			return k, validate(k)
		}
	}
	return ParseKey(ctx)
}

func (s *server) intercept(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	method := info.FullMethod
	if !s.covers(method) {
		return handler(ctx, req)
	}
	clientKey, err := s.clientKey(ctx, method, req)
	switch {
	case errors.Is(err, idem.ErrMissingKey):
		if s.required(ctx, method) {
			s.outcome(ctx, method, OutcomeRejected)
			return nil, errorStatus(codes.InvalidArgument, ReasonKeyMissing,
				"idemgrpc: "+method+" requires an idempotency key: send one in the "+MetadataKey+" metadata", 0)
		}
		s.outcome(ctx, method, OutcomePassedThrough)
		return handler(ctx, req)
	case err != nil:
		s.outcome(ctx, method, OutcomeRejected)
		return nil, errorStatus(codes.InvalidArgument, ReasonKeyInvalid, err.Error(), 0)
	}
	tenant := s.cfg.Tenant(ctx)
	if tenant == "" {
		if err := s.anonymousCaller(ctx, method); err != nil {
			return nil, err
		}
	}
	fp, err := s.cfg.Fingerprint(method, req)
	if err != nil {
		s.outcome(ctx, method, OutcomeRejected)
		s.cfg.Logger.LogAttrs(ctx, slog.LevelError, "idem: request not fingerprinted; the call was not run",
			slog.String("method", method), slog.Any("error", err))
		return nil, errorStatus(codes.Internal, ReasonNotFingerprinted, err.Error(), 0)
	}
	// clientKey passed idem.ValidateKey, Scope.Key's own check.
	key, _ := idem.Scope{Tenant: tenant, Method: method}.Key(clientKey)
	return s.serve(ctx, req, method, handler, key, fp, clientKey, tenant)
}

// v1Key is the key v1.0 derived for a call whose tenant today is tenant:
// v1.0's DefaultTenant where the tenant is the default's (v1.0 hashed
// authorization as written, gave several values no tenant, and did not
// read the API-key metadata), also when a Config.Tenant of the user's
// answered DefaultTenant's (v1.0's fell back to v1.0's). The fingerprint
// is v1.0's.
func (s *server) v1Key(ctx context.Context, method, clientKey, tenant string) idem.Key {
	if s.userTenant == nil || tenant == DefaultTenant(ctx) {
		tenant = v1Tenant(ctx)
	}
	k, _ := idem.Scope{Tenant: tenant, Method: method}.Key(clientKey)
	return k
}

// anonymousCaller reports a keyed call that no tenant source identifies
// and, with RefuseAnonymous, returns the Unauthenticated status that
// refuses it.
func (s *server) anonymousCaller(ctx context.Context, method string) error {
	if s.cfg.OnAnonymous != nil {
		s.cfg.OnAnonymous(ctx, method)
	}
	s.eng.Anonymous(ctx)
	if s.cfg.RefuseAnonymous {
		s.outcome(ctx, method, OutcomeRejected)
		return errorStatus(codes.Unauthenticated, ReasonAnonymous,
			"idemgrpc: "+method+" requires calls with an idempotency key to identify their caller (authorization or API-key metadata, "+
				"a client certificate, or the configured tenant source), so that no caller gets another's result; the call was not run", 0)
	}
	if s.anonymous.First(method) {
		s.cfg.Logger.LogAttrs(ctx, slog.LevelWarn, "idem: a keyed call carries no credential that identifies its caller "+
			"(authorization or API-key metadata, a client certificate, or the configured tenant source): callers that use the same key "+
			"share its record; set Config.Tenant, or refuse such calls (Config.RefuseAnonymous); logged once per method",
			slog.String("method", method))
	}
	return nil
}

// serve acquires the key and answers: run the handler, replay, Aborted,
// FailedPrecondition or Unavailable; with Config.Wait, an in-flight key is
// waited for first.
func (s *server) serve(ctx context.Context, req any, method string, handler grpc.UnaryHandler, key idem.Key, fp idem.Fingerprint,
	clientKey, tenant string) (any, error) {
	// The work's context keeps the call's values, not its cancellation
	// nor its deadline: once acquired, the key's work runs to its end
	// whatever the client does.
	d := s.eng.Acquire(ctx, context.WithoutCancel(ctx), key, fp, method)
	if d.Outcome == engine.OutcomeExecuted && s.eng.FallingBack() {
		d = s.eng.Fallback(ctx, d, key, fp, s.v1Key(ctx, method, clientKey, tenant), fp)
	}
	switch d.Outcome {
	case engine.OutcomeExecuted:
		return s.execute(ctx, req, handler, d, method)
	case engine.OutcomeReplayed:
		telemetry.Event(ctx, telemetry.EventReplay)
		return s.replay(ctx, method, key, d.Response)
	case engine.OutcomeMismatch:
		s.outcome(ctx, method, OutcomeMismatch)
		return nil, errorStatus(codes.FailedPrecondition, ReasonMismatch,
			"idemgrpc: this idempotency key was already used with a different request to "+method+"; send a new request with a new key", 0)
	case engine.OutcomeInFlight:
		s.outcome(ctx, method, OutcomeInFlight)
		return nil, errorStatus(codes.Aborted, ReasonInFlight,
			"idemgrpc: a call with this idempotency key is in progress; retry with the same key to get its result",
			max(min(d.RetryAfter, maxInFlightDelay), time.Millisecond))
	case engine.OutcomeGone:
		s.outcome(ctx, method, OutcomeGone)
		return nil, status.FromContextError(ctx.Err()).Err() // nobody to answer, nothing to run
	case engine.OutcomeUnsealable:
		// It ran once; its outcome cannot be read. Never run again, not
		// even with FailOpen: the store did not fail.
		s.outcome(ctx, method, OutcomeUnsealable)
		if err := grpc.SetHeader(ctx, metadata.MD{MetadataReplayed: trueValue}); err != nil {
			s.cfg.Logger.LogAttrs(ctx, slog.LevelDebug, "idem: replayed header metadata not set", slog.Any("error", err))
		}
		return nil, errorStatus(codes.DataLoss, ReasonUnsealable,
			"idemgrpc: the call with this idempotency key was executed and will not be executed again, but its stored outcome is sealed "+
				"and cannot be opened (altered in the store, or the key that sealed it is no longer configured)", 0)
	}
	// engine.OutcomeStoreError
	s.outcome(ctx, method, OutcomeStoreError)
	switch {
	case d.Unknown:
		return nil, errorStatus(codes.Unavailable, ReasonStoreUnavailable,
			"idemgrpc: the idempotency store gave an unknown answer; the call was not run", storeRetryDelay)
	case s.cfg.FailOpen:
		return handler(ctx, req)
	}
	return nil, errorStatus(codes.Unavailable, ReasonStoreUnavailable,
		"idemgrpc: the idempotency store is unavailable; the call was not run. Retry with the same key.", storeRetryDelay)
}

// outcome reports what the interceptor did with a call: telemetry, then
// Config.OnOutcome.
func (s *server) outcome(ctx context.Context, method string, o Outcome) {
	s.eng.Report(ctx, engine.Outcome(o))
	if s.cfg.OnOutcome != nil {
		s.cfg.OnOutcome(ctx, method, o)
	}
}

// execute runs the handler under the lease of d, with the work's context
// and a stream that captures the metadata it sets, then stores its outcome
// or releases the key according to ShouldStore. The work reports the
// outcome, executed or released. A panic, in the handler or after it
// (ShouldStore, OnOutcome, the encoding), releases the key (w.End) and
// goes on. The calls in this process that wait for the key get the stored
// outcome handed to them.
func (s *server) execute(ctx context.Context, req any, handler grpc.UnaryHandler, d engine.Decision, method string) (any, error) {
	x := &execution{cs: captureStream{next: grpc.ServerTransportStreamFromContext(ctx), req: ctx}, s: s, ctx: ctx, method: method}
	cs, w := &x.cs, &x.work
	s.eng.StartIn(w, d, x)
	defer w.End()
	work := grpc.NewContextWithServerTransportStream(w.Ctx, cs)
	resp, err := handler(work, req)

	c := &captured{resp: resp}
	code := codes.OK
	if err != nil {
		st, ok := status.FromError(err)
		if !ok { // as grpc-go converts it
			st = status.FromContextError(err)
		}
		c.st, code = st, st.Code()
	}
	if !s.cfg.ShouldStore(work, code) {
		w.Release()
		return resp, err
	}
	c.header, c.trailer = cs.metadata()
	stored, encErr := encode(c, s.deny, s.cfg.Types)
	if encErr != nil {
		w.Failed("idem: handler ran but its outcome cannot be stored; a retry will run it again", encErr)
		w.Release()
		return resp, err
	}
	w.Complete(stored)
	if ctx.Err() != nil {
		w.ClientGone(context.Cause(ctx))
	}
	return resp, err
}

// execution is what execute keeps of a call that runs the handler, in
// one allocation: the stream that captures its metadata, the engine's
// Work, and what the Work's report needs (it is the Work's Reporter).
type execution struct {
	cs     captureStream
	work   engine.Work
	s      *server
	ctx    context.Context // the call's
	method string
}

// Report reports the work's outcome, executed or released.
func (x *execution) Report(o engine.Outcome) { x.s.outcome(x.ctx, x.method, Outcome(o)) }

// trueValue is the value of the replay markers; grpc-go copies metadata
// values it is given (metadata.Join), so one slice serves every replay.
var trueValue = []string{"true"}

// replay answers with a stored outcome: its header metadata plus
// idempotent-replayed: true, its trailer metadata, and its message or
// status.
func (s *server) replay(ctx context.Context, method string, key idem.Key, r *idem.Response) (any, error) {
	c, err := decode(r, s.deny, s.cfg.Types)
	if err != nil {
		s.outcome(ctx, method, OutcomeStoreError)
		s.cfg.Logger.LogAttrs(ctx, slog.LevelError, "idem: stored outcome cannot be replayed; the call was not run",
			slog.String("method", method), slog.String("key", key.String()), slog.Any("error", err))
		return nil, errorStatus(codes.Internal, ReasonUnreplayable,
			"idemgrpc: the stored outcome for this idempotency key cannot be decoded; the call was not run again", 0)
	}
	s.outcome(ctx, method, OutcomeReplayed)
	header := c.header
	if header == nil {
		header = make(metadata.MD, 2)
	}
	header[MetadataReplayed] = trueValue
	if r.BodyOmitted {
		header[MetadataBodyOmitted] = trueValue
	}
	if err := grpc.SetHeader(ctx, header); err != nil {
		s.cfg.Logger.LogAttrs(ctx, slog.LevelDebug, "idem: replayed header metadata not set", slog.Any("error", err))
	}
	if len(c.trailer) > 0 {
		if err := grpc.SetTrailer(ctx, c.trailer); err != nil {
			s.cfg.Logger.LogAttrs(ctx, slog.LevelDebug, "idem: replayed trailer metadata not set", slog.Any("error", err))
		}
	}
	if c.st != nil {
		return nil, c.st.Err()
	}
	return c.resp, nil
}
