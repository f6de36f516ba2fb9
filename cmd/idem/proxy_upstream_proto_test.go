package main

import (
	"crypto/tls"
	"encoding/pem"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/idemkit/idem/internal/tlstest"
)

// TestProxyHTTPSUpstreamHTTP1: an https:// upstream that offers HTTP/2 by
// ALPN is reached over HTTP/1.1, so that a keyed request without a body
// goes as sendOnce frames it for HTTP/1.1 (net/http's HTTP/2 client would
// resend it after some stream errors); an h2c:// upstream is the way to
// HTTP/2.
func TestProxyHTTPSUpstreamHTTP1(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	protos := map[string]int{}
	up := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		protos[r.Proto]++
		mu.Unlock()
		w.WriteHeader(http.StatusCreated)
		w.Write([]byte(`{"ok":true}`))
	}))
	up.EnableHTTP2 = true
	up.StartTLS()
	t.Cleanup(up.Close)
	caFile := filepath.Join(t.TempDir(), "upstream-ca.pem")
	if err := os.WriteFile(caFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: up.Certificate().Raw}), 0o600); err != nil {
		t.Fatal(err)
	}
	// The upstream does offer HTTP/2: a client that asks for it gets it.
	c := up.Client()
	resp, err := c.Get(up.URL)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.ProtoMajor != 2 {
		t.Fatalf("the test upstream answered a client that offers h2 over %s; want HTTP/2", resp.Proto)
	}

	p := startProxy(t, nil, "--upstream", up.URL, "--upstream-ca", caFile)
	first := mustSend(t, "POST", p.url("/payments"), "h1-up", "")
	wantStatus(t, "a keyed POST without a body", first, http.StatusCreated, "")
	again := mustSend(t, "POST", p.url("/payments"), "h1-up", "")
	if !again.replayed() {
		t.Errorf("its repeat: got %d, not replayed", again.status)
	}
	wantStatus(t, "a GET passed through", mustSend(t, "GET", p.url("/x"), "", ""), http.StatusCreated, "")
	mu.Lock()
	defer mu.Unlock()
	if protos["HTTP/1.1"] != 2 || len(protos) != 2 || protos["HTTP/2.0"] != 1 {
		t.Errorf("the upstream got %v; want the proxy's 2 requests over HTTP/1.1 (and the test's own over HTTP/2)", protos)
	}
}

// TestProxyUpstreamCAReload: --upstream-ca is re-read on SIGHUP as the
// certificates are: an upstream whose certificate is renewed under
// another CA is refused (502) until the CA file holds that CA too and the
// proxy is told; a CA file that does not load is refused with one ERROR
// line and the CAs in place kept. The upstream's name is verified with
// the CAs in place: a certificate of a trusted CA for another address is
// refused.
func TestProxyUpstreamCAReload(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	caA, caB := tlstest.NewCA(t, dir, "ca-a"), tlstest.NewCA(t, dir, "ca-b")
	certA, keyA := caA.Issue("up-a", "127.0.0.1", 10, false)
	certB, keyB := caB.Issue("up-b", "127.0.0.1", 11, false)
	var served atomic.Pointer[tls.Certificate]
	pa := tlstest.Pair(t, certA, keyA)
	served.Store(&pa)
	// The upstream's certificate is whichever served holds at each
	// handshake (httptest's StartTLS would add a certificate of its own).
	upTLS := &tls.Config{GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) { return served.Load(), nil }}
	created := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusCreated) })
	serveTLS := func(addr string) (url string, closeConns func()) {
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		var mu sync.Mutex
		conns := map[net.Conn]bool{}
		srv := &http.Server{Handler: created, TLSConfig: upTLS, ConnState: func(c net.Conn, st http.ConnState) {
			mu.Lock()
			defer mu.Unlock()
			if st == http.StateClosed || st == http.StateHijacked {
				delete(conns, c)
			} else {
				conns[c] = true
			}
		}}
		go srv.ServeTLS(ln, "", "")
		t.Cleanup(func() { srv.Close() })
		return "https://" + ln.Addr().String(), func() {
			// Every connection is cut, as a renewed upstream's restart
			// would: the next request handshakes. (Closing the idle ones
			// only would miss a connection whose response was just
			// written, not yet idle, which the next request then reuses.)
			mu.Lock()
			defer mu.Unlock()
			for c := range conns {
				c.Close()
				delete(conns, c)
			}
		}
	}
	upURL, cut := serveTLS("127.0.0.1:0")
	caFile := filepath.Join(dir, "upstream-ca.pem")
	copyFile(t, caA.File, caFile)

	p := startProxy(t, nil, "--upstream", upURL, "--upstream-ca", caFile, "--tls-watch", "0")
	wantStatus(t, "an upstream of the trusted CA", mustSend(t, "GET", p.url("/1"), "", ""), http.StatusCreated, "")

	pb := tlstest.Pair(t, certB, keyB)
	served.Store(&pb) // renewed under CA B
	cut()
	wantStatus(t, "the upstream renewed under an untrusted CA", mustSend(t, "GET", p.url("/2"), "", ""), http.StatusBadGateway, "")

	if err := os.WriteFile(caFile, []byte("not PEM\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	p.hangup(t, `"msg":"reload refused; the running configuration is kept","what":"upstream certificate"`, 1)
	if lines := p.errorLines(); len(lines) != 1 || !strings.Contains(lines[0], "--upstream-ca "+caFile) {
		t.Errorf("a bad CA file: ERROR lines %q, want one naming --upstream-ca %s", lines, caFile)
	}
	served.Store(&pa)
	cut()
	wantStatus(t, "CA A kept after the refused file", mustSend(t, "GET", p.url("/3"), "", ""), http.StatusCreated, "")

	both := append(readFile(t, caA.File), readFile(t, caB.File)...)
	if err := os.WriteFile(caFile, both, 0o600); err != nil {
		t.Fatal(err)
	}
	p.hangup(t, `"msg":"reloaded","what":"upstream certificate"`, 1)
	served.Store(&pb)
	cut()
	wantStatus(t, "CA B trusted after the reload", mustSend(t, "GET", p.url("/4"), "", ""), http.StatusCreated, "")

	// The same upstream, named by another loopback address: its
	// certificate (for 127.0.0.1 and localhost) does not name it.
	otherURL, _ := serveTLS("127.0.0.2:0")
	q := startProxy(t, nil, "--upstream", otherURL, "--upstream-ca", caFile)
	wantStatus(t, "an upstream whose certificate names another address", mustSend(t, "GET", q.url("/5"), "", ""), http.StatusBadGateway, "")
}

func copyFile(t *testing.T, from, to string) {
	t.Helper()
	if err := os.WriteFile(to, readFile(t, from), 0o600); err != nil {
		t.Fatal(err)
	}
}

func readFile(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
