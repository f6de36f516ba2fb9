package idemhttp_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/memstore"
)

// keyServer serves an echo handler behind the middleware with cfg, and
// counts the handler's runs.
type keyServer struct {
	*httptest.Server
	runs atomic.Int64
}

func newKeyServer(t *testing.T, cfg idemhttp.Config) *keyServer {
	t.Helper()
	cfg.Logger = quietLogger()
	mw, err := idemhttp.NewMiddleware(memstore.New(memstore.Options{}), cfg)
	if err != nil {
		t.Fatal(err)
	}
	ks := &keyServer{}
	ks.Server = httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := ks.runs.Add(1)
		body, _ := io.ReadAll(r.Body)
		fmt.Fprintf(w, "run %d: %s", n, body)
	})))
	t.Cleanup(ks.Close)
	return ks
}

type keyAnswer struct {
	status   int
	body     string
	replayed bool
	problem  idemhttp.Problem
}

func (ks *keyServer) post(t *testing.T, body string, header ...string) keyAnswer {
	t.Helper()
	req, _ := http.NewRequest("POST", ks.URL+"/hooks", strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer tenant-1")
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Add(header[i], header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	a := keyAnswer{status: resp.StatusCode, body: string(b), replayed: resp.Header.Get(idemhttp.HeaderReplayed) == "true"}
	if resp.Header.Get("Content-Type") == "application/problem+json" {
		if err := json.Unmarshal(b, &a.problem); err != nil {
			t.Fatalf("problem body %q: %v", b, err)
		}
	}
	return a
}

func TestKeyFromJSONAnswers(t *testing.T) {
	long := strings.Repeat("k", 256)
	for _, c := range []struct {
		name, body string
		require    bool
		status     int
		problem    string // the problem type; "" for none
		detail     string // in the problem's detail
	}{
		{"string key", `{"id":"evt_1"}`, false, 200, "", ""},
		{"number key", `{"id":12345}`, true, 200, "", ""},
		{"field missing, not required", `{"type":"ping"}`, false, 200, "", ""},
		{"field missing, required", `{"type":"ping"}`, true, 400, idemhttp.ProblemKeyMissing, "no key at the body's field /id"},
		{"empty body, not required", ``, false, 200, "", ""},
		{"empty body, required", ``, true, 400, idemhttp.ProblemKeyMissing, "no body"},
		{"not JSON", `id=evt_1`, false, 400, idemhttp.ProblemKeyInvalid, "the body is not JSON"},
		{"truncated JSON", `{"id":"evt_1"`, false, 400, idemhttp.ProblemKeyInvalid, "the body is not JSON"},
		{"null", `{"id":null}`, false, 400, idemhttp.ProblemKeyInvalid, "not a string or a number"},
		{"object", `{"id":{"v":"evt_1"}}`, false, 400, idemhttp.ProblemKeyInvalid, "not a string or a number"},
		{"bool", `{"id":true}`, false, 400, idemhttp.ProblemKeyInvalid, "not a string or a number"},
		{"empty string", `{"id":""}`, false, 400, idemhttp.ProblemKeyInvalid, "1 to 255 printable ASCII"},
		{"too long", `{"id":"` + long + `"}`, false, 400, idemhttp.ProblemKeyInvalid, "1 to 255 printable ASCII"},
		{"control character", `{"id":"evt\u0001"}`, false, 400, idemhttp.ProblemKeyInvalid, "1 to 255 printable ASCII"},
		{"non-ASCII", `{"id":"évt"}`, false, 400, idemhttp.ProblemKeyInvalid, "1 to 255 printable ASCII"},
		{"twice", `{"id":"evt_1","id":"evt_2"}`, false, 400, idemhttp.ProblemKeyInvalid, "twice"},
		{"over the body limit, keyless", `{"type":"` + strings.Repeat("x", 64) + `"}`, false, 413, idemhttp.ProblemBodyTooLarge, "at most 48 bytes"},
	} {
		t.Run(c.name, func(t *testing.T) {
			limit := int64(0) // the default
			if c.status == 413 {
				limit = 48
			}
			ks := newKeyServer(t, idemhttp.Config{KeySource: idemhttp.KeyFromJSON("/id"), RequireKey: c.require, MaxBodySize: limit})
			a := ks.post(t, c.body)
			if a.status != c.status || a.problem.Type != c.problem || !strings.Contains(a.problem.Detail, c.detail) {
				t.Fatalf("got %d %+v, want %d %s with detail %q", a.status, a.problem, c.status, c.problem, c.detail)
			}
			wantRuns := int64(0)
			if c.status == 200 {
				wantRuns = 1
				// The handler gets the body the middleware read, whole.
				if want := "run 1: " + c.body; a.body != want {
					t.Errorf("got body %q, want %q", a.body, want)
				}
			}
			if got := ks.runs.Load(); got != wantRuns {
				t.Errorf("got %d runs, want %d", got, wantRuns)
			}
			// A keyed request replays; an unkeyed one runs again.
			b := ks.post(t, c.body)
			keyed := c.problem == "" && !strings.Contains(c.name, "missing") && !strings.Contains(c.name, "empty body")
			if keyed && (!b.replayed || b.body != a.body) {
				t.Errorf("second: got %+v, want a replay of %q", b, a.body)
			}
			if !keyed && b.replayed {
				t.Errorf("second: got a replay %+v of a request without a key", b)
			}
		})
	}
}

// Titles for a source other than Idempotency-Key do not name that header.
func TestKeyFromJSONProblemTitles(t *testing.T) {
	ks := newKeyServer(t, idemhttp.Config{KeySource: idemhttp.KeyFromJSON("/id"), RequireKey: true})
	if a := ks.post(t, `{}`); a.problem.Title != "Idempotency key required" || a.problem.Detail != "This request must carry an idempotency key: no key at the body's field /id." {
		t.Errorf("got %+v", a.problem)
	}
	if a := ks.post(t, `[`); a.problem.Title != "Invalid idempotency key" {
		t.Errorf("got %+v", a.problem)
	}
}

func TestKeyFromJSONPointers(t *testing.T) {
	body := []byte(`{"a/b": {"~c": [{"id": "first"}, {"id": "second", "n": 7}]}, "": {"": "empty-names"}, "top": 42.5e1}`)
	for _, c := range []struct {
		pointer, want string
		err           error
	}{
		{"/a~1b/~0c/1/id", "second", nil},
		{"/a~1b/~0c/0/id", "first", nil},
		{"/a~1b/~0c/1/n", "7", nil},
		{"/top", "42.5e1", nil}, // a number's key is as written
		{"//", "empty-names", nil},
		{"/a~1b/~0c/2/id", "", idem.ErrMissingKey},  // index out of range
		{"/a~1b/~0c/01/id", "", idem.ErrMissingKey}, // leading zero: not an index
		{"/a~1b/~0c/-/id", "", idem.ErrMissingKey},  // "-" is past the end
		{"/a/b", "", idem.ErrMissingKey},            // "/" unescaped splits the name
		{"/top/x", "", idem.ErrMissingKey},          // into a scalar
		{"/a~1b", "", idem.ErrInvalidKey},           // an object
		{"", "", idem.ErrInvalidKey},                // the whole body, an object
	} {
		got, err := idemhttp.KeyFromJSON(c.pointer).Key(nil, body)
		if got != c.want || !errors.Is(err, c.err) || (c.err == nil) != (err == nil) {
			t.Errorf("%q: got %q, %v; want %q, %v", c.pointer, got, err, c.want, c.err)
		}
	}
	if got, err := idemhttp.KeyFromJSON("").Key(nil, []byte(` "whole" `)); got != "whole" || err != nil {
		t.Errorf(`"" of a string body: got %q, %v`, got, err)
	}
}

func TestKeySourceConfigErrors(t *testing.T) {
	for _, c := range []struct {
		name string
		src  idemhttp.KeySource
		want string
	}{
		{"pointer without slash", idemhttp.KeyFromJSON("id"), `KeyFromJSON: JSON Pointer "id" does not start with "/"`},
		{"bad escape", idemhttp.KeyFromJSON("/a~2"), `"~" not followed by 0 or 1`},
		{"dangling escape", idemhttp.KeyFromJSON("/a~"), `"~" not followed by 0 or 1`},
		{"header name", idemhttp.KeyFromHeader("X Delivery"), `KeyFromHeader: "X Delivery" is not a header field name`},
		{"empty header name", idemhttp.KeyFromHeader(""), `KeyFromHeader: "" is not a header field name`},
		{"body, no function", idemhttp.KeySource{NeedsBody: true}, "NeedsBody but no Key function"},
	} {
		_, err := idemhttp.NewMiddleware(memstore.New(memstore.Options{}), idemhttp.Config{KeySource: c.src})
		if err == nil || !strings.Contains(err.Error(), c.want) || strings.Contains(err.Error(), "\n") {
			t.Errorf("%s: got %v, want one line with %q", c.name, err, c.want)
		}
	}
}

func TestKeyFromHeader(t *testing.T) {
	ks := newKeyServer(t, idemhttp.Config{KeySource: idemhttp.KeyFromHeader("x-github-delivery"), MaxBodySize: 16})
	first := ks.post(t, `{"a":1}`, "X-GitHub-Delivery", "72d3162e-cc78-11e3-81ab-4c9367dc0958")
	again := ks.post(t, `{"a":1}`, "X-GitHub-Delivery", "72d3162e-cc78-11e3-81ab-4c9367dc0958")
	if first.status != 200 || again.body != first.body || !again.replayed {
		t.Errorf("got %+v then %+v, want a replay", first, again)
	}
	// The Idempotency-Key header is not this source's.
	if a := ks.post(t, `{"a":1}`, "Idempotency-Key", "k1"); a.replayed || a.body != "run 2: {\"a\":1}" {
		t.Errorf("Idempotency-Key only: got %+v, want a pass-through", a)
	}
	if a := ks.post(t, `{}`, "X-GitHub-Delivery", "d1", "X-GitHub-Delivery", "d2"); a.status != 400 || a.problem.Detail != "more than one X-Github-Delivery header" {
		t.Errorf("twice: got %d %+v", a.status, a.problem)
	}
	if a := ks.post(t, `{}`, "X-GitHub-Delivery", `"unterminated`); a.problem.Detail != "X-Github-Delivery string has no closing quote" {
		t.Errorf("bad string: got %+v", a.problem)
	}
	// A header source reads no body before it has a key: a request
	// without one passes through whatever its size.
	big := strings.Repeat("x", 64)
	if a := ks.post(t, big); a.status != 200 || a.body != "run 3: "+big {
		t.Errorf("keyless, over the limit: got %d %q, want a pass-through", a.status, a.body)
	}
	if a := ks.post(t, big, "X-GitHub-Delivery", "d3"); a.status != 413 || a.problem.Detail != "Requests with an Idempotency-Key may carry at most 16 bytes of body." {
		t.Errorf("keyed, over the limit: got %d %+v, want 413", a.status, a.problem)
	}
}

// KeyFromHeader(HeaderKey) is the default, to the byte.
func TestKeyFromHeaderIdempotencyKeyIsDefault(t *testing.T) {
	def := newKeyServer(t, idemhttp.Config{RequireKey: true})
	named := newKeyServer(t, idemhttp.Config{RequireKey: true, KeySource: idemhttp.KeyFromHeader("idempotency-key")})
	for _, h := range [][]string{nil, {"Idempotency-Key", ""}, {"Idempotency-Key", "a", "Idempotency-Key", "b"}, {"Idempotency-Key", `"x`}} {
		a, b := def.post(t, `{}`, h...), named.post(t, `{}`, h...)
		if a != b || a.status != 400 {
			t.Errorf("%q: got %+v and %+v, want one 400", h, a, b)
		}
	}
}

// signedSource is a KeySource that verifies a toy signature over the
// body, as a webhook preset does, before it names the key.
var signedSource = idemhttp.KeySource{NeedsBody: true, Key: func(r *http.Request, body []byte) (string, error) {
	if r.Header.Get("X-Signature") != fmt.Sprintf("len=%d", len(body)) {
		return "", fmt.Errorf("%w: X-Signature does not match the body; want len=<bytes>", idemhttp.ErrKeyUnverified)
	}
	if r.Header.Get("X-Delivery") == "" {
		// Unverified and missing at once: unverified wins, never a pass-through.
		return "", errors.Join(idem.ErrMissingKey, idemhttp.ErrKeyUnverified)
	}
	return r.Header.Get("X-Delivery"), nil
}}

func TestKeySourceUnverified(t *testing.T) {
	ks := newKeyServer(t, idemhttp.Config{KeySource: signedSource})
	body := `{"event":"paid"}`
	forged := ks.post(t, `{"event":"refund"}`, "X-Signature", "len=1", "X-Delivery", "d-1")
	if forged.status != 401 || forged.problem.Type != idemhttp.ProblemUnverified ||
		forged.problem.Detail != "request not verified: X-Signature does not match the body; want len=<bytes>; the request was not processed." {
		t.Fatalf("forged: got %d %+v, want 401 %s", forged.status, forged.problem, idemhttp.ProblemUnverified)
	}
	if a := ks.post(t, body, "X-Signature", fmt.Sprintf("len=%d", len(body))); a.status != 401 {
		t.Errorf("an unverified error joined with a missing key: got %d %q, want 401", a.status, a.body)
	}
	if n := ks.runs.Load(); n != 0 {
		t.Fatalf("got %d runs of refused requests, want 0", n)
	}
	// Nothing was claimed: the genuine delivery under the same id runs.
	sig := fmt.Sprintf("len=%d", len(body))
	genuine := ks.post(t, body, "X-Signature", sig, "X-Delivery", "d-1")
	again := ks.post(t, body, "X-Signature", sig, "X-Delivery", "d-1")
	if genuine.status != 200 || genuine.body != "run 1: "+body || !again.replayed || again.body != genuine.body {
		t.Errorf("genuine: got %+v then %+v, want it run once and replayed", genuine, again)
	}
}

// A source of one's own has its key validated as an Idempotency-Key.
func TestKeySourceValidatesKey(t *testing.T) {
	ks := newKeyServer(t, idemhttp.Config{KeySource: idemhttp.KeySource{Key: func(r *http.Request, _ []byte) (string, error) {
		return r.Header.Get("X-Raw"), nil
	}}})
	if a := ks.post(t, `{}`, "X-Raw", "has space"); a.status != 200 {
		t.Errorf("got %d, want 200 (a space is printable ASCII)", a.status)
	}
	if a := ks.post(t, `{}`, "X-Raw", ""); a.status != 400 || a.problem.Type != idemhttp.ProblemKeyInvalid ||
		!strings.HasPrefix(a.problem.Detail, "the idempotency key must be 1 to 255 printable ASCII characters") {
		t.Errorf("got %d %+v, want 400 key-invalid", a.status, a.problem)
	}
}
