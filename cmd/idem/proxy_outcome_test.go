package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/proctest"
)

// requestLine is a request's log line.
type requestLine struct {
	Msg, Method, Path, Outcome string
	Status                     int
	ClientGone                 bool    `json:"client_gone"`
	UpstreamAborted            bool    `json:"upstream_aborted"`
	DurationMS                 float64 `json:"duration_ms"`
}

// awaitRequestLine waits (bounded) for the log line of a request to path
// and returns its outcome and status: the proxy logs a request once it
// has answered it.
func (p *proxyProc) awaitRequestLine(t *testing.T, path string) requestLine {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		for line := range strings.Lines(p.logText()) {
			var l requestLine
			if json.Unmarshal([]byte(line), &l) == nil && l.Msg == "request" && l.Path == path {
				return l
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no request line for %s in the log within 10s", path)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// A keyed request whose upstream answer is not stored (a 5xx, under the
// default policy) or that breaks off mid-body releases its key: the log
// and idem_requests_total say "released", not "executed".
func TestProxyReleasedOutcome(t *testing.T) {
	t.Parallel()
	var runs atomic.Int64
	up := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		runs.Add(1)
		switch r.URL.Path {
		case "/unavailable":
			w.WriteHeader(http.StatusServiceUnavailable)
		case "/abort": // the upstream fails in the middle of its body
			w.Header().Set("Content-Length", "1000")
			w.WriteHeader(http.StatusOK)
			io.WriteString(w, "half")
			http.NewResponseController(w).Flush()
			panic(http.ErrAbortHandler)
		default:
			w.WriteHeader(http.StatusCreated)
		}
	}))
	up.Config.ErrorLog = nil
	up.Start()
	t.Cleanup(up.Close)
	p := startProxy(t, nil, "--upstream", up.URL)

	wantStatus(t, "upstream 503", mustSend(t, "POST", p.url("/unavailable"), "rel-1", "{}"), http.StatusServiceUnavailable, "")
	if l := p.awaitRequestLine(t, "/unavailable"); l.Outcome != "released" || l.Status != http.StatusServiceUnavailable {
		t.Errorf("log of a released 503: got outcome %q status %d, want released 503", l.Outcome, l.Status)
	}
	// On a connection of its own: Go's client resends a keyed request
	// when a reused connection breaks before the response.
	fresh := &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	req, _ := http.NewRequest("POST", p.url("/abort"), strings.NewReader("{}"))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(idemhttp.HeaderKey, "rel-2")
	if resp, err := fresh.Do(req); err == nil {
		_, err = io.ReadAll(resp.Body)
		resp.Body.Close()
		if err == nil {
			t.Error("upstream failing mid-body: the client got a whole response")
		}
	}
	if l := p.awaitRequestLine(t, "/abort"); l.Outcome != "released" || !l.UpstreamAborted || l.Status != http.StatusBadGateway {
		t.Errorf("log of an upstream failing mid-body: got outcome %q upstream_aborted %v status %d, want released, true, 502",
			l.Outcome, l.UpstreamAborted, l.Status)
	}
	if got := p.metric("idem_upstream_aborted_total"); got != 1 {
		t.Errorf("idem_upstream_aborted_total: got %v, want 1", got)
	}
	wantStatus(t, "upstream 201", mustSend(t, "POST", p.url("/created"), "ok-1", "{}"), http.StatusCreated, "")
	if l := p.awaitRequestLine(t, "/created"); l.Outcome != "executed" {
		t.Errorf("log of a stored 201: got outcome %q, want executed", l.Outcome)
	}
	// The released key runs again.
	wantStatus(t, "retry of the 503", mustSend(t, "POST", p.url("/unavailable"), "rel-1", "{}"), http.StatusServiceUnavailable, "")
	if n := runs.Load(); n != 4 {
		t.Errorf("got %d upstream executions, want 4", n)
	}
	p.awaitLines(t, 4)
	for outcome, want := range map[string]float64{"released": 3, "executed": 1} {
		if got := p.metric(fmt.Sprintf(`idem_requests_total{outcome=%q}`, outcome)); got != want {
			t.Errorf(`idem_requests_total{outcome=%q}: got %v, want %v`, outcome, got, want)
		}
	}
}

// awaitLog waits (bounded) until the log contains text, and reports
// whether it does: the proxy logs a request once it has answered it, which
// can be after a retry already got the replay of its stored response.
func (p *proxyProc) awaitLog(text string) bool {
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(p.logText(), text) {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(20 * time.Millisecond)
	}
	return true
}

// awaitLines waits (bounded) until the log holds n request lines.
func (p *proxyProc) awaitLines(t *testing.T, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for strings.Count(p.logText(), `"msg":"request"`) < n {
		if time.Now().After(deadline) {
			t.Fatalf("fewer than %d request lines in the log after 10s", n)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// A client that read the whole response and then closed its connection,
// as curl does writing a large body to a file, is not gone: the request
// is logged executed without client_gone, and idem_client_gone_total
// stays at zero.
func TestProxyWholeResponseReadIsNotClientGone(t *testing.T) {
	t.Parallel()
	curl := proctest.RequireTool(t, "curl")
	const size = 5 << 20
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Length", strconv.Itoa(size))
		w.WriteHeader(http.StatusCreated)
		w.Write(bytes.Repeat([]byte("x"), size))
	}))
	t.Cleanup(up.Close)
	rd := proxyRedis(t) // a store call that takes a round trip after the body went out
	p := startProxy(t, nil, "--upstream", up.URL, "--store", "redis://"+rd.Addr(), "--max-response", "8MiB")
	out := filepath.Join(t.TempDir(), "body")
	for i := range 5 {
		cmd := exec.Command(curl, "-sS", "-o", out, "-w", "%{http_code} %{size_download}", "-H", "Content-Type: application/json",
			"-H", fmt.Sprintf("Idempotency-Key: whole-%d", i), "--data", "{}", p.url(fmt.Sprintf("/big/%d", i)))
		got, err := cmd.Output()
		if err != nil || string(got) != fmt.Sprintf("201 %d", size) {
			t.Fatalf("curl: got %q (%v), want 201 and %d bytes", got, err, size)
		}
		if l := p.awaitRequestLine(t, fmt.Sprintf("/big/%d", i)); l.Outcome != "executed" || l.ClientGone {
			t.Errorf("log of a response read to its end: got outcome %q client_gone %v, want executed, false", l.Outcome, l.ClientGone)
		}
	}
	if got := p.metric(`idem_client_gone_total{outcome="executed"}`); got != 0 {
		t.Errorf(`idem_client_gone_total{outcome="executed"}: got %v, want 0`, got)
	}
}
