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
// The record is scoped by tenant (default: a hash of the Authorization
// header), method, route (default: the ServeMux pattern) and key, so one
// tenant never receives another's replay, and reusing a key on another
// route is a new operation. The fingerprint (default: method, path, query,
// Content-Type and body) detects a key reused for a different request.
//
// The handler's context carries the lease: idem.LeaseFromContext gives the
// key and the fencing token, to pass on to the system of record. If the
// lease is lost while the handler runs, that context is cancelled with
// cause idem.ErrLeaseLost and the response is not stored.
//
// # What is stored and replayed
//
// The final status, the header as it was when the status was written, and
// the body. Never stored: Set-Cookie, the hop-by-hop headers (Connection
// and the headers it names, Keep-Alive, Transfer-Encoding, Upgrade, TE,
// Trailer, Proxy-*) and Config.ReplayHeaderDenylist. Trailers and 1xx
// informational responses are not stored. net/http adds Date on every
// response, and Content-Length and a sniffed Content-Type when the handler
// did not set them; a replay gets them computed from the same body, so
// they match.
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
// receives a response only once it is stored. A streamed (flushed) or large
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
