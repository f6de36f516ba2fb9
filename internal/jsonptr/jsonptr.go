// Package jsonptr parses RFC 6901 JSON Pointers and finds what they point
// to in a JSON document, for the key sources and fingerprints that read a
// request's body. It is here, not in idemhttp, so that a front end (the
// proxy's configuration, Caddy's) can refuse a malformed pointer with a
// one-line error when it is configured, not when a request comes.
package jsonptr

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
)

// A Pointer is a parsed JSON Pointer: its reference tokens, unescaped.
// The empty Pointer is the whole document.
type Pointer struct {
	text   string
	tokens []string
}

// Parse parses s, "" or a sequence of "/token", where a token's "~" must
// be followed by "0" (for "~") or "1" (for "/").
func Parse(s string) (Pointer, error) {
	if s == "" {
		return Pointer{}, nil
	}
	if s[0] != '/' {
		return Pointer{}, fmt.Errorf("JSON Pointer %q does not start with \"/\"; want \"\" or /field/field (RFC 6901)", s)
	}
	p := Pointer{text: s}
	for tok := range strings.SplitSeq(s[1:], "/") {
		for i := 0; i < len(tok); i++ {
			if tok[i] == '~' && (i+1 == len(tok) || (tok[i+1] != '0' && tok[i+1] != '1')) {
				return Pointer{}, fmt.Errorf("JSON Pointer %q has a \"~\" not followed by 0 or 1; write ~0 for \"~\" and ~1 for \"/\" (RFC 6901)", s)
			}
		}
		// ~1 first would turn "~01" into "/" instead of "~1".
		p.tokens = append(p.tokens, strings.ReplaceAll(strings.ReplaceAll(tok, "~1", "/"), "~0", "~"))
	}
	return p, nil
}

// String is the pointer as written.
func (p Pointer) String() string { return p.text }

// Tokens are the pointer's reference tokens, unescaped.
func (p Pointer) Tokens() []string { return p.tokens }

// Errors of Find.
var (
	ErrNotJSON   = errors.New("not JSON")
	ErrNotFound  = errors.New("nothing there")
	ErrAmbiguous = errors.New("a member on the way is in its object twice")
)

// Find returns the raw JSON value that p points to in doc. doc must be
// one valid JSON value (else ErrNotJSON). A member named on the way that
// is not there, an array index out of range or not a decimal index, or a
// step into a scalar is ErrNotFound; a member on the way that its object
// holds twice is ErrAmbiguous (parsers differ in which one they take, so
// neither is the request's).
func Find(doc []byte, p Pointer) (json.RawMessage, error) {
	if !json.Valid(doc) {
		return nil, ErrNotJSON
	}
	raw := json.RawMessage(bytes.TrimSpace(doc))
	for _, tok := range p.tokens {
		next, err := step(raw, tok)
		if err != nil {
			return nil, err
		}
		raw = next
	}
	return raw, nil
}

// step returns the member tok of the object raw, or its element tok if
// raw is an array. raw is valid JSON.
func step(raw json.RawMessage, tok string) (json.RawMessage, error) {
	dec := json.NewDecoder(bytes.NewReader(raw))
	t, _ := dec.Token()
	switch t {
	case json.Delim('{'):
		var found json.RawMessage
		for dec.More() {
			name, _ := dec.Token()
			var v json.RawMessage
			if err := dec.Decode(&v); err != nil {
				return nil, ErrNotJSON
			}
			if name != tok {
				continue
			}
			if found != nil {
				return nil, ErrAmbiguous
			}
			found = v
		}
		if found == nil {
			return nil, ErrNotFound
		}
		return found, nil
	case json.Delim('['):
		// RFC 6901: an index is "0" or digits without a leading zero.
		n, err := strconv.Atoi(tok)
		if err != nil || n < 0 || (len(tok) > 1 && tok[0] == '0') || tok[0] == '+' {
			return nil, ErrNotFound
		}
		for i := 0; dec.More(); i++ {
			var v json.RawMessage
			if err := dec.Decode(&v); err != nil {
				return nil, ErrNotJSON
			}
			if i == n {
				return v, nil
			}
		}
		return nil, ErrNotFound
	}
	return nil, ErrNotFound
}

// RemoveAll returns v, a document decoded with json.Decoder.UseNumber,
// with the values ps point to removed (a member deleted from its object,
// an element from its array). Every pointer names what it names in v as
// given, whatever the others remove: /a/0 and /a/1 remove the first two
// elements of /a. A pointer to nothing leaves v as it is; the empty
// pointer removes the whole document (nil, false).
func RemoveAll(v any, ps ...Pointer) (any, bool) {
	for _, p := range ps {
		if len(p.tokens) == 0 {
			return nil, false
		}
		v = remove(v, p.tokens)
	}
	return compact(v), true
}

// removedElement stands in for an array element that RemoveAll removes,
// until compact drops it, so that every pointer's indices are those of
// the document as given.
type removedElement struct{}

func compact(v any) any {
	switch c := v.(type) {
	case map[string]any:
		for k, child := range c {
			c[k] = compact(child)
		}
	case []any:
		out := c[:0]
		for _, e := range c {
			if _, gone := e.(removedElement); !gone {
				out = append(out, compact(e))
			}
		}
		return out
	}
	return v
}

func remove(v any, toks []string) any {
	tok, last := toks[0], len(toks) == 1
	switch c := v.(type) {
	case map[string]any:
		child, ok := c[tok]
		if !ok {
			return v
		}
		if last {
			delete(c, tok)
		} else {
			c[tok] = remove(child, toks[1:])
		}
	case []any:
		n, err := strconv.Atoi(tok)
		if err != nil || n < 0 || n >= len(c) || (len(tok) > 1 && tok[0] == '0') || tok[0] == '+' {
			return v
		}
		if _, gone := c[n].(removedElement); gone {
			return v
		}
		if last {
			c[n] = removedElement{}
		} else {
			c[n] = remove(c[n], toks[1:])
		}
	}
	return v
}

// Decode decodes doc, one JSON value, keeping numbers as written.
func Decode(doc []byte) (any, error) {
	dec := json.NewDecoder(bytes.NewReader(doc))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, ErrNotJSON
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, ErrNotJSON
	}
	return v, nil
}
