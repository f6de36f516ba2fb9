// Package caddyidem is idem inside Caddy: an HTTP handler, module
// http.handlers.idempotency and Caddyfile directive idempotency, that makes
// the rest of its route (reverse_proxy to any upstream, usually) run once
// per Idempotency-Key. It is the idemhttp middleware with the options and
// outcomes of `idem proxy`, without a second process. A whole Caddyfile:
//
//	:8080 {
//		@payments path /payments /payments/*
//		idempotency @payments {
//			store redis://127.0.0.1:6379
//		}
//		reverse_proxy 127.0.0.1:9000
//	}
//
// The matcher covers /payments and the paths under it (/payments/* alone
// does not match /payments). The directive is ordered before
// reverse_proxy, so outside a route block no order line is needed; in a
// route block, write it before reverse_proxy, and give the site a handler
// for the requests the route does not match (Caddy answers those with an
// empty 200 otherwise). Build Caddy with it with
//
//	xcaddy build v2.11.9 --with github.com/idemkit/idem/caddyidem
//
// or use cmd/idem-caddy of this module. It is a Go module of its own, so
// that Caddy's dependencies never reach the builds of idem's users.
//
// What is guaranteed is idemhttp's and idem proxy's (docs/proxy.md,
// docs/guarantee.md): a covered request with a key runs the route once
// per key while its record lives (Retention) — a repeat gets the stored
// status, headers and body byte for byte with Idempotent-Replayed: true;
// while the first is in flight, its result after a wait (wait, default
// 500ms; wait 0: none), 409 with Retry-After past it; 422 for the same key
// with another request. The work belongs to the key: a client that disconnects or times out does not cancel the
// upstream request, whose response is stored for the retry. An error
// returned by the rest of the route (reverse_proxy's 502 when the upstream
// cannot be reached) releases the key and goes to Caddy's error handling
// (handle_errors) as it came; it is never stored. A keyed request without
// a body goes upstream with its Idempotency-Key under the lower-case name,
// so that Go's HTTP transport (reverse_proxy's) never resends it on its
// own.
//
// What is not guaranteed: with store memory (the default) the records live
// in this process, are shared by every handler that names the same store
// and prefix, survive config reloads, and are lost on restart; every
// Caddy instance has its own. Use redis://, postgres:// or mysql:// (or
// Redis and PostgreSQL, the tiered store) when more than one instance
// serves a route or restarts matter. A Caddy killed while a request runs blocks its key for one
// lease; the retry after that runs the upstream again (idem's at-least-once
// limit for a crashed holder). reverse_proxy's own retries (lb_retries,
// lb_try_duration with retry_match) can resend a request to another
// upstream within one execution: leave them off for keyed methods, or make
// sure they retry only requests that were not sent.
//
// Keys are scoped by tenant (a hash of Authorization, or tenant_header or
// tenant_cookie, as idem proxy's), method and the request's path as the
// handler sees it (after a handle_path strip), as idem proxy's without
// --config: a Caddy and idem proxies on the same store and prefix share
// their records. Sites that must not share keys need their own prefix.
//
// Metrics are idem proxy's names on Caddy's registry (enable Caddy's
// metrics): idem_requests_total{outcome}, idem_lease_renewals_total{result},
// idem_responses_not_kept_total, idem_blob_errors_total{op,reason}. The
// access log line of a request gets idempotency_outcome (the same word, see
// docs/telemetry.md) and idempotency_key (the stored key's digest, what idem
// inspect --stored-key takes; never the client's key).
package caddyidem
