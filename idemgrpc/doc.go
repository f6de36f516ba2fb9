// Package idemgrpc makes unary gRPC calls idempotent, for grpc-go: a server
// interceptor that runs each keyed call once and replays its stored outcome
// to every repeat, and a client interceptor that sends keys and retries
// safely.
//
// # Server
//
// UnaryServerInterceptor(store, cfg) covers every unary method by default
// (Config.Methods, Config.MethodFunc narrow it). For a covered call:
//
//	key missing, not required        the call passes through untouched
//	key missing, required            InvalidArgument (reason IDEMPOTENCY_KEY_MISSING)
//	key malformed, or two values     InvalidArgument (IDEMPOTENCY_KEY_INVALID)
//	key, caller not identified,      Unauthenticated (IDEMPOTENCY_CALLER_UNIDENTIFIED); the
//	RefuseAnonymous                  handler does not run, nothing is stored
//	first call                       the handler runs; its outcome goes to the client and
//	                                 is stored (per ShouldStore)
//	same key, completed, same request  the stored message or status, header and trailer
//	                                 metadata, plus header idempotent-replayed: true
//	same key, still running          wait for its outcome, up to Config.Wait (default
//	                                 DefaultWait, 500ms), and replay it; past the wait,
//	                                 Aborted (IDEMPOTENCY_KEY_IN_FLIGHT) with RetryInfo:
//	                                 the holder's lease time left, at most 1s (Wait
//	                                 negative: Aborted at once)
//	same key, different request      FailedPrecondition (IDEMPOTENCY_KEY_REUSED); the
//	                                 handler does not run
//	store failing                    Unavailable (IDEMPOTENCY_STORE_UNAVAILABLE) with
//	                                 RetryInfo 1s; the handler does not run (unless
//	                                 Config.FailOpen)
//	handler panics, or ShouldStore   the key is released: a retry runs the handler again
//	says no                          (a panic is passed on); so does a panic after the
//	                                 handler and before the store (ShouldStore,
//	                                 OnOutcome)
//	client leaves after the acquire  the handler runs to its end and its outcome is
//	                                 stored; the retry waits (Aborted past Wait), then
//	                                 gets the replay
//	sealed outcome that does not     DataLoss (IDEMPOTENT_RESPONSE_UNSEALABLE) on every
//	open (Config.Seal: altered, key  retry until the record expires; the handler does
//	id not in the ring, no Sealer)   not run again, FailOpen or not; logged at ERROR
//	                                 with the key id
//
// The interceptor's own errors carry a google.rpc.ErrorInfo with domain
// ErrorDomain and a stable reason (the Reason constants; ErrorReason reads
// it), so a client can tell them from its handler's errors.
//
// The key is the single value of the idempotency-key metadata, 1 to 255
// printable ASCII characters (idem.ValidateKey, the rule of idemhttp's
// quoted form: spaces allowed), or what Config.Key takes from the request
// message: a field such as AIP-155's request_id. A key from the message
// wins over the metadata. Google's AIP-155 asks that a request_id reused
// with a different request be refused; that is FailedPrecondition here
// (the request is well formed; the key's state forbids it).
//
// The record is scoped by tenant, full method name and key. The tenant is
// DefaultTenant by default, as idemhttp's: the credentials the call's
// metadata carries, each as a hash, never raw: authorization in its normal
// form (so "Bearer tok", "bearer tok", "Bearer  tok" and " Bearer tok " are
// one caller; the token itself keeps its case) and the API-key metadata
// x-api-key, api-key and x-auth-token (two keys are two callers; a call
// with several credentials is a caller of its own); without any, the
// peer's TLS client certificate. Set Config.Tenant from the authenticated
// identity where that is elsewhere or where tokens rotate between retries
// (the interceptor that authenticates must run before this one).
//
// A keyed call that none of these identifies (Tenant returns "") is
// anonymous: anonymous calls share one scope, so one that sends a key
// another anonymous caller used gets that caller's stored response. Each
// is counted (idem.anonymous, Config.OnAnonymous) and the first of each
// method logged at WARN; Config.RefuseAnonymous refuses them with
// Unauthenticated before anything is stored. Calls without a key pass
// through as ever.
//
// A single authorization value in normal form has v1.0's tenant, so the
// records v1.0 stored for it keep answering. The tenant changed for
// API-key callers (anonymous in v1.0), for other spellings of
// authorization and for several authorization values.
//
// The fingerprint (DefaultFingerprint) is the method and the deterministic
// proto encoding of the request, so maps in any order are one request;
// requests must be proto messages unless Config.Fingerprint says
// otherwise.
//
// The handler's context carries the lease: idem.LeaseFromContext gives the
// key and the fencing token, to pass on to the system of record. If the
// lease is lost while the handler runs, that context is cancelled with
// cause idem.ErrLeaseLost and the outcome is not stored.
//
// # What is stored and replayed
//
// The outcome is kept as an idem.Response (encoding version 1): Status is
// 900 plus the gRPC code; Body is the response message's proto encoding
// (deterministic) for OK, or the google.rpc.Status (code, message and
// details) for an error; Header holds the header metadata the handler set
// under their own keys (in lower case), the trailer metadata under ":trailer:" + key, and
// the response message's full name under ":type" (names starting with ':'
// can never be gRPC metadata keys). A replay decodes the message into a
// new instance of that type, found in Config.Types (default
// protoregistry.GlobalTypes, where generated code registers every
// message); a response whose type cannot be found there is not stored.
//
// A replay sets the header metadata the handler set (grpc.SetHeader,
// grpc.SendHeader), with every value byte for byte (binary "-bin" values
// included), plus idempotent-replayed: true, and the trailer metadata it
// set (grpc.SetTrailer) byte for byte. Metadata set by interceptors that run
// before this one (a request id, tracing) is the new call's, not the
// outcome's: it is not stored, and a replay leaves the new call's in place;
// interceptors after this one count as the handler. A replayed error has
// the stored code, message and details. A replayed message equals the
// original (proto.Equal), and goes on the wire byte for byte as the
// original did unless it holds a map with more than one entry: Go's proto
// encoding orders map entries at random, for the original as for the
// replay. Config.ReplayMetadataDenylist names keys never stored nor
// replayed, in any case.
//
// Metadata keys are case-insensitive, and HTTP/2 sends them in lower case:
// grpc-go sends the keys of a metadata.MD literal as written
// (metadata.MD{"Set-Cookie": ...}), and a grpc-go client refuses such a
// response (Internal, "invalid header field name"). The interceptor gives
// what the handler sets to grpc-go in lower case, and stores it so: the
// call and its replays reach the client, and the denylist matches a key
// however the handler spelled it. A record stored before a key joined the
// denylist replays without it.
//
// The interceptor stores the outcome before returning it to grpc-go, so a
// client normally receives an outcome only once it is stored. If storing
// fails (the store is down, the lease was lost), the failure is logged and
// the key released when possible: the client still gets the handler's
// outcome, and a retry runs the handler again. Header metadata the handler
// sends early with grpc.SendHeader reaches the client before that.
//
// Outcomes over Config.MaxResponseSize (default 4 MiB, grpc-go's default
// receive limit) complete the key without being stored: the handler never
// runs again for it, and a replay gets DataLoss (reason
// IDEMPOTENT_RESPONSE_NOT_STORED) with the stored metadata and
// idempotent-replay-body-omitted: true. An empty message would be mistaken
// for the real one, so none is sent.
//
// The default storage policy (DefaultShouldStore) keeps what a retry of
// the same request would get again, and releases what says "try again":
//
//	stored:    OK, InvalidArgument, NotFound, AlreadyExists, PermissionDenied,
//	           FailedPrecondition, OutOfRange
//	released:  Canceled, Unknown, DeadlineExceeded, ResourceExhausted, Aborted,
//	           Unimplemented, Internal, Unavailable, DataLoss, Unauthenticated
//
// # When the client gives up
//
// The work belongs to the key, not to the connection. A client that
// cancels its call, passes its deadline or loses its connection:
//
//   - before the key is acquired (while it waits with Config.Wait, during
//     the acquire): nothing runs, and a key acquired in that instant is
//     released at once;
//   - while the handler runs: the handler's context keeps the call's values
//     (metadata, peer, the lease) but neither its cancellation nor its
//     deadline (context.WithoutCancel), so the handler and the calls it
//     makes with that context run to their end, and the outcome is stored.
//     Metadata the handler sets after the client left is kept for the
//     replay, and the handler sees no error for it. A retry waits for it
//     (Config.Wait) or gets Aborted until then, and the replay after;
//   - after completion: nothing changes.
//
// The handler's context is cancelled only when the lease is lost (cause
// idem.ErrLeaseLost), after Config.MaxExecution (cause
// idem.ErrMaxExecution), or when Config.StopContext is done (cause
// idem.ErrStopped): cancel it once grpc.Server.GracefulStop has waited
// long enough. A handler that wants the client's deadline as a budget
// must apply one itself (MaxExecution).
//
// # Client
//
// UnaryClientInterceptor(cfg) gives every covered call an idempotency-key
// (a UUIDv4, or the one the call's outgoing metadata already has: WithKey)
// and retries Unavailable and Aborted with the same key and request, with
// exponential backoff and full jitter, honouring RetryInfo; at most 5
// attempts and 30s by default. The key is call metadata, so grpc-go's own
// retries (retryPolicy, transparent retries) carry it too.
// ClientConfig.AttemptTimeout bounds each attempt: a slow attempt is
// abandoned and retried with the same key, and the call ends with the
// first attempt's stored outcome.
//
// # Streaming
//
// Streaming RPCs are not covered: the package has no stream interceptors,
// so streams pass through untouched and run as often as they are sent. A
// stream is not one request and one outcome: a client stream's request is
// only known once the client closes it, after the handler has started
// acting on its messages, and a server stream's outcome is a sequence of
// messages the client may have consumed in part when it retries, so
// replaying it would need the whole sequence stored and a resumption
// point. Make a method that needs idempotency unary.
//
// # Limits
//
// Guarantees and their limits are idem's (see package idem): at most one
// live lease per key; a handler whose process crashes, or whose lease is
// lost, before its outcome is stored may run again after the lease ends,
// so effects outside the store are at-least-once with fencing. Inside a
// covered handler grpc.SetSendCompressor and
// grpc.ClientSupportedCompressors fail, because they need grpc-go's own
// stream type and the handler's context carries the capturing stream; use
// the client's or the server's compressor options instead.
package idemgrpc
