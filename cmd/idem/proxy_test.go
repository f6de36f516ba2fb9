package main

// End-to-end tests of idem proxy: they build the binary, run it as a
// subprocess against private redis-servers and a test upstream, and look
// at it only from outside (HTTP, /metrics, signals, exit status).

import (
	"bufio"
	"bytes"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/proctest"
	"github.com/idemkit/idem/internal/redisserver"
)

// proxyRace is set in proxy_race_test.go when the tests run under -race.
var proxyRace bool

var (
	proxyBinOnce sync.Once
	proxyBinDir  string
	proxyBinPath string
	proxyBinErr  error
)

func TestMain(m *testing.M) {
	code := m.Run()
	if proxyBinDir != "" {
		os.RemoveAll(proxyBinDir)
	}
	proctest.RemoveIdem() // the binary of the blob tests (proxy_blob_test.go)
	os.Exit(code)
}

// idemBinary builds the idem command once per test run (with -race when
// the tests have it) and returns its path.
func idemBinary(t *testing.T) string {
	t.Helper()
	proxyBinOnce.Do(func() {
		proxyBinDir, proxyBinErr = os.MkdirTemp("", "idem-proxy-test-")
		if proxyBinErr != nil {
			return
		}
		proxyBinPath = filepath.Join(proxyBinDir, "idem")
		args := []string{"build", "-o", proxyBinPath}
		if proxyRace {
			args = append(args, "-race")
		}
		out, err := exec.Command("go", append(args, ".")...).CombinedOutput()
		if err != nil {
			proxyBinErr = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	if proxyBinErr != nil {
		t.Fatal(proxyBinErr)
	}
	return proxyBinPath
}

// proxyRedis starts a private redis-server for one test.
func proxyRedis(t *testing.T) *redisserver.Server {
	t.Helper()
	srv, err := redisserver.StartServer()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	return srv
}

// testUpstream is the service behind the proxy. It counts executions per
// Idempotency-Key and answers 201 with a body unique to each execution,
// so that a byte-identical body proves a replay. Request headers steer
// it: X-Test-Delay (a duration; the wait ends if the client leaves) and
// X-Test-Status.
type testUpstream struct {
	*httptest.Server
	mu      sync.Mutex
	runs    map[string]int
	headers map[string]http.Header // the last request's, per key
	started chan string            // each request's key as it starts
}

func newTestUpstream(t *testing.T) *testUpstream {
	u := &testUpstream{runs: map[string]int{}, headers: map[string]http.Header{}, started: make(chan string, 1000)}
	u.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get(idemhttp.HeaderKey)
		body, _ := io.ReadAll(r.Body)
		u.mu.Lock()
		u.runs[key]++
		n := u.runs[key]
		u.headers[key] = r.Header.Clone()
		u.mu.Unlock()
		select {
		case u.started <- key:
		default:
		}
		if d, err := time.ParseDuration(r.Header.Get("X-Test-Delay")); err == nil {
			select {
			case <-time.After(d):
			case <-r.Context().Done():
				return
			}
		}
		status := http.StatusCreated
		if s, err := strconv.Atoi(r.Header.Get("X-Test-Status")); err == nil {
			status = s
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("X-Upstream-Run", strconv.Itoa(n))
		w.WriteHeader(status)
		json.NewEncoder(w).Encode(map[string]any{"key": key, "run": n, "nonce": rand.Text(), "path": r.URL.Path, "body": string(body)})
	}))
	t.Cleanup(u.Close)
	return u
}

func (u *testUpstream) runsOf(key string) int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.runs[key]
}

func (u *testUpstream) headerOf(key string) http.Header {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.headers[key]
}

// awaitStarted waits until the upstream has started n requests with key.
func (u *testUpstream) awaitStarted(t *testing.T, n int, keys ...string) {
	t.Helper()
	timeout := time.After(10 * time.Second)
	want := map[string]bool{}
	for _, k := range keys {
		want[k] = true
	}
	for n > 0 {
		select {
		case k := <-u.started:
			if want[k] {
				n--
			}
		case <-timeout:
			t.Fatalf("upstream: %d requests with keys %q not started within 10s", n, keys)
		}
	}
}

// proxyProc is a running idem proxy.
type proxyProc struct {
	t      *testing.T
	cmd    *exec.Cmd
	addr   string // host:port of the proxied traffic
	admin  string // host:port of /metrics, /healthz, /readyz
	exited chan struct{}
	err    error // cmd.Wait's, once exited is closed

	mu  sync.Mutex
	log bytes.Buffer
}

// runIdem runs the idem binary to completion (bounded) and returns its
// exit status and stderr.
func runIdem(t *testing.T, env []string, args ...string) (int, string) {
	t.Helper()
	cmd := exec.Command(idemBinary(t), args...)
	cmd.Env = proxyEnv(env)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		cmd.Process.Kill()
		<-done
		t.Fatalf("idem %q still running after 10s\n%s", args, stderr.String())
	}
	return cmd.ProcessState.ExitCode(), stderr.String()
}

// proxyEnv is the environment without IDEM_* variables, plus env.
func proxyEnv(env []string) []string {
	var out []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "IDEM_") {
			out = append(out, kv)
		}
	}
	// The AWS SDK behind s3:// looks for credentials at the EC2 metadata
	// address when it finds none: tests send traffic to loopback only.
	out = append(out, "AWS_EC2_METADATA_DISABLED=true")
	return append(out, env...)
}

// startProxy runs idem proxy on free ports with JSON logs and args, waits
// until it listens and /readyz answers 200, and kills it at the end of the
// test. Its log is shown when the test fails.
func startProxy(t *testing.T, env []string, args ...string) *proxyProc {
	t.Helper()
	p := startProxyNoWait(t, env, args...)
	p.awaitReady(http.StatusOK)
	return p
}

func startProxyNoWait(t *testing.T, env []string, args ...string) *proxyProc {
	t.Helper()
	all := append([]string{"proxy", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", "--log-format", "json"}, args...)
	p := &proxyProc{t: t, cmd: exec.Command(idemBinary(t), all...), exited: make(chan struct{})}
	p.cmd.Env = proxyEnv(env)
	stderr, err := p.cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	listening := make(chan [2]string, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		sc.Buffer(nil, 1<<20)
		for sc.Scan() {
			line := sc.Bytes()
			p.mu.Lock()
			p.log.Write(line)
			p.log.WriteByte('\n')
			p.mu.Unlock()
			var rec struct{ Msg, Listen, Admin string }
			if json.Unmarshal(line, &rec) == nil && rec.Msg == "idem proxy listening" {
				listening <- [2]string{rec.Listen, rec.Admin}
			}
		}
		io.Copy(io.Discard, stderr)
		p.err = p.cmd.Wait()
		close(p.exited)
	}()
	t.Cleanup(func() {
		select {
		case <-p.exited:
		default:
			p.cmd.Process.Kill()
			<-p.exited
		}
		if t.Failed() {
			t.Logf("idem %s log:\n%s", strings.Join(all, " "), p.logText())
		}
	})
	select {
	case a := <-listening:
		p.addr, p.admin = a[0], a[1]
	case <-p.exited:
		t.Fatalf("idem proxy exited at start: %v", p.err)
	case <-time.After(10 * time.Second):
		t.Fatal("idem proxy did not listen within 10s")
	}
	return p
}

func (p *proxyProc) logText() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.log.String()
}

func (p *proxyProc) url(path string) string { return "http://" + p.addr + path }

// awaitReady polls /readyz until it answers status (bounded).
func (p *proxyProc) awaitReady(status int) {
	p.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		resp, err := testClient.Get("http://" + p.admin + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == status {
				return
			}
		}
		if time.Now().After(deadline) {
			p.t.Fatalf("/readyz: did not answer %d within 10s (last: %v %v)", status, resp, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// awaitExit waits (bounded) for the process to exit and returns its status.
func (p *proxyProc) awaitExit(d time.Duration) int {
	p.t.Helper()
	select {
	case <-p.exited:
		return p.cmd.ProcessState.ExitCode()
	case <-time.After(d):
		p.t.Fatalf("idem proxy still running %v after the signal", d)
		return -1
	}
}

// metric returns the value of one series of /metrics, e.g.
// `idem_requests_total{outcome="executed"}`.
func (p *proxyProc) metric(series string) float64 {
	p.t.Helper()
	resp, err := testClient.Get("http://" + p.admin + "/metrics")
	if err != nil {
		p.t.Fatal(err)
	}
	defer resp.Body.Close()
	text, _ := io.ReadAll(resp.Body)
	for line := range strings.Lines(string(text)) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), series+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				p.t.Fatalf("/metrics: %q: %v", line, err)
			}
			return f
		}
	}
	p.t.Fatalf("/metrics: no series %s in\n%s", series, text)
	return 0
}

var testClient = &http.Client{
	Timeout:   20 * time.Second,
	Transport: &http.Transport{MaxIdleConnsPerHost: 100},
}

// result is an answer of the proxy.
type result struct {
	status int
	header http.Header
	body   []byte
}

func (r result) replayed() bool { return r.header.Get(idemhttp.HeaderReplayed) == "true" }

// send makes a request through the proxy; key "" sends none. hdr holds
// "Name: value" pairs.
func send(method, url, key, body string, hdr ...string) (result, error) {
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		return result{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set(idemhttp.HeaderKey, key)
	}
	for _, h := range hdr {
		name, value, _ := strings.Cut(h, ":")
		req.Header.Set(name, strings.TrimSpace(value))
	}
	resp, err := testClient.Do(req)
	if err != nil {
		return result{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return result{resp.StatusCode, resp.Header, b}, err
}

func mustSend(t *testing.T, method, url, key, body string, hdr ...string) result {
	t.Helper()
	r, err := send(method, url, key, body, hdr...)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// wantStatus checks an answer's status and, for problems, its type.
func wantStatus(t *testing.T, what string, r result, status int, problemType string) {
	t.Helper()
	if r.status != status {
		t.Fatalf("%s: got status %d, want %d; body %s", what, r.status, status, r.body)
	}
	if problemType == "" {
		return
	}
	var p idemhttp.Problem
	if ct := r.header.Get("Content-Type"); ct != "application/problem+json" {
		t.Fatalf("%s: got Content-Type %q, want application/problem+json", what, ct)
	}
	if err := json.Unmarshal(r.body, &p); err != nil || p.Type != problemType {
		t.Fatalf("%s: got problem %s, want type %s", what, r.body, problemType)
	}
}

func TestProxyDuplicatesReplayConflictMismatch(t *testing.T) {
	t.Parallel()
	rs := proxyRedis(t)
	up := newTestUpstream(t)
	// A short lease, so that the slow request below is renewed.
	p := startProxy(t, nil, "--upstream", up.URL, "--store", "redis://"+rs.Addr(), "--lease", "600ms")

	// 50 identical requests at once: one upstream execution.
	const n = 50
	const key, body = "dup-1", `{"amount":42}`
	results := make([]result, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { results[i], errs[i] = send("POST", p.url("/orders"), key, body, "X-Test-Delay: 300ms") })
	}
	wg.Wait()
	var first result
	executed, replayed, conflicts := 0, 0, 0
	for i, r := range results {
		switch {
		case errs[i] != nil:
			t.Fatalf("request %d: %v", i, errs[i])
		case r.status == http.StatusCreated && !r.replayed():
			executed++
			first = r
		case r.status == http.StatusCreated:
			replayed++
		case r.status == http.StatusConflict:
			conflicts++
			if r.header.Get("Retry-After") == "" {
				t.Errorf("409 without Retry-After")
			}
		default:
			t.Fatalf("request %d: got status %d, want 201 or 409; body %s", i, r.status, r.body)
		}
	}
	if executed != 1 || up.runsOf(key) != 1 {
		t.Fatalf("%d identical requests: got %d fresh answers and %d upstream executions, want 1 and 1", n, executed, up.runsOf(key))
	}
	t.Logf("%d identical requests: 1 executed, %d replayed, %d conflicts", n, replayed, conflicts)

	// Forwarded unchanged: the key and X-Forwarded-* reach the upstream.
	h := up.headerOf(key)
	if h.Get(idemhttp.HeaderKey) != key || h.Get("X-Forwarded-For") == "" || h.Get("X-Forwarded-Host") != p.addr {
		t.Errorf("upstream got Idempotency-Key %q, X-Forwarded-For %q, X-Forwarded-Host %q; want %q, the client, %q",
			h.Get(idemhttp.HeaderKey), h.Get("X-Forwarded-For"), h.Get("X-Forwarded-Host"), key, p.addr)
	}

	// A later repeat: the stored answer, byte for byte.
	r := mustSend(t, "POST", p.url("/orders"), key, body)
	wantStatus(t, "repeat", r, http.StatusCreated, "")
	if !r.replayed() || !bytes.Equal(r.body, first.body) || r.header.Get("X-Upstream-Run") != "1" {
		t.Fatalf("repeat: got replayed=%v body %s, want a replay of %s", r.replayed(), r.body, first.body)
	}

	// The same key with another body: 422, the upstream does not run.
	r = mustSend(t, "POST", p.url("/orders"), key, `{"amount":43}`)
	wantStatus(t, "other body", r, http.StatusUnprocessableEntity, idemhttp.ProblemMismatch)

	// A malformed key: 400.
	r = mustSend(t, "POST", p.url("/orders"), strings.Repeat("k", 256), body)
	wantStatus(t, "256-byte key", r, http.StatusBadRequest, idemhttp.ProblemKeyInvalid)

	// 409 while the first request is in flight; the first one's lease is
	// renewed meanwhile (lease 600ms, upstream 1.5s).
	slow := make(chan result, 1)
	go func() {
		r, err := send("POST", p.url("/orders"), "slow-1", body, "X-Test-Delay: 1500ms")
		if err != nil {
			r.status = -1
		}
		slow <- r
	}()
	up.awaitStarted(t, 1, "slow-1")
	r = mustSend(t, "POST", p.url("/orders"), "slow-1", body)
	wantStatus(t, "while in flight", r, http.StatusConflict, idemhttp.ProblemInFlight)
	if r.header.Get("Retry-After") != "1" {
		t.Errorf("409: got Retry-After %q, want 1", r.header.Get("Retry-After"))
	}
	select {
	case r := <-slow:
		wantStatus(t, "slow request", r, http.StatusCreated, "")
	case <-time.After(10 * time.Second):
		t.Fatal("slow request: no answer within 10s")
	}

	// Not covered (GET) and no key (POST): forwarded untouched.
	mustSend(t, "GET", p.url("/orders"), "get-1", "")
	mustSend(t, "GET", p.url("/orders"), "get-1", "")
	if got := up.runsOf("get-1"); got != 2 {
		t.Errorf("GET twice with a key: got %d upstream executions, want 2", got)
	}
	wantStatus(t, "no key", mustSend(t, "POST", p.url("/orders"), "", body), http.StatusCreated, "")

	// The counters moved accordingly.
	for series, want := range map[string]float64{
		`idem_requests_total{outcome="executed"}`:        2,
		`idem_requests_total{outcome="replayed"}`:        float64(replayed + 1),
		`idem_requests_total{outcome="in_flight"}`:       float64(conflicts + 1),
		`idem_requests_total{outcome="mismatch"}`:        1,
		`idem_requests_total{outcome="rejected"}`:        1,
		`idem_requests_total{outcome="store_error"}`:     0,
		`idem_requests_total{outcome="passed_through"}`:  1,
		`idem_requests_total{outcome="not_covered"}`:     2,
		`idem_lease_renewals_total{result="lease_lost"}`: 0,
		`idem_upstream_duration_seconds_count`:           5,
	} {
		if got := p.metric(series); got != want {
			t.Errorf("%s: got %v, want %v", series, got, want)
		}
	}
	if got := p.metric(`idem_lease_renewals_total{result="ok"}`); got < 2 {
		t.Errorf(`idem_lease_renewals_total{result="ok"}: got %v, want at least 2`, got)
	}
	// The first of the 50 and the requests after them ask the store; the
	// copies that arrive while the first runs wait for it in the proxy
	// without asking (engine.Acquire), so the 50 make far fewer than 50.
	if got := p.metric(`idem_store_duration_seconds_count{op="acquire"}`); got < 2 || got >= n {
		t.Errorf(`idem_store_duration_seconds_count{op="acquire"}: got %v, want at least 2 and fewer than the %d copies`, got, n)
	}
	if got := p.metric(`idem_store_duration_seconds_count{op="complete"}`); got != 2 {
		t.Errorf(`idem_store_duration_seconds_count{op="complete"}: got %v, want 2`, got)
	}

	// The log has one line per request, with the key's digest only.
	if log := p.logText(); strings.Contains(log, key) || strings.Contains(log, "slow-1") || strings.Contains(log, "amount") {
		t.Errorf("the log shows a raw key or body:\n%s", log)
	}
	if !strings.Contains(p.logText(), `"outcome":"replayed"`) {
		t.Errorf("the log has no request line with outcome replayed")
	}
	// The lines of the 50 copies (and of the later requests under the same
	// key) name one stored key, the middleware's own (idemhttp
	// Config.OnKey).
	keys := map[string]int{}
	for line := range strings.Lines(p.logText()) {
		var l struct{ Msg, Path, Key string }
		if json.Unmarshal([]byte(line), &l) == nil && l.Msg == "request" && l.Path == "/orders" {
			keys[l.Key]++
		}
	}
	if most := slices.Max(slices.Collect(maps.Values(keys))); most < n || keys[""] >= n {
		t.Errorf("the log lines of /orders name the keys %v: want one stored key on each of the %d copies", keys, n)
	}
}

func TestProxyStoreDownAndBack(t *testing.T) {
	t.Parallel()
	rs := proxyRedis(t)
	up := newTestUpstream(t)
	p := startProxy(t, nil, "--upstream", up.URL, "--store", "redis://"+rs.Addr())
	wantStatus(t, "before", mustSend(t, "POST", p.url("/x"), "down-0", "{}"), http.StatusCreated, "")

	rs.Kill()
	r := mustSend(t, "POST", p.url("/x"), "down-1", "{}")
	wantStatus(t, "redis down", r, http.StatusServiceUnavailable, idemhttp.ProblemStoreUnavailable)
	if r.header.Get("Retry-After") == "" {
		t.Error("503 without Retry-After")
	}
	if got := up.runsOf("down-1"); got != 0 {
		t.Fatalf("redis down: got %d upstream executions, want 0", got)
	}
	p.awaitReady(http.StatusServiceUnavailable)
	if got := p.metric(`idem_requests_total{outcome="store_error"}`); got != 1 {
		t.Errorf(`idem_requests_total{outcome="store_error"}: got %v, want 1`, got)
	}

	if err := rs.Restart(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(15 * time.Second)
	for {
		r = mustSend(t, "POST", p.url("/x"), "down-1", "{}")
		if r.status == http.StatusCreated {
			break
		}
		if r.status != http.StatusServiceUnavailable || time.Now().After(deadline) {
			t.Fatalf("redis back: got status %d, want 201 within 15s; body %s", r.status, r.body)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if got := up.runsOf("down-1"); got != 1 || r.replayed() {
		t.Fatalf("redis back: got %d upstream executions (replayed %v), want 1 fresh", got, r.replayed())
	}
	p.awaitReady(http.StatusOK)
}

func TestProxySIGKILLFreesKeyAfterLease(t *testing.T) {
	t.Parallel()
	rs := proxyRedis(t)
	up := newTestUpstream(t)
	// --wait 0: a copy sees the dead proxy's key in flight at once (with
	// the default wait, one sent late in the lease could wait past it).
	args := []string{"--upstream", up.URL, "--store", "redis://" + rs.Addr(), "--lease", "1s", "--wait", "0"}
	a := startProxy(t, nil, args...)
	b := startProxy(t, nil, args...)

	go send("POST", a.url("/jobs"), "crash-1", "{}", "X-Test-Delay: 10s") // never answered
	up.awaitStarted(t, 1, "crash-1")
	a.cmd.Process.Kill()
	killed := time.Now()
	a.awaitExit(5 * time.Second)

	// The dead proxy's lease still holds the key...
	wantStatus(t, "just after SIGKILL", mustSend(t, "POST", b.url("/jobs"), "crash-1", "{}"), http.StatusConflict, idemhttp.ProblemInFlight)
	// ...until it ends, at most one lease later: then the key runs again.
	for {
		r := mustSend(t, "POST", b.url("/jobs"), "crash-1", "{}")
		if r.status == http.StatusCreated && !r.replayed() {
			break
		}
		if r.status != http.StatusConflict || time.Since(killed) > 5*time.Second {
			t.Fatalf("after SIGKILL: got %d (replayed %v), want 409 and then 201 within 5s; body %s", r.status, r.replayed(), r.body)
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("key free again %v after SIGKILL (lease 1s)", time.Since(killed).Round(time.Millisecond))
	if got := up.runsOf("crash-1"); got != 2 {
		t.Fatalf("got %d upstream executions, want 2 (the killed one and the retry)", got)
	}
}

func TestProxySIGTERMFinishesInFlight(t *testing.T) {
	t.Parallel()
	rs := proxyRedis(t)
	up := newTestUpstream(t)
	args := []string{"--upstream", up.URL, "--store", "redis://" + rs.Addr(), "--shutdown-timeout", "10s"}
	p := startProxy(t, nil, args...)

	const n = 10
	keys := make([]string, n)
	results := make([]result, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		keys[i] = fmt.Sprintf("term-%d", i)
		wg.Go(func() { results[i], errs[i] = send("POST", p.url("/pay"), keys[i], "{}", "X-Test-Delay: 1s") })
	}
	up.awaitStarted(t, n, keys...)
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	for i := range n {
		if errs[i] != nil {
			t.Fatalf("%s: in flight at SIGTERM: %v", keys[i], errs[i])
		}
		wantStatus(t, keys[i]+" in flight at SIGTERM", results[i], http.StatusCreated, "")
	}
	if code := p.awaitExit(10 * time.Second); code != 0 {
		t.Fatalf("exit status after SIGTERM: got %d, want 0", code)
	}
	if !strings.Contains(p.logText(), "idem proxy stopped") {
		t.Error(`the log has no "idem proxy stopped"`)
	}

	// Their keys were completed: a new proxy replays them.
	q := startProxy(t, nil, args...)
	for i := range n {
		r := mustSend(t, "POST", q.url("/pay"), keys[i], "{}")
		if r.status != http.StatusCreated || !r.replayed() || !bytes.Equal(r.body, results[i].body) {
			t.Fatalf("%s after restart: got %d replayed=%v %s, want a replay of %s", keys[i], r.status, r.replayed(), r.body, results[i].body)
		}
		if got := up.runsOf(keys[i]); got != 1 {
			t.Fatalf("%s: got %d upstream executions, want 1", keys[i], got)
		}
	}
}

func TestProxyShutdownTimeoutReleasesKeys(t *testing.T) {
	t.Parallel()
	rs := proxyRedis(t)
	up := newTestUpstream(t)
	args := []string{"--upstream", up.URL, "--store", "redis://" + rs.Addr()} // lease 30s
	p := startProxy(t, nil, append(args, "--shutdown-timeout", "300ms")...)

	done := make(chan error, 1)
	go func() { _, err := send("POST", p.url("/slow"), "cut-1", "{}", "X-Test-Delay: 20s"); done <- err }()
	up.awaitStarted(t, 1, "cut-1")
	p.cmd.Process.Signal(syscall.SIGTERM)
	if code := p.awaitExit(10 * time.Second); code != 1 {
		t.Fatalf("exit status after a shutdown timeout: got %d, want 1", code)
	}
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the cut-off request got no answer nor error within 10s")
	}
	// The cut-off request's key was released, not left to its 30s lease.
	q := startProxy(t, nil, args...)
	r := mustSend(t, "POST", q.url("/slow"), "cut-1", "{}")
	if r.status != http.StatusCreated || r.replayed() || up.runsOf("cut-1") != 2 {
		t.Fatalf("after the cut-off: got %d replayed=%v and %d upstream executions, want a fresh 201 and 2", r.status, r.replayed(), up.runsOf("cut-1"))
	}
}

func TestProxyConfigFileAndEnvironment(t *testing.T) {
	t.Parallel()
	up := newTestUpstream(t)
	file := filepath.Join(t.TempDir(), "idem.yaml")
	writeFile(t, file, `
routes:
  - match: "POST /payments/{id}"   # ServeMux pattern syntax
    require_key: true
    lease: 10s
  - match: "/health"
    methods: []                     # not covered
  - match: "POST /accepted"
    store_statuses: [202]
`)
	// Everything from the environment.
	p := startProxy(t, []string{"IDEM_UPSTREAM=" + up.URL, "IDEM_CONFIG=" + file, "IDEM_STORE=memory", "IDEM_METHODS=post"})

	// The route that requires a key.
	r := mustSend(t, "POST", p.url("/payments/7"), "", "{}")
	wantStatus(t, "POST /payments/7 without a key", r, http.StatusBadRequest, idemhttp.ProblemKeyMissing)
	if got := up.runsOf(""); got != 0 {
		t.Fatalf("got %d upstream executions, want 0", got)
	}
	wantStatus(t, "with a key", mustSend(t, "POST", p.url("/payments/7"), "pay-1", "{}"), http.StatusCreated, "")
	if r := mustSend(t, "POST", p.url("/payments/7"), "pay-1", "{}"); !r.replayed() {
		t.Fatal("POST /payments/7 repeated: not replayed")
	}
	// Unclean spellings of the path match the same route: its settings
	// cannot be stepped around.
	for _, path := range []string{"/payments//7", "/x/../payments/7", "/payments/./7"} {
		req, _ := http.NewRequest("POST", p.url("/"), strings.NewReader("{}"))
		req.URL.Opaque = path // sent as written, not cleaned by the client
		resp, err := testClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusBadRequest {
			t.Errorf("POST %s without a key: got %d, want 400 (the route requires one)", path, resp.StatusCode)
		}
	}
	// Elsewhere the flags' default: no key needed.
	wantStatus(t, "POST /other without a key", mustSend(t, "POST", p.url("/other"), "", "{}"), http.StatusCreated, "")
	// GET /payments/7 is not the pattern's method: the defaults, which
	// cover only POST here (IDEM_METHODS).
	mustSend(t, "GET", p.url("/payments/7"), "get-pay", "")
	mustSend(t, "GET", p.url("/payments/7"), "get-pay", "")
	// A route with no method covered.
	for range 2 {
		wantStatus(t, "POST /health", mustSend(t, "POST", p.url("/health"), "health-1", "{}"), http.StatusCreated, "")
	}
	// store_statuses: 201 is not stored there (the key is released), 202 is.
	for range 2 {
		mustSend(t, "POST", p.url("/accepted"), "acc-201", "{}")
		mustSend(t, "POST", p.url("/accepted"), "acc-202", "{}", "X-Test-Status: 202")
	}
	for key, want := range map[string]int{"get-pay": 2, "health-1": 2, "acc-201": 2, "acc-202": 1, "pay-1": 1} {
		if got := up.runsOf(key); got != want {
			t.Errorf("%s: got %d upstream executions, want %d", key, got, want)
		}
	}
	if got := p.metric(`idem_requests_total{outcome="not_covered"}`); got != 4 {
		t.Errorf(`idem_requests_total{outcome="not_covered"}: got %v, want 4`, got)
	}

	// --require-key from the environment too, and --tenant-header: one
	// key in two tenants is two operations.
	q := startProxy(t, []string{"IDEM_REQUIRE_KEY=true", "IDEM_TENANT_HEADER=X-Tenant"}, "--upstream", up.URL)
	wantStatus(t, "--require-key without a key", mustSend(t, "POST", q.url("/any"), "", "{}"), http.StatusBadRequest, idemhttp.ProblemKeyMissing)
	for _, tenant := range []string{"a", "b", "a"} {
		mustSend(t, "POST", q.url("/any"), "tenant-1", "{}", "X-Tenant: "+tenant)
	}
	if got := up.runsOf("tenant-1"); got != 2 {
		t.Errorf("one key from tenants a, b, a: got %d upstream executions, want 2", got)
	}
}

func TestProxyUsageErrors(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	files := map[string]string{
		"unknown-field.yaml": "routes:\n  - match: /x\n    requre_key: true\n",
		"bad-pattern.yaml":   "routes:\n  - match: \"POST /x/{id\"\n",
		"conflict.yaml":      "routes:\n  - match: /x\n  - match: /x\n",
		"no-match.yaml":      "routes:\n  - require_key: true\n",
		"bad-lease.yaml":     "routes:\n  - match: /x\n    lease: 5\n",
		"short-lease.yaml":   "routes:\n  - match: /x\n    lease: 1ms\n",
		"bad-method.yaml":    "routes:\n  - match: /x\n    methods: [\"PO ST\"]\n",
		"bad-status.yaml":    "routes:\n  - match: /x\n    store_statuses: [99]\n",
		"bad-cwt.yaml":       "routes:\n  - match: /x\n    client_write_timeout: -1s\n",
		"not-yaml.yaml":      "routes: [\n",
	}
	for name, text := range files {
		writeFile(t, filepath.Join(dir, name), text)
	}
	// A bad store URL is refused before any connection is tried: the port
	// the URLs name must see none.
	watch, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var dialled atomic.Int64
	go func() {
		for {
			c, err := watch.Accept()
			if err != nil {
				return
			}
			dialled.Add(1)
			c.Close()
		}
	}()
	defer func() {
		watch.Close()
		if n := dialled.Load(); n != 0 {
			t.Errorf("bad store URLs: got %d connections to the port they name, want 0", n)
		}
	}()
	_, watchPort, _ := net.SplitHostPort(watch.Addr().String())
	for _, c := range []struct {
		env  []string
		args []string
		want []string // in stderr
	}{
		{nil, []string{"proxy"}, []string{"--upstream is required"}},
		{nil, []string{"proxy", "--upstream", "ftp://example.com"}, []string{"--upstream", "http://"}},
		{nil, []string{"proxy", "--upstream", "localhost:8080"}, []string{"--upstream", "want a URL: http://localhost:8080"}},
		{nil, []string{"proxy", "--upstream", "127.0.0.1:19000"}, []string{"--upstream", "want a URL: http://127.0.0.1:19000"}},
		{nil, []string{"proxy", "--upstream", "http://u", "--log-format", "xml"}, []string{"--log-format"}},
		{nil, []string{"proxy", "--upstream", "http://u", "--lease", "1ms"}, []string{"--lease", "10ms"}},
		{nil, []string{"proxy", "--upstream", "http://u", "--methods", "GET,P OST"}, []string{"--methods"}},
		{nil, []string{"proxy", "--upstream", "http://u", "--max-body", "lots"}, []string{"-max-body", "size"}},
		{nil, []string{"proxy", "--upstream", "http://u", "--store", "mongodb://x"}, []string{"--store"}},
		{nil, []string{"proxy", "--upstream", "http://u", "--store", "redis:127.0.0.1:" + watchPort}, []string{"--store", "no host", "redis://host:port"}},
		{nil, []string{"proxy", "--upstream", "http://u", "--store", "127.0.0.1:" + watchPort}, []string{"redis://127.0.0.1:" + watchPort}},
		{nil, []string{"proxy", "--upstream", "http://u", "--store", "localhost:" + watchPort}, []string{"redis://localhost:" + watchPort}},
		{nil, []string{"proxy", "--upstream", "http://u", "--store", "redis://127.0.0.1:" + watchPort + "?dbb=1"}, []string{"--store", `unknown query parameter "dbb"`}},
		{nil, []string{"proxy", "--upstream", "http://u", "--store", "redis://127.0.0.1:" + watchPort + "/0/1"}, []string{"--store", "path"}},
		{nil, []string{"proxy", "--upstream", "http://u", "--store", "postgres:127.0.0.1:" + watchPort}, []string{"--store", "no host"}},
		{nil, []string{"proxy", "--upstream", "http://u", "--max-execution", "-1s"}, []string{"--max-execution"}},
		{nil, []string{"proxy", "--upstream", "http://u", "--client-write-timeout", "-1s"}, []string{"--client-write-timeout"}},
		{nil, []string{"proxy", "--upstream", "http://u", "--config", filepath.Join(dir, "missing.yaml")}, []string{"missing.yaml"}},
		{nil, []string{"proxy", "--upstream", "http://u", "--key-header", "X-Id", "--webhook", "github", "--webhook-secret-env", "GH"},
			[]string{`--key-header "header:X-Id" and --webhook github: the preset names its key; drop --key-header`}},
		{nil, []string{"proxy", "--upstream", "http://u", "--webhook", "stripe"}, []string{"--webhook stripe: set one of --webhook-secret-file and --webhook-secret-env"}},
		{nil, []string{"proxy", "--upstream", "http://u", "--webhook", "github", "--webhook-secret-env", "GH", "--webhook-tolerance", "1m"},
			[]string{"--webhook-tolerance 1m0s: github signs no timestamp"}},
		{nil, []string{"proxy", "--upstream", "http://u", "--fingerprint-exclude", "/ts", "--fingerprint-fields", "/id"},
			[]string{"--fingerprint-exclude and --fingerprint-fields: set one, not both"}},
		{nil, []string{"proxy", "--upstream", "http://u", "--fingerprint", "raw", "--fingerprint-fields", "/id, /amount"},
			[]string{"--fingerprint raw: --fingerprint-exclude and --fingerprint-fields need json"}},
		{[]string{"IDEM_KEY_HEADER=X Id"}, []string{"proxy", "--upstream", "http://u"}, []string{`IDEM_KEY_HEADER: --key-header "X Id": not a header name`}},
		{[]string{"IDEM_LEASE=forever"}, []string{"proxy", "--upstream", "http://u"}, []string{"IDEM_LEASE"}},
		{[]string{"IDEM_UPSTREAM=http://u", "IDEM_WAIT=-1s"}, []string{"proxy"}, []string{"--wait"}},
		{nil, cfgArgs(dir, "unknown-field.yaml"), []string{"unknown-field.yaml", "requre_key"}},
		{nil, cfgArgs(dir, "bad-pattern.yaml"), []string{"bad-pattern.yaml", "routes[0]", "invalid pattern"}},
		{nil, cfgArgs(dir, "conflict.yaml"), []string{"conflict.yaml", "routes[1]", "conflicts"}},
		{nil, cfgArgs(dir, "no-match.yaml"), []string{"no-match.yaml", "match is missing"}},
		{nil, cfgArgs(dir, "bad-lease.yaml"), []string{"bad-lease.yaml", "line 3", "not a duration"}},
		{nil, cfgArgs(dir, "short-lease.yaml"), []string{"short-lease.yaml", "lease 1ms"}},
		{nil, cfgArgs(dir, "bad-method.yaml"), []string{"bad-method.yaml", "methods"}},
		{nil, cfgArgs(dir, "bad-status.yaml"), []string{"bad-status.yaml", "store_statuses", "99"}},
		{nil, cfgArgs(dir, "bad-cwt.yaml"), []string{"bad-cwt.yaml", "client_write_timeout -1s"}},
		{nil, cfgArgs(dir, "not-yaml.yaml"), []string{"not-yaml.yaml"}},
	} {
		code, stderr := runIdem(t, c.env, c.args...)
		if code != 2 {
			t.Errorf("%q %q: got exit status %d, want 2; stderr:\n%s", c.env, c.args, code, stderr)
			continue
		}
		for _, w := range c.want {
			if !strings.Contains(stderr, w) {
				t.Errorf("%q %q: stderr %q does not mention %q", c.env, c.args, stderr, w)
			}
		}
	}
}

func cfgArgs(dir, name string) []string {
	return []string{"proxy", "--upstream", "http://u", "--config", filepath.Join(dir, name)}
}

func writeFile(t *testing.T, path, text string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestProxySize(t *testing.T) {
	for _, c := range []struct {
		in   string
		want int64
		str  string
	}{{"1048576", 1 << 20, "1MiB"}, {"64KiB", 64 << 10, "64KiB"}, {"1 MiB", 1 << 20, "1MiB"}, {"10MB", 10e6, "10000000"},
		{"3GiB", 3 << 30, "3GiB"}, {"1000", 1000, "1000"}, {"0", 0, "0"}} {
		var b byteSize
		if err := b.Set(c.in); err != nil || int64(b) != c.want || b.String() != c.str {
			t.Errorf("size %q: got %d %q %v, want %d %q", c.in, int64(b), b.String(), err, c.want, c.str)
		}
	}
	for _, in := range []string{"", "-1", "1.5MiB", "MiB", "1TiB", "9223372036854775807KiB"} {
		var b byteSize
		if err := b.Set(in); err == nil {
			t.Errorf("size %q: got %d, want an error", in, int64(b))
		}
	}
}
