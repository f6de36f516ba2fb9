// Package webhook verifies webhook deliveries the way their senders sign
// them, and names the delivery's key, so that a sender's redeliveries can
// be deduplicated without letting anyone who can reach the endpoint choose
// a key.
//
// Why verify before claiming a key: a key taken from a sender's header
// without checking the sender's signature is a weapon. Whoever sends a
// forged delivery under a real delivery id first gets the forgery's
// response stored under that id, and the genuine delivery is then answered
// from the store and never runs. So a front end calls Verify on the raw
// body, before any key is claimed, and only a nil error yields a key:
//
//	key, err := v.Verify(r.Header, body, time.Now())
//	switch {
//	case errors.Is(err, webhook.ErrUnverified): // 401; forward nothing, claim nothing, count it
//	case errors.Is(err, webhook.ErrNoKey):      // genuine, but no key: the missing-key answer
//	default:                                    // claim key
//	}
//
// Verify returns no error that wraps neither.
//
// The presets (Lookup):
//
//	github             X-Hub-Signature-256: sha256=<hex HMAC-SHA256(secret, body)>
//	                   key: X-GitHub-Delivery
//	stripe             Stripe-Signature: t=<unix>,v1=<hex>[,v1=<hex>...]
//	                   v1 = HMAC-SHA256(secret, "<t>.<body>"), the secret's
//	                   bytes as given (whsec_... included), as Stripe's
//	                   libraries use it; tolerance 300 s
//	                   key: the "id" string of the JSON body's top-level object
//	shopify            X-Shopify-Hmac-Sha256: <base64 HMAC-SHA256(secret, body)>
//	                   key: X-Shopify-Webhook-Id
//	standard-webhooks  webhook-id, webhook-timestamp (unix seconds),
//	                   webhook-signature: v1,<base64>[ v1,<base64>...]
//	                   v1 = HMAC-SHA256(base64-decode(secret less "whsec_"),
//	                   "<id>.<timestamp>.<body>"); tolerance 300 s
//	                   key: webhook-id
//
// What verification guarantees, and where it stops:
//   - A delivery is accepted when any of the secrets gives any of the
//     header's signatures (several secrets while the receiver rotates,
//     several signatures while the sender does). Signatures are compared
//     with hmac.Equal, in time independent of where they differ.
//   - Where the scheme signs a timestamp (stripe, standard-webhooks), a
//     timestamp more than the tolerance before or after now is refused, so
//     a captured delivery cannot be replayed later than that.
//   - github and shopify sign neither a timestamp nor the delivery-id
//     header. Whoever has seen one genuine delivery (a log, a proxy) can
//     resend its body and signature at any time under any delivery id; the
//     schemes allow nothing better. What they do not allow is a body the
//     sender did not sign, so a forged delivery cannot take a real id
//     first. stripe's key is in the signed body and standard-webhooks'
//     webhook-id is signed: neither can be moved to another key.
//   - Errors say what was wrong (a header missing or malformed, the
//     timestamp outside the tolerance, no signature matching) and never
//     hold a secret, a computed signature or the body.
package webhook

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Sentinel errors; callers branch on them with errors.Is. The messages of
// the errors that wrap them name the preset and what was wrong, and are
// safe to log and to send back: they hold no secret or signature.
var (
	// ErrUnverified reports a delivery whose signature could not be
	// checked or did not match: a header missing or malformed, the
	// timestamp outside the tolerance, no signature made by any secret.
	// The delivery must not be forwarded and no key may be claimed for it.
	ErrUnverified = errors.New("webhook signature not verified")

	// ErrNoKey reports a delivery whose signature is genuine but which
	// names no key where its preset looks for one (a missing header, a
	// body that is not a JSON object or has no string "id"). It is not an
	// ErrUnverified.
	ErrNoKey = errors.New("webhook delivery has no key")
)

// DefaultTolerance is the timestamp tolerance of the stripe and
// standard-webhooks presets: Stripe's libraries' default and the Standard
// Webhooks specification's.
const DefaultTolerance = 5 * time.Minute

// A Preset is one sender's signature scheme and the place where it names
// the delivery. Get one with Lookup; the zero Preset is none.
type Preset struct {
	name string
	// Tolerance bounds how far a signed timestamp may be from now, before
	// or after. Lookup sets DefaultTolerance for the schemes that sign a
	// timestamp (stripe, standard-webhooks) and 0 for those that do not
	// (github, shopify), where any other value is an error in NewVerifier.
	// It counts in whole seconds, as the timestamps do.
	Tolerance time.Duration
	scheme    scheme
}

// Name is the preset's name as Lookup takes it.
func (p Preset) Name() string { return p.name }

type scheme int

const (
	schemeGitHub scheme = iota + 1
	schemeStripe
	schemeShopify
	schemeStandard
)

var presets = map[string]Preset{
	"github":            {name: "github", scheme: schemeGitHub},
	"stripe":            {name: "stripe", scheme: schemeStripe, Tolerance: DefaultTolerance},
	"shopify":           {name: "shopify", scheme: schemeShopify},
	"standard-webhooks": {name: "standard-webhooks", scheme: schemeStandard, Tolerance: DefaultTolerance},
}

// Names lists the presets' names, sorted.
func Names() []string {
	names := make([]string, 0, len(presets))
	for n := range presets {
		names = append(names, n)
	}
	slices.Sort(names)
	return names
}

// Lookup returns the preset named name; an unknown name is an error that
// lists the known ones.
func Lookup(name string) (Preset, error) {
	p, ok := presets[name]
	if !ok {
		return Preset{}, fmt.Errorf("webhook preset %q: want one of %s", name, strings.Join(Names(), ", "))
	}
	return p, nil
}

// A Verifier checks deliveries against one preset and its secrets. It is
// safe for concurrent use.
type Verifier struct {
	preset Preset
	keys   [][]byte // the HMAC keys, decoded from the secrets as the scheme wants
}

// NewVerifier returns a Verifier for the preset p under the secrets s. For
// standard-webhooks each secret must be base64 after an optional "whsec_"
// prefix (as the Standard Webhooks libraries accept it); an error names the
// secret's line and source, never its value.
func NewVerifier(p Preset, s Secrets) (*Verifier, error) {
	if p.scheme == 0 {
		return nil, errors.New("webhook: no preset (get one with Lookup)")
	}
	if len(s.lines) == 0 {
		return nil, errNoSecrets
	}
	switch signsTime := p.scheme == schemeStripe || p.scheme == schemeStandard; {
	case signsTime && p.Tolerance < time.Second:
		return nil, fmt.Errorf("webhook preset %s: tolerance %v: want at least 1s", p.name, p.Tolerance)
	case !signsTime && p.Tolerance != 0:
		return nil, fmt.Errorf("webhook preset %s: tolerance %v: want 0, the scheme signs no timestamp", p.name, p.Tolerance)
	}
	v := &Verifier{preset: p}
	for _, l := range s.lines {
		key := []byte(l.value)
		if p.scheme == schemeStandard {
			var err error
			key, err = base64.StdEncoding.DecodeString(strings.TrimPrefix(l.value, "whsec_"))
			if err != nil || len(key) == 0 {
				return nil, fmt.Errorf("webhook preset %s: the secret on line %d of %s: want whsec_ followed by base64", p.name, l.n, s.source)
			}
		}
		v.keys = append(v.keys, key)
	}
	return v, nil
}

// Verify checks the delivery with header h and raw body body, as received
// at now, and returns its key. The error wraps ErrUnverified when the
// signature is not genuine or cannot be checked, and ErrNoKey when it is
// genuine but the delivery names no key; the key is "" whenever the error
// is not nil. body must be the bytes as received: a body decoded and
// encoded again does not verify.
func (v *Verifier) Verify(h http.Header, body []byte, now time.Time) (string, error) {
	switch v.preset.scheme {
	case schemeGitHub:
		return v.verifyGitHub(h, body)
	case schemeStripe:
		return v.verifyStripe(h, body, now)
	case schemeShopify:
		return v.verifyShopify(h, body)
	default:
		return v.verifyStandard(h, body, now)
	}
}

func (v *Verifier) unverified(format string, args ...any) error {
	return fmt.Errorf("%w (%s): %s", ErrUnverified, v.preset.name, fmt.Sprintf(format, args...))
}

func (v *Verifier) noKey(format string, args ...any) error {
	return fmt.Errorf("%w (%s): %s", ErrNoKey, v.preset.name, fmt.Sprintf(format, args...))
}

// header returns the one value of the header name. Several values are
// refused: which one a sender meant, and which one an intermediary would
// read, is not clear.
func (v *Verifier) header(h http.Header, name, want string) (string, error) {
	vals := h.Values(name)
	switch {
	case len(vals) == 0 || len(vals) == 1 && strings.TrimSpace(vals[0]) == "":
		return "", v.unverified("header %s missing; want %s", name, want)
	case len(vals) > 1:
		return "", v.unverified("header %s sent %d times; want it once", name, len(vals))
	}
	return strings.TrimSpace(vals[0]), nil
}

// keyHeader returns the one value of the key header name of a verified
// delivery.
func (v *Verifier) keyHeader(h http.Header, name string) (string, error) {
	vals := h.Values(name)
	switch {
	case len(vals) == 0 || len(vals) == 1 && strings.TrimSpace(vals[0]) == "":
		return "", v.noKey("header %s missing", name)
	case len(vals) > 1:
		return "", v.noKey("header %s sent %d times; want it once", name, len(vals))
	}
	return strings.TrimSpace(vals[0]), nil
}

// matches reports whether any key's HMAC-SHA256 of the parts, in order,
// is any of sigs. Every pair is compared, whatever the outcome, with
// hmac.Equal.
func (v *Verifier) matches(sigs [][]byte, parts ...[]byte) bool {
	ok := false
	for _, key := range v.keys {
		m := hmac.New(sha256.New, key)
		for _, p := range parts {
			m.Write(p)
		}
		sum := m.Sum(nil)
		for _, sig := range sigs {
			if hmac.Equal(sum, sig) {
				ok = true
			}
		}
	}
	return ok
}

// inTolerance checks a signed unix timestamp against now.
func (v *Verifier) inTolerance(ts string, now time.Time) error {
	// Digits only: ParseInt would take a sign, and a negative time is no
	// sender's.
	sec, err := strconv.ParseInt(ts, 10, 64)
	if err != nil || ts[0] == '+' || ts[0] == '-' {
		// Not quoted: the value is the sender's (or a forger's), of any length.
		return v.unverified("timestamp malformed; want unix seconds")
	}
	tol := int64(v.preset.Tolerance / time.Second)
	nowSec := now.Unix()
	switch {
	case sec < nowSec-tol:
		return v.unverified("timestamp %d is %d s before now; want within %v", sec, nowSec-sec, v.preset.Tolerance)
	case sec > nowSec+tol:
		return v.unverified("timestamp %d is %d s after now; want within %v", sec, sec-nowSec, v.preset.Tolerance)
	}
	return nil
}

func (v *Verifier) verifyGitHub(h http.Header, body []byte) (string, error) {
	const want = "sha256=<hex HMAC-SHA256 of the body>"
	val, err := v.header(h, "X-Hub-Signature-256", want)
	if err != nil {
		return "", err
	}
	hexSig, ok := strings.CutPrefix(val, "sha256=")
	sig, err := hex.DecodeString(hexSig)
	if !ok || err != nil || len(sig) != sha256.Size {
		return "", v.unverified("header X-Hub-Signature-256 malformed; want %s", want)
	}
	if !v.matches([][]byte{sig}, body) {
		return "", v.unverified("no secret gives the X-Hub-Signature-256 signature of the body")
	}
	return v.keyHeader(h, "X-GitHub-Delivery")
}

func (v *Verifier) verifyShopify(h http.Header, body []byte) (string, error) {
	const want = "<base64 HMAC-SHA256 of the body>"
	val, err := v.header(h, "X-Shopify-Hmac-Sha256", want)
	if err != nil {
		return "", err
	}
	sig, err := base64.StdEncoding.DecodeString(val)
	if err != nil || len(sig) != sha256.Size {
		return "", v.unverified("header X-Shopify-Hmac-Sha256 malformed; want %s", want)
	}
	if !v.matches([][]byte{sig}, body) {
		return "", v.unverified("no secret gives the X-Shopify-Hmac-Sha256 signature of the body")
	}
	return v.keyHeader(h, "X-Shopify-Webhook-Id")
}

func (v *Verifier) verifyStripe(h http.Header, body []byte, now time.Time) (string, error) {
	const want = "t=<unix seconds>,v1=<hex HMAC-SHA256>[,v1=...]"
	val, err := v.header(h, "Stripe-Signature", want)
	if err != nil {
		return "", err
	}
	// Stripe's format: comma-separated key=value pairs; one t, one v1 per
	// signing secret, and other schemes (v0, test-mode extras) ignored, as
	// Stripe's libraries ignore them.
	var ts string
	var seenT bool
	var sigs [][]byte
	for item := range strings.SplitSeq(val, ",") {
		k, x, ok := strings.Cut(strings.TrimSpace(item), "=")
		if !ok {
			return "", v.unverified("header Stripe-Signature malformed (an item without \"=\"); want %s", want)
		}
		switch k {
		case "t":
			if seenT {
				return "", v.unverified("header Stripe-Signature malformed (t given twice); want %s", want)
			}
			ts, seenT = x, true
		case "v1":
			sig, err := hex.DecodeString(x)
			if err != nil || len(sig) != sha256.Size {
				return "", v.unverified("header Stripe-Signature malformed (a v1 that is not 64 hex digits); want %s", want)
			}
			sigs = append(sigs, sig)
		}
	}
	if !seenT || ts == "" || len(sigs) == 0 {
		return "", v.unverified("header Stripe-Signature malformed (no t or no v1); want %s", want)
	}
	if err := v.inTolerance(ts, now); err != nil {
		return "", err
	}
	if !v.matches(sigs, []byte(ts), []byte("."), body) {
		return "", v.unverified("no secret gives a v1 signature of the Stripe-Signature header")
	}
	return v.stripeID(body)
}

// stripeID returns the "id" string of the top-level JSON object body. The
// key is matched exactly (encoding/json's struct fields would match "ID"
// too), a second "id" is refused as ambiguous, and so is anything after
// the object.
func (v *Verifier) stripeID(body []byte) (string, error) {
	const want = "want a JSON object with a string \"id\""
	dec := json.NewDecoder(bytes.NewReader(body))
	if t, err := dec.Token(); err != nil || t != json.Delim('{') {
		return "", v.noKey("body is not a JSON object; %s", want)
	}
	var id *string
	for dec.More() {
		t, err := dec.Token()
		if err != nil {
			return "", v.noKey("body is not valid JSON; %s", want)
		}
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return "", v.noKey("body is not valid JSON; %s", want)
		}
		if t != "id" {
			continue
		}
		if id != nil {
			return "", v.noKey("body has \"id\" twice; %s", want)
		}
		var s string
		if err := json.Unmarshal(raw, &s); err != nil || raw[0] != '"' {
			return "", v.noKey("body's \"id\" is not a string; %s", want)
		}
		id = &s
	}
	if t, err := dec.Token(); err != nil || t != json.Delim('}') {
		return "", v.noKey("body is not valid JSON; %s", want)
	}
	if _, err := dec.Token(); err != io.EOF {
		return "", v.noKey("body has more after its JSON object; %s", want)
	}
	if id == nil || *id == "" {
		return "", v.noKey("body has no \"id\" or an empty one; %s", want)
	}
	return *id, nil
}

func (v *Verifier) verifyStandard(h http.Header, body []byte, now time.Time) (string, error) {
	id, err := v.header(h, "webhook-id", "the message id")
	if err != nil {
		return "", err
	}
	ts, err := v.header(h, "webhook-timestamp", "unix seconds")
	if err != nil {
		return "", err
	}
	const want = "v1,<base64 HMAC-SHA256>[ v1,<base64>...]"
	val, err := v.header(h, "webhook-signature", want)
	if err != nil {
		return "", err
	}
	// Space-separated versioned signatures; versions other than v1 (v1a,
	// the asymmetric one) are ignored, as the Standard Webhooks libraries
	// ignore them.
	var sigs [][]byte
	for item := range strings.FieldsSeq(val) {
		ver, b64, ok := strings.Cut(item, ",")
		if !ok {
			return "", v.unverified("header webhook-signature malformed (an item without \",\"); want %s", want)
		}
		if ver != "v1" {
			continue
		}
		sig, err := base64.StdEncoding.DecodeString(b64)
		if err != nil || len(sig) != sha256.Size {
			return "", v.unverified("header webhook-signature malformed (a v1 that is not base64 of 32 bytes); want %s", want)
		}
		sigs = append(sigs, sig)
	}
	if len(sigs) == 0 {
		return "", v.unverified("header webhook-signature malformed (no v1 signature); want %s", want)
	}
	if err := v.inTolerance(ts, now); err != nil {
		return "", err
	}
	if !v.matches(sigs, []byte(id), []byte("."), []byte(ts), []byte("."), body) {
		return "", v.unverified("no secret gives a v1 signature of the webhook-signature header")
	}
	// webhook-id is signed, so the key is the id just verified.
	return id, nil
}
