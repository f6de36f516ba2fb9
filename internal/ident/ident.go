// Package ident says who sent a keyed request and what it was sent to, the
// same way in every layer (idemhttp, idemgrpc, idemlambda, idem proxy,
// Caddy): the credentials that name a caller, in a normal form so that
// one credential spelled two ways is one caller, and the path an upstream
// will see.
//
// A tenant is built from every credential the request carries, each as a
// prefix and a digest ("authz:…", "apikey:…"), never the raw bytes: a
// request with an Authorization header and an API key is a caller of its
// own, neither of the callers that send one of them alone (a gateway that
// adds a fixed Authorization header in front of clients that each send
// their own X-Api-Key must not make them one caller).
package ident

import (
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"net"
	"net/netip"
	"strings"
	"unicode/utf8"
)

// APIKeyHeaders are the request headers that carry an API key by common
// practice, in canonical form; gRPC metadata names are their lower-case
// forms. Each is a credential: two values are two callers.
var APIKeyHeaders = []string{"X-Api-Key", "Api-Key", "X-Auth-Token"}

// Tenant returns the tenant named by the credentials that values reads:
// values(name) returns every value of the header or metadata name, given
// in canonical form ("Authorization", "X-Api-Key"); a gRPC reader
// lower-cases it. "" when the request carries none of them.
//
// Authorization values are read in their normal form (see
// Authorization); the tenant of a request with one Authorization value
// and no API key is "authz:" and the digest of v1.0's DefaultTenant for
// that normal form, so a caller that wrote its header in normal form
// ("Bearer tok") kept its tenant across the upgrade.
func Tenant(values func(name string) []string) string {
	t, _ := TenantV1(values)
	return t
}

// TenantV1 is Tenant, and whether that tenant is the one v1.0's
// DefaultTenant gave the request: one Authorization value, in normal
// form, and no API key, so that the tenant is "authz:" and the hash of
// the value as written (Hashed("authz:", value)).
func TenantV1(values func(name string) []string) (_ string, asV1 bool) {
	// The tenant is built in out and each digest's input in in, both on
	// the stack for the usual sizes: the tenant's string is the one
	// allocation.
	var out [128]byte
	var in [256]byte
	b := out[:0]
	switch vs := values("Authorization"); len(vs) {
	case 0:
	case 1:
		if v := Authorization(vs[0]); v != "" {
			b = appendHash(append(b, "authz:"...), append(in[:0], v...))
			asV1 = v == vs[0]
		}
	default:
		// The normal forms, one a line.
		norm := in[:0]
		for i, v := range vs {
			if i > 0 {
				norm = append(norm, '\n')
			}
			norm = append(norm, Authorization(v)...)
		}
		b = appendHash(append(b, "authz:"...), norm)
	}
	for _, name := range APIKeyHeaders {
		vs := values(name)
		if len(vs) == 0 || (len(vs) == 1 && strings.TrimSpace(vs[0]) == "") {
			continue
		}
		if len(b) > 0 {
			b = append(b, ' ') // the parts, one space apart
		}
		asV1 = false
		// Digest's fields: the name in lower case, then each value
		// without its surrounding whitespace.
		fields := appendLowerField(in[:0], name)
		for _, v := range vs {
			fields = appendField(fields, strings.TrimSpace(v))
		}
		b = appendHash(append(b, "apikey:"...), fields)
	}
	return string(b), asV1
}

// OnlyAPIKeys reports whether tenant (Tenant's) was named by API-key
// headers alone: a key that may be a publishable one, shared by every
// browser of a site, so it need not tell two users apart.
func OnlyAPIKeys(tenant string) bool {
	return strings.HasPrefix(tenant, "apikey:") && !strings.Contains(tenant, "authz:")
}

// hash is the first 128 bits of SHA-256 over s in unpadded base64url (the
// form of v1.0's "authz:" and "cert:" tenants).
func hash(s string) string {
	var in [256]byte
	var out [32]byte
	return string(appendHash(out[:0], append(in[:0], s...)))
}

// Hashed is prefix and hash(s): v1.0's tenants.
func Hashed(prefix, s string) string {
	var in [256]byte
	var out [64]byte
	return string(appendHash(append(out[:0], prefix...), append(in[:0], s...)))
}

// appendHash appends to dst the first 128 bits of SHA-256 over in, in
// unpadded base64url: hash's form, without a string on the way.
func appendHash(dst, in []byte) []byte {
	sum := sha256.Sum256(in)
	return base64.RawURLEncoding.AppendEncode(dst, sum[:16])
}

// Cert is the tenant of a verified client certificate (its DER bytes):
// "cert:" and a digest, as in v1.0.
func Cert(der []byte) string {
	var out [32]byte
	return string(appendHash(append(out[:0], "cert:"...), der))
}

// Digest is the first 128 bits of SHA-256 over the fields, each with its
// length first, in unpadded base64url.
func Digest(fields ...string) string {
	var in [256]byte
	var out [32]byte
	b := in[:0]
	for _, f := range fields {
		b = appendField(b, f)
	}
	return string(appendHash(out[:0], b))
}

// appendField appends a field of Digest's input to b: its length (a
// uvarint), then its bytes.
func appendField(b []byte, f string) []byte {
	return append(binary.AppendUvarint(b, uint64(len(f))), f...)
}

// appendLowerField is appendField of strings.ToLower(f), without the
// string when f is ASCII (whose lower case is as long).
func appendLowerField(b []byte, f string) []byte {
	for i := 0; i < len(f); i++ {
		if f[i] >= utf8.RuneSelf {
			return appendField(b, strings.ToLower(f))
		}
	}
	b = binary.AppendUvarint(b, uint64(len(f)))
	for i := 0; i < len(f); i++ {
		c := f[i]
		if 'A' <= c && c <= 'Z' {
			c += 'a' - 'A'
		}
		b = append(b, c)
	}
	return b
}

// Authorization returns the normal form of an Authorization value
// (RFC 9110 section 11.4: credentials = auth-scheme [ 1*SP ( token68 /
// #auth-param ) ]): the whitespace around it dropped, the scheme, which
// is case-insensitive, written with its first letter in upper case and
// the rest in lower case ("Bearer", "Basic", "Digest"), one space after
// it, and each run of spaces and tabs in the rest made one space. The
// credential itself keeps its case: "Bearer tokA" and "Bearer TOKA" are
// two callers.
func Authorization(v string) string {
	if normalAuthorization(v) {
		return v // the usual case: no copy
	}
	v = strings.Trim(v, " \t")
	scheme, rest, _ := strings.Cut(v, " ")
	if i := strings.IndexByte(scheme, '\t'); i >= 0 {
		scheme, rest = scheme[:i], scheme[i+1:]+" "+rest
	}
	rest = strings.Join(strings.FieldsFunc(rest, func(r rune) bool { return r == ' ' || r == '\t' }), " ")
	if scheme == "" {
		return rest
	}
	scheme = strings.ToUpper(scheme[:1]) + strings.ToLower(scheme[1:])
	if rest == "" {
		return scheme
	}
	return scheme + " " + rest
}

// normalAuthorization reports whether v is in Authorization's normal form.
func normalAuthorization(v string) bool {
	scheme, rest, _ := strings.Cut(v, " ")
	if scheme == "" || (rest == "" && strings.HasSuffix(v, " ")) {
		return false
	}
	for i := 0; i < len(scheme); i++ {
		c := scheme[i]
		if c == '\t' || (i == 0 && 'a' <= c && c <= 'z') || (i > 0 && 'A' <= c && c <= 'Z') {
			return false
		}
	}
	return !strings.ContainsRune(rest, '\t') && !strings.Contains(rest, "  ") &&
		!strings.HasPrefix(rest, " ") && !strings.HasSuffix(rest, " ")
}

// Path returns the normal form of an escaped URL path (RFC 3986 section
// 6.2.2): percent-encoded unreserved characters (letters, digits, "-",
// ".", "_", "~") decoded, the hex digits of the other escapes in upper
// case. "/acct/%70ay" and "/acct/pay" are one path, as the upstream that
// decodes them sees one; "/a%2Fb" and "/a/b" stay two, since servers tell
// them apart. A malformed escape is left as it is.
func Path(escaped string) string {
	i := strings.IndexByte(escaped, '%')
	if i < 0 {
		return escaped
	}
	var b strings.Builder
	b.Grow(len(escaped))
	b.WriteString(escaped[:i])
	for ; i < len(escaped); i++ {
		c := escaped[i]
		if c != '%' || i+2 >= len(escaped) {
			b.WriteByte(c)
			continue
		}
		hi, lo := unhex(escaped[i+1]), unhex(escaped[i+2])
		if hi < 0 || lo < 0 {
			b.WriteByte(c)
			continue
		}
		if d := byte(hi<<4 | lo); unreserved(d) {
			b.WriteByte(d)
		} else {
			b.WriteByte('%')
			b.WriteByte(upperHex[hi])
			b.WriteByte(upperHex[lo])
		}
		i += 2
	}
	return b.String()
}

const upperHex = "0123456789ABCDEF"

func unhex(c byte) int {
	switch {
	case '0' <= c && c <= '9':
		return int(c - '0')
	case 'a' <= c && c <= 'f':
		return int(c - 'a' + 10)
	case 'A' <= c && c <= 'F':
		return int(c - 'A' + 10)
	}
	return -1
}

func unreserved(c byte) bool {
	return 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '-' || c == '.' || c == '_' || c == '~'
}

// Host returns the virtual host a request's authority names, for its
// scope: the host name in lower case, without its port or a trailing dot.
// An IP address names no virtual host ("" like no Host at all): instances
// of one service reached by their addresses, or on several ports of one
// machine, are one service, and a client that resends to another of them
// gets its replay. Servers that tell sites apart by port alone need a
// Config.Authority of their own.
func Host(hostport string) string {
	host := hostport
	if strings.ContainsAny(hostport, ":[]") {
		// Without a colon there is no port to split (SplitHostPort
		// fails), and without brackets nothing to trim.
		if h, _, err := net.SplitHostPort(hostport); err == nil {
			host = h
		}
		host = strings.Trim(host, "[]")
	}
	host = strings.TrimSuffix(strings.ToLower(host), ".")
	if mayBeIP(host) {
		// net.ParseIP(host) != nil, without its copy of the address.
		if a, err := netip.ParseAddr(host); err == nil && a.Zone() == "" {
			return ""
		}
	}
	return host
}

// mayBeIP reports whether s may parse as an IP address: an IPv6 address
// has a colon, and an IPv4 address has only digits and dots
// (netip.ParseAddr). A host name (a letter, a hyphen) is not one.
func mayBeIP(s string) bool {
	if strings.IndexByte(s, ':') >= 0 {
		return true
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; c != '.' && (c < '0' || c > '9') {
			return false
		}
	}
	return true
}
