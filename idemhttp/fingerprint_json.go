package idemhttp

import (
	"encoding/json"
	"fmt"
	"net/http"

	"github.com/gowebpki/jcs"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/jsonptr"
)

// FingerprintJSON returns a Config.Fingerprint over the body's canonical
// JSON (RFC 8785, JCS: members sorted, no white space, numbers and strings
// in one form) with the members or elements the JSON Pointers exclude
// (RFC 6901) removed, and the method, path, query and Content-Type as
// DefaultFingerprint has them. A retry that reorders members, spaces them
// otherwise, or changes only an excluded field (a sender's attempt counter
// or timestamp) is a replay, not a mismatch; any other change is a 422.
// A pointer that points to nothing in a body leaves it as it is, and each
// names what it names in the body as sent ("/items/0" and "/items/1"
// exclude the first two elements).
//
// A body that is not one I-JSON value (RFC 7493: not JSON, a member twice
// in one object, a string that is not UTF-8, a number out of range) is
// fingerprinted as it is, raw, as DefaultFingerprint does: such a body
// has no one canonical form, and parsers differ in what they read from a
// member given twice. The body is read whatever the Content-Type, which
// is in the fingerprint.
//
// It panics if a pointer is malformed, or is "" (the whole body: use a
// Fingerprint that leaves the body out instead).
func FingerprintJSON(exclude ...string) func(r *http.Request, body []byte) idem.Fingerprint {
	ptrs := mustPointers("FingerprintJSON", exclude)
	return func(r *http.Request, body []byte) idem.Fingerprint {
		return DefaultFingerprint(r, canonicalWithout(body, ptrs))
	}
}

// FingerprintJSONFields returns a Config.Fingerprint over the fields the
// JSON Pointers include, and nothing else of the body: the canonical JSON
// (RFC 8785) of an object whose members are the pointers, as written,
// and their values (a pointer to nothing is left out, so a field that is
// absent differs from one that is null), with the method, path, query and
// Content-Type as DefaultFingerprint has them. A body that is not I-JSON
// is fingerprinted raw, as FingerprintJSON says. It panics if a pointer is
// malformed.
func FingerprintJSONFields(include ...string) func(r *http.Request, body []byte) idem.Fingerprint {
	ptrs := mustPointers("FingerprintJSONFields", include)
	return func(r *http.Request, body []byte) idem.Fingerprint {
		return DefaultFingerprint(r, canonicalFields(body, ptrs))
	}
}

func mustPointers(fn string, ss []string) []jsonptr.Pointer {
	ps := make([]jsonptr.Pointer, 0, len(ss))
	for _, s := range ss {
		p, err := jsonptr.Parse(s)
		if err != nil {
			panic(fmt.Sprintf("idemhttp: %s: %v", fn, err))
		}
		if s == "" && fn == "FingerprintJSON" {
			panic(`idemhttp: FingerprintJSON: the pointer "" excludes the whole body; want /field, or a Fingerprint that leaves the body out`)
		}
		ps = append(ps, p)
	}
	return ps
}

// canonicalWithout is the JCS form of body less what ptrs point to, or
// body itself if it is not I-JSON.
func canonicalWithout(body []byte, ptrs []jsonptr.Pointer) []byte {
	c, err := jcs.Transform(body)
	if err != nil {
		return body
	}
	if len(ptrs) == 0 {
		return c
	}
	// c is I-JSON: it decodes, and what is left of it encodes again
	// (numbers as JCS wrote them, which json.Number keeps).
	v, err := jsonptr.Decode(c)
	if err != nil {
		return body
	}
	v, _ = jsonptr.RemoveAll(v, ptrs...)
	return transformValue(v, body)
}

// canonicalFields is the JCS form of the object {pointer: value} of the
// values ptrs point to in body, or body itself if it is not I-JSON.
func canonicalFields(body []byte, ptrs []jsonptr.Pointer) []byte {
	c, err := jcs.Transform(body)
	if err != nil {
		return body
	}
	fields := make(map[string]json.RawMessage, len(ptrs))
	for _, p := range ptrs {
		if v, err := jsonptr.Find(c, p); err == nil {
			fields[p.String()] = v
		}
	}
	return transformValue(fields, body)
}

func transformValue(v any, body []byte) []byte {
	b, err := json.Marshal(v)
	if err != nil {
		return body
	}
	c, err := jcs.Transform(b)
	if err != nil {
		return body
	}
	return c
}
