package main

// idem proxy over TLS, from outside: curl (--http2, --http1.1, with and
// without a client certificate) and Python's urllib against the built
// binary with --tls-cert, --tls-key and --tls-client-ca; certificates
// rotated under load, by their files and by SIGHUP; https:// upstreams
// (Go's net/http) with --upstream-ca, --upstream-cert and --upstream-key.
// Every certificate is made here, with crypto/x509, in t.TempDir().

import (
	"bufio"
	"context"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/proctest"
	"github.com/idemkit/idem/internal/tlstest"
)

// handshakeSerial is the serial of the certificate a new TLS handshake
// with addr gets, once the server has answered a request on the
// connection, or an error. The answer is what proves the connection
// accepted: a TLS 1.3 server refuses a client's certificate only after
// the client's Finished, so a handshake that returns proves nothing, and
// no time without a refusal proves anything either. The request is
// OPTIONS *, which net/http answers itself: it reaches no upstream. The
// deadline only bounds a server that never answers.
func handshakeSerial(addr string, roots *x509.CertPool, client ...tls.Certificate) (int64, error) {
	c, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", addr, &tls.Config{RootCAs: roots, Certificates: client})
	if err != nil {
		return 0, err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(15 * time.Second))
	if _, err := io.WriteString(c, "OPTIONS * HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"); err != nil {
		return 0, err
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		return 0, fmt.Errorf("no answer to OPTIONS * after the handshake: %w", err)
	}
	resp.Body.Close()
	return c.ConnectionState().PeerCertificates[0].SerialNumber.Int64(), nil
}

// awaitSerial waits (bounded) until new handshakes get serial.
func awaitSerial(t *testing.T, addr string, roots *x509.CertPool, serial int64) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		got, err := handshakeSerial(addr, roots)
		if err == nil && got == serial {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("new handshakes still get serial %d (%v), want %d", got, err, serial)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// logLines are the lines of log that hold s, in order.
func logLines(log, s string) []string {
	var lines []string
	for line := range strings.Lines(log) {
		if strings.Contains(line, s) {
			lines = append(lines, line)
		}
	}
	return lines
}

// awaitLogCount waits (bounded) until the proxy's log holds n lines with s.
func (p *proxyProc) awaitLogCount(s string, n int) {
	p.t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for strings.Count(p.logText(), s) < n {
		if time.Now().After(deadline) {
			p.t.Fatalf("the log has %d lines with %s within 15s, want %d", strings.Count(p.logText(), s), s, n)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestProxyTLS: with --tls-cert and --tls-key the listener serves TLS,
// HTTP/2 and HTTP/1.1 by ALPN; a keyed POST runs once and is replayed
// over either, and to Python's urllib; on TCP and on a unix socket.
func TestProxyTLS(t *testing.T) {
	proctest.RequireTool(t, "curl")
	dir := t.TempDir()
	ca := tlstest.NewCA(t, dir, "ca")
	cert, key := ca.Issue("server", "localhost", 10, false)
	u := newTestUpstream(t)
	p := startProxy(t, nil, "--upstream", u.URL, "--tls-cert", cert, "--tls-key", key)
	base := "https://" + p.addr
	first := runCurl(t, "--cacert", ca.File, "--http2", "-H", "Idempotency-Key: tls-a", "-d", "amount=10", base+"/charges")
	if first.code != 0 || first.proto != "HTTP/2" || first.status != http.StatusCreated {
		t.Fatalf("curl --http2 over TLS: exit %d, %s %d, want HTTP/2 201", first.code, first.proto, first.status)
	}
	again := runCurl(t, "--cacert", ca.File, "--http1.1", "-H", "Idempotency-Key: tls-a", "-d", "amount=10", base+"/charges")
	if again.proto != "HTTP/1.1" || again.status != http.StatusCreated || again.header.Get(idemhttp.HeaderReplayed) != "true" {
		t.Fatalf("curl --http1.1 repeat: %s %d replayed %q, want HTTP/1.1 201 replayed", again.proto, again.status, again.header.Get(idemhttp.HeaderReplayed))
	}
	if string(first.body) != string(again.body) {
		t.Errorf("replay differs:\n%s\n%s", first.body, again.body)
	}
	if n := u.runsOf("tls-a"); n != 1 {
		t.Errorf("upstream ran tls-a %d times, want 1", n)
	}
	// A client that does not trust the CA refuses the proxy, and plain
	// HTTP is not served on a TLS listener.
	if r := runCurl(t, "--http1.1", base+"/"); r.code == 0 {
		t.Errorf("curl without --cacert: exit 0, want a verification failure")
	}
	if r := runCurl(t, "http://"+p.addr+"/"); r.status != http.StatusBadRequest {
		t.Errorf("plain HTTP on the TLS listener: exit %d, %s %d, want 400", r.code, r.proto, r.status)
	}

	// Python's urllib, twice with one key: run once, replayed.
	var bodies []string
	for i := range 2 {
		got := pythonPost(t, base+"/charges", "py-1", ca.File, "", "")
		if got.Status != http.StatusCreated || (got.Replayed == "true") != (i == 1) {
			t.Errorf("python POST %d: %d replayed %q", i+1, got.Status, got.Replayed)
		}
		bodies = append(bodies, got.Body)
	}
	if bodies[0] != bodies[1] || u.runsOf("py-1") != 1 {
		t.Errorf("python: upstream ran py-1 %d times, answers:\n%s\n%s", u.runsOf("py-1"), bodies[0], bodies[1])
	}
	if !strings.Contains(p.logText(), `"tls":"tls"`) {
		t.Errorf("the start's line does not say tls")
	}

	// TLS on a unix socket listener.
	sock := filepath.Join(t.TempDir(), "idem.sock")
	startProxy(t, nil, "--upstream", u.URL, "--tls-cert", cert, "--tls-key", key, "--listen", "unix://"+sock)
	for i, flag := range []string{"--http2", "--http1.1"} {
		r := runCurl(t, "--unix-socket", sock, "--cacert", ca.File, flag, "-H", "Idempotency-Key: tls-sock", "-d", "amount=1", "https://localhost/charges")
		if r.status != http.StatusCreated || (r.header.Get(idemhttp.HeaderReplayed) == "true") != (i == 1) {
			t.Errorf("curl --unix-socket %s over TLS: exit %d, %s %d replayed %q", flag, r.code, r.proto, r.status, r.header.Get(idemhttp.HeaderReplayed))
		}
	}
	if n := u.runsOf("tls-sock"); n != 1 {
		t.Errorf("upstream ran tls-sock %d times, want 1", n)
	}
}

// pyAnswer is what pythonScript prints.
type pyAnswer struct {
	Status   int
	Replayed string
	Body     string
}

// pythonScript POSTs amount=10 (a form, as curl -d sends it) with an
// Idempotency-Key over TLS with urllib, trusting a CA file, with a client
// certificate when given one.
const pythonScript = `
import json, ssl, sys, urllib.request, urllib.error
url, key, ca, cert, keyfile = sys.argv[1:6]
ctx = ssl.create_default_context(cafile=ca)
if cert:
    ctx.load_cert_chain(cert, keyfile)
req = urllib.request.Request(url, data=b"amount=10", method="POST", headers={"Idempotency-Key": key})
try:
    r = urllib.request.urlopen(req, context=ctx, timeout=20)
except urllib.error.HTTPError as e:
    r = e
print(json.dumps({"Status": r.status, "Replayed": r.headers.get("Idempotent-Replayed") or "", "Body": r.read().decode()}))
`

func pythonPost(t *testing.T, url, key, ca, cert, keyFile string) pyAnswer {
	t.Helper()
	py := "/usr/bin/python3" // Debian's, as scripts/test.sh installs
	if _, err := os.Stat(py); err != nil {
		t.Fatalf("%s is not installed (scripts/test.sh installs it): %v", py, err)
	}
	out, err := exec.Command(py, "-c", pythonScript, url, key, ca, cert, keyFile).Output()
	if err != nil {
		var stderr string
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = string(ee.Stderr)
		}
		t.Fatalf("python POST %s: %v\n%s", url, err, stderr)
	}
	var a pyAnswer
	if err := json.Unmarshal(out, &a); err != nil {
		t.Fatalf("python printed %q: %v", out, err)
	}
	return a
}

// TestProxyMTLS: with --tls-client-ca the handshake needs a client
// certificate of that CA; the certificate is the tenant: one key from two
// certificates runs twice, and each replays its own answer (to curl and
// to Python). A credential names the client before its certificate.
// SIGHUP re-reads the CA file: the clients of a CA taken out of it are
// refused from the next handshake on; while draining, it still reloads.
func TestProxyMTLS(t *testing.T) {
	proctest.RequireTool(t, "curl")
	dir := t.TempDir()
	ca := tlstest.NewCA(t, dir, "ca")
	cert, key := ca.Issue("server", "localhost", 10, false)
	aCert, aKey := ca.Issue("client-a", "client-a", 20, true)
	bCert, bKey := ca.Issue("client-b", "client-b", 21, true)
	clientCA := filepath.Join(dir, "clients.pem")
	b, _ := os.ReadFile(ca.File)
	os.WriteFile(clientCA, b, 0o600)
	u := newTestUpstream(t)
	p := startProxy(t, nil, "--upstream", u.URL, "--tls-cert", cert, "--tls-key", key, "--tls-client-ca", clientCA, "--tls-watch", "0")
	base := "https://" + p.addr
	post := func(certFile, keyFile, key string, extra ...string) curlResult {
		args := []string{"--cacert", ca.File, "-H", "Idempotency-Key: " + key, "-d", "amount=10"}
		if certFile != "" {
			args = append(args, "--cert", certFile, "--key", keyFile)
		}
		return runCurl(t, append(append(args, extra...), base+"/charges")...)
	}

	if r := post("", "", "m-1"); r.code == 0 {
		t.Errorf("curl without a client certificate: exit 0 (%s %d), want the handshake refused", r.proto, r.status)
	}
	if n := u.runsOf("m-1"); n != 0 {
		t.Errorf("upstream ran a request without a client certificate %d times", n)
	}
	a1 := post(aCert, aKey, "m-1", "--http2")
	b1 := post(bCert, bKey, "m-1", "--http1.1")
	if a1.status != http.StatusCreated || b1.status != http.StatusCreated || a1.proto != "HTTP/2" {
		t.Fatalf("with client certificates: %s %d and %s %d (exit %d, %d), want 201 twice", a1.proto, a1.status, b1.proto, b1.status, a1.code, b1.code)
	}
	if a1.header.Get(idemhttp.HeaderReplayed) != "" || b1.header.Get(idemhttp.HeaderReplayed) != "" {
		t.Errorf("two certificates, one key: replayed %q and %q, want two executions", a1.header.Get(idemhttp.HeaderReplayed), b1.header.Get(idemhttp.HeaderReplayed))
	}
	if n := u.runsOf("m-1"); n != 2 {
		t.Errorf("upstream ran m-1 %d times for two certificates, want 2", n)
	}
	a2, b2 := post(aCert, aKey, "m-1"), post(bCert, bKey, "m-1")
	if string(a2.body) != string(a1.body) || string(b2.body) != string(b1.body) || a2.header.Get(idemhttp.HeaderReplayed) != "true" || b2.header.Get(idemhttp.HeaderReplayed) != "true" {
		t.Errorf("replays: A got\n%s\n(first %s)\nB got\n%s\n(first %s)", a2.body, a1.body, b2.body, b1.body)
	}
	// Python's urllib with certificate A gets A's answer.
	if got := pythonPost(t, base+"/charges", "m-1", ca.File, aCert, aKey); got.Status != http.StatusCreated || got.Replayed != "true" {
		t.Errorf("python with certificate A: %d replayed %q, want A's replay", got.Status, got.Replayed)
	} else if got.Body != string(a1.body) {
		t.Errorf("python with certificate A got\n%s\nwant A's\n%s", got.Body, a1.body)
	}
	// A credential comes before the certificate: A and B with one token
	// are one client.
	c1 := post(aCert, aKey, "m-2", "-H", "Authorization: Bearer tok")
	c2 := post(bCert, bKey, "m-2", "-H", "Authorization: Bearer tok")
	if c2.header.Get(idemhttp.HeaderReplayed) != "true" || string(c1.body) != string(c2.body) || u.runsOf("m-2") != 1 {
		t.Errorf("one token from two certificates: replayed %q, upstream ran %d times, want one client", c2.header.Get(idemhttp.HeaderReplayed), u.runsOf("m-2"))
	}

	// The client CA file now holds another CA only: after SIGHUP, A
	// (of the first CA) is refused, a client of the new CA admitted.
	ca2 := tlstest.NewCA(t, t.TempDir(), "ca2")
	dCert, dKey := ca2.Issue("client-d", "client-d", 30, true)
	b, _ = os.ReadFile(ca2.File)
	os.WriteFile(clientCA, b, 0o600)
	p.cmd.Process.Signal(syscall.SIGHUP)
	p.awaitLogCount(`"msg":"reloaded","what":"certificates"`, 1)
	if r := post(aCert, aKey, "m-3"); r.code == 0 {
		t.Errorf("a client of the CA taken out: %s %d, want the handshake refused", r.proto, r.status)
	}
	if r := post(dCert, dKey, "m-3"); r.status != http.StatusCreated {
		t.Errorf("a client of the new CA: exit %d, %s %d, want 201", r.code, r.proto, r.status)
	}
	if n := u.runsOf("m-3"); n != 1 {
		t.Errorf("upstream ran m-3 %d times, want 1 (the new CA's client)", n)
	}

	// A SIGHUP while the proxy drains after SIGTERM reloads; it does not
	// end the process (SIGHUP's default) under the request it finishes.
	done := make(chan curlResult, 1)
	go func() { done <- post(dCert, dKey, "m-4", "-H", "X-Test-Delay: 1s") }()
	u.awaitStarted(t, 1, "m-4")
	p.cmd.Process.Signal(syscall.SIGTERM)
	p.awaitLogCount(`"msg":"shutting down: finishing in-flight requests"`, 1)
	p.cmd.Process.Signal(syscall.SIGHUP)
	if r := <-done; r.status != http.StatusCreated {
		t.Errorf("keyed request in flight at SIGTERM, then SIGHUP: exit %d, %s %d, want 201", r.code, r.proto, r.status)
	}
	if code := p.awaitExit(15 * time.Second); code != 0 {
		t.Errorf("exit %d after SIGTERM and SIGHUP, want 0", code)
	}
	if n := strings.Count(p.logText(), `"msg":"reloaded","what":"certificates"`); n != 2 {
		t.Errorf("%d reloads logged, want 2 (the SIGHUP while draining included)", n)
	}
}

// loadClient sends requests through the proxy until stopped, and counts
// what it saw.
type loadClient struct {
	name   string
	c      *http.Client
	dials  atomic.Int32
	sent   atomic.Int32
	mu     sync.Mutex
	failed []string
	serial map[int64]int // the serials of the certificates its answers came over
}

func newLoadClient(name string, roots *x509.CertPool, h2, keepAlive bool) *loadClient {
	lc := &loadClient{name: name, serial: map[int64]int{}}
	d := &net.Dialer{Timeout: 5 * time.Second}
	tr := &http.Transport{
		TLSClientConfig:   &tls.Config{RootCAs: roots},
		ForceAttemptHTTP2: h2,
		DisableKeepAlives: !keepAlive,
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			lc.dials.Add(1)
			return d.DialContext(ctx, network, addr)
		},
	}
	if !h2 {
		tr.TLSNextProto = map[string]func(string, *tls.Conn) http.RoundTripper{} // HTTP/1.1 only
	}
	lc.c = &http.Client{Transport: tr, Timeout: 20 * time.Second}
	return lc
}

func (lc *loadClient) run(base string, stop <-chan struct{}, done *sync.WaitGroup) {
	defer done.Done()
	for i := 0; ; i++ {
		select {
		case <-stop:
			return
		default:
		}
		req, _ := http.NewRequest(http.MethodPost, base+"/load", strings.NewReader("n=1"))
		if i%2 == 0 {
			req.Header.Set(idemhttp.HeaderKey, fmt.Sprintf("%s-%d", lc.name, i))
		}
		resp, err := lc.c.Do(req)
		lc.sent.Add(1)
		lc.mu.Lock()
		if err != nil {
			lc.failed = append(lc.failed, err.Error())
		} else {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusCreated {
				lc.failed = append(lc.failed, resp.Status)
			}
			lc.serial[resp.TLS.PeerCertificates[0].SerialNumber.Int64()]++
		}
		lc.mu.Unlock()
	}
}

// awaitSent waits (bounded) until each client sent n more requests.
func awaitSent(t *testing.T, n int32, clients ...*loadClient) {
	t.Helper()
	for _, lc := range clients {
		want := lc.sent.Load() + n
		deadline := time.Now().Add(30 * time.Second)
		for lc.sent.Load() < want {
			if time.Now().After(deadline) {
				t.Fatalf("client %s: %d requests, want %d within 30s", lc.name, lc.sent.Load(), want)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
}

// TestProxyTLSRotation: the certificate is replaced while clients hold
// keep-alive connections (HTTP/2 and HTTP/1.1) and a third opens a
// connection per request: no request fails, the keep-alive connections
// stay open (one dial each, every answer over the first certificate), and
// new handshakes get the new certificate. A new pair whose key is not the
// certificate's is refused in one ERROR line and the running certificate
// kept. By the files (the watcher) and by SIGHUP (no watcher).
func TestProxyTLSRotation(t *testing.T) {
	for _, mode := range []string{"files", "sighup"} {
		t.Run(mode, func(t *testing.T) {
			dir := t.TempDir()
			ca := tlstest.NewCA(t, dir, "ca")
			cert, key := ca.Issue("server", "localhost", 1, false)
			u := newTestUpstream(t)
			watch := "200ms"
			if mode == "sighup" {
				watch = "0"
			}
			p := startProxy(t, nil, "--upstream", u.URL, "--tls-cert", cert, "--tls-key", key, "--tls-watch", watch)
			base := "https://" + p.addr
			// rotated puts the files in place and waits for new handshakes
			// to get serial.
			rotated := func(serial int64) {
				t.Helper()
				if mode == "sighup" {
					if got, err := handshakeSerial(p.addr, ca.Pool); err != nil || got == serial {
						t.Fatalf("before SIGHUP, with --tls-watch 0: serial %d (%v), want the old one", got, err)
					}
					p.cmd.Process.Signal(syscall.SIGHUP)
				}
				awaitSerial(t, p.addr, ca.Pool, serial)
			}

			h2 := newLoadClient("h2", ca.Pool, true, true)
			h1 := newLoadClient("h1", ca.Pool, false, true)
			fresh := newLoadClient("fresh", ca.Pool, false, false)
			stop := make(chan struct{})
			var wg sync.WaitGroup
			for _, lc := range []*loadClient{h2, h1, fresh} {
				wg.Add(1)
				go lc.run(base, stop, &wg)
			}
			defer func() { close(stop); wg.Wait() }()
			awaitSent(t, 5, h2, h1, fresh)

			ca.IssueTo(cert, key, "localhost", 2, false)
			rotated(2)
			awaitSent(t, 5, h2, h1, fresh)

			// A bad pair: the certificate of serial 3 (its own key goes to
			// unused.key) with the key of serial 2, in one rename, so that
			// the watched files change once. The refusals logged so far are
			// counted first: with --tls-watch, a rotation whose two renames
			// the machine parted by more than an interval is refused too
			// (the new certificate with the old key), and that refusal
			// must not stand for this one.
			// The count is taken once serial 2's load is logged: a refusal
			// before it is logged before it, so none is still on its way
			// from the proxy's stderr.
			const refused = `"msg":"reload refused; the running configuration is kept"`
			p.awaitLogCount(`"serial":"2",`, 1)
			before := strings.Count(p.logText(), refused)
			ca.IssueTo(cert, filepath.Join(dir, "unused.key"), "localhost", 3, false)
			if mode == "sighup" {
				p.cmd.Process.Signal(syscall.SIGHUP)
			}
			p.awaitLogCount(refused, before+1)
			line := logLines(p.logText(), refused)[before]
			wantErr := "--tls-key " + key + ": the key does not match the certificate in --tls-cert " + cert
			if !strings.Contains(line, `"level":"ERROR"`) || !strings.Contains(line, wantErr) {
				t.Errorf("the refusal of the bad pair: %s\nwant an ERROR with %q", line, wantErr)
			}
			if got, err := handshakeSerial(p.addr, ca.Pool); err != nil || got != 2 {
				t.Errorf("after a bad pair: serial %d (%v), want 2 kept", got, err)
			}
			awaitSent(t, 5, h2, h1, fresh)
			// The bad pair held still through that load: it is refused
			// once, not at every look.
			if n := strings.Count(p.logText(), refused); n != before+1 {
				t.Errorf("%d refusals logged after the bad pair, want %d:\n%s", n, before+1, p.logText())
			}

			ca.IssueTo(cert, key, "localhost", 4, false)
			rotated(4)
			awaitSent(t, 5, h2, h1, fresh)
			close(stop)
			wg.Wait()
			stop = make(chan struct{})

			// On SIGHUP the files are read only once a rotation is whole:
			// the bad pair's is the one refusal.
			if log := p.logText(); mode == "sighup" && strings.Count(log, refused) != 1 {
				t.Errorf("%d refusals logged, want 1:\n%s", strings.Count(log, refused), log)
			}
			for _, lc := range []*loadClient{h2, h1, fresh} {
				if len(lc.failed) > 0 {
					t.Errorf("client %s: %d of %d requests failed: %q", lc.name, len(lc.failed), lc.sent.Load(), lc.failed[:min(5, len(lc.failed))])
				}
			}
			for _, lc := range []*loadClient{h2, h1} {
				if n := lc.dials.Load(); n != 1 || len(lc.serial) != 1 || lc.serial[1] == 0 {
					t.Errorf("keep-alive client %s: %d connections, answers by serial %v, want one connection, serial 1 throughout", lc.name, n, lc.serial)
				}
			}
			if fresh.serial[2] == 0 || fresh.serial[4] == 0 || fresh.serial[3] != 0 {
				t.Errorf("new connections: answers by serial %v, want 2 and 4 (never 3)", fresh.serial)
			}
		})
	}
}

// tlsUpstream is an https:// upstream (Go's net/http) with a certificate
// of ca; with clients set it requires a client certificate of ca. It
// answers 201 with the run count of the key and the client certificate's
// name.
func tlsUpstream(t *testing.T, ca *tlstest.CA, requireClient bool) (*httptest.Server, func(string) int) {
	t.Helper()
	srv, runs, _ := tlsUpstreamClients(t, ca, requireClient)
	return srv, runs
}

// tlsUpstreamClients is tlsUpstream, and also returns the name of the
// client certificate each key came with.
func tlsUpstreamClients(t *testing.T, ca *tlstest.CA, requireClient bool) (*httptest.Server, func(string) int, func(string) string) {
	t.Helper()
	cert, key := ca.Issue("upstream", "localhost", 50, false)
	var mu sync.Mutex
	runs, clients := map[string]int{}, map[string]string{}
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		k := r.Header.Get(idemhttp.HeaderKey)
		peer := ""
		if len(r.TLS.PeerCertificates) > 0 {
			peer = r.TLS.PeerCertificates[0].Subject.CommonName
		}
		mu.Lock()
		runs[k]++
		n := runs[k]
		clients[k] = peer
		mu.Unlock()
		w.WriteHeader(http.StatusCreated)
		json.NewEncoder(w).Encode(map[string]any{"run": n, "client": peer, "proto": r.Proto, "nonce": rand.Text()})
	}))
	srv.TLS = &tls.Config{Certificates: []tls.Certificate{tlstest.Pair(t, cert, key)}}
	if requireClient {
		srv.TLS.ClientAuth, srv.TLS.ClientCAs = tls.RequireAndVerifyClientCert, ca.Pool
	}
	srv.EnableHTTP2 = true
	srv.StartTLS()
	t.Cleanup(srv.Close)
	return srv, func(k string) int { mu.Lock(); defer mu.Unlock(); return runs[k] },
		func(k string) string { mu.Lock(); defer mu.Unlock(); return clients[k] }
}

// TestProxyTLSUpstream: an https:// upstream is verified against
// --upstream-ca instead of the system's CAs (without it: 502), and one
// that requires a client certificate gets --upstream-cert (without it:
// 502); a keyed request runs there once and is replayed. The client
// certificate's files replaced and SIGHUP: new upstream connections
// present the new one; a bad new pair is refused, the old one kept.
func TestProxyTLSUpstream(t *testing.T) {
	dir := t.TempDir()
	ca := tlstest.NewCA(t, dir, "upstream-ca")
	t.Run("ca", func(t *testing.T) {
		srv, runs := tlsUpstream(t, ca, false)
		p := startProxy(t, nil, "--upstream", srv.URL, "--upstream-ca", ca.File)
		got := keyedTwice(t, "http://"+p.addr, "up-1", "n=1")
		if runs("up-1") != 1 || !strings.Contains(got, `"proto":"HTTP/1.1"`) {
			t.Errorf("upstream ran up-1 %d times, answered %s; want once, over HTTP/1.1 (https:// upstreams are HTTP/1.1 only)", runs("up-1"), got)
		}
		q := startProxy(t, nil, "--upstream", srv.URL)
		if r := mustSend(t, http.MethodPost, q.url("/x"), "up-2", "n=1"); r.status != http.StatusBadGateway || runs("up-2") != 0 {
			t.Errorf("without --upstream-ca: %d, upstream ran %d times, want 502 (the system's CAs do not know this one)", r.status, runs("up-2"))
		}
	})
	t.Run("client-cert", func(t *testing.T) {
		srv, runs, clientOf := tlsUpstreamClients(t, ca, true)
		cert, key := ca.Issue("proxy-client", "idem-proxy", 60, true)
		p := startProxy(t, nil, "--upstream", srv.URL, "--upstream-ca", ca.File, "--upstream-cert", cert, "--upstream-key", key, "--tls-watch", "0")
		got := keyedTwice(t, "http://"+p.addr, "up-3", "n=1")
		if runs("up-3") != 1 || !strings.Contains(got, `"client":"idem-proxy"`) {
			t.Errorf("upstream ran up-3 %d times, answered %s; want once, to the client idem-proxy", runs("up-3"), got)
		}
		ca.IssueTo(cert, key, "idem-proxy-2", 61, true)
		p.cmd.Process.Signal(syscall.SIGHUP)
		p.awaitLogCount(`"msg":"reloaded","what":"upstream certificate"`, 1)
		srv.CloseClientConnections()                     // the proxy's next request opens a new connection
		mustSend(t, http.MethodGet, p.url("/x"), "", "") // (a GET first: see below)
		if r := mustSend(t, http.MethodPost, p.url("/x"), "up-5", "n=1"); r.status != http.StatusCreated || clientOf("up-5") != "idem-proxy-2" {
			t.Errorf("after the rotation: %d, the upstream saw client %q, want 201 from idem-proxy-2", r.status, clientOf("up-5"))
		}
		kder, _ := x509.MarshalPKCS8PrivateKey(tlstest.NewKey(t))
		tlstest.WritePEM(t, key, "PRIVATE KEY", kder)
		p.cmd.Process.Signal(syscall.SIGHUP)
		p.awaitLogCount(`"msg":"reload refused; the running configuration is kept","what":"upstream certificate"`, 1)
		srv.CloseClientConnections()
		// A GET first: the proxy's Transport may not have seen the close of
		// its idle connection yet; a GET it resends on a new one, a keyed
		// POST it never resends (502, the key released).
		mustSend(t, http.MethodGet, p.url("/x"), "", "")
		if r := mustSend(t, http.MethodPost, p.url("/x"), "up-6", "n=1"); r.status != http.StatusCreated || clientOf("up-6") != "idem-proxy-2" {
			t.Errorf("after a bad pair: %d, the upstream saw client %q, want 201 from idem-proxy-2 (kept)", r.status, clientOf("up-6"))
		}
		q := startProxy(t, nil, "--upstream", srv.URL, "--upstream-ca", ca.File)
		if r := mustSend(t, http.MethodPost, q.url("/x"), "up-4", "n=1"); r.status != http.StatusBadGateway || runs("up-4") != 0 {
			t.Errorf("without --upstream-cert: %d, upstream ran %d times, want 502", r.status, runs("up-4"))
		}
	})
}

// TestProxyTLSMistakes: TLS flags that do not go together and files that
// do not load are refused at start in one line, with exit status 2.
func TestProxyTLSMistakes(t *testing.T) {
	dir := t.TempDir()
	ca := tlstest.NewCA(t, dir, "ca")
	cert, key := ca.Issue("server", "localhost", 10, false)
	_, otherKey := ca.Issue("other", "localhost", 11, false)
	junk := filepath.Join(dir, "junk.pem")
	os.WriteFile(junk, []byte("not PEM at all\n"), 0o600)
	missing := filepath.Join(dir, "missing.pem")
	up := "http://127.0.0.1:1"
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--upstream", up, "--tls-cert", cert}, "--tls-cert needs --tls-key"},
		{[]string{"--upstream", up, "--tls-key", key}, "--tls-key needs --tls-cert"},
		{[]string{"--upstream", up, "--tls-client-ca", ca.File}, "--tls-client-ca needs --tls-cert and --tls-key"},
		{[]string{"--upstream", up, "--tls-cert", missing, "--tls-key", key}, "--tls-cert " + missing + ": no such file or directory"},
		{[]string{"--upstream", up, "--tls-cert", cert, "--tls-key", dir}, "--tls-key " + dir + ": is a directory"},
		{[]string{"--upstream", up, "--tls-cert", cert, "--tls-key", otherKey}, "--tls-key " + otherKey + ": the key does not match the certificate in --tls-cert " + cert},
		{[]string{"--upstream", up, "--tls-cert", junk, "--tls-key", key}, "--tls-cert " + junk + `: no certificate in it (want PEM "CERTIFICATE" blocks)`},
		{[]string{"--upstream", up, "--tls-cert", cert, "--tls-key", cert}, "--tls-key " + cert + `: no private key in it`},
		{[]string{"--upstream", up, "--tls-cert", cert, "--tls-key", key, "--tls-client-ca", key}, "--tls-client-ca " + key + ": no certificate in it"},
		{[]string{"--upstream", up, "--tls-cert", cert, "--tls-key", key, "--tls-watch", "-1s"}, "--tls-watch -1s: must not be negative"},
		{[]string{"--upstream", "https://127.0.0.1:1", "--upstream-ca", junk}, "--upstream-ca " + junk + ": no certificate in it"},
		{[]string{"--upstream", "https://127.0.0.1:1", "--upstream-ca", missing}, "--upstream-ca " + missing + ": no such file"},
		{[]string{"--upstream", "https://127.0.0.1:1", "--upstream-cert", cert}, "--upstream-cert needs --upstream-key"},
		{[]string{"--upstream", "https://127.0.0.1:1", "--upstream-cert", cert, "--upstream-key", otherKey}, "--upstream-key " + otherKey + ": the key does not match"},
		{[]string{"--upstream", up, "--upstream-ca", ca.File}, "need an https:// upstream; --upstream is http://"},
	} {
		code, stderr := runIdem(t, nil, append([]string{"proxy", "--listen", "127.0.0.1:0"}, c.args...)...)
		lines := strings.Split(strings.TrimSpace(stderr), "\n")
		if code != 2 || !strings.Contains(stderr, c.want) || len(lines) != 1 {
			t.Errorf("idem proxy %q: exit %d, want 2 and one line with %q:\n%s", c.args, code, c.want, stderr)
		}
	}
	// From the environment, the line names the variable.
	code, stderr := runIdem(t, []string{"IDEM_TLS_CERT=" + missing, "IDEM_TLS_KEY=" + key}, "proxy", "--listen", "127.0.0.1:0", "--upstream", up)
	if code != 2 || !strings.HasPrefix(stderr, "idem proxy: IDEM_TLS_CERT: --tls-cert "+missing) {
		t.Errorf("IDEM_TLS_CERT of a missing file: exit %d\n%s", code, stderr)
	}
}
