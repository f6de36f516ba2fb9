// Package seal encrypts stored idempotency records at rest: a key ring of
// AES-256 keys with ids (the first the primary, which seals; every key
// opens), and AES-256-GCM envelopes that name the key that sealed them, so
// that rotating is adding a key and making it primary, with no
// re-encryption: what the old primary sealed still opens while its key is
// in the ring.
//
// A Ring is an idem.Sealer: set it as idem.Config.Seal, and the Guard
// seals every response it stores, bound to the record's key and
// fingerprint, and opens every sealed one it replays.
package seal

import (
	"crypto/aes"
	"crypto/cipher"
	"encoding/base64"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"regexp"
	"strings"
)

// KeySize is the size of a ring's keys in bytes (AES-256).
const KeySize = 32

// MaxIDLen is the longest key id, in bytes.
const MaxIDLen = 32

// Ring is a set of keys, each with an id, one of them the primary. It is
// safe for concurrent use and never changes once made. It never prints its
// keys: String, GoString and LogValue name only where it came from, how
// many keys it holds and the primary's id, so that a Ring passed to a log
// line or an error by mistake leaks nothing (they have value receivers,
// so that a Ring printed by value, not through its pointer, does not print
// its ciphers' key schedules either). It keeps no key bytes of its
// own, only the ciphers made from them. Make one with ParseRing,
// RingFromFile or RingFromEnv: the zero Ring holds no key, and its Seal
// and Open panic.
type Ring struct {
	source  string // "file PATH" or "environment variable NAME", for errors
	primary *ringKey
	keys    map[string]*ringKey
}

type ringKey struct {
	id   string
	aead cipher.AEAD
}

// idPattern is what a key id may be: a short token that can go into an
// error, a log line or a metric label as it is.
var idPattern = regexp.MustCompile(`^[A-Za-z0-9._-]{1,32}$`)

// envName is what RingFromEnv takes for a variable's name.
var envName = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

// RingFromFile reads the key ring in the file at path, in ParseRing's
// format. A missing or unreadable file is an error that names it.
func RingFromFile(path string) (*Ring, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		// os.PathError names the file and the cause, never its contents.
		return nil, fmt.Errorf("seal keys: %w", err)
	}
	return parseRing("file "+path, string(data))
}

// RingFromEnv reads the key ring in the environment variable name, in
// ParseRing's format (newline-separated). An unset variable is an error
// that names it.
func RingFromEnv(name string) (*Ring, error) {
	if !envName.MatchString(name) {
		// Perhaps a key itself, given where the variable's name goes:
		// never quote it.
		return nil, errors.New("seal keys: the environment variable's name is not a name; want letters, digits and _ ([A-Za-z_][A-Za-z0-9_]*), the name of a variable that holds the key ring")
	}
	text, ok := os.LookupEnv(name)
	if !ok {
		return nil, fmt.Errorf("seal keys: environment variable %s is not set", name)
	}
	return parseRing("environment variable "+name, text)
}

// ParseRing reads a key ring from text: one key a line, written
//
//	ID BASE64
//
// where ID is 1 to 32 of [A-Za-z0-9._-] and BASE64 the 32 bytes of an
// AES-256 key in standard or URL-safe base64, padded or not (as
// `openssl rand -base64 32` writes it). The first key is the primary.
// Surrounding white space is trimmed; blank lines and lines starting with
// "#" are ignored. Errors are one line, name the line and the source, and
// never quote a key (nor an id that is not an id: it could be a key
// written in the wrong place).
func ParseRing(text string) (*Ring, error) { return parseRing("text", text) }

func parseRing(source, text string) (*Ring, error) {
	r := &Ring{source: source, keys: map[string]*ringKey{}}
	lineOf := map[string]int{}
	n := 0
	for line := range strings.Lines(text) {
		n++
		v := strings.TrimSpace(line)
		if v == "" || strings.HasPrefix(v, "#") {
			continue
		}
		fields := strings.Fields(v)
		if len(fields) != 2 {
			return nil, fmt.Errorf("seal keys: %s line %d: %d field(s); want ID BASE64 (a key id, a space, a base64 key of %d bytes)", source, n, len(fields), KeySize)
		}
		id, enc := fields[0], fields[1]
		if !idPattern.MatchString(id) {
			return nil, fmt.Errorf("seal keys: %s line %d: the key id is not 1 to %d of A-Z a-z 0-9 . _ -", source, n, MaxIDLen)
		}
		if at, dup := lineOf[id]; dup {
			return nil, fmt.Errorf("seal keys: %s line %d: key id %s is already on line %d; want each id once", source, n, id, at)
		}
		key, ok := decodeKey(enc)
		if !ok {
			return nil, fmt.Errorf("seal keys: %s line %d: key %s is not base64 (standard or URL-safe)", source, n, id)
		}
		if len(key) != KeySize {
			clear(key)
			return nil, fmt.Errorf("seal keys: %s line %d: key %s has %d bytes; want %d (AES-256)", source, n, id, len(key), KeySize)
		}
		block, err := aes.NewCipher(key)
		clear(key)
		if err != nil {
			return nil, fmt.Errorf("seal keys: %s line %d: key %s: %v", source, n, id, err) // not reached: 32 bytes is a valid AES key
		}
		aead, err := cipher.NewGCM(block)
		if err != nil {
			return nil, fmt.Errorf("seal keys: %s line %d: key %s: %v", source, n, id, err) // not reached
		}
		k := &ringKey{id: id, aead: aead}
		r.keys[id] = k
		lineOf[id] = n
		if r.primary == nil {
			r.primary = k
		}
	}
	if r.primary == nil {
		return nil, fmt.Errorf("seal keys: %s holds no key, so no primary; want lines ID BASE64, the first the primary (blank lines and # comments are ignored)", source)
	}
	return r, nil
}

// decodeKey decodes a key in any of the four base64 forms.
func decodeKey(s string) ([]byte, bool) {
	for _, e := range []*base64.Encoding{base64.StdEncoding, base64.RawStdEncoding, base64.URLEncoding, base64.RawURLEncoding} {
		if b, err := e.DecodeString(s); err == nil {
			return b, true
		}
	}
	return nil, false
}

// Primary returns the id of the key that seals.
func (r *Ring) Primary() string { return r.primary.id }

// Len reports how many keys the ring holds.
func (r *Ring) Len() int { return len(r.keys) }

// Has reports whether the ring holds a key with that id.
func (r *Ring) Has(id string) bool { _, ok := r.keys[id]; return ok }

// String names where the ring came from, how many keys it holds and the
// primary's id, never a key.
func (r Ring) String() string {
	if r.primary == nil {
		return "no seal keys"
	}
	return fmt.Sprintf("%d seal key(s) from %s, primary %s", len(r.keys), r.source, r.primary.id)
}

// GoString is String, so that %#v does not print the keys either.
func (r Ring) GoString() string { return r.String() }

// LogValue is String, for slog.
func (r Ring) LogValue() slog.Value { return slog.StringValue(r.String()) }
