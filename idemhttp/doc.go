// Package idemhttp makes HTTP requests idempotent: server middleware that
// honours the Idempotency-Key header (IETF draft
// draft-ietf-httpapi-idempotency-key-header, as Stripe does it), and a
// client Transport that sends keys and retries safely.
//
// # Server
//
// Middleware(store, cfg) wraps any http.Handler (net/http's ServeMux, chi,
// gorilla/mux, and gin or echo through their net/http adapters). For a
// covered method (default POST and PATCH) with an Idempotency-Key:
//
//	first request                    the handler runs; its response goes to the client
//	                                 and is stored (per ShouldStore)
//	same key, completed, same body   the stored status, headers and body, byte for byte,
//	                                 plus Idempotent-Replayed: true
//	same key, still running          wait for its result, up to Config.Wait (default
//	                                 DefaultWait, 500ms), and replay it; past the wait,
//	                                 409 with Retry-After: 1 (Wait negative: 409 at once)
//	same key, different request      422; the handler does not run
//	key missing, not required        the request passes through untouched
//	key missing, required            400
//	key malformed or repeated        400
//	body over MaxBodySize            413; nothing is stored
//	store failing                    503 with Retry-After: 1; the handler does not run
//	                                 (unless Config.FailOpen)
//	store full (idem.ErrStoreFull:   503 store-full with Retry-After: 1; the handler does
//	a bounded store refuses a        not run (unless Config.FailOpen); keys already in
//	new key)                         flight or completed answer as usual
//	new key past its tenant's        429 quota-exceeded with Retry-After; the handler does
//	Config.Quota (on by default      not run and nothing is claimed; keys already in flight
//	for a memstore with MaxBytes)    or completed answer as usual (see Quota)
//	handler panics, or ShouldStore   the key is released: a retry runs the handler
//	says no (default: 5xx, 408,      again (a panic is passed on); so does a panic
//	409, 425, 429)                   after the handler and before the store
//	                                 (ShouldStore, OnBodyOmitted, OnOutcome)
//	client leaves after the acquire, the handler runs to its end and its response is
//	or stops reading for             stored; the retry waits (409 past Wait), then replays
//	ClientWriteTimeout
//
// Error answers are RFC 9457 application/problem+json with a stable type
// (the Problem* constants); Config.ErrorHandler can write them otherwise.
//
// The record is scoped by tenant, method, route and key, so one tenant
// never receives another's replay. The tenant defaults to a hash of the
// Authorization header, else of the TLS client certificate (DefaultTenant):
// a client that refreshes its bearer token between two retries becomes a
// new tenant and runs the operation again, so set Config.Tenant to a
// stable account id where tokens rotate. Clients that authenticate with a
// session cookie: set Config.Tenant to TenantFromCookie("session") (or
// TenantFromHeader for an account header set by a trusted gateway). A
// request that no source identifies but that carries cookies has its
// Cookie header in its fingerprint: the same key from another browser is
// a 422, never a replay of someone else's response. The route
// defaults to the ServeMux pattern when the middleware wraps a
// *http.ServeMux or runs inside one (Request.Pattern), and to the escaped
// path otherwise (chi, echo, gin, gorilla: set Config.Route to use their
// route templates). A key reused on another route is a new operation; a
// key reused under the same route for a different request (another path
// under one pattern, another body) gets 422: the fingerprint (default:
// method, escaped path, query, Content-Type and body) tells them apart.
//
// The handler's context carries the lease: idem.LeaseFromContext gives the
// key and the fencing token, to pass on to the system of record. If the
// lease is lost while the handler runs, that context is cancelled with
// cause idem.ErrLeaseLost and the response is not stored.
//
// # Keys where senders put them, and fingerprints that ignore what changes
//
// Config.KeySource says where a request's key is; the zero KeySource is the
// Idempotency-Key header, and the answers above hold for every source (a
// missing key passes through, or is a 400 with RequireKey; a malformed one
// is a 400; every key is 1 to 255 printable ASCII characters):
//
//	KeyFromHeader("X-GitHub-Delivery")  a header of the sender's, read as
//	                                    Idempotency-Key is; the body is read
//	                                    only once the request has a key
//	KeyFromJSON("/data/object/id")      a field of a JSON body (RFC 6901 JSON
//	                                    Pointer; ~1 is "/", ~0 is "~"): its
//	                                    string, or its number as written; no
//	                                    body or no field is a missing key, a
//	                                    body that is not JSON or a field of
//	                                    another type an invalid one
//	KeySource{NeedsBody: true, Key: f}  a source of one's own: f can verify
//	                                    the request first (a webhook's
//	                                    signature over the raw body) and
//	                                    refuse it with ErrKeyUnverified: 401
//	                                    ProblemUnverified, nothing runs and
//	                                    nothing is claimed
//
// A source that reads the body (NeedsBody) has the body of every request of
// a covered method read first, keyed or not: a body over MaxBodySize is a
// 413 even without a key, and the anonymous-caller check
// (RefuseAnonymous) comes after the read. A key from a header or a body
// that anyone can send is a key anyone can choose: where a sender signs
// its requests, verify them in the source. Records are looked for under
// v1.0's keys (Config.V1Scopes) only for the Idempotency-Key header.
//
// Config.Fingerprint decides which retries are the same request.
// FingerprintJSON("/attempt", "/sent_at") hashes the body's canonical JSON
// (RFC 8785: members sorted, no white space, one form for each number and
// string) without the excluded fields, so a redelivery that reorders
// members or bumps a retry counter is a replay, and one that changes
// anything else a 422; FingerprintJSONFields("/id", "/amount") hashes those
// fields alone. A body that is not I-JSON (not JSON, a member twice, not
// UTF-8) is hashed raw, as DefaultFingerprint does.
//
// Config.EchoKey sends the key back, as the source read it, in an
// Idempotency-Key response header on every answer to a keyed request
// (replays and problems included), and Config.LifetimeHeader says on every
// answer of a covered method how long a key is kept
// (Idempotency-Key-Lifetime: PT24H, Retention in ISO 8601); neither is
// stored, and a handler's header of either name is replaced. Config.OnKey
// hands over the stored key (idem.Key) of each keyed request, to log it.
//
// # When the client gives up
//
// The work belongs to the key, not to the connection. A client that
// disconnects, times out or resets its stream:
//
//   - before the key is acquired (while its body is read, while it waits
//     with Config.Wait, during the acquire): nothing runs, and a key
//     acquired in that instant is released at once;
//   - while the handler runs: the handler's context keeps the request's
//     values but not its cancellation (context.WithoutCancel), so the
//     handler and the calls it makes with r.Context() run to their end,
//     and the response is stored. A retry waits for it (Config.Wait) or
//     gets 409 until then, and the byte-identical replay after;
//   - while the response streams: the middleware stops writing to the
//     client and keeps capturing; the handler sees no write error (so
//     httputil.ReverseProxy does not abort), and the whole response is
//     stored for the retry;
//   - by no longer reading, its connection open (its receive window
//     full): once a write to it has not been taken for
//     Config.ClientWriteTimeout (30s), it is gone as above, instead of
//     holding the handler at its write, and the key in flight, for as
//     long as it keeps the connection. Each write goes out in pieces of
//     32 KiB under a write deadline that is lifted between writes, so a
//     handler that pauses between writes is not affected, and an
//     http.Server.WriteTimeout is never extended;
//   - after completion: nothing changes.
//
// The handler's context is cancelled only when the lease is lost (cause
// idem.ErrLeaseLost), after Config.MaxExecution (cause
// idem.ErrMaxExecution), or when Config.StopContext is done (cause
// idem.ErrStopped): cancel it once http.Server.Shutdown has waited its
// grace period. Config.CancelOnDisconnect restores the old behaviour, in
// which the client's disconnect cancels the handler's context; it is unsafe for effects outside a transaction that
// the cancellation rolls back, since the failed handler's key is released
// and the client's retry runs the work again.
//
// # What is stored and replayed
//
// The final status, the header as the handler had set it when the status
// was written, and the body as net/http sent it (nothing for 204, 304 and
// HEAD). Headers that outer middleware set before the handler ran (a
// request id, tracing) are the new request's, not the response's: they are
// not stored, and a replay leaves the new request's values in place. Never
// stored: Set-Cookie, the hop-by-hop headers (Connection and the headers it
// names, Keep-Alive, Transfer-Encoding, Upgrade, TE, Trailer, Proxy-*),
// Config.ReplayHeaderDenylist, and Idempotency-Key with Config.EchoKey and
// Idempotency-Key-Lifetime with Config.LifetimeHeader (a replay sends the
// retry's own). With Config.ReplayHeaderAllowlist, only the headers it
// names are stored, and those that say what the body is (Content-Type,
// Content-Encoding, gRPC's status and encoding). The lists shape the
// record and its replays only: the request that ran the handler gets
// every header the handler set. 1xx informational responses are not
// stored.
//
// Trailers are stored with the header, each under http.TrailerPrefix and
// its name ("Trailer:Grpc-Status"): those the handler announced in its
// Trailer header and set once it had written the body (ReverseProxy does
// so for an upstream's trailers), and those it set under the prefix. A
// replay sends them as trailers, after the body (HTTP/2 trailers; on
// HTTP/1.1 the replay is chunked). gRPC's grpc-status, grpc-message and
// trailing metadata live there. A denied name is dropped as a trailer too,
// and an allowlist keeps a trailer if it names it (or it is gRPC's status).
// A v1.0 process replaying such a record hands the entries to net/http
// under the same names, which sends them as trailers as well.
//
// With Config.Seal the record is sealed at rest (see idem's doc, Sealed
// records). A completed record whose sealed response cannot be opened
// (altered in the store, under a key id no longer in the ring, read
// without a Sealer) is never replayed and never run again: every retry
// gets 500 application/problem+json of type ProblemResponseUnreadable,
// with Idempotent-Replayed: true and no Retry-After, its outcome is
// OutcomeUnsealable, and each is logged at ERROR with the key and the
// key_id, never content. FailOpen does not run it: the store did not fail.
//
// When the handler set no Content-Type, net/http sniffs one from the first
// bytes, or sends none if the handler flushed before writing any; the
// stored header records what the client got, and a replay sends exactly
// that. net/http adds Date to every response; the framing may differ (a
// flushed original is chunked, its replay has a Content-Length).
//
// Handlers must write their response before returning: a framework that
// writes an error returned by the handler after the middleware chain has
// returned (echo does) would have an empty 200 stored. See
// examples/frameworks for the one-line fix.
//
// # Streaming and large responses
//
// The response goes to the client as the handler writes it; Flush works.
// The middleware keeps a copy of up to MaxResponseSize bytes (default 1
// MiB), the inline limit. A longer response is still completed, so the
// handler never runs again for that key. Without a blob store its body is
// not stored, and a replay must not look like a complete answer: it is a
// 500 application/problem+json of type ProblemResponseNotKept, with
// Idempotent-Replayed: true, Idempotent-Replay-Body-Omitted: true and
// Idempotent-Original-Status (also the problem's status_executed member),
// whose detail says that the request ran and why its body is gone; every
// retry gets it until the record expires. The first such response of each
// route is logged at WARN, naming the limit and the fix (Config.Blobs, or
// a larger MaxResponseSize), and OnBodyOmitted counts every one. A
// handler that hijacks the
// connection is not stored; the key is released.
//
// With Config.Blobs (package blobstore: S3, a directory, memory), a body
// that outgrows the inline limit streams on to a blob as the handler
// writes it, the bytes held so far first, and memory stays bounded
// whatever its size. Before the key completes, the blob is committed
// whole under a name built from the store's namespace (idem.Namespacer),
// the record key's digest and the fencing token (idem.NewBlobName), and
// the record keeps its name, size and SHA-256 (idem.BlobRef, about 100
// bytes). A replay opens the blob first: missing, of the wrong size, or
// in a store that does not answer, it gets 503
// (ProblemStoredBodyUnavailable) and the handler does not run again (a
// missing or corrupt blob is logged with the stored key and the idem
// purge that runs the key again). It then streams the stored status and headers with the blob's
// Content-Length, checking the digest as it reads and sending each 64 KiB
// only once the next has been read: a blob found corrupt after the header
// went out aborts the response (the connection, on HTTP/1.1; the stream,
// on HTTP/2), so the client sees a broken response, never a short 200.
// OnBlobError and OutcomeReplayFailed count these. A client that leaves
// mid-body changes nothing: the rest is still written to the blob.
//
// With Config.Seal as well, the middleware wraps Config.Blobs with
// idem.SealBlobs: blob contents are sealed at rest in 64 KiB chunks bound
// to the blob's name, and a replay checks each chunk as it reads (the
// AEAD in place of the digest; the size still). A sealed blob that does
// not open (altered, truncated, moved, or under a key id not in the ring)
// is handled as a corrupt one, logged at ERROR with its key_id.
//
// Before a new request runs, the blob store is probed (at most once a
// second): when it does not answer, the request gets 503
// (ProblemBlobStoreUnavailable) and the key is released, as for a failing
// store; with FailOpen the handler runs, and a body over the inline limit
// is not stored (ProblemResponseNotKept on replay). A write that
// fails, or makes no progress for BlobTimeout (30s), midway through a
// body also completes the key without its body: the client got the whole
// response, and the work is never run again. A status that ShouldStore
// releases, a panic or a lost lease discard the blob. Blobs whose attempt
// crashed between the blob write and Complete are orphans: no record
// refers to them; blobstore.Sweep (idem gc) removes them, and the blobs
// of expired records.
//
// net/http buffers small responses until the handler returns, and the
// middleware stores the response before returning, so a client normally
// receives a response only once it is stored. If storing fails (the store
// is down, the lease was lost), the failure is logged and the key released
// when possible: the client still gets the handler's response, and a retry
// runs the handler again. A streamed (flushed) or large
// response can reach the client first; a retry in that short window gets
// its replay or 409 (waiting first, with Config.Wait), never a second
// execution.
//
// # Client
//
// Transport is an http.RoundTripper that adds an Idempotency-Key to covered
// methods and retries network errors and 409, 429, 502, 503 and 504 with
// exponential backoff and full jitter, honouring Retry-After, always with
// the same key and the same body. Transport.AttemptTimeout bounds each
// attempt until its response headers arrive; a slow attempt is retried with
// the same key and ends with the first attempt's stored response.
package idemhttp
