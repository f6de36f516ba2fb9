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
//	same key, still running          409 with Retry-After: 1 (or, with Config.Wait, wait
//	                                 for the result, bounded)
//	same key, different request      422; the handler does not run
//	key missing, not required        the request passes through untouched
//	key missing, required            400
//	key malformed or repeated        400
//	body over MaxBodySize            413; nothing is stored
//	store failing                    503 with Retry-After: 1; the handler does not run
//	                                 (unless Config.FailOpen)
//	handler panics, or ShouldStore   the key is released: a retry runs the handler
//	says no (default: 5xx, 408,      again (a panic is passed on)
//	409, 425, 429)
//
// Error answers are RFC 9457 application/problem+json with a stable type
// (the Problem* constants); Config.ErrorHandler can write them otherwise.
//
// The record is scoped by tenant, method, route and key, so one tenant
// never receives another's replay. The tenant defaults to a hash of the
// Authorization header: a client that refreshes its bearer token between
// two retries becomes a new tenant and runs the operation again, so set
// Config.Tenant to a stable account id where tokens rotate. The route
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
// # What is stored and replayed
//
// The final status, the header as the handler had set it when the status
// was written, and the body as net/http sent it (nothing for 204, 304 and
// HEAD). Headers that outer middleware set before the handler ran (a
// request id, tracing) are the new request's, not the response's: they are
// not stored, and a replay leaves the new request's values in place. Never
// stored: Set-Cookie, the hop-by-hop headers (Connection and the headers it
// names, Keep-Alive, Transfer-Encoding, Upgrade, TE, Trailer, Proxy-*) and
// Config.ReplayHeaderDenylist. Trailers and 1xx informational responses are
// not stored.
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
// MiB). A longer response is still completed, so the handler never runs
// again for that key, but its body is not stored: a replay carries the
// status and headers, an empty body and Idempotent-Replay-Body-Omitted:
// true. A handler that hijacks the connection is not stored; the key is
// released.
//
// net/http buffers small responses until the handler returns, and the
// middleware stores the response before returning, so a client normally
// receives a response only once it is stored. If storing fails (the store
// is down, the lease was lost), the failure is logged and the key released
// when possible: the client still gets the handler's response, and a retry
// runs the handler again. A streamed (flushed) or large
// response can reach the client first; a retry in that short window gets
// 409 (or waits, with Config.Wait), never a second execution.
//
// # Client
//
// Transport is an http.RoundTripper that adds an Idempotency-Key to covered
// methods and retries network errors and 409, 429, 502, 503 and 504 with
// exponential backoff and full jitter, honouring Retry-After, always with
// the same key and the same body.
package idemhttp
