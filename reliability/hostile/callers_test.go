package hostile

import (
	"bufio"
	"bytes"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/proctest"
	"github.com/idemkit/idem/internal/redistest"
)

// The scenarios of issue 31 ("No caller gets another's result"), driven
// from the outside: the built `idem proxy` and Caddy with idem's handler
// (idem-caddy), each on the private Redis, in front of an upstream that
// counts its executions, sent to with Go's client, curl, raw sockets and
// Python requests. Each reports how many requests it made, how many
// executions the upstream counted, how many answers were replays, and
// what leaked to another caller (always 0).

// execution is one request that reached the upstream's POST handler.
type execution struct {
	run    int
	host   string // the Host the upstream saw
	path   string // r.URL.Path (decoded)
	uri    string // the request target as sent (RequestURI)
	cookie string // the Cookie header it got
}

// callerUpstream is the protected service of these scenarios. Every POST
// is an execution: it answers 201 with a body unique to the execution,
// an X-Session-Token of its own (the secret another caller must never
// get) and Set-Cookie session=… (a new session value, as an app that
// rotates its session on a write). GET /login answers 200 and sets a
// session cookie, as a login page does; GET is never covered by idem.
type callerUpstream struct {
	srv  *http.Server
	url  string
	mu   sync.Mutex
	runs []execution
}

func startCallerUpstream(t *testing.T) *callerUpstream {
	t.Helper()
	u := &callerUpstream{}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	u.url = "http://" + ln.Addr().String()
	u.srv = &http.Server{Handler: http.HandlerFunc(u.serve), ReadHeaderTimeout: 5 * time.Second}
	go u.srv.Serve(ln)
	t.Cleanup(func() { u.srv.Close() })
	return u
}

func (u *callerUpstream) serve(w http.ResponseWriter, r *http.Request) {
	if r.Method == http.MethodGet && r.URL.Path == "/login" {
		http.SetCookie(w, &http.Cookie{Name: "session", Value: "login-" + randomToken(), Path: "/"})
		io.WriteString(w, "logged in\n")
		return
	}
	io.Copy(io.Discard, r.Body)
	u.mu.Lock()
	n := len(u.runs) + 1
	u.runs = append(u.runs, execution{run: n, host: r.Host, path: r.URL.Path, uri: r.RequestURI, cookie: r.Header.Get("Cookie")})
	u.mu.Unlock()
	token := fmt.Sprintf("secret-%d-%s", n, randomToken())
	w.Header().Set("X-Session-Token", token)
	http.SetCookie(w, &http.Cookie{Name: "session", Value: fmt.Sprintf("s%d-%s", n, randomToken()), Path: "/"})
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"run":%d,"token":%q,"path":%q}`, n, token, r.URL.Path)
}

// count is the number of executions so far.
func (u *callerUpstream) count() int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return len(u.runs)
}

// since returns the executions after the first n.
func (u *callerUpstream) since(n int) []execution {
	u.mu.Lock()
	defer u.mu.Unlock()
	return append([]execution(nil), u.runs[n:]...)
}

func randomToken() string { return strings.ToLower(rand.Text()[:10]) }

// idemTarget is one system under test: `idem proxy` or Caddy with idem,
// on the private Redis under a prefix of its own.
type idemTarget struct {
	name    string // "idem proxy" or "Caddy"
	addr    string // host:port
	url     string // http://addr
	metrics string // the URL of its Prometheus metrics
	log     func() string
}

// startProxyTarget runs `idem proxy` in front of upstream on the private
// Redis, with its admin endpoint on, and extra flags.
func startProxyTarget(t *testing.T, upstream string, extra ...string) *idemTarget {
	t.Helper()
	prefix := redistest.Prefix("callers")
	args := append([]string{"--upstream", upstream, "--store", "redis://" + rdb.Addr(), "--prefix", prefix,
		"--admin-listen", "127.0.0.1:0"}, extra...)
	p := proctest.StartProxy(t, args...)
	admin := ""
	for line := range strings.Lines(p.LogText()) {
		var rec struct{ Msg, Admin string }
		if json.Unmarshal([]byte(line), &rec) == nil && rec.Msg == "idem proxy listening" {
			admin = rec.Admin
		}
	}
	if admin == "" {
		t.Fatalf("got no admin address in the proxy's listening line, want one:\n%s", p.LogText())
	}
	return &idemTarget{name: "idem proxy", addr: p.Addr, url: "http://" + p.Addr, metrics: "http://" + admin + "/metrics", log: p.LogText}
}

// startCaddyTarget runs idem-caddy with one site on a free port: Caddy's
// metrics at /metrics, the idempotency handler on the private Redis with
// the extra lines of its block (tenant_header X, refuse_anonymous), in
// front of reverse_proxy to upstream. Its log (JSON, WARN and up, and
// the access log) is on stderr.
func startCaddyTarget(t *testing.T, upstream string, extra ...string) *idemTarget {
	t.Helper()
	prefix := redistest.Prefix("callers")
	c := proctest.StartCaddy(t, func(addr string) string {
		host, port, _ := net.SplitHostPort(addr)
		var lines strings.Builder
		for _, l := range extra {
			fmt.Fprintf(&lines, "\t\t%s\n", l)
		}
		return fmt.Sprintf(`{
	admin off
	auto_https off
	persist_config off
	metrics
	log {
		output stderr
		format json
		level WARN
	}
}
http://:%s {
	bind %s
	log {
		output stderr
		format json
	}
	metrics /metrics
	reverse_proxy %s
	idempotency {
		store redis://%s
		prefix %s
%s	}
}
`, port, host, strings.TrimPrefix(upstream, "http://"), rdb.Addr(), prefix, lines.String())
	})
	return &idemTarget{name: "Caddy", addr: c.Addr, url: "http://" + c.Addr, metrics: "http://" + c.Addr + "/metrics", log: c.LogText}
}

// metric reads one series (name and labels as Prometheus prints them)
// from the target's metrics; 0 when absent.
func (tg *idemTarget) metric(t *testing.T, series string) float64 {
	t.Helper()
	resp, err := http.Get(tg.metrics)
	if err != nil {
		t.Fatalf("%s: GET %s: %v", tg.name, tg.metrics, err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), series+" "); ok {
			v, err := strconv.ParseFloat(strings.TrimSpace(rest), 64)
			if err != nil {
				t.Fatalf("%s: metric line %q: %v", tg.name, sc.Text(), err)
			}
			return v
		}
	}
	return 0
}

// anonymousWarnings returns the routes of the target's WARN lines about
// keyed requests from unidentified callers, in order.
func (tg *idemTarget) anonymousWarnings() []string {
	var out []string
	for line := range strings.Lines(tg.log()) {
		var rec struct {
			Msg, Level, Route string
		}
		if json.Unmarshal([]byte(line), &rec) == nil && strings.Contains(rec.Msg, "unidentified caller") {
			out = append(out, rec.Route)
		}
	}
	return out
}

// send is one request sent with Go's client: method POST, the key (if
// any), the body, and the headers given. A header name is sent as written
// (set in the map directly, not canonicalised); "Host" sets the Host.
func send(t *testing.T, c *http.Client, url, key, body string, hdr [][2]string) answer {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set(idemhttp.HeaderKey, key)
	}
	for _, kv := range hdr {
		if strings.EqualFold(kv[0], "Host") {
			req.Host = kv[1]
			continue
		}
		req.Header[kv[0]] = append(req.Header[kv[0]], kv[1])
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("POST %s (key %q, %v): %v", url, key, hdr, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("POST %s: reading the body: %v", url, err)
	}
	return answer{status: resp.StatusCode, header: resp.Header, body: string(b)}
}

// rawPost writes one POST to addr byte for byte: the request target, the
// header lines exactly as given (no normalisation of names, values or
// whitespace; Host: addr unless a line gives one), and the body; it reads
// the response.
func rawPost(t *testing.T, addr, target string, lines []string, body string) answer {
	t.Helper()
	a, _ := rawPostHead(t, addr, target, lines, body)
	return a
}

// rawPostHead is rawPost that also returns the response's status line and
// header lines as they came on the wire (names in the case written).
func rawPostHead(t *testing.T, addr, target string, lines []string, body string) (answer, string) {
	t.Helper()
	var b strings.Builder
	fmt.Fprintf(&b, "POST %s HTTP/1.1\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: %d\r\n", target, len(body))
	host := false
	for _, l := range lines {
		host = host || strings.HasPrefix(strings.ToLower(l), "host:")
		b.WriteString(l + "\r\n")
	}
	if !host {
		b.WriteString("Host: " + addr + "\r\n")
	}
	b.WriteString("\r\n" + body)
	conn, err := net.DialTimeout("tcp", addr, 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(conn, b.String()); err != nil {
		t.Fatalf("raw POST to %s: %v", addr, err)
	}
	var wire bytes.Buffer
	resp, err := http.ReadResponse(bufio.NewReader(io.TeeReader(conn, &wire)), nil)
	if err != nil {
		t.Fatalf("raw POST to %s (%q): reading the response: %v", addr, lines, err)
	}
	defer resp.Body.Close()
	rb, _ := io.ReadAll(resp.Body)
	head, _, _ := strings.Cut(wire.String(), "\r\n\r\n")
	return answer{status: resp.StatusCode, header: resp.Header, body: string(rb)}, head
}

// curlPost runs curl (with --path-as-is: the path is sent as written) for
// one POST and returns the status, the response headers and the body.
func curlPost(t *testing.T, url, key, body string, args ...string) answer {
	t.Helper()
	bin := needTool(t, "curl")
	dir := t.TempDir()
	all := append([]string{"-sS", "--path-as-is", "-m", "10", "-X", "POST", "-H", "Content-Type: application/json",
		"-H", idemhttp.HeaderKey + ": " + key, "--data-binary", body, "-D", dir + "/h", "-o", dir + "/b", "-w", "%{http_code}"}, args...)
	all = append(all, url)
	out, err := exec.Command(bin, all...).Output()
	if err != nil {
		t.Fatalf("curl %q: %v", all, err)
	}
	status, _ := strconv.Atoi(strings.TrimSpace(string(out)))
	hb, _ := os.ReadFile(dir + "/h")
	bb, _ := os.ReadFile(dir + "/b")
	h := http.Header{}
	for line := range strings.Lines(string(hb)) {
		if k, v, ok := strings.Cut(line, ":"); ok && !strings.HasPrefix(k, "HTTP/") {
			h.Add(strings.TrimSpace(k), strings.TrimSpace(v))
		}
	}
	return answer{status: status, header: h, body: string(bb)}
}

// needTool finds a program the scenario runs, or fails naming the Debian
// package (scripts/test.sh installs them).
func needTool(t *testing.T, name string) string {
	t.Helper()
	switch name {
	case "python":
		out, err := exec.Command("/usr/bin/python3", "-c", "import requests").CombinedOutput()
		if err != nil {
			t.Fatalf("got /usr/bin/python3 failing to import requests (%v: %s), want Debian's python3-requests installed (apt-get install python3-requests)", err, bytes.TrimSpace(out))
		}
		return "/usr/bin/python3"
	case "haproxy":
		if p, err := exec.LookPath("haproxy"); err == nil {
			return p
		}
		if _, err := os.Stat("/usr/sbin/haproxy"); err == nil {
			return "/usr/sbin/haproxy"
		}
		t.Fatal("got no haproxy on PATH nor in /usr/sbin, want Debian's haproxy installed (apt-get install haproxy)")
	default:
		p, err := exec.LookPath(name)
		if err != nil {
			t.Fatalf("got no %s on PATH, want Debian's %s installed (apt-get install %s)", name, name, name)
		}
		return p
	}
	return ""
}

// replayed reports whether an answer is a replay.
func (a answer) replayed() bool { return a.header.Get(idemhttp.HeaderReplayed) == "true" }

// run is the execution number in an answer's body (0 when none).
func (a answer) run() int {
	var b struct{ Run int }
	json.Unmarshal([]byte(a.body), &b)
	return b.Run
}
