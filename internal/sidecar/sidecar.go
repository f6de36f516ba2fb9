// Package sidecar is the library of idem's sidecars, idem proxy
// (cmd/idem) and the Caddy handler (caddyidem): what they do alike in
// front of an upstream, so that they differ only in their syntax (flags
// and a YAML file; a Caddyfile or JSON) and each capability is written
// once. A front end turns its syntax into Settings (DefaultSettings, then
// what was given; Settings.Validate names each setting as it spells
// them), opens its store (OpenStore) and makes each route's middleware
// (Settings.Middleware, with the Env its routes share: Metrics, the
// quota, the blob store). Beside that: the tenant and route of a request
// and its stored key for the log, the headers that would let net/http's
// Transport resend a request, gRPC calls answered and stored as gRPC, the
// TLS of the listener (CertSource: its certificate reloaded from the
// files) and of an https:// upstream, and the one SIGHUP loop
// (ReloadOnHangup).
package sidecar

import (
	"net/http"
	"strings"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/ident"
)

// TenantFunc scopes keys by the named header, "hdr:" + its value, or by
// idemhttp.DefaultTenant when there is no header name or the request
// lacks the header; or, with a cookie name, by idemhttp.TenantFromCookie
// (the callers allow one of the two per route). The header's raw value
// (not idemhttp.TenantFromHeader's hash) keeps the records of earlier
// releases reachable and idem inspect --tenant hdr:ID usable; Scope.Key
// hashes it, so no raw value reaches the store.
func TenantFunc(header, cookie string) func(*http.Request) string {
	if cookie != "" {
		return idemhttp.TenantFromCookie(cookie)
	}
	if header == "" {
		return idemhttp.DefaultTenant
	}
	return func(r *http.Request) string {
		switch vs := r.Header.Values(header); {
		case len(vs) == 1 && vs[0] != "":
			return "hdr:" + vs[0]
		case len(vs) > 1:
			// A client's own value beside the gateway's (a gateway that
			// appends rather than replaces): never the tenant of the one
			// value alone.
			return "hdr:" + strings.Join(vs, "\n")
		}
		return idemhttp.DefaultTenant(r)
	}
}

// Route is the route of a request's scope where no pattern names it: the
// path the upstream will see (idemhttp's default route, with which idem
// proxy without --config and Caddy share their records).
func Route(r *http.Request) string { return ident.Path(r.URL.EscapedPath()) }

// replayHints are the headers that make net/http's Transport resend a
// request without a body on its own when a reused connection breaks
// (Request.isReplayable): the upstream may have acted on the first copy.
var replayHints = []string{"Idempotency-Key", "X-Idempotency-Key"}

// HideReplayHints returns h, or a copy of h with each of replayHints under
// its lower-case name, which the upstream reads the same (header names are
// case-insensitive) but the Transport does not take for a sign that it may
// resend. For a keyed request without a body, sent under a lease.
func HideReplayHints(h http.Header) http.Header {
	var out http.Header
	for _, name := range replayHints {
		v, ok := h[name]
		if !ok {
			continue
		}
		if out == nil {
			out = h.Clone()
		}
		delete(out, name)
		lower := strings.ToLower(name)
		out[lower] = append(out[lower], v...)
	}
	if out == nil {
		return h
	}
	return out
}
