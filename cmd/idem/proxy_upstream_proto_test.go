package main

import (
	"encoding/pem"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync"
	"testing"
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
