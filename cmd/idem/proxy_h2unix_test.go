package main

// idem proxy over HTTP/2 cleartext (h2c) and unix sockets, from outside:
// curl --http2-prior-knowledge and curl --unix-socket against the built
// binary; an h2c upstream (Go's net/http, HTTP/2 only); a unix-socket
// upstream on Python's http.server (internal/upstreamtest's unix_upstream.py).

import (
	"bytes"
	"errors"
	"io"
	"io/fs"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/proctest"
	"github.com/idemkit/idem/internal/upstreamtest"
)

// curlResult is one answer curl printed with -i.
type curlResult struct {
	proto  string // "HTTP/2", "HTTP/1.1"
	status int
	header http.Header
	body   []byte
	code   int // curl's exit status
}

// runCurl runs curl -sS -i with args and parses its answer.
func runCurl(t *testing.T, args ...string) curlResult {
	t.Helper()
	cmd := exec.Command(proctest.RequireTool(t, "curl"), append([]string{"-sS", "-i", "--max-time", "20"}, args...)...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	var r curlResult
	if ee := (*exec.ExitError)(nil); errors.As(err, &ee) {
		r.code = ee.ExitCode()
		return r
	} else if err != nil {
		t.Fatal(err)
	}
	head, body, ok := bytes.Cut(out, []byte("\r\n\r\n"))
	if !ok {
		t.Fatalf("curl %q: no header in its output:\n%s\n%s", args, out, stderr.String())
	}
	lines := strings.Split(string(head), "\r\n")
	f := strings.Fields(lines[0])
	if len(f) < 2 {
		t.Fatalf("curl %q: status line %q", args, lines[0])
	}
	r.proto = f[0]
	r.status, _ = strconv.Atoi(f[1])
	r.header = http.Header{}
	for _, l := range lines[1:] {
		if k, v, ok := strings.Cut(l, ":"); ok {
			r.header.Add(k, strings.TrimSpace(v))
		}
	}
	r.body = body
	return r
}

// TestProxyH2CPriorKnowledge: curl --http2-prior-knowledge on the
// proxy's listener (the one HTTP/1.1 is served on) gets HTTP/2 answers,
// and a keyed POST keeps its guarantees: run once, replayed byte for
// byte, 422 for another body under the key, and a client gone after the
// key was taken leaves the work running for its retry.
func TestProxyH2CPriorKnowledge(t *testing.T) {
	u := newTestUpstream(t)
	p := startProxy(t, nil, "--upstream", u.URL, "--wait", "10s") // a copy in flight waits for its result
	post := func(key, body string, extra ...string) curlResult {
		return runCurl(t, append([]string{"--http2-prior-knowledge", "-H", "Idempotency-Key: " + key, "-d", body}, append(extra, p.url("/charges"))...)...)
	}
	first := post("h2-a", "amount=10")
	if first.code != 0 || first.proto != "HTTP/2" || first.status != http.StatusCreated {
		t.Fatalf("first: curl exit %d, %s %d, want HTTP/2 201", first.code, first.proto, first.status)
	}
	again := post("h2-a", "amount=10")
	if again.proto != "HTTP/2" || again.status != http.StatusCreated || again.header.Get(idemhttp.HeaderReplayed) != "true" {
		t.Fatalf("repeat: %s %d %s: %q, want HTTP/2 201 replayed", again.proto, again.status, idemhttp.HeaderReplayed, again.header.Get(idemhttp.HeaderReplayed))
	}
	if !bytes.Equal(first.body, again.body) {
		t.Errorf("replay differs:\n%s\n%s", first.body, again.body)
	}
	if n := u.runsOf("h2-a"); n != 1 {
		t.Errorf("upstream ran h2-a %d times, want 1", n)
	}
	if r := post("h2-a", "amount=99"); r.status != http.StatusUnprocessableEntity {
		t.Errorf("another body under the key: %s %d, want 422", r.proto, r.status)
	}

	// The client leaves (curl's --max-time) while the upstream works;
	// its retry, sent while it still runs, waits for and gets the result
	// of the one execution.
	gone := post("h2-b", "amount=5", "-H", "X-Test-Delay: 1500ms", "--max-time", "0.5")
	if gone.code == 0 {
		t.Fatalf("curl --max-time 0.5 against a 1.5s upstream: exit 0, status %d", gone.status)
	}
	retry := post("h2-b", "amount=5", "-H", "X-Test-Delay: 1500ms")
	if retry.status != http.StatusCreated || retry.header.Get(idemhttp.HeaderReplayed) != "true" {
		t.Errorf("retry after the client left: %s %d replayed %q, want 201 replayed", retry.proto, retry.status, retry.header.Get(idemhttp.HeaderReplayed))
	}
	if n := u.runsOf("h2-b"); n != 1 {
		t.Errorf("upstream ran h2-b %d times, want 1", n)
	}
	// HTTP/1.1 still answers on the same listener.
	if r := runCurl(t, "--http1.1", p.url("/")); r.proto != "HTTP/1.1" || r.status != http.StatusCreated {
		t.Errorf("curl --http1.1: %s %d", r.proto, r.status)
	}

	// SIGTERM while a keyed HTTP/2 request runs: it finishes and is
	// answered, then the proxy exits 0.
	done := make(chan curlResult, 1)
	go func() { done <- post("h2-c", "amount=1", "-H", "X-Test-Delay: 1s") }()
	u.awaitStarted(t, 1, "h2-c")
	p.cmd.Process.Signal(syscall.SIGTERM)
	if r := <-done; r.proto != "HTTP/2" || r.status != http.StatusCreated {
		t.Errorf("keyed HTTP/2 request in flight at SIGTERM: curl exit %d, %s %d, want HTTP/2 201", r.code, r.proto, r.status)
	}
	if code := p.awaitExit(15 * time.Second); code != 0 {
		t.Errorf("exit %d after SIGTERM, want 0", code)
	}
}

// h2cUpstream is an upstream that speaks only cleartext HTTP/2 (Go's
// net/http, Protocols UnencryptedHTTP2): it counts executions per key and
// records the protocol each request came in.
type h2cUpstream struct {
	srv    *httptest.Server
	mu     sync.Mutex
	runs   map[string]int
	protos map[string]string
	conns  atomic.Int32 // connections accepted
}

func newH2CUpstream(t *testing.T, ln net.Listener) *h2cUpstream {
	u := &h2cUpstream{runs: map[string]int{}, protos: map[string]string{}}
	u.srv = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get(idemhttp.HeaderKey)
		body, _ := io.ReadAll(r.Body)
		u.mu.Lock()
		u.runs[key]++
		n := u.runs[key]
		u.protos[key] = r.Proto
		u.mu.Unlock()
		w.Header().Set("Content-Type", "text/plain")
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, r.Proto+" "+r.Host+" "+r.URL.RequestURI()+" run="+strconv.Itoa(n)+" body="+string(body)+" nonce="+strconv.FormatInt(time.Now().UnixNano(), 36))
	}))
	if ln != nil {
		u.srv.Listener.Close()
		u.srv.Listener = ln
	}
	u.srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			u.conns.Add(1)
		}
	}
	u.srv.Config.Protocols = new(http.Protocols)
	u.srv.Config.Protocols.SetUnencryptedHTTP2(true)
	u.srv.Start()
	t.Cleanup(u.srv.Close)
	return u
}

func (u *h2cUpstream) of(key string) (int, string) {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.runs[key], u.protos[key]
}

// keyedTwice POSTs body under key twice through base and checks that the
// second is the replay of the first, byte for byte; it returns the body.
func keyedTwice(t *testing.T, base, key, body string) string {
	t.Helper()
	var bodies [2]string
	for i := range bodies {
		r := mustSend(t, http.MethodPost, base+"/orders?x=1", key, body)
		if r.status != http.StatusCreated {
			t.Fatalf("POST %d under %s: %d %s", i+1, key, r.status, r.body)
		}
		if r.replayed() != (i == 1) {
			t.Errorf("POST %d under %s: replayed %v", i+1, key, r.replayed())
		}
		bodies[i] = string(r.body)
	}
	if bodies[0] != bodies[1] {
		t.Errorf("replay differs:\n%s\n%s", bodies[0], bodies[1])
	}
	return bodies[0]
}

// TestProxyH2CUpstream: --upstream h2c://host:port reaches an upstream
// that speaks only cleartext HTTP/2, and h2c+unix:///path one on a unix
// socket; a keyed request runs there once and is replayed.
func TestProxyH2CUpstream(t *testing.T) {
	t.Run("tcp", func(t *testing.T) {
		u := newH2CUpstream(t, nil)
		p := startProxy(t, nil, "--upstream", "h2c://"+u.srv.Listener.Addr().String())
		got := keyedTwice(t, "http://"+p.addr, "h2c-tcp", "n=1")
		if n, proto := u.of("h2c-tcp"); n != 1 || proto != "HTTP/2.0" {
			t.Errorf("upstream: %d runs over %s, want 1 over HTTP/2.0", n, proto)
		}
		if !strings.Contains(got, " /orders?x=1 ") {
			t.Errorf("upstream saw %q, want the client's path /orders?x=1", got)
		}
		// Unkeyed requests with streamed (chunked) bodies share the one
		// HTTP/2 connection: the connection is closed after such a
		// request only for an HTTP/1.1 upstream.
		for i := range 3 {
			body := io.MultiReader(strings.NewReader("part one, "), strings.NewReader("part two"))
			resp, err := testClient.Post("http://"+p.addr+"/stream", "text/plain", body)
			if err != nil {
				t.Fatal(err)
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusCreated || !strings.Contains(string(b), "body=part one, part two") {
				t.Fatalf("streamed POST %d: %d %s", i, resp.StatusCode, b)
			}
		}
		if n := u.conns.Load(); n != 1 {
			t.Errorf("the upstream accepted %d connections, want 1 (HTTP/2 multiplexes)", n)
		}
	})
	t.Run("unix", func(t *testing.T) {
		sock := filepath.Join(t.TempDir(), "app.sock")
		ln, err := net.Listen("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		u := newH2CUpstream(t, ln)
		p := startProxy(t, nil, "--upstream", "h2c+unix://"+sock)
		got := keyedTwice(t, "http://"+p.addr, "h2c-unix", "n=2")
		if n, proto := u.of("h2c-unix"); n != 1 || proto != "HTTP/2.0" {
			t.Errorf("upstream: %d runs over %s, want 1 over HTTP/2.0", n, proto)
		}
		if !strings.HasPrefix(got, "HTTP/2.0 localhost /orders?x=1 ") {
			t.Errorf("upstream saw %q, want Host localhost and the client's path", got)
		}
	})
}

// TestProxyUnixUpstream: --upstream unix:///path reaches Python's
// http.server on a unix socket; the upstream sees the client's path and
// query, Host localhost (the client's in X-Forwarded-Host); a keyed POST
// runs once and is replayed byte for byte.
func TestProxyUnixUpstream(t *testing.T) {
	sock := upstreamtest.StartUnixPython(t)
	p := startProxy(t, nil, "--upstream", "unix://"+sock)
	got := keyedTwice(t, "http://"+p.addr, "unix-a", "amount=7")
	for _, want := range []string{`"executions": 1`, `"path": "/orders?x=1"`, `"host": "localhost"`, `"forwarded_host": "` + p.addr + `"`, `"body": "amount=7"`} {
		if !strings.Contains(got, want) {
			t.Errorf("upstream's answer %s: no %s", got, want)
		}
	}
	// An unkeyed GET passes through with its path.
	resp, err := testClient.Get("http://" + p.addr + "/status/x?y=2")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(b), `"path": "/status/x?y=2"`) {
		t.Errorf("GET through: %s", b)
	}
}

// TestProxyUnixListen: --listen unix:///path serves HTTP/1.1 and h2c on
// a socket of mode 0660, replacing a stale socket left at the path, and
// removes the socket after SIGTERM.
func TestProxyUnixListen(t *testing.T) {
	u := newTestUpstream(t)
	dir := t.TempDir()
	sock := filepath.Join(dir, "idem.sock")
	// A stale socket: its process is gone without removing it.
	stale, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	stale.(*net.UnixListener).SetUnlinkOnClose(false)
	stale.Close()

	p := startProxy(t, nil, "--upstream", u.URL, "--listen", "unix://"+sock)
	if p.addr != "unix://"+sock {
		t.Errorf("listening on %q, want unix://%s", p.addr, sock)
	}
	fi, err := os.Lstat(sock)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Type() != fs.ModeSocket || fi.Mode().Perm() != 0o660 {
		t.Errorf("socket mode %v, want a socket of mode 0660", fi.Mode())
	}
	var bodies []string
	for _, flag := range []string{"--http1.1", "--http2-prior-knowledge"} {
		r := runCurl(t, "--unix-socket", sock, flag, "-H", "Idempotency-Key: sock-a", "-d", "x=1", "http://localhost/charges")
		if r.status != http.StatusCreated {
			t.Fatalf("curl --unix-socket %s: exit %d, %s %d", flag, r.code, r.proto, r.status)
		}
		bodies = append(bodies, string(r.body))
		if replayed := r.header.Get(idemhttp.HeaderReplayed) == "true"; replayed != (flag != "--http1.1") {
			t.Errorf("curl %s: replayed %v", flag, replayed)
		}
	}
	if bodies[0] != bodies[1] {
		t.Errorf("replay differs:\n%s\n%s", bodies[0], bodies[1])
	}
	if n := u.runsOf("sock-a"); n != 1 {
		t.Errorf("upstream ran sock-a %d times, want 1", n)
	}

	// A second proxy on the socket the first serves is refused.
	code, stderr := runIdem(t, nil, "proxy", "--upstream", u.URL, "--listen", "unix://"+sock)
	if code == 0 || !strings.Contains(stderr, "another process serves this socket") {
		t.Errorf("a second proxy on a served socket: exit %d\n%s", code, stderr)
	}

	p.cmd.Process.Signal(syscall.SIGTERM)
	if code := p.awaitExit(15 * time.Second); code != 0 {
		t.Fatalf("exit %d after SIGTERM", code)
	}
	if _, err := os.Lstat(sock); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("socket after exit: %v, want it removed", err)
	}
}

// TestProxySocketURLMistakes: a malformed unix://, h2c:// or --listen
// unix:// value, or a path that is not a socket, is refused at start in
// one line (exit 2), and the file is left alone.
func TestProxySocketURLMistakes(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "notasocket")
	if err := os.WriteFile(file, []byte("keep me"), 0o644); err != nil {
		t.Fatal(err)
	}
	long := "/" + strings.Repeat("d", 120) + "/app.sock"
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--upstream", "unix://app.sock"}, "--upstream unix://app.sock: want an absolute socket path"},
		{[]string{"--upstream", "unix:app.sock"}, "want an absolute socket path"},
		{[]string{"--upstream", "unix:///run/app.sock?x=1"}, "without a query"},
		{[]string{"--upstream", "unix://" + long}, "at most 107 bytes"},
		{[]string{"--upstream", "h2c+unix://app.sock"}, "want an absolute socket path, such as h2c+unix:///run/app.sock"},
		{[]string{"--upstream", "h2c://127.0.0.1"}, "want h2c://host:port"},
		{[]string{"--upstream", "h2c:///x"}, "want h2c://host:port"},
		{[]string{"--upstream", "ftp://127.0.0.1:1"}, "or unix:///path/to/app.sock"},
		{[]string{"--upstream", "http://127.0.0.1:1", "--listen", "unix://idem.sock"}, "--listen unix://idem.sock: want an absolute socket path"},
		{[]string{"--upstream", "http://127.0.0.1:1", "--listen", "unix://" + file}, "the path exists and is not a socket (a regular file)"},
		{[]string{"--upstream", "http://127.0.0.1:1", "--listen", "unix://" + dir}, "is not a socket (a directory)"},
	} {
		code, stderr := runIdem(t, nil, append([]string{"proxy"}, c.args...)...)
		lines := strings.Split(strings.TrimSpace(stderr), "\n")
		if code != 2 || !strings.Contains(stderr, c.want) || len(lines) > 2 {
			t.Errorf("idem proxy %q: exit %d, want 2 and one line with %q:\n%s", c.args, code, c.want, stderr)
		}
	}
	if b, err := os.ReadFile(file); err != nil || string(b) != "keep me" {
		t.Errorf("the file at --listen: %q %v, want it untouched", b, err)
	}
}
