package main

import (
	"encoding/json"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
)

// TestProxyKeySourcesAndAnswers: the flags and a --config route of key
// sources, JSON fingerprints and answer profiles, end to end. The flags:
// the key from X-Request-Id, a retry counter left out of the fingerprint,
// Stripe's answers, the key echoed and the retention advertised. A route:
// the key from a JSON field, ACP's answers, no echo.
func TestProxyKeySourcesAndAnswers(t *testing.T) {
	t.Parallel()
	up := newTestUpstream(t)
	cfg := filepath.Join(t.TempDir(), "routes.yaml")
	writeFile(t, cfg, "routes:\n  - match: \"POST /orders\"\n    key: json:/id\n    profile: acp\n    echo_key: false\n")
	p := startProxy(t, nil, "--upstream", up.URL, "--config", cfg, "--key-header", "X-Request-Id", "--fingerprint-exclude", "/attempt",
		"--profile", "stripe", "--echo-key", "--lifetime-header", "--retention", "90m")

	if !strings.Contains(p.logText(), `"key":"header:X-Request-Id"`) {
		t.Errorf("the start-up line does not name the key source --key-header X-Request-Id:\n%s", p.logText())
	}
	first := mustSend(t, "POST", p.url("/pay"), "", `{"amount":5,"attempt":1}`, "X-Request-Id: r-1")
	wantStatus(t, "the first delivery of r-1", first, http.StatusCreated, "")
	if got := first.header.Get("Idempotency-Key"); got != "r-1" {
		t.Errorf("--echo-key: got Idempotency-Key %q, want r-1 (the key X-Request-Id carried)", got)
	}
	if got := first.header.Get("Idempotency-Key-Lifetime"); got != "PT1H30M" {
		t.Errorf("--lifetime-header with --retention 90m: got Idempotency-Key-Lifetime %q, want PT1H30M", got)
	}
	// Another attempt, its members reordered: the same request.
	if r := mustSend(t, "POST", p.url("/pay"), "", `{"attempt":2, "amount":5}`, "X-Request-Id: r-1"); !r.replayed() || r.header.Get("Idempotency-Key") != "r-1" {
		t.Errorf("r-1 with attempt 2: got %d replayed %v echo %q, want the replay, echoed", r.status, r.replayed(), r.header.Get("Idempotency-Key"))
	}
	// Another amount: Stripe's 400.
	r := mustSend(t, "POST", p.url("/pay"), "", `{"amount":6,"attempt":3}`, "X-Request-Id: r-1")
	var stripe struct {
		Error struct{ Type string } `json:"error"`
	}
	if r.status != http.StatusBadRequest || json.Unmarshal(r.body, &stripe) != nil || stripe.Error.Type != "idempotency_error" {
		t.Errorf("r-1 with another amount under --profile stripe: got %d %s, want 400 {\"error\":{\"type\":\"idempotency_error\",...}}", r.status, r.body)
	}
	// The Idempotency-Key header is not the key here: no key, passed through.
	if r := mustSend(t, "POST", p.url("/pay"), "k-1", `{}`); r.status != http.StatusCreated || r.header.Get("Idempotency-Key") != "" {
		t.Errorf("Idempotency-Key without X-Request-Id: got %d echo %q, want 201 passed through, no key to echo", r.status, r.header.Get("Idempotency-Key"))
	}
	if got, k1 := up.runsOf(""), up.runsOf("k-1"); got != 1 || k1 != 1 {
		t.Errorf("the upstream ran %d requests without Idempotency-Key and %d with k-1, want 1 (r-1, once) and 1", got, k1)
	}

	// The route: the key is /id of the body; ACP's 409 for another body.
	wantStatus(t, "order o-1", mustSend(t, "POST", p.url("/orders"), "", `{"id":"o-1","n":1}`), http.StatusCreated, "")
	if r := mustSend(t, "POST", p.url("/orders"), "", `{"id":"o-1","n":1}`); !r.replayed() || r.header.Get("Idempotency-Key") != "" {
		t.Errorf("order o-1 again: got %d replayed %v echo %q, want the replay, not echoed (echo_key: false)", r.status, r.replayed(), r.header.Get("Idempotency-Key"))
	}
	r = mustSend(t, "POST", p.url("/orders"), "", `{"id":"o-1","n":2}`)
	var acp struct{ Type, Code string }
	if r.status != http.StatusConflict || json.Unmarshal(r.body, &acp) != nil || acp.Code != "idempotency_conflict" {
		t.Errorf("order o-1 with another body under profile acp: got %d %s, want 409 code idempotency_conflict", r.status, r.body)
	}
}
