package hostile

import (
	"bufio"
	"fmt"
	"io"
	"net/http"
	"os/exec"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/reltest"
)

// oddCaseUpstream is a Python http.server (not Go: nothing canonicalises
// the names it writes) whose POST answers 201 with Set-Cookie in three
// spellings (set-cookie, SET-COOKIE, sEt-CoOkIe), the hop-by-hop headers
// connection (naming x-hop) and KEEP-ALIVE, x-hop itself, and the
// caller's secret as x-session-token. GET /count is its executions.
const oddCaseUpstream = `
import http.server, json, sys, threading
n = 0
lock = threading.Lock()
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_POST(self):
        global n
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        with lock:
            n += 1
            run = n
        body = json.dumps({"run": run, "auth": self.headers.get("Authorization", "")}).encode()
        self.send_response(201)
        self.send_header("set-cookie", "session=lower%d; Path=/" % run)
        self.send_header("SET-COOKIE", "csrf=upper%d; Path=/" % run)
        self.send_header("sEt-CoOkIe", "pref=mixed%d; Path=/" % run)
        self.send_header("connection", "x-hop")
        self.send_header("x-hop", "hop-%d" % run)
        self.send_header("KEEP-ALIVE", "timeout=5")
        self.send_header("x-session-token", "secret-%d" % run)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        body = str(n).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
print(srv.server_address[1], flush=True)
srv.serve_forever()
`

// startOddCaseUpstream runs oddCaseUpstream and returns its URL and a
// function that reads its execution count.
func startOddCaseUpstream(t *testing.T) (string, func() int) {
	t.Helper()
	cmd := exec.Command(needTool(t, "python"), "-c", oddCaseUpstream)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	port := make(chan string, 1)
	go func() {
		line, _ := bufio.NewReader(out).ReadString('\n')
		port <- strings.TrimSpace(line)
		io.Copy(io.Discard, out)
	}()
	var p string
	select {
	case p = <-port:
	case <-time.After(10 * time.Second):
		t.Fatal("got no port from the Python upstream within 10s, want it listening")
	}
	if p == "" {
		t.Fatal("the Python upstream exited at start")
	}
	url := "http://127.0.0.1:" + p
	return url, func() int {
		resp, err := http.Get(url + "/count")
		if err != nil {
			t.Fatalf("GET %s/count: %v", url, err)
		}
		defer resp.Body.Close()
		var n int
		fmt.Fscan(resp.Body, &n)
		return n
	}
}

// deniedOnWire returns the header lines of a response head (as it came
// on the wire) whose names, in any case, must never be in a replay.
func deniedOnWire(head string) []string {
	var out []string
	for line := range strings.Lines(head) {
		name, _, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		switch strings.ToLower(strings.TrimSpace(name)) {
		case "set-cookie", "x-hop", "keep-alive", "transfer-encoding", "upgrade", "idempotent-caller-cookies":
			out = append(out, strings.TrimSpace(line))
		}
	}
	return out
}

// headerCaseRound sends, through one target, Alice's keyed POST, her
// retry and Bob's (raw sockets, so the response heads are read as they
// came): the retry replays without any denied header in any case, and
// with her x-session-token; Bob runs his own and never sees her token.
func headerCaseRound(t *testing.T, name, addr string, count func() int) (c tally, leaked int) {
	t.Helper()
	key := "case-" + randomToken()
	kl := "Idempotency-Key: " + key
	body := `{"amount":3}`
	before := count()
	first, firstHead := rawPostHead(t, addr, "/charges", []string{kl, "Authorization: Bearer alice"}, body)
	c.add(first)
	token := first.header.Get("X-Session-Token")
	if first.status != http.StatusCreated || first.replayed() || token == "" || len(first.header.Values("Set-Cookie")) != 3 {
		t.Errorf("%s: got Alice's first answer %d (replayed %v) with X-Session-Token %q and Set-Cookie %q, want an execution's 201 with its token and 3 cookies:\n%s",
			name, first.status, first.replayed(), token, first.header.Values("Set-Cookie"), firstHead)
	}
	for i := range 2 {
		retry, head := rawPostHead(t, addr, "/charges", []string{kl, "Authorization: Bearer alice"}, body)
		c.add(retry)
		if !retry.replayed() || retry.body != first.body {
			t.Errorf("%s: got Alice's retry %d: %d %q (replayed %v), want the replay of %q", name, i+1, retry.status, retry.body, retry.replayed(), first.body)
		}
		if bad := deniedOnWire(head); len(bad) > 0 {
			leaked += len(bad)
			t.Errorf("%s: got a replay carrying %q, want no Set-Cookie, hop-by-hop or Connection-named header in any case:\n%s", name, bad, head)
		}
		if got := retry.header.Get("X-Session-Token"); got != token {
			t.Errorf("%s: got Alice's replay with X-Session-Token %q, want hers %q", name, got, token)
		}
	}
	bob, head := rawPostHead(t, addr, "/charges", []string{kl, "Authorization: Bearer bob"}, body)
	c.add(bob)
	if bob.replayed() || bob.body == first.body || strings.Contains(strings.ToLower(head), strings.ToLower(token)) {
		leaked++
		t.Errorf("%s: got Bob's answer %d %q (replayed %v), want his own execution without Alice's %s:\n%s", name, bob.status, bob.body, bob.replayed(), token, head)
	}
	c.executions = count() - before
	if c.executions != 2 {
		t.Errorf("%s: the upstream ran %d times for Alice (3 sends) and Bob, want 2", name, c.executions)
	}
	return c, leaked
}

// TestHeaderCase runs headerCaseRound through the proxy and Caddy in
// front of the Python upstream, and through idemhttp.Middleware on a
// real server whose handler writes header map keys as it likes
// (w.Header()["set-cookie"], which net/http sends as written) with
// ReplayHeaderDenylist ["x-SESSION-token"]: there Alice's replay has no
// X-Session-Token either, since the denylist matches in any case.
func TestHeaderCase(t *testing.T) {
	t.Parallel()
	upURL, count := startOddCaseUpstream(t)
	for _, tg := range targetsFor(t, upURL, nil, nil) {
		c, leaked := headerCaseRound(t, tg.name, tg.addr, count)
		reltest.Report(t, reltest.Row{
			Scenario: "hostile: header case from a Python upstream (" + tg.name + ")", Store: "redis (single)",
			Fault:    "upstream (http.server) writes set-cookie, SET-COOKIE, sEt-CoOkIe, connection: x-hop, x-hop, KEEP-ALIVE, x-session-token; Alice twice more, then Bob",
			Requests: c.requests, Keys: 1, Duplicates: c.executions - 2, ClientErrors: c.errs,
			Notes: fmt.Sprintf("%d executions (Alice, Bob), %d replays; denied headers in the replays, in any case, and Alice's token to Bob: %d", c.executions, c.replays, leaked),
		})
	}

	// In process: a handler writing raw map keys.
	var runs atomic.Int64
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := runs.Add(1)
		h := w.Header()
		h["set-cookie"] = []string{fmt.Sprintf("session=lower%d", n)}
		h["SET-COOKIE"] = []string{fmt.Sprintf("csrf=upper%d", n)}
		h["connection"] = []string{"x-hop"}
		h["x-hop"] = []string{"hop"}
		h["keep-alive"] = []string{"timeout=5"}
		h["upgrade"] = []string{"h2c"}
		h["X-SESSION-TOKEN"] = []string{fmt.Sprintf("secret-%d", n)}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"run":%d,"auth":%q}`, n, r.Header.Get("Authorization"))
	})
	st, _ := newRedisStore(t, rdb)
	ts, _ := startServer(t, idemhttp.Middleware(st, idemhttp.Config{Logger: quietLogger(), ReplayHeaderDenylist: []string{"x-SESSION-token"}})(h), nil)
	addr := strings.TrimPrefix(ts.URL, "http://")
	var c tally
	leaked := 0
	key := "case-mw-" + randomToken()
	kl := "Idempotency-Key: " + key
	first, firstHead := rawPostHead(t, addr, "/charges", []string{kl, "Authorization: Bearer alice"}, "{}")
	c.add(first)
	if first.status != http.StatusCreated || first.replayed() || !strings.Contains(firstHead, "set-cookie:") {
		t.Errorf("middleware: got the first answer %d (replayed %v), want a 201 with the handler's set-cookie as written:\n%s", first.status, first.replayed(), firstHead)
	}
	for range 2 {
		retry, head := rawPostHead(t, addr, "/charges", []string{kl, "Authorization: Bearer alice"}, "{}")
		c.add(retry)
		bad := deniedOnWire(head)
		for line := range strings.Lines(head) {
			if strings.HasPrefix(strings.ToLower(line), "x-session-token:") {
				bad = append(bad, strings.TrimSpace(line))
			}
		}
		if !retry.replayed() || retry.body != first.body || len(bad) > 0 {
			leaked += len(bad)
			t.Errorf("middleware: got the retry %d %q (replayed %v) carrying %q, want the replay of %q without denied headers in any case:\n%s",
				retry.status, retry.body, retry.replayed(), bad, first.body, head)
		}
	}
	bob, head := rawPostHead(t, addr, "/charges", []string{kl, "Authorization: Bearer bob"}, "{}")
	c.add(bob)
	if bob.replayed() || strings.Contains(head, "secret-1") {
		leaked++
		t.Errorf("middleware: got Bob's answer %d (replayed %v), want his own execution:\n%s", bob.status, bob.replayed(), head)
	}
	c.executions = int(runs.Load())
	if c.executions != 2 {
		t.Errorf("middleware: the handler ran %d times for Alice (3 sends) and Bob, want 2", c.executions)
	}
	reltest.Report(t, reltest.Row{
		Scenario: "hostile: header case from a handler's map keys (middleware)", Store: "redis (single)",
		Fault:    `handler sets w.Header()["set-cookie"], ["SET-COOKIE"], ["connection"], ["x-hop"], ["keep-alive"], ["upgrade"], ["X-SESSION-TOKEN"]; ReplayHeaderDenylist ["x-SESSION-token"]`,
		Requests: c.requests, Keys: 1, Duplicates: c.executions - 2, ClientErrors: c.errs,
		Notes: fmt.Sprintf("%d executions, %d replays; denied headers in the replays, in any case: %d", c.executions, c.replays, leaked),
	})
}
