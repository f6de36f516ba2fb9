package idemhttp

import (
	"net/http"
	"strconv"
	"strings"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/ident"
)

// Tenants: Config.Tenant says whose request this is, and two requests
// share a record only when their tenants are equal. Each source below
// gives a prefix and a hash of what identifies the client ("authz:",
// "apikey:", "cert:", "cookie:", "hdr:"), never the client's raw bytes,
// so sources cannot collide with each other.
//
// When the tenant is "" (no source identifies the client) and the request
// carries cookies, its record remembers them (as digests): a later request
// with the key replays only if it carries the same identifying cookies
// (see Config.TrackingCookies), else it gets 422, never another client's
// response.

// DefaultTenant scopes keys by the caller's credentials: the
// Authorization header, in its normal form (the scheme's case and the
// whitespace around and inside it do not matter, RFC 9110 section 11.4),
// and the API-key headers X-Api-Key, Api-Key and X-Auth-Token, each as a
// hash ("authz:...", "apikey:..."; a request with several has all of them,
// and is a caller of its own); else a hash of the TLS client certificate
// the client presented ("cert:...", with tls.Config.ClientAuth at
// RequestClientCert or above: the handshake proves the client holds the
// certificate's key); else "". A client that refreshes its bearer token
// between two retries becomes a new tenant and runs the operation again:
// where tokens rotate, or clients authenticate with a session cookie, use
// TenantFromCookie, TenantFromHeader or a function of the account id.
//
// A normal-form Authorization header ("Bearer tok") and no API key gives
// the tenant v1.0 gave it.
func DefaultTenant(r *http.Request) string {
	t, _ := defaultTenant(r)
	return t
}

// defaultTenant is DefaultTenant, and, when that tenant is also
// v1DefaultTenant's answer for the request as it is now ("authz:" and the
// hash of its one Authorization value, in normal form: ident.TenantV1),
// that value; else "". So v1.0's tenant need not be hashed again while the
// request's Authorization is that value (request.v1Authz).
func defaultTenant(r *http.Request) (tenant, v1Authz string) {
	if t, asV1 := ident.TenantV1(r.Header.Values); t != "" {
		if asV1 {
			v1Authz = r.Header.Get("Authorization")
		}
		return t, v1Authz
	}
	if r.TLS != nil && len(r.TLS.PeerCertificates) > 0 {
		return ident.Cert(r.TLS.PeerCertificates[0].Raw), ""
	}
	return "", ""
}

// v1DefaultTenant is DefaultTenant as v1.0 released it, for the keys of
// records stored before the upgrade (Config.V1Scopes).
func v1DefaultTenant(r *http.Request) string {
	if auth := r.Header.Get("Authorization"); auth != "" {
		return ident.Hashed("authz:", auth)
	}
	if r.TLS != nil && len(r.TLS.PeerCertificates) > 0 {
		return ident.Cert(r.TLS.PeerCertificates[0].Raw)
	}
	return ""
}

// DefaultAuthority is the default Config.Authority: the host name the
// request's Host header names, in lower case, without its port; "" for an
// IP address, which names no virtual host (instances reached by address,
// or on several ports, are one service).
func DefaultAuthority(r *http.Request) string { return ident.Host(r.Host) }

// TenantFromCookie returns a Config.Tenant that scopes keys by the value
// of the named cookie (a session cookie): "cookie:" and a hash of its name
// and value. A request without the cookie, or with an empty one, gets
// DefaultTenant's answer. Other cookies play no part: a retry whose
// tracking cookies changed still replays. It panics if name is not a
// cookie name.
func TenantFromCookie(name string) func(*http.Request) string {
	if !isToken(name) {
		panic("idemhttp: TenantFromCookie: " + strconv.Quote(name) + " is not a cookie name")
	}
	return func(r *http.Request) string {
		if c, err := r.Cookie(name); err == nil && c.Value != "" {
			return "cookie:" + digest(name, c.Value)
		}
		return DefaultTenant(r)
	}
}

// TenantFromHeader returns a Config.Tenant that scopes keys by the named
// request header (an account id set by a trusted gateway): "hdr:" and a
// hash of its name and every value it has, so that a client adding a
// header of that name beside the gateway's never shares the gateway's
// tenant. A request without the header gets DefaultTenant's answer. The
// header must be one that clients cannot set for someone else (the
// gateway replaces it). It panics if name is not a header name.
func TenantFromHeader(name string) func(*http.Request) string {
	if !isToken(name) {
		panic("idemhttp: TenantFromHeader: " + strconv.Quote(name) + " is not a header name")
	}
	canonical := http.CanonicalHeaderKey(name)
	return func(r *http.Request) string {
		vs := r.Header[canonical]
		if len(vs) == 0 || (len(vs) == 1 && vs[0] == "") {
			return DefaultTenant(r)
		}
		return "hdr:" + digest(append([]string{canonical}, vs...)...)
	}
}

// digest is ident.Digest.
func digest(fields ...string) string { return ident.Digest(fields...) }

// v1CookieFingerprint is v1.0's guard for a request no tenant source
// identified, for the records stored before the upgrade: the whole Cookie
// header mixed into fp. ok is false when the request has no cookies (fp
// unchanged).
func v1CookieFingerprint(r *http.Request, fp idem.Fingerprint) (_ idem.Fingerprint, ok bool) {
	cookies := r.Header.Values("Cookie")
	if len(cookies) == 0 {
		return fp, false
	}
	return idem.SumFingerprint(nil, "idemhttp/cookie", string(fp[:]), strings.Join(cookies, "; ")), true
}

// isToken reports whether s is an RFC 9110 token (header and cookie
// names).
func isToken(s string) bool {
	if s == "" {
		return false
	}
	for _, c := range []byte(s) {
		if c <= ' ' || c >= 0x7f || strings.IndexByte(`"(),/:;<=>?@[\]{}`, c) >= 0 {
			return false
		}
	}
	return true
}
