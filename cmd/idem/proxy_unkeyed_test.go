package main

import (
	"bufio"
	"crypto/rand"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"
)

// Unkeyed requests with a body over inlineBodySize pass through the
// proxy with their body streamed to the upstream (smaller ones are read
// whole first). Go's HTTP/1 server closes a request body once
// the response header goes out, and Go's transport reads a body once more
// after its declared Content-Length (to check that it holds no more): when
// that read came after the close, the transport tore down the upstream
// connection and cut the response in the middle of its body. The proxy
// ends such a body at its Content-Length itself.
//
// Not parallel: 2 GB through the proxy would slow the timing-bound tests
// that run beside it.
func TestProxyUnkeyedBodyLargeResponses(t *testing.T) {
	const size = 10 * mib
	const requests = 200
	body := make([]byte, size)
	rand.Read(body)
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body) // it reads its request before it answers
		w.Header().Set("Content-Type", "application/octet-stream")
		w.Header().Set("Content-Length", strconv.Itoa(size))
		for p := body; len(p) > 0; p = p[min(len(p), 32*kib):] {
			if _, err := w.Write(p[:min(len(p), 32*kib)]); err != nil {
				return
			}
		}
	}))
	t.Cleanup(up.Close)
	// The proxy built without -race, as in production: the race detector
	// slows it down enough to hide the race.
	p := startBlobProxy(t, "--upstream", up.URL)

	client := &http.Client{Timeout: 2 * time.Minute, Transport: &http.Transport{MaxIdleConnsPerHost: 1}}
	t.Cleanup(client.CloseIdleConnections)
	var failed []string
	reqBody := `{"report":"q3","pad":"` + strings.Repeat("x", inlineBodySize) + `"}`
	for range requests {
		req, _ := http.NewRequest("POST", p.base()+"/export", strings.NewReader(reqBody))
		req.Header.Set("Content-Type", "application/json")
		what := ""
		resp, err := client.Do(req)
		if err == nil {
			var got int64
			got, err = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if err != nil || got != size || resp.StatusCode != http.StatusOK {
				what = fmt.Sprintf("status %d after %d bytes: %v", resp.StatusCode, got, err)
			}
		} else {
			what = err.Error()
		}
		if what != "" {
			failed = append(failed, what)
		}
	}
	if len(failed) > 0 {
		t.Errorf("%d of %d unkeyed POSTs with a %d-byte response failed; the first: %q",
			len(failed), requests, size, failed[:min(len(failed), 3)])
		for line := range strings.Lines(p.LogText()) {
			if strings.Contains(line, `"level":"WARN"`) {
				t.Logf("the proxy's first warning: %s", strings.TrimSpace(line))
				break
			}
		}
	}
}

// An unkeyed request whose body ends before its Content-Length (a client
// that stops sending, or leaves) gets a 400 naming the two lengths, and
// nothing reaches the upstream; a whole one is forwarded with its body.
func TestProxyUnkeyedShortBody(t *testing.T) {
	t.Parallel()
	up := newTestUpstream(t)
	p := startProxy(t, nil, "--upstream", up.URL, "--store", "memory")
	addr := strings.TrimPrefix(p.url(""), "http://")
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	fmt.Fprintf(conn, "POST /orders HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"amount\":1}", addr)
	conn.(*net.TCPConn).CloseWrite() // 12 of the 100 bytes, then nothing more
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(body), "after 12 of the 100 bytes") {
		t.Errorf("short body: got %d %s, want 400 naming 12 of the 100 bytes", resp.StatusCode, body)
	}
	if n := up.runsOf(""); n != 0 {
		t.Errorf("the upstream got %d requests, want none", n)
	}
	wantStatus(t, "whole body", mustSend(t, "POST", p.url("/orders"), "", `{"amount":1}`), http.StatusCreated, "")
	if n := up.runsOf(""); n != 1 {
		t.Errorf("the upstream got %d requests, want the whole one", n)
	}
}
