package idemhttp

import (
	"errors"
	"net/http"
	"strings"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/engine"
)

// HeaderKey is the request header that carries the idempotency key.
const HeaderKey = "Idempotency-Key"

// HeaderReplayed is set to "true" on replayed responses.
const HeaderReplayed = "Idempotent-Replayed"

var errKeyMissing error = &engine.KeyError{Pkg: "idemhttp", Why: "no Idempotency-Key", Err: idem.ErrMissingKey}

// ParseKey returns the client key of a request: the single Idempotency-Key
// header, either a bare token of visible ASCII (0x21-0x7E) or an RFC 8941
// sf-string ("..." with \" and \\ escapes, printable ASCII inside),
// surrounded by optional whitespace, 1 to 255 characters after unquoting.
// A missing header gives an error that wraps idem.ErrMissingKey; everything
// else wrong (two headers, control bytes, non-ASCII, bad quoting, length)
// wraps idem.ErrInvalidKey.
func ParseKey(h http.Header) (string, error) {
	return parseKeyHeader(h, HeaderKey, errKeyMissing)
}

// parseKeyHeader is ParseKey for the header name (canonical), its errors
// naming it; missing is the error for a missing header.
func parseKeyHeader(h http.Header, name string, missing error) (string, error) {
	vs := h.Values(name)
	switch len(vs) {
	case 0:
		return "", missing
	case 1:
	default:
		return "", invalidKey("more than one " + name + " header")
	}
	v := strings.Trim(vs[0], " \t")
	if strings.HasPrefix(v, `"`) {
		return parseSFString(v, name)
	}
	if v == "" {
		return "", invalidKey("empty " + name)
	}
	for i := 0; i < len(v); i++ {
		if c := v[i]; c < 0x21 || c > 0x7E {
			return "", invalidKey(name + " holds a character that is not visible ASCII; quote it as a string to include spaces")
		}
	}
	return v, validateAs(v, name)
}

// validateAs is idem.ValidateKey, its error wrapped in an *engine.KeyError
// that names where the key came from (what).
func validateAs(key, what string) error {
	if err := idem.ValidateKey(key); err != nil {
		return &engine.KeyError{Pkg: "idemhttp", Why: what + " must be 1 to 255 printable ASCII characters", Err: err}
	}
	return nil
}

// parseSFString parses an RFC 8941 sf-string (§3.3.3) that must make up the
// whole value of the header name.
func parseSFString(v, name string) (string, error) {
	var b strings.Builder
	for i := 1; i < len(v); i++ {
		switch c := v[i]; {
		case c == '\\':
			i++
			if i == len(v) || (v[i] != '"' && v[i] != '\\') {
				return "", invalidKey(name + ` string has a bad escape; only \" and \\ are allowed`)
			}
			b.WriteByte(v[i])
		case c == '"':
			if i != len(v)-1 {
				return "", invalidKey(name + " has characters after its closing quote")
			}
			return b.String(), validateAs(b.String(), name)
		case c < 0x20 || c > 0x7E:
			return "", invalidKey(name + " string holds a character that is not printable ASCII")
		default:
			b.WriteByte(c)
		}
	}
	return "", invalidKey(name + " string has no closing quote")
}

func invalidKey(why string) error {
	return &engine.KeyError{Pkg: "idemhttp", Why: why, Err: idem.ErrInvalidKey}
}

// keyErrorDetail is the text of a ParseKey error, for a problem's detail.
func keyErrorDetail(err error) string {
	if ke, ok := errors.AsType[*engine.KeyError](err); ok {
		return ke.Text()
	}
	return err.Error()
}
