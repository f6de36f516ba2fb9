package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/idemhttp"
)

// requestLine is a request's log line.
type requestLine struct {
	Msg, Method, Path, Outcome string
	Status                     int
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
	if l := p.awaitRequestLine(t, "/abort"); l.Outcome != outcomeUpstreamAborted {
		t.Errorf("log of an upstream failing mid-body: got outcome %q, want %s", l.Outcome, outcomeUpstreamAborted)
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
