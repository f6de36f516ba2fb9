package idem

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"fmt"
)

// MaxKeyLen is the longest client key accepted, in bytes.
const MaxKeyLen = 255

// Key identifies one idempotency record. It is the first 128 bits of a
// SHA-256 digest over the scope and the client key, so it has a fixed size,
// holds no raw client bytes and cannot be steered to a chosen Redis Cluster
// slot. Build one with Scope.Key.
type Key [16]byte

// String returns the key in unpadded base64url (22 characters), the form
// stores use in their own key names.
func (k Key) String() string { return base64.RawURLEncoding.EncodeToString(k[:]) }

// ParseKey parses the 22-character form returned by Key.String.
func ParseKey(s string) (Key, error) {
	var k Key
	if base64.RawURLEncoding.DecodedLen(len(s)) != len(k) {
		return k, fmt.Errorf("idem: stored key %q: want %d base64url characters", s, base64.RawURLEncoding.EncodedLen(len(k)))
	}
	if _, err := base64.RawURLEncoding.Strict().Decode(k[:], []byte(s)); err != nil {
		return k, fmt.Errorf("idem: stored key %q: %w", s, err)
	}
	return k, nil
}

// Scope is everything besides the client key that distinguishes one
// operation from another. Two requests share a record only when tenant,
// method, route and client key are all equal, so one tenant can never see
// another tenant's result.
type Scope struct {
	Tenant string // who is calling: an account, an API key hash; may be empty
	Method string // the operation kind: an HTTP method, "amqp", ...
	Route  string // the operation target: a route pattern, a queue, a topic
	// Authority is the host the request was sent to (HTTP's Host), for
	// servers that answer for several: two virtual hosts never share a
	// record. Empty for operations that have none (message
	// consumers); a Scope without one derives the same key as in v1.0.
	Authority string
}

// Key validates clientKey and derives the record key: SHA-256 over a
// version tag and the fields, each prefixed by its length, so no two
// distinct (tenant, method, route, key, authority) tuples share an
// encoding. A Scope without Authority is encoded as in v1.0 (four fields
// under the tag idem/key/v1), so its keys did not change; one with an
// Authority adds it as a fifth field under the tag idem/key/v2.
func (s Scope) Key(clientKey string) (Key, error) {
	if err := ValidateKey(clientKey); err != nil {
		return Key{}, err
	}
	var buf [512]byte // most scopes fit: no allocation
	tag := "idem/key/v1"
	if s.Authority != "" {
		tag = "idem/key/v2"
	}
	b := append(buf[:0], tag...)
	for _, f := range [...]string{s.Tenant, s.Method, s.Route, clientKey} {
		b = appendField(b, f)
	}
	if s.Authority != "" {
		b = appendField(b, s.Authority)
	}
	sum := sha256.Sum256(b)
	return Key(sum[:16]), nil
}

// ValidateKey reports whether clientKey is acceptable: 1 to 255 bytes, each
// printable ASCII (0x20 to 0x7E). Space is allowed because an RFC 8941
// sf-string (the quoted form of the Idempotency-Key header) may hold it; a
// bare header token may not (idemhttp.ParseKey). The error wraps
// ErrInvalidKey.
func ValidateKey(clientKey string) error {
	if clientKey == "" {
		return fmt.Errorf("%w: empty", ErrInvalidKey)
	}
	if len(clientKey) > MaxKeyLen {
		return fmt.Errorf("%w: %d bytes, more than %d", ErrInvalidKey, len(clientKey), MaxKeyLen)
	}
	for i := 0; i < len(clientKey); i++ {
		if c := clientKey[i]; c < 0x20 || c > 0x7E {
			return fmt.Errorf("%w: byte 0x%02x at offset %d is not printable ASCII", ErrInvalidKey, c, i)
		}
	}
	return nil
}

// Fingerprint summarises the request a key was first used with: the first
// 128 bits of a SHA-256 digest. A later request with the same key and a
// different fingerprint is a Mismatch. The zero Fingerprint is a valid value:
// callers that do not hash content (message consumers) pass it every time.
type Fingerprint [16]byte

// SumFingerprint returns the fingerprint of some fields and a body: SHA-256
// over a version tag, each field with its length first, then the body with
// its length first, so field boundaries are unambiguous.
func SumFingerprint(body []byte, fields ...string) Fingerprint {
	var buf [256]byte
	b := append(buf[:0], "idem/fp/v1"...)
	for _, f := range fields {
		b = appendField(b, f)
	}
	b = binary.AppendUvarint(b, uint64(len(body)))
	h := sha256.New()
	h.Write(b)
	h.Write(body)
	var sum [sha256.Size]byte
	return Fingerprint(h.Sum(sum[:0])[:16])
}

func appendField(b []byte, f string) []byte {
	b = binary.AppendUvarint(b, uint64(len(f)))
	return append(b, f...)
}

// LeaseID names one acquisition. It is random, chosen by the caller before
// Acquire, so that a retried Acquire (after a lost reply) is recognised as
// the same call.
type LeaseID [16]byte

// NewLeaseID returns a random LeaseID.
func NewLeaseID() LeaseID {
	var id LeaseID
	rand.Read(id[:]) // never fails on supported platforms (crypto/rand docs)
	return id
}

// String returns the lease id in unpadded base64url.
func (id LeaseID) String() string { return base64.RawURLEncoding.EncodeToString(id[:]) }
