package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/proctest"
)

// curlPost sends a POST through curl (another HTTP client than Go's),
// with extra curl arguments, and parses its answer.
func curlPost(t *testing.T, url, key, body string, args ...string) result {
	t.Helper()
	all := append([]string{"-sS", "-i", "--max-time", "10", "-X", "POST", "-H", "Content-Type: application/json",
		"-H", idemhttp.HeaderKey + ": " + key, "--data-binary", body}, args...)
	out, err := exec.Command(proctest.RequireTool(t, "curl"), append(all, url)...).Output()
	if err != nil {
		t.Fatalf("curl %q: %v", all, err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(bytes.NewReader(out)), nil)
	if err != nil {
		t.Fatalf("curl's answer %q: %v", out, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return result{resp.StatusCode, resp.Header, b}
}

// Web apps behind the proxy authenticate with a session cookie. With the
// default tenant, one key from two sessions never hands one the other's
// response (the reproduced defect: Mallory got Alice's 201): it is a 422,
// and the upstream ran once. Bearer tokens and requests with neither
// behave as before.
func TestProxyCookieClientsIsolated(t *testing.T) {
	t.Parallel()
	up := newTestUpstream(t)
	p := startProxy(t, nil, "--upstream", up.URL)
	const body = `{"order":1001}`

	alice := curlPost(t, p.url("/orders"), "order-1001", body, "-b", "session=alice")
	if alice.status != http.StatusCreated || alice.replayed() {
		t.Fatalf("alice: got %d %v, want 201 executed", alice.status, alice.header)
	}
	mallory := curlPost(t, p.url("/orders"), "order-1001", body, "-b", "session=mallory")
	if mallory.replayed() || bytes.Equal(mallory.body, alice.body) {
		t.Fatalf("mallory got alice's response: %d %s %v", mallory.status, mallory.body, mallory.header)
	}
	wantStatus(t, "mallory", mallory, http.StatusUnprocessableEntity, idemhttp.ProblemMismatch)
	again := curlPost(t, p.url("/orders"), "order-1001", body, "-b", "session=alice")
	if !again.replayed() || !bytes.Equal(again.body, alice.body) {
		t.Errorf("alice's retry: got %d %s, want the replay of %s", again.status, again.body, alice.body)
	}
	if n := up.runsOf("order-1001"); n != 1 {
		t.Errorf("upstream executions: got %d, want 1", n)
	}

	// Two bearer tokens: two executions; a token's retry replays.
	a := mustSend(t, "POST", p.url("/orders"), "tok", body, "Authorization: Bearer a")
	b := mustSend(t, "POST", p.url("/orders"), "tok", body, "Authorization: Bearer b")
	if b.replayed() || bytes.Equal(a.body, b.body) {
		t.Errorf("second token: got %d %s, want its own execution", b.status, b.body)
	}
	if r := mustSend(t, "POST", p.url("/orders"), "tok", body, "Authorization: Bearer a"); !r.replayed() || !bytes.Equal(r.body, a.body) {
		t.Errorf("first token's retry: got %d %s, want the replay of %s", r.status, r.body, a.body)
	}
	// Neither a cookie nor a token: a replay, as before.
	first := mustSend(t, "POST", p.url("/orders"), "anon", body)
	if r := mustSend(t, "POST", p.url("/orders"), "anon", body); !r.replayed() || !bytes.Equal(r.body, first.body) {
		t.Errorf("no credentials: got %d %s, want the replay of %s", r.status, r.body, first.body)
	}
	if up.runsOf("tok") != 2 || up.runsOf("anon") != 1 {
		t.Errorf("upstream executions: tok %d, anon %d; want 2 and 1", up.runsOf("tok"), up.runsOf("anon"))
	}
	if n := p.metric(`idem_requests_total{outcome="mismatch"}`); n != 1 {
		t.Errorf(`idem_requests_total{outcome="mismatch"}: got %v, want 1`, n)
	}
}

// --tenant-cookie names the session cookie: other cookies may change
// between retries and still replay, another session runs its own request;
// a route of the --config file sets its own source, which replaces the
// flags'.
func TestProxyTenantCookie(t *testing.T) {
	t.Parallel()
	up := newTestUpstream(t)
	p := startProxy(t, nil, "--upstream", up.URL, "--tenant-cookie", "session")
	alice := curlPost(t, p.url("/orders"), "k", "{}", "-b", "session=alice; tracking=1")
	again := curlPost(t, p.url("/orders"), "k", "{}", "-b", "tracking=2; session=alice")
	if !again.replayed() || !bytes.Equal(again.body, alice.body) {
		t.Errorf("same session, another tracking cookie: got %d %s, want the replay of %s", again.status, again.body, alice.body)
	}
	mallory := curlPost(t, p.url("/orders"), "k", "{}", "-b", "session=mallory; tracking=2")
	if mallory.replayed() || mallory.status != http.StatusCreated {
		t.Errorf("another session: got %d %s, want its own execution", mallory.status, mallory.body)
	}
	if n := up.runsOf("k"); n != 2 {
		t.Errorf("upstream executions: got %d, want 2 (alice, mallory)", n)
	}

	cfg := filepath.Join(t.TempDir(), "routes.yaml")
	writeFile(t, cfg, "routes:\n  - match: \"POST /web/\"\n    tenant_cookie: session\n")
	q := startProxy(t, nil, "--upstream", up.URL, "--tenant-header", "X-Tenant", "--config", cfg)
	// /web/: the cookie is the tenant, X-Tenant plays no part.
	w1 := mustSend(t, "POST", q.url("/web/orders"), "w", "{}", "Cookie: session=alice", "X-Tenant: a")
	if w2 := mustSend(t, "POST", q.url("/web/orders"), "w", "{}", "Cookie: session=alice", "X-Tenant: b"); !w2.replayed() || !bytes.Equal(w2.body, w1.body) {
		t.Errorf("tenant_cookie route, same session: got %d %s, want the replay of %s", w2.status, w2.body, w1.body)
	}
	if w3 := mustSend(t, "POST", q.url("/web/orders"), "w", "{}", "Cookie: session=bob", "X-Tenant: a"); w3.replayed() {
		t.Errorf("tenant_cookie route, another session: got a replay %s", w3.body)
	}
	// Elsewhere: --tenant-header.
	mustSend(t, "POST", q.url("/api/orders"), "h", "{}", "Cookie: session=alice", "X-Tenant: a")
	if h := mustSend(t, "POST", q.url("/api/orders"), "h", "{}", "Cookie: session=alice", "X-Tenant: b"); h.replayed() {
		t.Errorf("--tenant-header route, another tenant: got a replay %s", h.body)
	}
	// A client's own X-Tenant sent beside the gateway's (a gateway that
	// appends) is never the tenant of one of its values.
	mustSend(t, "POST", q.url("/api/orders"), "v", "{}", "X-Tenant: victim")
	if spoof := curlPost(t, q.url("/api/orders"), "v", "{}", "-H", "X-Tenant: victim", "-H", "X-Tenant: mallory"); spoof.replayed() {
		t.Errorf("--tenant-header sent twice: got the replay of the first value's response %s", spoof.body)
	}
	if up.runsOf("w") != 2 || up.runsOf("h") != 2 || up.runsOf("v") != 2 {
		t.Errorf("upstream executions: w %d, h %d, v %d; want 2, 2 and 2", up.runsOf("w"), up.runsOf("h"), up.runsOf("v"))
	}
}

// One tenant source per route: both is a usage error naming them.
func TestProxyTenantSourceUsage(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	writeFile(t, filepath.Join(dir, "both.yaml"), "routes:\n  - match: \"POST /web/\"\n    tenant_cookie: session\n    tenant_header: X-Tenant\n")
	writeFile(t, filepath.Join(dir, "bad-cookie.yaml"), "routes:\n  - match: \"POST /web/\"\n    tenant_cookie: \"a b\"\n")
	for _, c := range []struct {
		args []string
		want []string
	}{
		{[]string{"proxy", "--upstream", "http://u", "--tenant-header", "X-Tenant", "--tenant-cookie", "session"},
			[]string{"--tenant-header", "--tenant-cookie", "not both"}},
		{[]string{"proxy", "--upstream", "http://u", "--tenant-cookie", "a;b"}, []string{"--tenant-cookie", "not a cookie name"}},
		{cfgArgs(dir, "both.yaml"), []string{"both.yaml", "routes[0]", "tenant_header", "tenant_cookie", "not both"}},
		{cfgArgs(dir, "bad-cookie.yaml"), []string{"bad-cookie.yaml", "tenant_cookie", "not a cookie name"}},
	} {
		code, stderr := runIdem(t, nil, c.args...)
		if code != 2 {
			t.Errorf("%q: got exit status %d, want 2; stderr:\n%s", c.args, code, stderr)
			continue
		}
		for _, w := range c.want {
			if !strings.Contains(stderr, w) {
				t.Errorf("%q: stderr %q does not mention %q", c.args, stderr, w)
			}
		}
	}
}

// Over --max-response without --blob: the first client gets the whole
// response; a replay is a 500 response-not-kept problem that names the
// status the request ran with, never a 201 with an empty body; the proxy
// counts each such response in idem_responses_not_kept_total and warns
// once per route.
func TestProxyResponseNotKept(t *testing.T) {
	t.Parallel()
	up := newTestUpstream(t)
	cfg := filepath.Join(t.TempDir(), "routes.yaml")
	writeFile(t, cfg, "routes:\n  - match: \"POST /reports/{id}\"\n")
	p := startProxy(t, nil, "--upstream", up.URL, "--max-response", "1KiB", "--config", cfg)
	big := `{"pad":"` + strings.Repeat("x", 2000) + `"}` // the test upstream echoes it: over 1 KiB
	if n := p.metric("idem_responses_not_kept_total"); n != 0 {
		t.Fatalf("idem_responses_not_kept_total at start: got %v, want 0", n)
	}
	for _, id := range []string{"1", "2"} {
		first := mustSend(t, "POST", p.url("/reports/"+id), "big-"+id, big)
		if first.status != http.StatusCreated || first.replayed() || !bytes.Contains(first.body, []byte(strings.Repeat("x", 2000))) {
			t.Fatalf("first answer: got %d, %d bytes, %v; want 201 with the whole body", first.status, len(first.body), first.header)
		}
	}
	r := curlPost(t, p.url("/reports/1"), "big-1", big)
	wantStatus(t, "replay", r, http.StatusInternalServerError, idemhttp.ProblemResponseNotKept)
	var prob map[string]any
	json.Unmarshal(r.body, &prob)
	if !r.replayed() || r.header.Get(idemhttp.HeaderBodyOmitted) != "true" || r.header.Get(idemhttp.HeaderOriginalStatus) != "201" ||
		prob["status_executed"] != 201.0 {
		t.Errorf("replay: got %v %s; want replayed, body omitted, original status 201", r.header, r.body)
	}
	if n := up.runsOf("big-1"); n != 1 {
		t.Errorf("upstream executions: got %d, want 1", n)
	}
	if n := p.metric("idem_responses_not_kept_total"); n != 2 {
		t.Errorf("idem_responses_not_kept_total: got %v, want 2", n)
	}
	if n := p.metric(`idem_requests_total{outcome="replayed"}`); n != 1 {
		t.Errorf(`idem_requests_total{outcome="replayed"}: got %v, want 1`, n)
	}
	// The warning is written before the record completes; the log is read
	// by another goroutine: wait for it (bounded).
	for deadline := time.Now().Add(5 * time.Second); !strings.Contains(p.logText(), "stored without its body") && time.Now().Before(deadline); {
		time.Sleep(20 * time.Millisecond)
	}
	warns := 0
	for line := range strings.Lines(p.logText()) {
		var rec struct{ Level, Msg, Route string }
		if json.Unmarshal([]byte(line), &rec) == nil && strings.Contains(rec.Msg, "stored without its body") {
			warns++
			if rec.Level != "WARN" || rec.Route != "POST /reports/{id}" || !strings.Contains(rec.Msg, "--blob") || !strings.Contains(line, `"max_response_size":1024`) {
				t.Errorf("warning: got %s, want WARN naming the route, the limit and --blob", line)
			}
		}
	}
	if warns != 1 {
		t.Errorf("got %d warnings of an omitted body for two on one route, want 1\n%s", warns, p.logText())
	}
}
