package idemhttp

import (
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"net/http"
	"strconv"
	"strings"

	"github.com/idemkit/idem"
)

// Tenants: Config.Tenant says whose request this is, and two requests
// share a record only when their tenants are equal. Each source below
// gives a prefix and a hash of what identifies the client ("authz:",
// "cert:", "cookie:", "hdr:"), never the client's raw bytes, so sources
// cannot collide with each other.
//
// When the tenant is "" (no source identifies the client) and the request
// carries cookies, the middleware adds a hash of its whole Cookie header
// to the request's fingerprint (see Config.Tenant): a request with other
// cookies and a used key is a mismatch (422), never a replay.

// DefaultTenant scopes keys by the caller's credentials: a hash of the
// Authorization header ("authz:..."), else of the TLS client certificate
// the client presented ("cert:...", with tls.Config.ClientAuth at
// RequestClientCert or above: the handshake proves the client holds the
// certificate's key), else "". A client that refreshes its bearer token
// between two retries becomes a new tenant and runs the operation again:
// where tokens rotate, or clients authenticate with a session cookie, use
// TenantFromCookie, TenantFromHeader or a function of the account id.
func DefaultTenant(r *http.Request) string {
	if auth := r.Header.Get("Authorization"); auth != "" {
		// Unchanged since the first release: records stay reachable.
		sum := sha256.Sum256([]byte(auth))
		return "authz:" + base64.RawURLEncoding.EncodeToString(sum[:16])
	}
	if r.TLS != nil && len(r.TLS.PeerCertificates) > 0 {
		sum := sha256.Sum256(r.TLS.PeerCertificates[0].Raw)
		return "cert:" + base64.RawURLEncoding.EncodeToString(sum[:16])
	}
	return ""
}

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

// digest is the first 128 bits of SHA-256 over the fields, each with its
// length first, in unpadded base64url.
func digest(fields ...string) string {
	h := sha256.New()
	var n [binary.MaxVarintLen64]byte
	for _, f := range fields {
		h.Write(binary.AppendUvarint(n[:0], uint64(len(f))))
		h.Write([]byte(f))
	}
	sum := h.Sum(nil)
	return base64.RawURLEncoding.EncodeToString(sum[:16])
}

// cookieFingerprint mixes the request's Cookie header into fp: for a
// request no tenant source identified, a request from another browser
// (other cookies) is a mismatch, never a replay. ok is false when the
// request has no cookies (fp unchanged).
func cookieFingerprint(r *http.Request, fp idem.Fingerprint) (_ idem.Fingerprint, ok bool) {
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
