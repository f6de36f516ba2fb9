package idemhttp

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"

	"golang.org/x/net/http/httpguts"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/engine"
	"github.com/idemkit/idem/internal/jsonptr"
)

// ErrKeyUnverified is the error a KeySource returns, or wraps, for a
// request it refuses as not genuine: a webhook whose signature does not
// verify, say. The request gets 401 application/problem+json of type
// ProblemUnverified, with the error's message as its detail (so it must
// hold no secret); it does not run and nothing is claimed or stored.
var ErrKeyUnverified = errors.New("idemhttp: request not verified")

// A KeySource finds the idempotency key of a request (Config.KeySource).
// The zero KeySource is the default: the Idempotency-Key header, as
// ParseKey reads it.
type KeySource struct {
	// NeedsBody says that Key reads the request body. The middleware then
	// reads the body (at most Config.MaxBodySize, else 413) before it
	// asks for the key, for every request of a covered method, keyed or
	// not; without it, Key is asked first, body is nil, and a request
	// without a key passes through before its body is read.
	NeedsBody bool

	// Key returns the request's key, validated then as an Idempotency-Key
	// is (1 to 255 printable ASCII characters). body is the request body
	// when NeedsBody is set, else nil; Key must not keep it or change it.
	// Its error says what the answer is, by what it wraps (errors.Is):
	//
	//	ErrKeyUnverified   401 ProblemUnverified; nothing runs (checked first)
	//	idem.ErrMissingKey as a request without Idempotency-Key: it passes
	//	                   through, or gets 400 ProblemKeyMissing when the
	//	                   key is required (Config.RequireKey)
	//	anything else      400 ProblemKeyInvalid
	//
	// The error's message is the problem's detail: what was expected, in
	// one line, and nothing secret.
	Key func(r *http.Request, body []byte) (string, error)

	err error // a constructor's argument was malformed; NewMiddleware returns it
	// v1 says the key is the Idempotency-Key header's, the only key
	// v1.0 stored: only then are v1.0's records looked for
	// (Config.V1Scopes).
	v1 bool
}

// defaultKeySource is the zero KeySource's: ParseKey.
var defaultKeySource = KeySource{Key: func(r *http.Request, _ []byte) (string, error) { return ParseKey(r.Header) }, v1: true}

// KeyFromHeader returns a KeySource that reads the key from the header
// name, by ParseKey's rules (once, a token of visible ASCII or an RFC 8941
// string), for senders that name a request in their own header
// (X-GitHub-Delivery, X-Shopify-Webhook-Id, webhook-id). It does not read
// the body. KeyFromHeader(HeaderKey) is the default. A name that is not a
// header field name is an error of NewMiddleware.
//
// A header that anyone who can reach the server can set is a key anyone
// can choose: whoever sends a request under another's key first has its
// response replayed to the other. Where the sender signs its requests,
// verify the signature in the key source and refuse the others with
// ErrKeyUnverified.
func KeyFromHeader(name string) KeySource {
	if !httpguts.ValidHeaderFieldName(name) {
		return KeySource{err: fmt.Errorf("idemhttp: KeyFromHeader: %q is not a header field name; want a token such as X-Request-Id", name)}
	}
	name = http.CanonicalHeaderKey(name)
	if name == HeaderKey {
		return defaultKeySource
	}
	missing := &engine.KeyError{Pkg: "idemhttp", Why: "no " + name + " header", Err: idem.ErrMissingKey}
	return KeySource{Key: func(r *http.Request, _ []byte) (string, error) { return parseKeyHeader(r.Header, name, missing) }}
}

// KeyFromJSON returns a KeySource that reads the key from the field of a
// JSON request body that pointer (RFC 6901 JSON Pointer: "/id",
// "/data/object/id", "/items/0/id"; "~1" is a "/" in a member's name and
// "~0" a "~") points to, for senders that name a request in its body (the
// event "id" of a Stripe webhook). It reads the body first (NeedsBody).
//
// The key is the field's string, or its number as written in the body (so
// 1e3 and 1000 are two keys), validated as an Idempotency-Key is. An empty
// body, or a body without the field, has no key (idem.ErrMissingKey: it
// passes through unless the key is required); a body that is not JSON, a
// field that is neither a string nor a number (null, true, an object), or
// a member on the way that its object holds twice, is an invalid key. A
// malformed pointer is an error of NewMiddleware.
func KeyFromJSON(pointer string) KeySource {
	p, err := jsonptr.Parse(pointer)
	if err != nil {
		return KeySource{err: fmt.Errorf("idemhttp: KeyFromJSON: %w", err)}
	}
	where := "the body's field " + pointer
	if pointer == "" {
		where = "the body"
	}
	keyErr := func(sentinel error, format string, args ...any) error {
		return &engine.KeyError{Pkg: "idemhttp", Why: fmt.Sprintf(format, args...), Err: sentinel}
	}
	return KeySource{NeedsBody: true, Key: func(_ *http.Request, body []byte) (string, error) {
		if len(body) == 0 {
			return "", keyErr(idem.ErrMissingKey, "no body, so no key at %s", where)
		}
		raw, err := jsonptr.Find(body, p)
		switch {
		case errors.Is(err, jsonptr.ErrNotFound):
			return "", keyErr(idem.ErrMissingKey, "no key at %s", where)
		case errors.Is(err, jsonptr.ErrAmbiguous):
			return "", keyErr(idem.ErrInvalidKey, "a member on the way to %s is in its object twice; want it once", where)
		case err != nil:
			return "", keyErr(idem.ErrInvalidKey, "the body is not JSON; want a JSON body with the key at %s", where)
		}
		var key string
		switch raw[0] {
		case '"':
			if err := json.Unmarshal(raw, &key); err != nil {
				return "", keyErr(idem.ErrInvalidKey, "%s is not a valid JSON string", where)
			}
		case '-', '0', '1', '2', '3', '4', '5', '6', '7', '8', '9':
			key = string(raw)
		default:
			return "", keyErr(idem.ErrInvalidKey, "%s is not a string or a number", where)
		}
		return key, validateAs(key, where)
	}}
}

// keyProblem is the answer to a request whose key source failed with err
// (not nil): 401, 400 for a missing key (missing true, when required),
// or 400 for an invalid one.
func (m *middleware) keyProblem(err error) (p Problem, missing bool) {
	switch {
	case errors.Is(err, ErrKeyUnverified):
		return Problem{Type: ProblemUnverified, Title: "Request not verified", Status: http.StatusUnauthorized,
			Detail: strings.TrimPrefix(keyErrorDetail(err), "idemhttp: ") + "; the request was not processed."}, false
	case errors.Is(err, idem.ErrMissingKey):
		if m.key.v1 {
			return problemKeyMissing, true
		}
		return Problem{Type: ProblemKeyMissing, Title: "Idempotency key required", Status: http.StatusBadRequest,
			Detail: "This request must carry an idempotency key: " + keyErrorDetail(err) + "."}, true
	case m.key.v1:
		return Problem{Type: ProblemKeyInvalid, Title: "Invalid Idempotency-Key", Status: http.StatusBadRequest, Detail: keyErrorDetail(err)}, false
	}
	return Problem{Type: ProblemKeyInvalid, Title: "Invalid idempotency key", Status: http.StatusBadRequest, Detail: keyErrorDetail(err)}, false
}
