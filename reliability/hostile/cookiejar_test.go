package hostile

import (
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/childproc"
	"github.com/idemkit/idem/internal/reltest"
)

// cookieJarClient is Python requests with a requests.Session (a cookie
// jar, as browsers and most HTTP clients have), sending keyed POSTs as
// four clients would:
//
//   - jar: a session that starts empty sends a key three times; the first
//     201 sets session=…, which the retries carry;
//   - browser: a session logged in first (GET /login sets session=login-…)
//     sends a key three times; the first 201 rotates its session cookie;
//   - other: another browser, logged in with its own session, sends the
//     browser's key and body;
//   - none: a third client without cookies sends the browser's key and body.
//
// It prints one JSON object: for each client, every answer's status,
// Idempotent-Replayed, body and the Cookie header the request carried.
const cookieJarClient = `
import json, sys, requests
base, tag = sys.argv[1], sys.argv[2]
def post(s, key):
    r = s.post(base + "/charges", data='{"amount":42}', headers={"Idempotency-Key": key, "Content-Type": "application/json"}, timeout=10)
    return {"status": r.status_code, "replayed": r.headers.get("Idempotent-Replayed", ""), "body": r.text,
            "sent": r.request.headers.get("Cookie", "")}
out = {}
jar = requests.Session()
out["jar"] = [post(jar, tag + "-jar") for _ in range(3)]
browser = requests.Session()
browser.get(base + "/login", timeout=10)
out["browser"] = [post(browser, tag + "-browser") for _ in range(3)]
other = requests.Session()
other.get(base + "/login", timeout=10)
out["other"] = [post(other, tag + "-browser")]
out["none"] = [post(requests.Session(), tag + "-browser")]
print(json.dumps(out))
`

// jarAnswer is one answer the Python client saw.
type jarAnswer struct {
	Status   int
	Replayed string
	Body     string
	Sent     string // the Cookie header of the request
}

// runCookieJar runs cookieJarClient against base.
func runCookieJar(t *testing.T, base, tag string) map[string][]jarAnswer {
	t.Helper()
	cmd := exec.Command(needTool(t, "python"), "-c", cookieJarClient, base, tag)
	out, err := cmd.Output()
	if err != nil {
		stderr := ""
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = string(ee.Stderr)
		}
		t.Fatalf("python requests client against %s: %v\n%s", base, err, stderr)
	}
	var res map[string][]jarAnswer
	if err := json.Unmarshal(out, &res); err != nil {
		t.Fatalf("python requests client: %v in %q", err, out)
	}
	return res
}

// rotatingLB is a private HAProxy 2.6 in front of one backend that adds
// Set-Cookie: AWSALB=<random> to every response, as AWS ALB's stickiness
// does: every retry of a cookie-jar client carries a new value.
type rotatingLB struct {
	addr string
	mu   sync.Mutex
	out  strings.Builder
}

func (h *rotatingLB) Write(p []byte) (int, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.out.Write(p)
}

func startRotatingLB(t *testing.T, backend string) *rotatingLB {
	t.Helper()
	bin := needTool(t, "haproxy")
	dir := t.TempDir()
	for attempt := 1; ; attempt++ {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addr := l.Addr().String()
		l.Close()
		conf := fmt.Sprintf(`global
	maxconn 64
defaults
	mode http
	timeout connect 1s
	timeout client 10s
	timeout server 10s
frontend fe
	bind %s
	http-response add-header Set-Cookie "AWSALB=%%[rand,hex]; Path=/"
	default_backend be
backend be
	server idem %s
`, addr, backend)
		path := dir + "/haproxy.cfg"
		if err := os.WriteFile(path, []byte(conf), 0o644); err != nil {
			t.Fatal(err)
		}
		h := &rotatingLB{addr: addr}
		cmd := exec.Command(bin, "-db", "-f", path)
		cmd.SysProcAttr = childproc.SysProcAttr()
		cmd.Stdout, cmd.Stderr = h, h
		if err := cmd.Start(); err != nil {
			t.Fatalf("starting haproxy: %v", err)
		}
		exited := make(chan struct{})
		go func() { cmd.Wait(); close(exited) }()
		ready := waitFor(10*time.Second, func() bool {
			select {
			case <-exited:
				return true
			default:
			}
			c, err := net.DialTimeout("tcp", addr, time.Second)
			if err == nil {
				c.Close()
			}
			return err == nil
		})
		select {
		case <-exited:
			h.mu.Lock()
			log := h.out.String()
			h.mu.Unlock()
			if strings.Contains(log, "Address already in use") && attempt < 3 {
				continue
			}
			t.Fatalf("got haproxy exiting at start, want it serving:\n%s", log)
		default:
		}
		t.Cleanup(func() { cmd.Process.Kill(); <-exited })
		if !ready {
			t.Fatalf("got haproxy not accepting connections on %s after 10s, want it serving", addr)
		}
		return h
	}
}

// TestCookieJarRetries runs the Python cookie-jar clients against the
// proxy and Caddy, directly and behind HAProxy rotating AWSALB on every
// response. No tenant source names these callers, so their cookies stand
// in for one: a retry that carries the cookies the first request had, or
// the values its response set, replays (the jar's and the logged-in
// browser's, whose session rotated, and whose AWSALB changed every
// time); another browser's session, or no cookies, under the browser's
// key is 422 and never another's answer. One execution per key.
func TestCookieJarRetries(t *testing.T) {
	t.Parallel()
	up := startCallerUpstream(t)
	for _, tg := range targetsFor(t, up.url, nil, nil) {
		for _, lb := range []bool{false, true} {
			base, via := tg.url, tg.name
			if lb {
				base, via = "http://"+startRotatingLB(t, tg.addr).addr, "HAProxy rotating AWSALB → "+tg.name
			}
			var c tally
			before := up.count()
			res := runCookieJar(t, base, "jar-"+randomToken())
			rotated := 0
			for _, who := range []string{"jar", "browser"} {
				as := res[who]
				if len(as) != 3 {
					t.Fatalf("%s, %s: got %d answers, want 3", via, who, len(as))
				}
				for i, a := range as {
					c.requests++
					switch {
					case i == 0 && (a.Status != 201 || a.Replayed != ""):
						t.Errorf("%s, %s: got the first answer %d (replayed %q) %q, want an execution", via, who, a.Status, a.Replayed, a.Body)
					case i > 0 && (a.Status != 201 || a.Replayed != "true" || a.Body != as[0].Body):
						t.Errorf("%s, %s: got retry %d (Cookie %q) %d %q (replayed %q), want the replay of %q (not 422)",
							via, who, i, a.Sent, a.Status, a.Body, a.Replayed, as[0].Body)
					}
					if i > 0 && a.Replayed == "true" {
						c.replays++
					}
					if lb && i > 0 && a.Sent != as[i-1].Sent {
						rotated++
					}
				}
				if !strings.Contains(as[1].Sent, "session=s") {
					t.Errorf("%s, %s: got the retry's Cookie %q, want the session the first 201 set", via, who, as[1].Sent)
				}
			}
			if lb && !strings.Contains(res["browser"][2].Sent, "AWSALB=") {
				t.Errorf("%s: got the browser's last Cookie %q, want an AWSALB from HAProxy", via, res["browser"][2].Sent)
			}
			for _, who := range []string{"other", "none"} {
				a := res[who][0]
				c.requests++
				if a.Status != 422 {
					t.Errorf("%s, %s: got %d %q (Cookie %q), want 422 under another browser's key", via, who, a.Status, a.Body, a.Sent)
				}
				if a.Body == res["browser"][0].Body || a.Replayed != "" {
					c.leaked++
					t.Errorf("%s, %s: got the browser's answer %q, want never another's", via, who, a.Body)
				}
				if c.errs == nil {
					c.errs = map[string]int{}
				}
				c.errs[fmt.Sprint(a.Status)]++
			}
			c.executions = up.count() - before
			if c.executions != 2 {
				t.Errorf("%s: the upstream ran %d times for two keys, want 2", via, c.executions)
			}
			notes := fmt.Sprintf("%d executions, %d replays to the jar and the browser (its session rotated by the first 201)", c.executions, c.replays)
			if lb {
				notes += fmt.Sprintf(", the Cookie changing on %d of 4 retries (AWSALB)", rotated)
			}
			notes += fmt.Sprintf("; another browser and a client without cookies: 422; another's answer given: %d", c.leaked)
			reltest.Report(t, reltest.Row{
				Scenario: "hostile: cookie-jar retries, Python requests.Session (" + via + ")", Store: "redis (single)",
				Fault:    "no tenant source: a jar that starts empty and a logged-in browser each send a key 3 times; another browser and a cookie-less client send the browser's key",
				Requests: c.requests, Keys: 2, Duplicates: c.executions - 2, ClientErrors: c.errs, Notes: notes,
			})
		}
	}
}
