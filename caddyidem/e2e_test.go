package caddyidem

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	_ "github.com/caddyserver/caddy/v2/modules/standard"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/nettest"
	"github.com/idemkit/idem/internal/redisserver"
)

// rdb is the private redis-server of the tests on Redis.
var rdb *redisserver.Server

func TestMain(m *testing.M) {
	// Caddy keeps its data (certificates, locks) and autosaved config
	// under XDG_DATA_HOME and XDG_CONFIG_HOME: a directory of the run's,
	// not the user's.
	dir, err := os.MkdirTemp("", "caddyidem-test-")
	if err != nil {
		panic(err)
	}
	os.Setenv("XDG_DATA_HOME", dir)
	os.Setenv("XDG_CONFIG_HOME", dir)
	storageDir = dir // caddy.DefaultStorage took its path at init: set storage in the config
	rdb = redisserver.MustStartServer()
	code := m.Run()
	caddy.Stop()
	rdb.Stop()
	os.RemoveAll(dir)
	os.Exit(code)
}

// storageDir is the Caddy storage of the run (a temporary directory).
var storageDir string

// runID keeps keys and prefixes of one run apart from another's.
var runID = fmt.Sprint(time.Now().UnixNano())

// counter is the upstream: POST /pay counts one execution per
// Idempotency-Key, works for work, and answers 201 with a body that names
// the execution (a second execution has another body).
type counter struct {
	srv  *httptest.Server
	work time.Duration
	seq  atomic.Int64
	mu   sync.Mutex
	runs map[string]int
	// headers is the raw Idempotency-Key header name of each request.
	names map[string]bool
}

func startCounter(t *testing.T, work time.Duration) *counter {
	c := &counter{work: work, runs: map[string]int{}, names: map[string]bool{}}
	c.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get(idemhttp.HeaderKey)
		c.mu.Lock()
		c.runs[key]++
		c.mu.Unlock()
		body, _ := io.ReadAll(r.Body)
		time.Sleep(c.work)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"run":%d,"key":%q,"request":%q}`, c.seq.Add(1), key, body)
	}))
	t.Cleanup(c.srv.Close)
	return c
}

func (c *counter) count(key string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.runs[key]
}

// startCaddy loads a Caddyfile into this process's Caddy (replacing the
// config of the test before) with admin off, listening on a free loopback
// port; site is the site block's body. It returns the base URL.
func startCaddy(t *testing.T, site string) string {
	t.Helper()
	return startCaddyGlobal(t, "", site)
}

// startCaddyGlobal is startCaddy with more global options.
func startCaddyGlobal(t *testing.T, global, site string) string {
	t.Helper()
	port, err := nettest.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	cf := fmt.Sprintf("{\n\tadmin off\n\tstorage file_system %s\n\tpersist_config off\n\tauto_https off\n\tmetrics\n\tlog {\n\t\tlevel WARN\n\t}\n%s}\nhttp://127.0.0.1:%d {\n%s\n}\n", storageDir, global, port, site)
	cfg, warnings, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(cf), nil)
	if err != nil {
		t.Fatalf("adapting the Caddyfile: %v\n%s", err, cf)
	}
	for _, w := range warnings {
		t.Logf("Caddyfile warning: %s", w.String())
	}
	if err := caddy.Load(cfg, true); err != nil {
		t.Fatalf("loading the config: %v\n%s", err, cfg)
	}
	t.Cleanup(func() { caddy.Stop() })
	return fmt.Sprintf("http://127.0.0.1:%d", port)
}

type answer struct {
	status   int
	body     string
	replayed string
	retry    string
}

func post(t *testing.T, url, key, body string) answer {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if key != "" {
		req.Header.Set(idemhttp.HeaderKey, key)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return answer{resp.StatusCode, string(b), resp.Header.Get(idemhttp.HeaderReplayed), resp.Header.Get("Retry-After")}
}

// stores are the stores the end-to-end tests run on.
func stores() map[string]string {
	return map[string]string{"memory": "memory", "redis": "redis://" + rdb.Addr()}
}

// TestOncePerKey: through a real Caddy (the route form) to a real
// upstream, a key runs once; its repeat is the byte-identical replay; a
// second request while the first runs gets 409 with Retry-After (wait 0:
// at once, as idem proxy's --wait 0; by default it would wait for the
// replay, TestWaitDefault); the same
// key with another body gets 422; a request without a key passes through.
func TestOncePerKey(t *testing.T) {
	for name, store := range stores() {
		t.Run(name, func(t *testing.T) {
			up := startCounter(t, 300*time.Millisecond)
			base := startCaddy(t, fmt.Sprintf("\troute /payments/* {\n\t\tidempotency {\n\t\t\tstore %s\n\t\t\tprefix caddyidem:%s:\n\t\t\twait 0\n\t\t}\n\t\treverse_proxy %s\n\t}",
				store, runID, strings.TrimPrefix(up.srv.URL, "http://")))
			key := "once-" + name + "-" + runID
			var first, during answer
			var wg sync.WaitGroup
			wg.Go(func() { first = post(t, base+"/payments/7", key, `{"amount":1}`) })
			time.Sleep(100 * time.Millisecond) // the first holds the key (300ms of work)
			during = post(t, base+"/payments/7", key, `{"amount":1}`)
			wg.Wait()
			if first.status != 201 || first.replayed != "" {
				t.Fatalf("first: got %d (replayed %q) %q, want the upstream's 201", first.status, first.replayed, first.body)
			}
			if during.status != 409 || during.retry == "" || !strings.Contains(during.body, idemhttp.ProblemInFlight) {
				t.Errorf("during the first: got %d Retry-After %q %q, want 409 in-flight with Retry-After", during.status, during.retry, during.body)
			}
			again := post(t, base+"/payments/7", key, `{"amount":1}`)
			if again.status != 201 || again.replayed != "true" || again.body != first.body {
				t.Errorf("repeat: got %d (replayed %q) %q, want the replay of %q", again.status, again.replayed, again.body, first.body)
			}
			other := post(t, base+"/payments/7", key, `{"amount":2}`)
			if other.status != 422 || !strings.Contains(other.body, idemhttp.ProblemMismatch) {
				t.Errorf("same key, another body: got %d %q, want 422 mismatch", other.status, other.body)
			}
			if n := up.count(key); n != 1 {
				t.Errorf("got %d executions of the key, want 1", n)
			}
			unkeyed := post(t, base+"/payments/7", "", `{"amount":1}`)
			unkeyed2 := post(t, base+"/payments/7", "", `{"amount":1}`)
			if unkeyed.status != 201 || unkeyed2.status != 201 || up.count("") != 2 {
				t.Errorf("without a key: got %d, %d and %d executions, want 201, 201 and 2 (passed through)", unkeyed.status, unkeyed2.status, up.count(""))
			}
		})
	}
}

// TestWaitDefault: without wait, a copy of a request still running waits
// for its result (idemhttp.DefaultWait) and gets the replay, not 409. The
// upstream holds the first until the copy was sent and had a moment to
// start waiting; a copy that arrives later still gets the replay.
func TestWaitDefault(t *testing.T) {
	gate := make(chan struct{})
	var runs atomic.Int64
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := runs.Add(1)
		<-gate
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"run":%d}`, n)
	}))
	t.Cleanup(up.Close)
	t.Cleanup(func() {
		select {
		case <-gate:
		default:
			close(gate)
		}
	})
	base := startCaddy(t, fmt.Sprintf("\tidempotency {\n\t\tprefix waitdefault:\n\t}\n\treverse_proxy %s", strings.TrimPrefix(up.URL, "http://")))
	key := "wait-default-" + runID
	var first, during answer
	var wg sync.WaitGroup
	wg.Go(func() { first = post(t, base+"/pay", key, `{}`) })
	for runs.Load() == 0 { // the first holds the key and is upstream
		time.Sleep(5 * time.Millisecond)
	}
	wg.Go(func() { during = post(t, base+"/pay", key, `{}`) })
	time.Sleep(100 * time.Millisecond) // well within the 500ms wait
	close(gate)
	wg.Wait()
	if first.status != 201 || first.replayed != "" {
		t.Fatalf("first: got %d (replayed %q) %q, want the upstream's 201", first.status, first.replayed, first.body)
	}
	if during.status != 201 || during.replayed != "true" || during.body != first.body {
		t.Errorf("copy during the first: got %d (replayed %q) %q, want the replay of %q after the default wait (unset wait is not 0)",
			during.status, during.replayed, during.body, first.body)
	}
	if n := runs.Load(); n != 1 {
		t.Errorf("got %d executions, want 1", n)
	}
}

// TestUpstreamErrorReleasesKey: reverse_proxy returns an error (502) when
// the upstream cannot be reached; the key is released, not stored, and
// the retry once the upstream is back runs it and gets its answer.
func TestUpstreamErrorReleasesKey(t *testing.T) {
	port, err := nettest.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	upAddr := fmt.Sprintf("127.0.0.1:%d", port)
	base := startCaddy(t, fmt.Sprintf("\tidempotency\n\treverse_proxy %s", upAddr))
	key := "down-" + runID
	down := post(t, base+"/pay", key, `{}`)
	if down.status != http.StatusBadGateway {
		t.Fatalf("upstream down: got %d %q, want reverse_proxy's 502", down.status, down.body)
	}
	ln, err := net.Listen("tcp", upAddr)
	if err != nil {
		t.Fatal(err)
	}
	up := startCounter(t, 0)
	up.srv.Close()
	srv := &http.Server{Handler: up.srv.Config.Handler}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	back := post(t, base+"/pay", key, `{}`)
	if back.status != 201 || back.replayed != "" || up.count(key) != 1 {
		t.Errorf("retry once the upstream is back: got %d (replayed %q) %q after %d executions, want the upstream's own 201 after 1 (the 502 released the key)",
			back.status, back.replayed, back.body, up.count(key))
	}
	again := post(t, base+"/pay", key, `{}`)
	if again.status != 201 || again.replayed != "true" || again.body != back.body {
		t.Errorf("repeat: got %d (replayed %q) %q, want the replay of %q", again.status, again.replayed, again.body, back.body)
	}
}

// TestBodilessSentOnce: a keyed POST without a body is sent upstream
// once. The upstream answers the first request of each connection and
// closes the connection on the second without an answer, after counting
// it: net/http's Transport (reverse_proxy's) resends a request on a
// reused connection that broke so, when the request has no body and an
// Idempotency-Key header, and the upstream would run it twice. The
// handler sends the key under its lower-case name, which the Transport
// does not take for a sign that it may resend: the key runs once, the
// client gets 502 and the key is released.
func TestBodilessSentOnce(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	var mu sync.Mutex
	runs := map[string]int{}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				br := bufio.NewReader(c)
				for n := 1; ; n++ {
					req, err := http.ReadRequest(br)
					if err != nil {
						return
					}
					io.Copy(io.Discard, req.Body)
					key := req.Header.Get(idemhttp.HeaderKey)
					mu.Lock()
					runs[key]++
					mu.Unlock()
					if n == 2 {
						return // acted, and the connection breaks before the answer
					}
					fmt.Fprint(c, "HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok")
				}
			}()
		}
	}()
	base := startCaddy(t, fmt.Sprintf("\tidempotency\n\treverse_proxy %s", ln.Addr()))
	if a := post(t, base+"/warm", "", "x"); a.status != 201 { // the upstream connection Caddy keeps
		t.Fatalf("warm-up: got %d %q, want 201", a.status, a.body)
	}
	key := "bodiless-" + runID
	a := post(t, base+"/pay", key, "")
	mu.Lock()
	n := runs[key]
	mu.Unlock()
	if n != 1 {
		t.Errorf("got %d upstream executions of the bodiless keyed request (answered %d %q), want 1", n, a.status, a.body)
	}
}

// metricValue reads one series of Caddy's /metrics (0 when absent).
func metricValue(t *testing.T, url, series string) float64 {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	for line := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), series+" "); ok {
			var f float64
			fmt.Sscan(v, &f)
			return f
		}
	}
	return 0
}

// TestMetrics: the outcomes are counted under idem proxy's names on
// Caddy's registry, served by Caddy's metrics handler.
func TestMetrics(t *testing.T) {
	up := startCounter(t, 0)
	base := startCaddy(t, fmt.Sprintf("\tmetrics /metrics\n\tidempotency /pay* {\n\t\tmethods POST\n\t}\n\treverse_proxy /pay* %s", strings.TrimPrefix(up.srv.URL, "http://")))
	series := func(o string) string { return `idem_requests_total{outcome="` + o + `"}` }
	before := map[string]float64{}
	for _, o := range []string{"executed", "replayed", "not_covered"} {
		before[o] = metricValue(t, base+"/metrics", series(o))
	}
	key := "metrics-" + runID
	post(t, base+"/pay", key, "{}")
	post(t, base+"/pay", key, "{}")
	req, _ := http.NewRequest(http.MethodPatch, base+"/pay", strings.NewReader("{}"))
	req.Header.Set(idemhttp.HeaderKey, key)
	if resp, err := http.DefaultClient.Do(req); err == nil {
		resp.Body.Close()
	}
	for o, want := range map[string]float64{"executed": 1, "replayed": 1, "not_covered": 1} {
		if got := metricValue(t, base+"/metrics", series(o)) - before[o]; got != want {
			t.Errorf("%s: got %v more, want %v", series(o), got, want)
		}
	}
}

// TestReloadKeepsRecords: a config reload keeps the memory store (shared
// by the handlers that name it, in a caddy.UsagePool): a key executed
// before the reload is replayed after it, not run again.
func TestReloadKeepsRecords(t *testing.T) {
	up := startCounter(t, 0)
	site := fmt.Sprintf("\tidempotency {\n\t\tstore memory\n\t\tprefix reload:\n\t}\n\treverse_proxy %s", strings.TrimPrefix(up.srv.URL, "http://"))
	key := "reload-" + runID
	first := post(t, startCaddy(t, site)+"/pay", key, "{}")
	base := startCaddy(t, site+"\n\theader X-Reloaded yes") // another config: a reload
	again := post(t, base+"/pay", key, "{}")
	if again.status != 201 || again.replayed != "true" || again.body != first.body || up.count(key) != 1 {
		t.Errorf("after the reload: got %d (replayed %q) %q after %d executions, want the replay of %q after 1",
			again.status, again.replayed, again.body, up.count(key), first.body)
	}
}

// TestQuota: through a real Caddy on the memory store, a tenant's new
// keys past its quota get 429 quota-exceeded with Retry-After and never
// reach the upstream; its stored key still replays; another tenant
// (another Authorization) still stores new keys; the refusals are counted
// in idem_quota_exceeded_total. Without quota settings, store memory has
// idemhttp.DefaultQuota of its memory_limit: memory_limit 1MiB gives each
// tenant 128 KiB.
func TestQuota(t *testing.T) {
	up := startCounter(t, 0)
	base := startCaddy(t, fmt.Sprintf("\tmetrics /metrics\n\troute /q/* {\n\t\tidempotency {\n\t\t\tmemory_limit 1MiB\n\t\t}\n\t\treverse_proxy %s\n\t}",
		strings.TrimPrefix(up.srv.URL, "http://")))
	const series = `idem_quota_exceeded_total{limit="bytes"}`
	before := metricValue(t, base+"/metrics", series)
	send := func(key, auth, body string) (int, http.Header, string) {
		req, _ := http.NewRequest(http.MethodPost, base+"/q/x", strings.NewReader(body))
		req.Header.Set(idemhttp.HeaderKey, key)
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, resp.Header, string(b)
	}
	body := fmt.Sprintf(`{"pad":%q}`, strings.Repeat("0123456789abcdef", 2<<10)) // 32 KiB: echoed
	refused := ""
	for i := range 40 {
		key := fmt.Sprint("q-", runID, "-", i)
		st, h, b := send(key, "Bearer mallory", body)
		if st == http.StatusCreated {
			continue
		}
		if st != http.StatusTooManyRequests || h.Get("Retry-After") == "" || !strings.Contains(b, idemhttp.ProblemQuotaExceeded) {
			t.Fatalf("key %d: got %d Retry-After %q %q, want 429 quota-exceeded with Retry-After", i, st, h.Get("Retry-After"), b)
		}
		if i < 3 || i > 5 {
			t.Errorf("refused after %d keys of 32 KiB, want about 4 (128 KiB per tenant)", i)
		}
		refused = key
		break
	}
	if refused == "" {
		t.Fatal("40 keys of 32 KiB: none refused, want 429 past 128 KiB")
	}
	if n := up.count(refused); n != 0 {
		t.Errorf("the refused key ran %d times upstream, want 0", n)
	}
	if st, h, _ := send(fmt.Sprint("q-", runID, "-0"), "Bearer mallory", body); st != 201 || h.Get(idemhttp.HeaderReplayed) != "true" {
		t.Errorf("a stored key over the quota: got %d, want its replay", st)
	}
	if st, _, b := send("victim-"+runID, "Bearer alice", body); st != 201 {
		t.Errorf("another tenant: got %d %.200s, want 201", st, b)
	}
	if got := metricValue(t, base+"/metrics", series) - before; got != 1 {
		t.Errorf("%s: got %v more, want 1", series, got)
	}
}
