package caddyidem

// Caddy with the idempotency handler over TLS and unix sockets, from
// outside: curl (--http2 and --http1.1, with and without a client
// certificate) and Go's net/http against a site served with Caddy's own
// `tls` and `client_auth`, where idemhttp.DefaultTenant takes the
// verified client certificate for the tenant; `reverse_proxy unix//…` to
// Python's http.server on a unix socket (internal/upstreamtest's
// unix_upstream.py, the one cmd/idem's tests run); and a site on
// `bind unix//…` driven by curl --unix-socket. Every certificate is made
// by internal/tlstest, with crypto/x509, in t.TempDir().

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"errors"
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
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/nettest"
	"github.com/idemkit/idem/internal/proctest"
	"github.com/idemkit/idem/internal/tlstest"
	"github.com/idemkit/idem/internal/upstreamtest"
)

// loadCaddyfile loads sites (whole site blocks, addresses included) under
// startCaddyGlobal's global options and more: startCaddyGlobal names its
// own http:// site, and these tests need an https:// one or a bind.
func loadCaddyfile(t *testing.T, global, sites string) {
	t.Helper()
	cf := fmt.Sprintf("{\n\tadmin off\n\tstorage file_system %s\n\tpersist_config off\n\tauto_https off\n\tlog {\n\t\tlevel WARN\n\t}\n%s}\n%s\n", storageDir, global, sites)
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
}

// certs are the files of a test's PKI: a CA, a server certificate for
// 127.0.0.1 and localhost, two client certificates of the CA (two
// tenants) and one of another CA (not trusted by the site).
type certs struct {
	ca, serverCert, serverKey string
	pool                      *x509.CertPool
	a, b, stranger            clientCert
}

type clientCert struct {
	cert, key string
	pair      tls.Certificate
	// fp is the SHA-256 of the certificate in hex, as Caddy's
	// {http.request.tls.client.fingerprint} names it.
	fp string
}

func makeCerts(t *testing.T) *certs {
	t.Helper()
	dir := t.TempDir()
	ca := tlstest.NewCA(t, dir, "ca")
	c := &certs{ca: ca.File, pool: ca.Pool}
	c.serverCert, c.serverKey = ca.Issue("server", "localhost", 2, false)
	c.a = newClientCert(t, ca, "tenant-a", 3)
	c.b = newClientCert(t, ca, "tenant-b", 4)
	c.stranger = newClientCert(t, tlstest.NewCA(t, dir, "another-ca"), "stranger", 5)
	return c
}

// newClientCert issues a client certificate of ca for name.
func newClientCert(t *testing.T, ca *tlstest.CA, name string, serial int64) clientCert {
	t.Helper()
	certFile, keyFile := ca.Issue(name, name, serial, true)
	p := tlstest.Pair(t, certFile, keyFile)
	sum := sha256.Sum256(p.Certificate[0])
	return clientCert{cert: certFile, key: keyFile, pair: p, fp: hex.EncodeToString(sum[:])}
}

// tenantCounter is the upstream of the TLS tests: it counts executions
// per client certificate (the fingerprint Caddy sends in X-Client-Fp)
// and Idempotency-Key, and answers 201 with a body that names the
// execution, so that a second execution has another body.
type tenantCounter struct {
	srv  *httptest.Server
	mu   sync.Mutex
	seq  int
	runs map[string]int // by fingerprint + " " + key
}

func startTenantCounter(t *testing.T) *tenantCounter {
	c := &tenantCounter{runs: map[string]int{}}
	c.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		fp, key := r.Header.Get("X-Client-Fp"), r.Header.Get(idemhttp.HeaderKey)
		c.mu.Lock()
		c.runs[fp+" "+key]++
		c.seq++
		n := c.seq
		c.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"run":%d,"client":%q,"key":%q,"request":%q}`, n, fp, key, body)
	}))
	t.Cleanup(c.srv.Close)
	return c
}

func (c *tenantCounter) count(fp, key string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.runs[fp+" "+key]
}

// keyRuns is the executions of key under any client certificate.
func (c *tenantCounter) keyRuns(key string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for k, v := range c.runs {
		if strings.HasSuffix(k, " "+key) {
			n += v
		}
	}
	return n
}

// reply is one answer as a client saw it, with the protocol it spoke.
type reply struct {
	err      error // the client failed (a refused handshake)
	proto    string
	status   int
	replayed string
	body     string
}

// curlPost POSTs body under key with curl and the extra args; an exit
// other than 0 is reply.err.
func curlPost(t *testing.T, url, key, body string, args ...string) reply {
	t.Helper()
	args = append([]string{"-sS", "-i", "--max-time", "20", "-X", "POST", "-H", "Content-Type: application/json",
		"-H", idemhttp.HeaderKey + ": " + key, "--data-binary", body}, args...)
	cmd := exec.Command(proctest.RequireTool(t, "curl"), append(args, url)...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if ee := (*exec.ExitError)(nil); errors.As(err, &ee) {
		return reply{err: fmt.Errorf("curl exit %d: %s", ee.ExitCode(), strings.TrimSpace(stderr.String()))}
	} else if err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(bytes.NewReader(fixHTTP2Status(out))), nil)
	if err != nil {
		t.Fatalf("curl %q: reading its output: %v\n%s", args, err, out)
	}
	b, _ := io.ReadAll(resp.Body)
	proto, _, _ := strings.Cut(string(out), " ")
	return reply{proto: proto, status: resp.StatusCode, replayed: resp.Header.Get(idemhttp.HeaderReplayed), body: string(b)}
}

// fixHTTP2Status makes curl's "HTTP/2 201" status line one that
// http.ReadResponse reads ("HTTP/2.0 201"); the rest is as curl -i
// printed it.
func fixHTTP2Status(out []byte) []byte {
	if rest, ok := bytes.CutPrefix(out, []byte("HTTP/2 ")); ok {
		return append([]byte("HTTP/2.0 "), rest...)
	}
	return out
}

// goPost POSTs body under key with client.
func goPost(t *testing.T, client *http.Client, url, key, body string) reply {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set(idemhttp.HeaderKey, key)
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return reply{err: err}
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return reply{err: err}
	}
	return reply{proto: resp.Proto, status: resp.StatusCode, replayed: resp.Header.Get(idemhttp.HeaderReplayed), body: string(b)}
}

// tlsClient is a Go client that trusts roots, presents cert (if any),
// speaks only HTTP/2 or only HTTP/1.1, and dials 127.0.0.1 whatever the
// URL's host (localhost, for its SNI: see startTLSCaddy).
func tlsClient(t *testing.T, roots *x509.CertPool, h2 bool, cert ...tls.Certificate) *http.Client {
	tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots, Certificates: cert}, Protocols: new(http.Protocols),
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			_, port, _ := net.SplitHostPort(addr)
			return (&net.Dialer{}).DialContext(ctx, network, net.JoinHostPort("127.0.0.1", port))
		}}
	if h2 {
		tr.Protocols.SetHTTP2(true)
	} else {
		tr.Protocols.SetHTTP1(true)
	}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 20 * time.Second}
}

// startTLSCaddy serves https://localhost:port (bound to 127.0.0.1) with
// Caddy's tls directive on c's server certificate, requiring and
// verifying a client certificate of c's CA, the idempotency handler on
// the memory store and reverse_proxy to up, sending the client
// certificate's fingerprint as X-Client-Fp. It returns the base URL and
// curl's --resolve argument for it.
//
// The site is named, not https://127.0.0.1:port: clients send no SNI to
// an IP address, and Caddy picks the connection policy (client_auth with
// it) by SNI, so a client without a certificate would be let in and
// then refused with 421 by the strict SNI-Host check that client_auth
// turns on.
func startTLSCaddy(t *testing.T, c *certs, up *tenantCounter) (base, resolve string) {
	t.Helper()
	port, err := nettest.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	loadCaddyfile(t, "\tservers {\n\t\tprotocols h1 h2\n\t}\n", fmt.Sprintf(`https://localhost:%d {
	bind 127.0.0.1
	tls %s %s {
		client_auth {
			mode require_and_verify
			trust_pool file %s
		}
	}
	idempotency {
		store memory
		prefix tls:%s:
	}
	reverse_proxy %s {
		header_up X-Client-Fp {http.request.tls.client.fingerprint}
	}
}`, port, c.serverCert, c.serverKey, c.ca, runID, strings.TrimPrefix(up.srv.URL, "http://")))
	return fmt.Sprintf("https://localhost:%d", port), fmt.Sprintf("localhost:%d:127.0.0.1", port)
}

// TestTLSClientCertTenant: through Caddy serving TLS with client_auth
// require_and_verify, a keyed POST runs once and is replayed byte for
// byte, by curl --http2 and --http1.1 and by Go clients on HTTP/2 and
// HTTP/1.1; the verified client certificate is the tenant (no
// Authorization is sent): the same key from a second certificate runs
// once more, for it, and each certificate gets its own replay.
func TestTLSClientCertTenant(t *testing.T) {
	c := makeCerts(t)
	up := startTenantCounter(t)
	base, resolve := startTLSCaddy(t, c, up)
	type poster func(cc clientCert, key, body string) reply
	curlWith := func(flag string) poster {
		return func(cc clientCert, key, body string) reply {
			return curlPost(t, base+"/pay", key, body, flag, "--resolve", resolve, "--cacert", c.ca, "--cert", cc.cert, "--key", cc.key)
		}
	}
	goWith := func(h2 bool) poster {
		clients := map[string]*http.Client{c.a.fp: tlsClient(t, c.pool, h2, c.a.pair), c.b.fp: tlsClient(t, c.pool, h2, c.b.pair)}
		return func(cc clientCert, key, body string) reply { return goPost(t, clients[cc.fp], base+"/pay", key, body) }
	}
	for _, tc := range []struct {
		name, proto string
		post        poster
	}{
		{"curl-http2", "HTTP/2", curlWith("--http2")},
		{"curl-http1.1", "HTTP/1.1", curlWith("--http1.1")},
		{"go-http2", "HTTP/2.0", goWith(true)},
		{"go-http1.1", "HTTP/1.1", goWith(false)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			key := "tls-" + tc.name + "-" + runID
			firsts := map[string]string{}
			for _, cc := range []clientCert{c.a, c.b} {
				first := tc.post(cc, key, `{"amount":1}`)
				if first.err != nil {
					t.Fatalf("first POST with a trusted certificate: %v", first.err)
				}
				if first.proto != tc.proto || first.status != 201 || first.replayed != "" || !strings.Contains(first.body, cc.fp) {
					t.Fatalf("first POST: got %s %d (replayed %q) %q, want %s 201 from the upstream, which saw the certificate %s",
						first.proto, first.status, first.replayed, first.body, tc.proto, cc.fp)
				}
				again := tc.post(cc, key, `{"amount":1}`)
				if again.err != nil || again.proto != tc.proto || again.status != 201 || again.replayed != "true" || again.body != first.body {
					t.Errorf("repeat with the same certificate: got %v %s %d (replayed %q) %q, want the %s replay of %q",
						again.err, again.proto, again.status, again.replayed, again.body, tc.proto, first.body)
				}
				firsts[cc.fp] = first.body
				if n := up.count(cc.fp, key); n != 1 {
					t.Errorf("got %d executions of the key under the certificate %s, want 1", n, cc.fp)
				}
			}
			if firsts[c.a.fp] == firsts[c.b.fp] {
				t.Errorf("both certificates got %q: the second was replayed another tenant's answer", firsts[c.a.fp])
			}
			if n := up.keyRuns(key); n != 2 {
				t.Errorf("got %d executions of the key, want 2 (once per certificate)", n)
			}
			other := tc.post(c.a, key, `{"amount":2}`)
			if other.err != nil || other.status != 422 || !strings.Contains(other.body, idemhttp.ProblemMismatch) {
				t.Errorf("same key and certificate, another body: got %v %d %q, want 422 mismatch", other.err, other.status, other.body)
			}
		})
	}
}

// TestTLSClientCertRequired: without a client certificate, or with one
// of a CA the site does not trust, the handshake is refused (by curl
// and by Go's client, on HTTP/2 and HTTP/1.1), and nothing reaches the
// upstream.
func TestTLSClientCertRequired(t *testing.T) {
	c := makeCerts(t)
	up := startTenantCounter(t)
	base, resolve := startTLSCaddy(t, c, up)
	key := "tls-refused-" + runID
	for name, r := range map[string]reply{
		"curl --http2, no certificate":              curlPost(t, base+"/pay", key, "{}", "--http2", "--resolve", resolve, "--cacert", c.ca),
		"curl --http1.1, no certificate":            curlPost(t, base+"/pay", key, "{}", "--http1.1", "--resolve", resolve, "--cacert", c.ca),
		"curl --http2, a certificate of another CA": curlPost(t, base+"/pay", key, "{}", "--http2", "--resolve", resolve, "--cacert", c.ca, "--cert", c.stranger.cert, "--key", c.stranger.key),
		"Go HTTP/2, no certificate":                 goPost(t, tlsClient(t, c.pool, true), base+"/pay", key, "{}"),
		"Go HTTP/1.1, no certificate":               goPost(t, tlsClient(t, c.pool, false), base+"/pay", key, "{}"),
		"Go HTTP/1.1, a certificate of another CA":  goPost(t, tlsClient(t, c.pool, false, c.stranger.pair), base+"/pay", key, "{}"),
	} {
		if r.err == nil {
			t.Errorf("%s: got %s %d %q, want the handshake refused", name, r.proto, r.status, r.body)
		} else {
			t.Logf("%s: %v", name, r.err)
		}
	}
	if n := up.keyRuns(key); n != 0 {
		t.Errorf("got %d executions from clients without a trusted certificate, want 0", n)
	}
	// The same site still serves a trusted certificate: the refusals
	// were of the clients, not of a site that never came up.
	if r := curlPost(t, base+"/pay", key, "{}", "--http2", "--resolve", resolve, "--cacert", c.ca, "--cert", c.a.cert, "--key", c.a.key); r.err != nil || r.status != 201 {
		t.Errorf("with a trusted certificate: got %v %d %q, want 201", r.err, r.status, r.body)
	}
}

// checkOnceAndReplay asserts that first was the upstream's first
// execution of the key (unix_upstream.py counts them) and again its
// byte-identical replay (the body carries a random nonce).
func checkOnceAndReplay(t *testing.T, first, again reply, body string) {
	t.Helper()
	if first.err != nil || first.status != 201 || first.replayed != "" || !strings.Contains(first.body, `"executions": 1`) || !strings.Contains(first.body, `"body": "`+body+`"`) {
		t.Fatalf("first POST: got %v %d (replayed %q) %q, want the upstream's 201 of its first execution of the key", first.err, first.status, first.replayed, first.body)
	}
	if again.err != nil || again.status != 201 || again.replayed != "true" || again.body != first.body {
		t.Errorf("repeat: got %v %d (replayed %q) %q, want the replay of %q", again.err, again.status, again.replayed, again.body, first.body)
	}
}

// TestUnixUpstream: reverse_proxy unix//path reaches Python's
// http.server on a unix socket; a keyed POST runs once and is replayed
// byte for byte, and the same key with another body gets 422 without
// reaching the upstream.
func TestUnixUpstream(t *testing.T) {
	sock := upstreamtest.StartUnixPython(t)
	base := startCaddy(t, fmt.Sprintf("\tidempotency {\n\t\tprefix unixup:%s:\n\t}\n\treverse_proxy unix/%s", runID, sock))
	key := "unix-up-" + runID
	first := goPost(t, http.DefaultClient, base+"/pay", key, "amount=7")
	again := goPost(t, http.DefaultClient, base+"/pay", key, "amount=7")
	checkOnceAndReplay(t, first, again, "amount=7")
	other := goPost(t, http.DefaultClient, base+"/pay", key, "amount=8")
	if other.err != nil || other.status != 422 || !strings.Contains(other.body, idemhttp.ProblemMismatch) {
		t.Errorf("same key, another body: got %v %d %q, want 422 mismatch", other.err, other.status, other.body)
	}
	// A GET under the key is not covered and reaches the upstream, whose
	// count of the key shows the one execution before it.
	if n := upstreamRuns(t, base+"/pay", key); n != 2 {
		t.Errorf("the upstream's count of the key at the GET after: %d, want 2 (the POST once, then the GET)", n)
	}
}

// upstreamRuns sends a GET carrying key through Caddy
// (GET is not covered: it passes through) and returns unix_upstream.py's
// count of the key's executions, the GET's included.
func upstreamRuns(t *testing.T, url, key string, curlArgs ...string) int {
	t.Helper()
	var body string
	if curlArgs != nil {
		cmd := exec.Command(proctest.RequireTool(t, "curl"), append([]string{"-sS", "--max-time", "20", "-H", idemhttp.HeaderKey + ": " + key}, append(curlArgs, url)...)...)
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("curl GET %s: %v", url, err)
		}
		body = string(out)
	} else {
		req, _ := http.NewRequest(http.MethodGet, url, nil)
		req.Header.Set(idemhttp.HeaderKey, key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		body = string(b)
	}
	var got struct {
		Executions int `json:"executions"`
	}
	if err := json.Unmarshal([]byte(body), &got); err != nil {
		t.Fatalf("GET %s: %v in %q", url, err, body)
	}
	return got.Executions
}

// TestUnixListen: a site on bind unix//path, driven by curl
// --unix-socket over HTTP/1.1, to the Python upstream on another unix
// socket (both ends on sockets, as gunicorn behind a socket-bound
// Caddy): a keyed POST runs once and is replayed byte for byte.
func TestUnixListen(t *testing.T) {
	up := upstreamtest.StartUnixPython(t)
	front := filepath.Join(t.TempDir(), "caddy.sock")
	loadCaddyfile(t, "", fmt.Sprintf("http:// {\n\tbind unix/%s\n\tidempotency {\n\t\tprefix unixlisten:%s:\n\t}\n\treverse_proxy unix/%s\n}", front, runID, up))
	if fi, err := os.Stat(front); err != nil {
		t.Fatalf("Caddy's listener: %v", err)
	} else if fi.Mode().Type() != os.ModeSocket {
		t.Fatalf("Caddy's listener %s has mode %v, want a socket", front, fi.Mode())
	}
	key := "unix-listen-" + runID
	first := curlPost(t, "http://localhost/pay", key, "amount=3", "--unix-socket", front)
	again := curlPost(t, "http://localhost/pay", key, "amount=3", "--unix-socket", front)
	checkOnceAndReplay(t, first, again, "amount=3")
	if first.proto != "HTTP/1.1" {
		t.Errorf("curl --unix-socket spoke %s, want HTTP/1.1", first.proto)
	}
	if n := upstreamRuns(t, "http://localhost/pay", key, "--unix-socket", front); n != 2 {
		t.Errorf("the upstream's count of the key at the GET after: %d, want 2 (the POST once, then the GET)", n)
	}
}
