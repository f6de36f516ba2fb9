package main

// SIGHUP re-reads --config, from outside: the built binary, its file
// rewritten and the signal sent, and its answers and log lines read.

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// hangup sends SIGHUP to the proxy and waits for the n-th log line that
// holds text (a reload's "reloaded" or "reload refused").
func (p *proxyProc) hangup(t *testing.T, text string, n int) {
	t.Helper()
	if err := p.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for strings.Count(p.logText(), text) < n {
		if time.Now().After(deadline) {
			t.Fatalf("after SIGHUP: fewer than %d log lines with %s within 10s:\n%s", n, text, p.logText())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// errorLines are the proxy's log lines at ERROR.
func (p *proxyProc) errorLines() []string {
	var out []string
	for line := range strings.Lines(p.logText()) {
		if strings.Contains(line, `"level":"ERROR"`) {
			out = append(out, line)
		}
	}
	return out
}

// TestProxyReloadConfig: a SIGHUP that finds a changed --config puts its
// routes in place (a route gains require_key, a new route appears) while
// the flags' routes keep their records; a file that does not load (a
// syntax error, an unknown field, a bad value) is refused with one ERROR
// line each, and the running routes are kept.
func TestProxyReloadConfig(t *testing.T) {
	t.Parallel()
	up := newTestUpstream(t)
	cfg := filepath.Join(t.TempDir(), "routes.yaml")
	writeFile(t, cfg, "routes:\n  - match: \"POST /a/\"\n    methods: [POST]\n")
	p := startProxy(t, nil, "--upstream", up.URL, "--config", cfg)

	wantStatus(t, "/a/ without a key, before", mustSend(t, "POST", p.url("/a/1"), "", `{}`), http.StatusCreated, "")
	wantStatus(t, "/c/ without a key, before", mustSend(t, "POST", p.url("/c/1"), "", `{}`), http.StatusCreated, "")
	first := mustSend(t, "POST", p.url("/flags/1"), "flags-1", `{"n":1}`)
	wantStatus(t, "the flags' route", first, http.StatusCreated, "")

	writeFile(t, cfg, "routes:\n  - match: \"POST /a/\"\n    methods: [POST]\n    require_key: true\n"+
		"  - match: \"POST /c/\"\n    methods: [POST]\n    require_key: true\n")
	p.hangup(t, `"msg":"reloaded","what":"config"`, 1)
	wantStatus(t, "/a/ without a key, after the reload", mustSend(t, "POST", p.url("/a/1"), "", `{}`), http.StatusBadRequest, "")
	wantStatus(t, "/c/ (a new route) without a key", mustSend(t, "POST", p.url("/c/1"), "", `{}`), http.StatusBadRequest, "")
	again := mustSend(t, "POST", p.url("/flags/1"), "flags-1", `{"n":1}`)
	if again.status != http.StatusCreated || !again.replayed() || string(again.body) != string(first.body) {
		t.Errorf("the flags' route after the reload: got %d replayed %v %s, want the replay of %s", again.status, again.replayed(), again.body, first.body)
	}
	if n := up.runsOf("flags-1"); n != 1 {
		t.Errorf("upstream ran flags-1 %d times, want 1", n)
	}

	for i, bad := range []struct{ file, want string }{
		{"routes:\n  - match: \"POST /a/\"\n   methods: [POST]\n", "line 3"},                   // mis-indented
		{"routes:\n  - match: \"POST /a/\"\n    methods: [POST]\n    colour: red\n", "colour"}, // unknown field
		{"routes:\n  - match: \"POST /a/\"\n    methods: [POST]\n    lease: 1ms\n", "lease 1ms: want at least 10ms"},
	} {
		writeFile(t, cfg, bad.file)
		p.hangup(t, "reload refused", i+1)
		lines := p.errorLines()
		if len(lines) != i+1 {
			t.Fatalf("after bad file %d: %d ERROR lines, want %d:\n%s", i, len(lines), i+1, strings.Join(lines, ""))
		}
		if last := lines[i]; !strings.Contains(last, `"what":"config"`) || !strings.Contains(last, "--config "+cfg) || !strings.Contains(last, bad.want) {
			t.Errorf("bad file %d: ERROR line %s, want what=config and the file's error saying %q", i, last, bad.want)
		}
		wantStatus(t, "/a/ without a key, after a refused reload", mustSend(t, "POST", p.url("/a/1"), "", `{}`), http.StatusBadRequest, "")
		wantStatus(t, "/c/ without a key, after a refused reload", mustSend(t, "POST", p.url("/c/1"), "", `{}`), http.StatusBadRequest, "")
	}
	if n := strings.Count(p.logText(), `"msg":"reloaded"`); n != 1 {
		t.Errorf("%d reloaded lines, want the one good reload's", n)
	}
}

// TestProxyReloadUnderLoad: keyed and unkeyed clients run while SIGHUPs
// swap the route table again and again, a slow keyed request among them
// from before the first reload to after the last: no request fails, and
// each key runs once (its copies, sent at once, get one execution, whether
// or not a reload came between them).
func TestProxyReloadUnderLoad(t *testing.T) {
	t.Parallel()
	up := newTestUpstream(t)
	cfg := filepath.Join(t.TempDir(), "routes.yaml")
	// The files differ in settings and in a route the load does not use:
	// a route that comes or goes moves its paths' keys to another scope
	// (its pattern, or the path), as a restart with the other file would.
	files := []string{
		"routes:\n  - match: \"POST /r/\"\n    methods: [POST]\n    wait: 10s\n  - match: \"POST /s/\"\n    methods: [POST]\n    wait: 10s\n",
		"routes:\n  - match: \"POST /r/\"\n    methods: [POST]\n    wait: 10s\n    retention: 1h\n    max_body: 64KiB\n" +
			"  - match: \"POST /s/\"\n    methods: [POST]\n    wait: 10s\n    quota_in_flight: 100\n  - match: \"POST /t/\"\n    methods: [POST]\n    require_key: true\n",
	}
	writeFile(t, cfg, files[0])
	p := startProxy(t, nil, "--upstream", up.URL, "--config", cfg, "--wait", "10s")

	slow := make(chan result, 1)
	go func() {
		r, _ := send("POST", p.url("/r/slow"), "slow", `{}`, "X-Test-Delay: 1500ms")
		slow <- r
	}()
	up.awaitStarted(t, 1, "slow")

	var stop atomic.Bool
	var failures atomic.Int64
	var mu sync.Mutex
	var keys []string
	var failed []string
	fail := func(what string) {
		failures.Add(1)
		mu.Lock()
		if len(failed) < 10 {
			failed = append(failed, what)
		}
		mu.Unlock()
	}
	var wg sync.WaitGroup
	for c := range 4 {
		wg.Go(func() { // keyed: each key sent twice at once
			for i := 0; !stop.Load(); i++ {
				key := fmt.Sprintf("load-%d-%d", c, i)
				path := []string{"/r/", "/s/", "/other/"}[i%3] + key
				mu.Lock()
				keys = append(keys, key)
				mu.Unlock()
				var pair sync.WaitGroup
				for range 2 {
					pair.Go(func() {
						r, err := send("POST", p.url(path), key, `{"k":"`+key+`"}`)
						if err != nil || r.status != http.StatusCreated {
							fail(fmt.Sprintf("keyed %s: %d %v %s", path, r.status, err, r.body))
						}
					})
				}
				pair.Wait()
			}
		})
		wg.Go(func() { // unkeyed
			for i := 0; !stop.Load(); i++ {
				r, err := send("POST", p.url(fmt.Sprintf("/r/plain-%d-%d", c, i)), "", `{}`)
				if err != nil || r.status != http.StatusCreated {
					fail(fmt.Sprintf("unkeyed: %d %v %s", r.status, err, r.body))
				}
			}
		})
	}
	const reloads = 6
	for i := range reloads {
		writeFile(t, cfg, files[(i+1)%2])
		p.hangup(t, `"msg":"reloaded","what":"config"`, i+1)
	}
	stop.Store(true)
	wg.Wait()

	if r := <-slow; r.status != http.StatusCreated {
		t.Errorf("the slow keyed request across the reloads: got %d %s, want 201", r.status, r.body)
	}
	if n := failures.Load(); n > 0 {
		t.Errorf("%d requests failed during the reloads, the first: %s", n, strings.Join(failed, "\n"))
	}
	if len(keys) < 8 {
		t.Errorf("only %d keys sent during %d reloads: the load did not overlap them", len(keys), reloads)
	}
	for _, k := range append(keys, "slow") {
		if n := up.runsOf(k); n != 1 {
			t.Errorf("upstream ran %s %d times, want 1", k, n)
		}
	}
	if lines := p.errorLines(); len(lines) > 0 {
		t.Errorf("ERROR lines: %s", strings.Join(lines, ""))
	}
}

// TestProxyReloadQuota: a reload keeps the counts of the flags' quota, and
// of a route's own quota while its pattern and limits stay; a route whose
// limits change starts new counts.
func TestProxyReloadQuota(t *testing.T) {
	t.Parallel()
	up := newTestUpstream(t)
	cfg := filepath.Join(t.TempDir(), "routes.yaml")
	route := "routes:\n  - match: \"POST /own/\"\n    methods: [POST]\n    quota_records: 1\n"
	writeFile(t, cfg, route)
	p := startProxy(t, nil, "--upstream", up.URL, "--config", cfg, "--quota-records", "1")
	wantStatus(t, "the flags' route, first key", mustSend(t, "POST", p.url("/flags/1"), "f1", `{}`), http.StatusCreated, "")
	wantStatus(t, "the own route, first key", mustSend(t, "POST", p.url("/own/1"), "o1", `{}`), http.StatusCreated, "")

	writeFile(t, cfg, route+"    require_key: true\n") // the same pattern and limits
	p.hangup(t, `"msg":"reloaded","what":"config"`, 1)
	wantStatus(t, "the flags' route, a second key after the reload", mustSend(t, "POST", p.url("/flags/2"), "f2", `{}`),
		http.StatusTooManyRequests, "urn:idem:problem:quota-exceeded")
	wantStatus(t, "the own route, a second key after the reload", mustSend(t, "POST", p.url("/own/2"), "o2", `{}`),
		http.StatusTooManyRequests, "urn:idem:problem:quota-exceeded")

	writeFile(t, cfg, "routes:\n  - match: \"POST /own/\"\n    methods: [POST]\n    quota_records: 2\n")
	p.hangup(t, `"msg":"reloaded","what":"config"`, 2)
	wantStatus(t, "the own route with new limits: new counts", mustSend(t, "POST", p.url("/own/3"), "o3", `{}`), http.StatusCreated, "")
	wantStatus(t, "the flags' route, still counted", mustSend(t, "POST", p.url("/flags/3"), "f3", `{}`),
		http.StatusTooManyRequests, "urn:idem:problem:quota-exceeded")
}

// TestProxyHangupNothingToReload: without --config and TLS files, a
// SIGHUP (sent to every sidecar by habit, or by a closed terminal) is
// logged and the proxy goes on serving, its records kept; it does not end
// the process, SIGHUP's default action.
func TestProxyHangupNothingToReload(t *testing.T) {
	t.Parallel()
	up := newTestUpstream(t)
	p := startProxy(t, nil, "--upstream", up.URL)
	first := mustSend(t, "POST", p.url("/payments"), "hup-1", `{"n":1}`)
	wantStatus(t, "before SIGHUP", first, http.StatusCreated, "")
	p.hangup(t, `"msg":"SIGHUP: nothing to reload"`, 1)
	again := mustSend(t, "POST", p.url("/payments"), "hup-1", `{"n":1}`)
	if again.status != http.StatusCreated || !again.replayed() || string(again.body) != string(first.body) {
		t.Errorf("after SIGHUP: got %d replayed %v %s, want the replay of %s", again.status, again.replayed(), again.body, first.body)
	}
}

// TestProxyHangupWhileStarting: a SIGHUP that comes while the proxy
// starts (here: while it waits for its store, held by a relay that only
// passes bytes to the real redis-server once the signal was sent) does
// not end it, SIGHUP's default action: it starts and serves.
func TestProxyHangupWhileStarting(t *testing.T) {
	t.Parallel()
	redis := proxyRedis(t)
	up := newTestUpstream(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	accepted := make(chan net.Conn, 1)
	release := make(chan struct{})
	go func() {
		first := true
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			if first {
				accepted <- c
				first = false
			}
			go func() {
				<-release
				r, err := net.Dial("tcp", redis.Addr())
				if err != nil {
					c.Close()
					return
				}
				go func() { io.Copy(r, c); r.Close() }()
				io.Copy(c, r)
				c.Close()
			}()
		}
	}()
	var stderr syncBuffer
	cmd := exec.Command(idemBinary(t), "proxy", "--listen", "127.0.0.1:0", "--log-format", "json",
		"--upstream", up.URL, "--store", "redis://"+ln.Addr().String()+"/0")
	cmd.Env = proxyEnv(nil)
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		cmd.Process.Kill()
		<-exited
		if t.Failed() {
			t.Logf("idem proxy log:\n%s", stderr.String())
		}
	})
	select {
	case <-accepted: // the proxy is opening its store: past its start
	case err := <-exited:
		t.Fatalf("idem proxy exited before it reached its store: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("idem proxy did not reach its store within 10s")
	}
	if err := cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	close(release)
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(stderr.String(), `"msg":"idem proxy listening"`) {
		select {
		case err := <-exited:
			t.Fatalf("idem proxy exited after a SIGHUP at start: %v; want it to start", err)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatal("idem proxy did not listen within 10s of its store answering")
		}
		time.Sleep(10 * time.Millisecond)
	}
	var rec struct{ Listen string }
	for line := range strings.Lines(stderr.String()) {
		if strings.Contains(line, `"msg":"idem proxy listening"`) {
			json.Unmarshal([]byte(line), &rec)
		}
	}
	r := mustSend(t, "POST", "http://"+rec.Listen+"/payments", "hup-start", `{"n":1}`)
	wantStatus(t, "a keyed POST after a SIGHUP at start", r, http.StatusCreated, "")
}

// syncBuffer is a bytes.Buffer that a process writes and a test reads at
// once.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// githubSignature is the X-Hub-Signature-256 header of body under secret,
// as GitHub signs its deliveries.
func githubSignature(secret, body string) string {
	mac := hmac.New(sha256.New, []byte(secret))
	mac.Write([]byte(body))
	return "X-Hub-Signature-256: sha256=" + hex.EncodeToString(mac.Sum(nil))
}

// TestProxyReloadWebhookSecrets: the flags' webhook secrets are read
// again on SIGHUP, without --config: after the file holds a new secret,
// a delivery signed with the old one gets 401 and one signed with the new
// one runs; a file gone is refused and the running secrets kept.
func TestProxyReloadWebhookSecrets(t *testing.T) {
	t.Parallel()
	up := newTestUpstream(t)
	secrets := filepath.Join(t.TempDir(), "github-secrets")
	writeFile(t, secrets, "old-secret\n")
	p := startProxy(t, nil, "--upstream", up.URL, "--webhook", "github", "--webhook-secret-file", secrets)
	deliver := func(id, secret, body string) result {
		return mustSend(t, "POST", p.url("/hooks/github"), "", body, "X-GitHub-Delivery: "+id, githubSignature(secret, body))
	}
	wantStatus(t, "signed with the old secret, before", deliver("d-1", "old-secret", `{"n":1}`), http.StatusCreated, "")
	wantStatus(t, "signed with the new secret, before", deliver("d-2", "new-secret", `{"n":2}`), http.StatusUnauthorized, "urn:idem:problem:unverified")

	writeFile(t, secrets, "new-secret\n")
	p.hangup(t, `"msg":"reloaded","what":"webhook secrets"`, 1)
	wantStatus(t, "signed with the old secret, after", deliver("d-3", "old-secret", `{"n":3}`), http.StatusUnauthorized, "urn:idem:problem:unverified")
	wantStatus(t, "signed with the new secret, after", deliver("d-2", "new-secret", `{"n":2}`), http.StatusCreated, "")
	if r := deliver("d-1", "new-secret", `{"n":1}`); r.status != http.StatusCreated || !r.replayed() {
		t.Errorf("d-1 again, signed with the new secret: got %d replayed %v, want the replay of its first delivery", r.status, r.replayed())
	}

	if err := os.Remove(secrets); err != nil {
		t.Fatal(err)
	}
	p.hangup(t, "reload refused", 1)
	if lines := p.errorLines(); len(lines) != 1 || !strings.Contains(lines[0], secrets) || strings.Contains(lines[0], "new-secret") {
		t.Errorf("after the file was removed: ERROR lines %q, want one naming %s (and no secret)", lines, secrets)
	}
	wantStatus(t, "signed with the new secret, after a refused reload", deliver("d-4", "new-secret", `{"n":4}`), http.StatusCreated, "")
	if strings.Contains(p.logText(), "old-secret") || strings.Contains(p.logText(), "new-secret") {
		t.Error("a secret is in the log")
	}
}
