package seal

import (
	"bytes"
	"crypto/rand"
	"errors"
	"fmt"
	"slices"
)

// Errors of Open. They arrive wrapped; branch on them with errors.Is.
var (
	// ErrUnknownKey reports a sealed value whose key id is not in the
	// ring (a key removed too early, or a ring of another deployment). The
	// error names the id.
	ErrUnknownKey = errors.New("seal: key id not in the ring")

	// ErrTampered reports a sealed value that does not open: altered,
	// truncated, malformed, or sealed under other associated data (a
	// record copied under another key).
	ErrTampered = errors.New("seal: sealed value does not authenticate")
)

// The envelope, version 1:
//
//	magic   3 bytes  0xFF 'S' 'L'
//	version 1 byte   1
//	id len  1 byte   1..MaxIDLen
//	id      the key id (ParseRing's id syntax)
//	nonce   12 bytes random (crypto/rand)
//	sealed  AES-256-GCM ciphertext of the plaintext, then its 16-byte tag
//
// The associated data that GCM authenticates is the envelope's header
// (magic through id) followed by the caller's associated data; the header
// is self-delimiting (the id's length comes first), so no two (header,
// caller's data) pairs give the same bytes.
//
// Why the magic cannot be the start of a clear record: every store keeps a
// completed response as idem.Response.AppendBinary's encoding, whose first
// byte holds the flags, bits 5-7 the encoding's version minus one, 0 in the
// only version there is; UnmarshalBinary refuses any other value. So a
// clear record starts with a byte of 0x00 to 0x1F, and 0xFF (all three
// version bits set: version 8, all flags) is neither a clear record of
// today nor one of the next six encoding versions. The response encoding
// must never take version 8 while sealed records exist. An idem without
// sealing finds a sealed record corrupt (unknown encoding version), never a
// response.
var magic = [3]byte{0xFF, 'S', 'L'}

const (
	version   = 1
	nonceSize = 12 // GCM's standard nonce
	tagSize   = 16 // GCM's tag
	// headerMin is magic, version and the id's length byte.
	headerMin = len(magic) + 2
)

// Overhead returns how many bytes Seal adds to a plaintext when the
// primary seals: the header, the nonce and the tag.
func (r *Ring) Overhead() int { return headerMin + len(r.primary.id) + nonceSize + tagSize }

// IsSealed reports whether b starts as a sealed value does (the magic),
// whatever its version and whether or not it is whole: a value for which
// it is true goes to Open, which tells a good one from a bad one; one for
// which it is false is a clear record (sealing turned on over existing
// records still reads them).
func IsSealed(b []byte) bool { return bytes.HasPrefix(b, magic[:]) }

// Seal appends to dst the envelope of plaintext sealed under the primary
// key with associated data ad, and returns the extended slice; its error
// is always nil (idem.Sealer's form: other Sealers reach a network). dst
// and plaintext must not overlap. The same ad must be given to Open: it is
// not stored in the envelope.
func (r *Ring) Seal(dst, plaintext, ad []byte) ([]byte, error) {
	return r.seal(dst, plaintext, ad, nil), nil
}

// KeyID returns the key id that sealed's header names, and false when
// sealed is not this package's envelope (its magic, version 1, a well-formed
// id). The id is the value's say-so, for logs: Open tells whether it holds.
func (r *Ring) KeyID(sealed []byte) (string, bool) { return KeyID(sealed) }

// KeyID is Ring.KeyID without a ring: it reads only the envelope's header
// (for tools that show a sealed value's key id without holding its key,
// such as idem inspect).
func KeyID(sealed []byte) (string, bool) {
	if !IsSealed(sealed) || len(sealed) < headerMin || sealed[len(magic)] != version {
		return "", false
	}
	n := int(sealed[len(magic)+1])
	if len(sealed) < headerMin+n {
		return "", false
	}
	id := sealed[headerMin : headerMin+n]
	if !validID(id) {
		return "", false
	}
	return string(id), true
}

// seal is Seal with the nonce given, for tests that need the same envelope
// in every process (a fuzz target's seeds); nil draws it from crypto/rand.
func (r *Ring) seal(dst, plaintext, ad, fixedNonce []byte) []byte {
	k := r.primary
	start := len(dst)
	dst = slices.Grow(dst, headerMin+len(k.id)+nonceSize+len(plaintext)+tagSize)
	dst = append(dst, magic[:]...)
	dst = append(dst, version, byte(len(k.id)))
	dst = append(dst, k.id...)
	headerEnd := len(dst)
	dst = append(dst, make([]byte, nonceSize)...)
	nonce := dst[headerEnd:]
	if fixedNonce != nil {
		copy(nonce, fixedNonce)
	} else {
		rand.Read(nonce) // never fails (crypto/rand)
	}
	var buf [adBufSize]byte
	return k.aead.Seal(dst, nonce, plaintext, associated(buf[:0], dst[start:headerEnd], ad))
}

// Open checks and decrypts sealed, a value Seal made with the same ad,
// appends the plaintext to dst and returns the extended slice. A value
// that is not whole, not sealed, altered, or sealed with another ad is an
// error wrapping ErrTampered; one sealed under a key that is not in the
// ring, an error wrapping ErrUnknownKey that names the key id. dst and
// sealed must not overlap.
func (r *Ring) Open(dst, sealed, ad []byte) ([]byte, error) {
	if !IsSealed(sealed) {
		return dst, fmt.Errorf("%w: not a sealed value", ErrTampered)
	}
	if len(sealed) < headerMin {
		return dst, fmt.Errorf("%w: truncated header (%d bytes)", ErrTampered, len(sealed))
	}
	if v := sealed[len(magic)]; v != version {
		return dst, fmt.Errorf("%w: unknown envelope version %d", ErrTampered, v)
	}
	n := int(sealed[len(magic)+1])
	if n == 0 || n > MaxIDLen || len(sealed) < headerMin+n+nonceSize+tagSize {
		return dst, fmt.Errorf("%w: truncated or malformed (%d bytes, key id length %d)", ErrTampered, len(sealed), n)
	}
	headerEnd := headerMin + n
	id := sealed[headerMin:headerEnd]
	if !validID(id) {
		// Not quoted: the bytes are anyone's.
		return dst, fmt.Errorf("%w: malformed key id", ErrTampered)
	}
	k, ok := r.keys[string(id)]
	if !ok {
		return dst, fmt.Errorf("%w: key id %s (the ring, %s, does not hold it)", ErrUnknownKey, id, r)
	}
	nonce := sealed[headerEnd : headerEnd+nonceSize]
	var buf [adBufSize]byte
	out, err := k.aead.Open(dst, nonce, sealed[headerEnd+nonceSize:], associated(buf[:0], sealed[:headerEnd], ad))
	if err != nil {
		return dst, fmt.Errorf("%w: under key %s (altered, or sealed with other associated data)", ErrTampered, k.id)
	}
	return out, nil
}

// adBufSize is the stack buffer for the associated data of Seal and Open:
// a header with the longest id and a record's associated data (47 bytes)
// fit; longer ones are allocated.
const adBufSize = 128

// associated appends to b the data GCM authenticates: the envelope's
// header, then the caller's associated data.
func associated(b, header, ad []byte) []byte {
	return append(append(b, header...), ad...)
}

// validID is idPattern's test, without a regexp, for Open's hot path.
func validID(id []byte) bool {
	if len(id) == 0 || len(id) > MaxIDLen {
		return false
	}
	for _, c := range id {
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '.' || c == '_' || c == '-') {
			return false
		}
	}
	return true
}
