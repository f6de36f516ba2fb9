package clients

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/childproc"
	"github.com/idemkit/idem/internal/proctest"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/idemkit/idem/internal/reltest"
)

// headerInstance names, on each request that reaches the upstream, the
// idem proxy HAProxy sent it to (http-send-name-header).
const headerInstance = "X-Idem-Instance"

// haproxyConf is a private HAProxy 2.6 configured as an operator who wants
// resilience would: every failure it may retry is retried, a POST
// included, on the other instance.
//
//   - retry-on conn-failure empty-response response-timeout: resend when
//     the connection failed, when the instance closed it without a byte of
//     answer (a crash), and when "timeout server" struck before the
//     response headers. HAProxy 2.6 has no method filter here: it resends
//     a POST as readily as a GET (the documentation leaves "replay
//     protection" to the application: that is idem). It only resends what
//     it kept a copy of: a request whose body was entirely received before
//     it was sent (option http-buffer-request makes sure of that) and that
//     fits in one buffer (tune.bufsize, 16 KiB by default).
//   - retries 3 and option redispatch 1: up to three more attempts, each on
//     another server than the last (without the argument only the last
//     retry is redispatched).
//   - timeout server 300ms (%[3]s): the work takes 1 s, so HAProxy gives up
//     on the instance doing it and resends the keyed POST to the other.
//   - http-send-name-header: the instance's name reaches the upstream, so
//     the test knows which instance forwarded each execution.
//
// Every line HAProxy logs (on stdout, format raw) is
// key|status|server|retries|termination state|response time.
const haproxyConf = `global
	maxconn 256
	log stdout format raw local0 info

defaults
	mode http
	log global
	timeout connect 1s
	timeout client 30s
	timeout http-request 10s
	timeout server %[3]s
	option dontlognull
	retries 3
	option redispatch 1
	retry-on %[4]s
	%[5]s

frontend fe
	bind 127.0.0.1:%[1]d
	capture request header Idempotency-Key len 255
	log-format "%%[capture.req.hdr(0)]|%%ST|%%s|%%rc|%%tsc|%%Tr"
	default_backend idem

backend idem
	balance roundrobin
	http-send-name-header ` + headerInstance + `
%[2]s`

// haproxyOptions are the lines of haproxyConf a test may change.
type haproxyOptions struct {
	serverTimeout string // "300ms"
	retryOn       string // "conn-failure empty-response response-timeout"
	bufferRequest bool   // option http-buffer-request
}

var resilient = haproxyOptions{serverTimeout: "300ms", retryOn: "conn-failure empty-response response-timeout", bufferRequest: true}

// haproxyProc is a running private HAProxy.
type haproxyProc struct {
	addr string
	mu   sync.Mutex
	out  bytes.Buffer // stdout and stderr: the log lines
}

func (h *haproxyProc) Write(p []byte) (int, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.out.Write(p)
}

func (h *haproxyProc) output() string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.out.String()
}

// haLine is one request HAProxy logged.
type haLine struct {
	key, status, server, retries, term, respTime string
}

// lines returns the requests HAProxy logged for key, in order.
func (h *haproxyProc) lines(key string) []haLine {
	var out []haLine
	for l := range strings.Lines(h.output()) {
		f := strings.Split(strings.TrimSpace(l), "|")
		if len(f) == 6 && f[0] == key {
			out = append(out, haLine{f[0], f[1], f[2], f[3], f[4], f[5]})
		}
	}
	return out
}

// startHAProxy runs haproxy -db (foreground) in front of backends (name →
// host:port) on a free loopback port and kills it at the end of the test.
// A port taken between the pick and HAProxy's bind makes it try another.
func startHAProxy(t *testing.T, o haproxyOptions, names []string, backends map[string]string) *haproxyProc {
	t.Helper()
	bin := toolPath(t, "haproxy")
	dir := t.TempDir()
	var servers strings.Builder
	for _, n := range names {
		fmt.Fprintf(&servers, "\tserver %s %s\n", n, backends[n])
	}
	buffer := ""
	if o.bufferRequest {
		buffer = "option http-buffer-request"
	}
	for attempt := 1; ; attempt++ {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		port := l.Addr().(*net.TCPAddr).Port
		l.Close()
		conf := dir + "/haproxy.cfg"
		if err := os.WriteFile(conf, fmt.Appendf(nil, haproxyConf, port, servers.String(), o.serverTimeout, o.retryOn, buffer), 0o644); err != nil {
			t.Fatal(err)
		}
		h := &haproxyProc{addr: fmt.Sprintf("127.0.0.1:%d", port)}
		cmd := exec.Command(bin, "-db", "-f", conf)
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
			c, err := net.DialTimeout("tcp", h.addr, time.Second)
			if err == nil {
				c.Close()
			}
			return err == nil
		})
		select {
		case <-exited:
			if strings.Contains(h.output(), "Address already in use") && attempt < 3 {
				continue
			}
			t.Fatalf("got haproxy exiting at start (%s), want it serving:\n%s", cmd.ProcessState, lastN(h.output(), 2048))
		default:
		}
		t.Cleanup(func() {
			cmd.Process.Kill()
			<-exited
			if t.Failed() {
				t.Logf("haproxy log (last 2 KiB):\n%s", lastN(h.output(), 2048))
			}
		})
		if !ready {
			t.Fatalf("got haproxy not accepting connections on %s after 10s, want it serving", h.addr)
		}
		return h
	}
}

// haSetup is HAProxy in front of two `idem proxy` instances, idem1 and
// idem2, that share one private Redis (a prefix of their own) and the
// counting upstream.
type haSetup struct {
	up      *upstream
	lb      *haproxyProc
	proxies map[string]*proctest.Proxy // by HAProxy server name
	tg      *target
}

var haNames = []string{"idem1", "idem2"}

func startHASetup(t *testing.T, up *upstream, o haproxyOptions, proxyArgs ...string) *haSetup {
	t.Helper()
	toolPath(t, "haproxy")
	// --wait 0: the instance that gets HAProxy's resend answers 409 at
	// once. With the default wait (500ms) it would wait past HAProxy's
	// "timeout server 300ms", which would then retry again: the cases
	// are about HAProxy passing on and the clients handling that 409.
	args := append([]string{"--upstream", up.srv.URL, "--store", "redis://" + rdb.Addr(), "--prefix", redistest.Prefix("clients"), "--wait", "0"}, proxyArgs...)
	s := &haSetup{up: up, proxies: map[string]*proctest.Proxy{}}
	addrs := map[string]string{}
	for _, n := range haNames {
		s.proxies[n] = proctest.StartProxy(t, args...)
		addrs[n] = s.proxies[n].Addr
	}
	s.lb = startHAProxy(t, o, haNames, addrs)
	s.tg = &target{name: "HAProxy → 2 × idem proxy", store: "redis (single)", short: "ha", url: "http://" + s.lb.addr,
		proxies: []*proctest.Proxy{s.proxies["idem1"], s.proxies["idem2"]}}
	return s
}

// other is the instance that is not name.
func other(name string) string {
	if name == "idem1" {
		return "idem2"
	}
	return "idem1"
}

// haPaths formats what HAProxy logged for key: status@server (retries).
func haPaths(lines []haLine) string {
	var parts []string
	for _, l := range lines {
		parts = append(parts, fmt.Sprintf("%s@%s (retries %s, %s)", l.status, l.server, l.retries, l.term))
	}
	return strings.Join(parts, " then ")
}

// TestHAProxyResend: HAProxy balances over two `idem proxy` instances on
// one Redis and gives up on the instance doing the 1 s of work after
// "timeout server 300ms"; retry-on response-timeout and option redispatch
// make it resend the keyed POST to the other instance, which finds the key
// in flight and answers 409 (Retry-After: 1). 409 is not among the statuses
// HAProxy may retry on, so it passes it on; the clients (Python requests,
// Node fetch, curl, Go; 5 s timeouts) retry after Retry-After and get the
// replay. The first instance must finish the work and store its answer
// although HAProxy closed the connection.
func TestHAProxyResend(t *testing.T) {
	clients := []client{pythonClient, nodeClient, curlClient, goClient}
	for _, c := range clients {
		if c.tool != "" {
			toolPath(t, c.tool)
		}
	}
	s := startHASetup(t, startUpstream(t), resilient)
	row, keys := runOn(t, s.up, s.tg, scenario{
		name: "HAProxy resends the POST to the second instance", short: "ha", path: "/pay",
		fault:   "HAProxy 2.6 (retry-on conn-failure empty-response response-timeout; retries 3; option redispatch 1; option http-buffer-request; timeout server 300ms) over 2 idem proxies on one Redis; 1 s of work; clients with 5 s timeouts retry",
		timeout: 5 * time.Second, attempts: 6, clients: clients,
	})
	// Every key's first request was resent by HAProxy to the instance that
	// was not doing the work, which answered 409.
	var paths []string
	for _, key := range keys {
		l := s.up.snapshot(key)
		lines := s.lb.lines(key)
		paths = append(paths, haPaths(lines))
		if len(lines) == 0 || len(l.via) == 0 {
			t.Errorf("key %s: got HAProxy lines %v and upstream calls via %v, want both", key, lines, l.via)
			continue
		}
		// +1: one retry, redispatched (to the other instance: HAProxy picks
		// another server than the last). More retries would mean the 409
		// itself took longer than timeout server.
		first := lines[0]
		if first.status != "409" || !strings.HasPrefix(first.retries, "+") || (first.retries == "+1" && first.server != other(l.via[0])) {
			t.Errorf("key %s: got HAProxy's first answer %s from %s after retries %q (the work ran via %s), want 409 from %s after a redispatched retry (+1)",
				key, first.status, first.server, first.retries, l.via[0], other(l.via[0]))
		}
	}
	row.Notes += "; HAProxy per key: " + strings.Join(paths, "; ")
	reltest.Report(t, row)
}

// haCase is one way HAProxy meets a slow or failing instance: first sends
// one keyed POST through HAProxy (injecting the fault) and returns the
// answer; the case then expects HAProxy's answer status and whether it
// resent the request.
type haCase struct {
	name, title, fault string
	note               string // for the report
	opts               haproxyOptions
	proxyArgs          []string
	first              func(t *testing.T, s *haSetup, key, body string) result
	status             int  // HAProxy's answer to the first request
	resent             bool // HAProxy's log shows a retry (+N: redispatched)
	why                string
	// killedHolder: the instance that held the key was SIGKILLed after the
	// upstream acted; the key runs again once its lease ends.
	killedHolder bool
	body         func() string // the POST's body; default haBody
}

// haBody is the keyed POST of the HAProxy cases.
func haBody() string { return fmt.Sprintf(`{"amount":%d,"currency":"eur"}`, 100+bodySeq.Add(1)) }

// haLargeBody is a keyed POST of 32 KiB, more than HAProxy's request
// buffer (tune.bufsize, 16 KiB by default).
func haLargeBody() string {
	return fmt.Sprintf(`{"amount":%d,"currency":"eur","memo":%q}`, 100+bodySeq.Add(1), strings.Repeat("m", 32<<10))
}

// goFirst sends the POST with Go's http.Client, 10 s timeout, no retry.
func goFirst(_ *testing.T, s *haSetup, key, body string) result {
	return runGo(context.Background(), call{url: s.tg.url + "/pay", key: key, body: body, timeout: 10 * time.Second, attempts: 1})
}

// TestHAProxyRetryConditions sends one keyed POST through HAProxy per case
// and checks what HAProxy 2.6 resends, what the client is answered, that
// the upstream ran once, and that the client's retry once the work is done
// gets the byte-identical replay. The cases pin down HAProxy's behaviour:
// it resends a POST on response-timeout and empty-response (no method
// filter), but only a request it held entirely when it sent it (option
// http-buffer-request), and by default (retry-on conn-failure) never after
// the request went out.
func TestHAProxyRetryConditions(t *testing.T) {
	toolPath(t, "haproxy")
	up := startUpstream(t)
	cases := []haCase{{
		name: "timeout", title: "HAProxy resends after timeout server (retry-on response-timeout)",
		fault: "1 s of work, timeout server 300ms, retry-on response-timeout",
		opts:  resilient, first: goFirst, status: 409, resent: true,
		why: "HAProxy gave up on the working instance and resent the POST to the other, which found the key in flight",
	}, {
		name: "timeout-default-retry-on", title: "HAProxy's default retry-on conn-failure does not resend after timeout server",
		fault: "1 s of work, timeout server 300ms, HAProxy's default retry-on conn-failure",
		opts:  haproxyOptions{serverTimeout: "300ms", retryOn: "conn-failure", bufferRequest: true}, first: goFirst, status: 504, resent: false,
		why: "retry-on conn-failure never resends a request that reached an instance: HAProxy answers its own 504",
	}, {
		name: "timeout-large-body", title: "HAProxy does not resend a body larger than its buffer",
		fault: "1 s of work, timeout server 300ms, retry-on response-timeout, option http-buffer-request; a 32 KiB body (tune.bufsize is 16 KiB)",
		opts:  resilient, first: goFirst, body: haLargeBody, status: 504, resent: false,
		why: "a request larger than one buffer is never resent (HAProxy's documentation): its own 504",
	}, {
		name: "late-body-unbuffered", title: "HAProxy without option http-buffer-request does not resend a late body",
		fault: "1 s of work, timeout server 300ms, retry-on response-timeout, no option http-buffer-request; the client sends the body after HAProxy forwarded the headers",
		opts:  haproxyOptions{serverTimeout: "300ms", retryOn: resilient.retryOn}, first: lateBodyFirst(true), status: 504, resent: false,
		why: "HAProxy keeps a copy for a retry only of a request it had entirely when it sent it: no resend, its own 504",
	}, {
		name: "late-body-buffered", title: "HAProxy with option http-buffer-request resends a late body",
		fault: "1 s of work, timeout server 300ms, retry-on response-timeout, option http-buffer-request; the client sends the body 100 ms after its headers",
		opts:  resilient, first: lateBodyFirst(false), status: 409, resent: true,
		why: "option http-buffer-request waits for the whole body, so the POST can be resent",
	}, {
		name: "killed-before-key", title: "HAProxy resends from an instance SIGKILLed before it read the request",
		fault: "one instance SIGSTOPped, the POST sent to it (in its accept queue), then SIGKILLed; retry-on empty-response",
		opts:  resilient, first: killFrozenFirst, status: 409, resent: true,
		why: "HAProxy resent the POST to the survivor, which ran it; that work outlasted timeout server too, so HAProxy's last retry (after connection refused by the dead instance) met the key in flight",
	}, {
		name: "killed-holding-key", title: "HAProxy resends from an instance SIGKILLed while it holds the key",
		note:  "1 execution while the dead instance's lease (2 s) lasted: HAProxy's resend and the client's retries got 409; the retry after it took the key over and ran the upstream again, the documented limit of a holder that crashed after its effect (at-least-once, a larger fencing token; the crash suite's after-effect row), not HAProxy's doing",
		fault: "the instance doing the work SIGKILLed once the upstream has acted; retry-on empty-response; --lease 2s",
		opts:  resilient, proxyArgs: []string{"--lease", "2s"}, first: killHolderFirst, status: 409, resent: true, killedHolder: true,
		why: "HAProxy resent the POST to the survivor, which found the dead instance's lease",
	}}
	for _, hc := range cases {
		t.Run(hc.name, func(t *testing.T) {
			t.Parallel()
			runHACase(t, up, hc)
		})
	}
}

func runHACase(t *testing.T, up *upstream, hc haCase) {
	s := startHASetup(t, up, hc.opts, hc.proxyArgs...)
	key := fmt.Sprintf("ha-%s-%s", hc.name, runID)
	newBody := haBody
	if hc.body != nil {
		newBody = hc.body
	}
	body := newBody()
	r := hc.first(t, s, key, body)
	// HAProxy logs a request once it has answered it.
	waitFor(5*time.Second, func() bool { return len(s.lb.lines(key)) > 0 })
	lines := s.lb.lines(key)
	if !waitFor(15*time.Second, func() bool { return up.snapshot(key).running == 0 }) {
		t.Fatalf("got the upstream still working on %s after 15s, want it done", key)
	}
	l := up.snapshot(key)
	seen := map[string]int{fmt.Sprintf("first %d", r.Status): 1}
	requests := 1
	// tally counts a client's attempts, and what they saw but a final 201.
	tally := func(r result) {
		requests += len(r.Seen)
		for i, st := range r.Seen {
			if i < len(r.Seen)-1 || r.Status != 201 {
				seen[st]++
			}
		}
	}

	// The first answer: exactly the status the configuration implies.
	switch {
	case r.Status != hc.status:
		t.Errorf("got the first answer %d %.120q (error %q), want %d: %s", r.Status, r.Body, r.Error, hc.status, hc.why)
	case r.Status == 409 && (r.RetryAfter == "" || !strings.Contains(r.Body, idemhttp.ProblemInFlight)):
		t.Errorf("got a 409 with Retry-After %q and body %.120q, want the in-flight problem with Retry-After", r.RetryAfter, r.Body)
	}
	if len(lines) != 1 {
		t.Errorf("got HAProxy log lines %v for the first request, want one", lines)
	} else if got := strings.HasPrefix(lines[0].retries, "+"); got != hc.resent || lines[0].status != strconv.Itoa(hc.status) {
		t.Errorf("got HAProxy logging %s after retries %q, want %d, resent (redispatched) %v", lines[0].status, lines[0].retries, hc.status, hc.resent)
	}
	// One execution, whatever HAProxy resent.
	if len(l.effects) != 1 {
		t.Errorf("got %d upstream executions (via %v) after the first request, want 1", len(l.effects), l.via)
	}
	want := ""
	if len(l.effects) > 0 {
		want = l.effects[0]
	}
	if hc.killedHolder {
		want = checkTakeover(t, s, key, body, l, tally)
	}

	// The client's retry once the work is done: the replay.
	later := runGo(context.Background(), call{url: s.tg.url + "/pay", key: key, body: body, timeout: 5 * time.Second, attempts: 6})
	tally(later)
	if later.Status != 201 || later.Replayed != "true" || later.Body != want {
		t.Errorf("got the retry after the work answered %d (replayed %q, %d bytes %.90q, error %q; attempts %v), want the replay of %d bytes %.90q",
			later.Status, later.Replayed, len(later.Body), later.Body, later.Error, later.Seen, len(want), want)
	}
	final := up.snapshot(key)
	// HAProxy and the instances log a request after answering it: give the
	// last lines a moment.
	waitFor(2*time.Second, func() bool {
		return len(s.lb.lines(key)) >= requests && len(s.tg.outcomesOf(key, "/pay")) >= requests
	})
	// The instances treated HAProxy's departure as a client gone: no
	// upstream request cut, no key released.
	outs := s.tg.outcomesOf(key, "/pay")
	if bad := slices.DeleteFunc(slices.Clone(outs), func(o string) bool {
		return !strings.HasPrefix(o, "upstream_aborted") && !strings.HasSuffix(o, "→502")
	}); len(bad) > 0 {
		t.Errorf("got proxy log outcomes %v, want no upstream_aborted or 502 (HAProxy's departure taken for an upstream failure)", bad)
	}
	lost := 0
	if later.Body != want {
		lost = 1
	}
	notes := fmt.Sprintf("first answer %d: %s; executions %d (via %s); HAProxy: %s; proxy log outcome→status: %s", hc.status, hc.why,
		len(final.effects), strings.Join(final.via, ", "), haPaths(s.lb.lines(key)), strings.Join(outs, ", "))
	if hc.note != "" {
		notes += "; " + hc.note
	}
	reltest.Report(t, reltest.Row{
		Scenario: fmt.Sprintf("clients: %s (HAProxy → 2 × idem proxy)", hc.title), Store: "redis (single)", Fault: hc.fault,
		Requests: requests, Keys: 1, Duplicates: max(0, len(final.effects)-1), Lost: lost, ClientErrors: seen, Notes: notes,
	})
}

// checkTakeover follows the killed holder's key: the survivor answers 409
// while the dead instance's lease lasts, and the retry after it runs the
// upstream again (idem's documented limit for a holder that crashed after
// its effect: at-least-once, with a larger fencing token). It returns the
// second execution's body, which the replay must carry.
func checkTakeover(t *testing.T, s *haSetup, key, body string, l ledger, tally func(result)) string {
	t.Helper()
	r := runGo(context.Background(), call{url: s.tg.url + "/pay", key: key, body: body, timeout: 5 * time.Second, attempts: 10})
	tally(r)
	if r.Status != 201 || r.Replayed != "true" {
		t.Errorf("got the client's retries past the lease ending with %d (replayed %q, attempts %v, error %q), want the replay of the takeover's execution", r.Status, r.Replayed, r.Seen, r.Error)
	}
	if !waitFor(15*time.Second, func() bool { return s.up.snapshot(key).running == 0 }) {
		t.Fatalf("got the upstream still working on %s after 15s, want it done", key)
	}
	after := s.up.snapshot(key)
	if len(after.effects) != 2 || after.via[len(after.via)-1] != other(l.via[0]) {
		t.Errorf("got %d executions via %v once the dead instance's lease ended, want 2: the crashed holder's and the survivor's takeover", len(after.effects), after.via)
		return ""
	}
	return after.effects[1]
}

// lateBodyFirst sends the POST by hand: its headers, then its body later.
// unbuffered: both instances are paused (SIGSTOP) until HAProxy has
// forwarded the headers to one of them (the bytes wait unread in its
// socket), so HAProxy provably sent the request before it had the body;
// then the body follows and the instances resume. Otherwise the body
// follows 100 ms after the headers (HAProxy, with option
// http-buffer-request, waits for it before choosing an instance).
func lateBodyFirst(unbuffered bool) func(t *testing.T, s *haSetup, key, body string) result {
	return func(t *testing.T, s *haSetup, key, body string) result {
		t.Helper()
		c, err := net.Dial("tcp", s.lb.addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if unbuffered {
			for _, n := range haNames {
				pause(t, s.proxies[n])
			}
		}
		fmt.Fprintf(c, "POST /pay HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n%s: %s\r\nContent-Length: %d\r\n\r\n",
			s.lb.addr, idemhttp.HeaderKey, key, len(body))
		if unbuffered {
			if !waitFor(15*time.Second, func() bool {
				for _, n := range haNames {
					if _, unread := acceptedConn(t, s.proxies[n]); unread {
						return true
					}
				}
				return false
			}) {
				t.Fatal("got no instance receiving the request headers from HAProxy within 15s, want HAProxy forwarding them before the body")
			}
		} else {
			time.Sleep(100 * time.Millisecond) // the client's pause between headers and body: the fault, not a wait
		}
		io.WriteString(c, body)
		if unbuffered {
			for _, n := range haNames {
				resume(t, s.proxies[n])
			}
		}
		c.SetReadDeadline(time.Now().Add(clientDeadline))
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			return result{Error: failure(err), Seen: []string{failure(err)}}
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return result{Status: resp.StatusCode, Body: string(b), Replayed: resp.Header.Get(idemhttp.HeaderReplayed),
			RetryAfter: resp.Header.Get("Retry-After"), Seen: []string{strconv.Itoa(resp.StatusCode)}}
	}
}

// killFrozenFirst pauses idem1 (SIGSTOP), sends the POST with Go, and
// SIGKILLs idem1 once HAProxy has a connection to it (the request waits in
// its accept queue: idem1 never read it, so never took the key). Whether
// HAProxy chose idem1 first or came to it on a retry, idem1 dies with the
// request unread.
func killFrozenFirst(t *testing.T, s *haSetup, key, body string) result {
	t.Helper()
	victim := s.proxies["idem1"]
	pause(t, victim)
	done := make(chan result, 1)
	go func() { done <- goFirst(t, s, key, body) }()
	if !waitFor(15*time.Second, func() bool { ok, _ := acceptedConn(t, victim); return ok }) {
		t.Fatal("got no connection from HAProxy to the paused idem1 within 15s, want HAProxy sending it the request")
	}
	victim.Cmd.Process.Signal(syscall.SIGKILL)
	r := <-done
	if l := s.up.snapshot(key); slices.Contains(l.via, "idem1") {
		t.Errorf("got upstream calls via %v, want none via the killed idem1 (it never read the request)", l.via)
	}
	return r
}

// killHolderFirst sends the POST with Go and SIGKILLs the instance that
// forwarded it once the upstream has acted (so it holds the key, and will
// never complete it).
func killHolderFirst(t *testing.T, s *haSetup, key, body string) result {
	t.Helper()
	done := make(chan result, 1)
	go func() { done <- goFirst(t, s, key, body) }()
	if !waitFor(15*time.Second, func() bool { return s.up.snapshot(key).calls > 0 }) {
		t.Fatal("got no upstream call within 15s, want the POST forwarded")
	}
	s.proxies[s.up.snapshot(key).via[0]].Cmd.Process.Signal(syscall.SIGKILL)
	return <-done
}

// pause stops p (SIGSTOP) until resume, and returns once every thread of
// p is stopped (kill returns before a busy process has stopped: until
// then it may still read from its sockets). The test's end resumes it.
func pause(t *testing.T, p *proctest.Proxy) {
	t.Helper()
	t.Cleanup(func() { p.Cmd.Process.Signal(syscall.SIGCONT) })
	if err := childproc.Pause(p.Cmd.Process, 10*time.Second); err != nil {
		t.Fatalf("idem proxy %s: %v", p.Addr, err)
	}
}

func resume(t *testing.T, p *proctest.Proxy) {
	t.Helper()
	if err := p.Cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
}

// acceptedConn reads /proc/net/tcp (Linux): whether some TCP connection to
// p's port is established on p's side (in the kernel, accepted by p or
// still in its accept queue), and whether one of them holds bytes p has
// not read.
func acceptedConn(t *testing.T, p *proctest.Proxy) (established, unread bool) {
	t.Helper()
	_, portText, _ := net.SplitHostPort(p.Addr)
	port, _ := strconv.Atoi(portText)
	b, err := os.ReadFile("/proc/net/tcp")
	if err != nil {
		t.Fatalf("reading /proc/net/tcp: %v (the HAProxy crash cases watch sockets there; Linux only)", err)
	}
	for line := range strings.Lines(string(b)) {
		// sl local_address rem_address st tx_queue:rx_queue ...
		f := strings.Fields(line)
		if len(f) < 5 || f[3] != "01" { // 01: ESTABLISHED
			continue
		}
		_, local, _ := strings.Cut(f[1], ":")
		if n, err := strconv.ParseUint(local, 16, 16); err != nil || int(n) != port {
			continue
		}
		established = true
		_, rx, _ := strings.Cut(f[4], ":")
		if q, _ := strconv.ParseUint(rx, 16, 64); q > 0 {
			unread = true
		}
	}
	return established, unread
}
