package idemhttp_test

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
)

func fpOf(f func(*http.Request, []byte) idem.Fingerprint, body string) idem.Fingerprint {
	r := httptest.NewRequest("POST", "/hooks?x=1", strings.NewReader(body))
	r.Header.Set("Content-Type", "application/json")
	return f(r, []byte(body))
}

func TestFingerprintJSON(t *testing.T) {
	fp := idemhttp.FingerprintJSON("/attempt", "/meta/sent~1at", "/items/1")
	base := `{"id":"evt_1","amount":5,"attempt":1,"meta":{"sent/at":"t1","x":[1,2]},"items":["a","b","c"],"s":"é"}`
	for _, c := range []struct {
		name, body string
		same       bool
	}{
		{"the same bytes", base, true},
		{"members reordered, spaced, numbers and strings written otherwise",
			"{ \"s\":\"\\u00e9\", \"items\":[\"a\",\"B\",\"c\"],\n\t\"meta\":{\"x\":[1.0,2e0],\"sent/at\":\"t2\"}, \"attempt\":2, \"amount\":0.5E1, \"id\":\"evt_1\" }", true},
		{"an excluded field gone", `{"id":"evt_1","amount":5,"meta":{"sent/at":"t1","x":[1,2]},"items":["a","b","c"],"s":"é"}`, true},
		{"a non-excluded field changed", strings.Replace(base, `"amount":5`, `"amount":6`, 1), false},
		{"a nested non-excluded field changed", strings.Replace(base, `"x":[1,2]`, `"x":[2,1]`, 1), false},
		{"a non-excluded element changed", strings.Replace(base, `"c"]`, `"d"]`, 1), false},
		{"a field added", strings.Replace(base, `{"id"`, `{"new":1,"id"`, 1), false},
		{"a number's type changed", strings.Replace(base, `"amount":5`, `"amount":"5"`, 1), false},
	} {
		a, b := fpOf(fp, base), fpOf(fp, c.body)
		if (a == b) != c.same {
			t.Errorf("%s: got same=%v, want %v", c.name, a == b, c.same)
		}
	}
	// Method, path, query and Content-Type count as in DefaultFingerprint.
	r := httptest.NewRequest("POST", "/hooks?x=2", nil)
	r.Header.Set("Content-Type", "application/json")
	if fp(r, []byte(base)) == fpOf(fp, base) {
		t.Error("another query: got the same fingerprint")
	}
}

// A body that is not I-JSON is fingerprinted raw, as by DefaultFingerprint.
func TestFingerprintJSONRawFallback(t *testing.T) {
	fp := idemhttp.FingerprintJSON("/attempt")
	for _, body := range []string{"amount=5&attempt=1", `{"a":1,"a":2}`, `{"n":1e400}`, "{\"s\":\"\xff\"}", ``} {
		if got, want := fpOf(fp, body), fpOf(idemhttp.DefaultFingerprint, body); got != want {
			t.Errorf("%q: got %x, want DefaultFingerprint's %x", body, got, want)
		}
	}
	// Two members of one name: not canonicalised into the last one.
	if fpOf(fp, `{"a":1,"a":2}`) == fpOf(fp, `{"a":2}`) {
		t.Error(`{"a":1,"a":2} and {"a":2}: got one fingerprint`)
	}
	if fpOf(fp, "amount=5&attempt=1") == fpOf(fp, "amount=5&attempt=2") {
		t.Error("a form body is not parsed, so any change in it must change its fingerprint: got one fingerprint")
	}
}

// The RFC 8785 examples: bodies that differ only in their serialisation.
func TestFingerprintJSONCanonicalForm(t *testing.T) {
	fp := idemhttp.FingerprintJSON()
	for _, c := range [][2]string{
		// RFC 8785 §3.2.2.3 numbers.
		{`[1E30, 4.50, 2e-3, 0.000000000000000000000000001, -0]`, `[1e+30,4.5,0.002,1e-27,0]`},
		// §3.2.3 sorting by UTF-16 code units: "\u20ac" sorts after "\ud83d\ude00".
		{`{"\u20ac":"Euro Sign","\r":"Carriage Return","\ud83d\ude00":"Emoji","1":"One"}`, `{"\r":"Carriage Return","1":"One","😀":"Emoji","€":"Euro Sign"}`},
		// §3.2.2.2 strings: escapes only where required.
		{`{"s":"\u0041\u000f\u0022"}`, `{"s":"A\u000f\""}`},
	} {
		if fpOf(fp, c[0]) != fpOf(fp, c[1]) {
			t.Errorf("%s and %s: got two fingerprints, want one", c[0], c[1])
		}
		if fpOf(fp, c[0]) == fpOf(idemhttp.DefaultFingerprint, c[0]) {
			t.Errorf("%s: got DefaultFingerprint's, want its canonical form's", c[0])
		}
	}
	// The canonical form is hashed as DefaultFingerprint hashes a body.
	if canon := `[1e+30,4.5,0.002,1e-27,0]`; fpOf(fp, canon) != fpOf(idemhttp.DefaultFingerprint, canon) {
		t.Error("a canonical body: got another fingerprint than DefaultFingerprint's")
	}
}

func TestFingerprintJSONFields(t *testing.T) {
	fp := idemhttp.FingerprintJSONFields("/id", "/data/amount", "/data/currency")
	base := `{"id":"evt_1","created":1,"data":{"amount":500,"currency":"eur","note":"x"}}`
	for _, c := range []struct {
		name, body string
		same       bool
	}{
		{"fields outside the subset changed", `{"data":{"note":"y","currency":"eur","amount":5e2},"created":2,"id":"evt_1"}`, true},
		{"an included field changed", strings.Replace(base, `500`, `501`, 1), false},
		{"an included field gone", strings.Replace(base, `"currency":"eur",`, ``, 1), false},
		{"an included field null", strings.Replace(base, `"currency":"eur"`, `"currency":null`, 1), false},
	} {
		if (fpOf(fp, base) == fpOf(fp, c.body)) != c.same {
			t.Errorf("%s: got same=%v, want %v", c.name, !c.same, c.same)
		}
	}
	if fpOf(fp, strings.Replace(base, `"currency":"eur",`, ``, 1)) == fpOf(fp, strings.Replace(base, `"currency":"eur"`, `"currency":null`, 1)) {
		t.Error("absent and null: got one fingerprint")
	}
}

func TestFingerprintJSONPanics(t *testing.T) {
	for _, c := range []struct {
		name string
		f    func()
		want string
	}{
		{"no slash", func() { idemhttp.FingerprintJSON("attempt") }, `idemhttp: FingerprintJSON: JSON Pointer "attempt" does not start with "/"`},
		{"whole body", func() { idemhttp.FingerprintJSON("") }, `excludes the whole body`},
		{"bad escape", func() { idemhttp.FingerprintJSONFields("/a~x") }, `idemhttp: FingerprintJSONFields: JSON Pointer "/a~x" has a "~" not followed by 0 or 1`},
	} {
		func() {
			defer func() {
				if got, _ := recover().(string); !strings.Contains(got, c.want) {
					t.Errorf("%s: got panic %q, want %q", c.name, got, c.want)
				}
			}()
			c.f()
		}()
	}
}

// Through the middleware: a sender's redelivery with a new attempt count
// and timestamp replays; a changed amount under the same id is a 422.
func TestFingerprintJSONRedelivery(t *testing.T) {
	ks := newKeyServer(t, idemhttp.Config{KeySource: idemhttp.KeyFromJSON("/id"), Fingerprint: idemhttp.FingerprintJSON("/attempt", "/sent_at")})
	first := ks.post(t, `{"id":"evt_1","amount":500,"attempt":1,"sent_at":"2026-12-02T01:00:00Z"}`)
	redelivery := ks.post(t, `{"sent_at":"2026-12-02T01:05:00Z", "attempt":2, "amount":500, "id":"evt_1"}`)
	changed := ks.post(t, `{"id":"evt_1","amount":501,"attempt":3,"sent_at":"2026-12-02T01:10:00Z"}`)
	if first.status != 200 || !redelivery.replayed || redelivery.body != first.body {
		t.Errorf("got %+v then %+v, want the redelivery replayed", first, redelivery)
	}
	if changed.status != 422 || changed.problem.Type != idemhttp.ProblemMismatch {
		t.Errorf("changed amount: got %d %+v, want 422 %s", changed.status, changed.problem, idemhttp.ProblemMismatch)
	}
	if n := ks.runs.Load(); n != 1 {
		t.Errorf("got %d runs, want 1", n)
	}
}
