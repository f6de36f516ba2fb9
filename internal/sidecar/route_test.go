package sidecar

import (
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/memstore"
)

// testRoute is a route's middleware (Settings.Middleware, on a fresh
// memory store) in front of an upstream that counts its runs, served by
// an httptest server.
type testRoute struct {
	srv  *httptest.Server
	runs atomic.Int64
	reg  *prometheus.Registry
}

// newRoute serves s's middleware with env (its Metrics made, and
// registered on the route's registry, when nil) in front of upstream
// (nil: one that answers 201 "ran N").
func newRoute(t *testing.T, s Settings, env Env, tenant func(*http.Request) string, upstream http.Handler) *testRoute {
	t.Helper()
	if err := s.Validate(Underscored); err != nil {
		t.Fatalf("settings: %v", err)
	}
	rt := &testRoute{reg: prometheus.NewRegistry()}
	if env.Metrics == nil {
		env.Metrics = NewMetrics(Underscored)
	}
	if env.Logger == nil {
		env.Logger = slog.New(slog.DiscardHandler)
	}
	env.Metrics.Register(rt.reg)
	mw, err := s.Middleware(memstore.New(memstore.Options{}), tenant, nil, env)
	if err != nil {
		t.Fatalf("Middleware: %v", err)
	}
	if upstream == nil {
		upstream = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			io.Copy(io.Discard, r.Body)
			w.WriteHeader(http.StatusCreated)
			io.WriteString(w, "ran "+strconv.FormatInt(rt.runs.Load(), 10))
		})
	}
	counted := upstream
	upstream = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rt.runs.Add(1)
		counted.ServeHTTP(w, r)
	})
	rt.srv = httptest.NewServer(mw(upstream))
	t.Cleanup(rt.srv.Close)
	return rt
}

// answer is a response, its body read.
type answer struct {
	status int
	header http.Header
	body   string
}

// post sends a POST of body with the headers (name, value, ...).
func (rt *testRoute) post(t *testing.T, body string, headers ...string) answer {
	t.Helper()
	req, err := http.NewRequest("POST", rt.srv.URL+"/hook", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	resp, err := rt.srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return answer{resp.StatusCode, resp.Header, string(b)}
}

// metric is the value of the counter series name{label="value"} on the
// route's registry (-1: no such series).
func (rt *testRoute) metric(t *testing.T, name, label, value string) float64 {
	t.Helper()
	mfs, err := rt.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == label && l.GetValue() == value {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return -1
}

// problemType is the type of a problem+json answer ("" if a is none).
func problemType(a answer) string {
	if a.header.Get("Content-Type") != "application/problem+json" {
		return ""
	}
	var p idemhttp.Problem
	if json.Unmarshal([]byte(a.body), &p) != nil {
		return ""
	}
	return p.Type
}

// writeFile writes lines to a file of the test's and returns its path.
func writeFile(t *testing.T, name string, lines ...string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(path, []byte(strings.Join(lines, "\n")+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestFingerprintModes: what a retry must repeat of the body: its bytes
// (raw, the default), its canonical JSON (json), but for the excluded
// pointers (FingerprintExclude), or only the included ones
// (FingerprintFields).
func TestFingerprintModes(t *testing.T) {
	const sent = `{"amount":10,"attempt":1,"note":"x"}`
	const (
		reordered  = `{ "note": "x", "attempt": 1, "amount": 10 }`
		retried    = `{"amount":10,"attempt":2,"note":"x"}`
		renoted    = `{"amount":10,"attempt":1,"note":"y"}`
		reamounted = `{"amount":11,"attempt":1,"note":"x"}`
	)
	for _, c := range []struct {
		name          string
		set           func(*Settings)
		replay, clash []string // retries that replay, and that are a mismatch
	}{
		{"default", func(*Settings) {}, nil, []string{reordered, retried, renoted}},
		{"raw", func(s *Settings) { s.Fingerprint = "raw" }, nil, []string{reordered, retried}},
		{"json", func(s *Settings) { s.Fingerprint = "json" }, []string{reordered}, []string{retried, renoted, reamounted}},
		{"exclude", func(s *Settings) { s.FingerprintExclude = []string{"/attempt"} }, []string{reordered, retried}, []string{renoted, reamounted}},
		{"json, exclude", func(s *Settings) { s.Fingerprint, s.FingerprintExclude = "json", []string{"/attempt", "/note"} },
			[]string{reordered, retried, renoted}, []string{reamounted}},
		{"fields", func(s *Settings) { s.FingerprintFields = []string{"/amount"} }, []string{reordered, retried, renoted}, []string{reamounted}},
	} {
		s := DefaultSettings()
		c.set(&s)
		rt := newRoute(t, s, Env{}, func(*http.Request) string { return "t" }, nil)
		for i, retry := range append(c.replay, c.clash...) {
			key := "k" + strconv.Itoa(i)
			rt.post(t, sent, "Idempotency-Key", key, "Content-Type", "application/json")
			a := rt.post(t, retry, "Idempotency-Key", key, "Content-Type", "application/json")
			if replay := i < len(c.replay); replay && (a.status != http.StatusCreated || a.header.Get(idemhttp.HeaderReplayed) != "true") {
				t.Errorf("%s: retry %s: got %d %s, want the replay of 201", c.name, retry, a.status, a.body)
			} else if !replay && (a.status != http.StatusUnprocessableEntity || problemType(a) != idemhttp.ProblemMismatch) {
				t.Errorf("%s: retry %s: got %d %s, want 422 %s", c.name, retry, a.status, a.body, idemhttp.ProblemMismatch)
			}
		}
	}
}

// TestKeySettings: Key names where the key is: a header of the sender's,
// or a field of a JSON body; the Idempotency-Key header is then no key.
func TestKeySettings(t *testing.T) {
	for _, c := range []struct {
		key           string
		first, repeat []string // body, then headers
	}{
		{"header:X-Delivery", []string{"a", "X-Delivery", "d1"}, []string{"a", "X-Delivery", "d1", "Idempotency-Key", "other"}},
		{"json:/event/id", []string{`{"event":{"id":"e1"},"n":1}`}, []string{`{"n":1,"event":{"id":"e1"}}`}},
	} {
		s := DefaultSettings()
		s.Key, s.Fingerprint = c.key, "json"
		rt := newRoute(t, s, Env{}, func(*http.Request) string { return "t" }, nil)
		rt.post(t, c.first[0], c.first[1:]...)
		if a := rt.post(t, c.repeat[0], c.repeat[1:]...); a.header.Get(idemhttp.HeaderReplayed) != "true" || rt.runs.Load() != 1 {
			t.Errorf("key %s: the repeat got %d %s (%d runs), want the replay", c.key, a.status, a.body, rt.runs.Load())
		}
		if a := rt.post(t, "{}", "Idempotency-Key", "k"); a.status != http.StatusCreated || rt.runs.Load() != 2 {
			t.Errorf("key %s, Idempotency-Key alone: got %d (%d runs), want passed through", c.key, a.status, rt.runs.Load())
		}
		rt.post(t, "{}", "Idempotency-Key", "k")
		if n := rt.runs.Load(); n != 3 {
			t.Errorf("key %s: Idempotency-Key alone twice: %d runs in all, want 3 (not a key)", c.key, n)
		}
	}
}
