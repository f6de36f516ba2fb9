package main

// The work belongs to the key, not to the connection: a client that gives
// up (times out, disconnects mid-body) never causes a second upstream
// execution, and the proxy never lets its transport resend a request.

import (
	"bufio"
	"bytes"
	"crypto/rand"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/idemhttp"
)

// proxyStores runs fn on the in-memory store and on a private Redis.
func proxyStores(t *testing.T, fn func(t *testing.T, store string)) {
	t.Run("memory", func(t *testing.T) { t.Parallel(); fn(t, "memory") })
	t.Run("redis", func(t *testing.T) { t.Parallel(); fn(t, "redis://"+proxyRedis(t).Addr()) })
}

// untilFinal sends the request again, as a client honouring 409 would,
// until the answer is something else (bounded).
func untilFinal(t *testing.T, url, key, body string) result {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		r := mustSend(t, "POST", url, key, body)
		if r.status != http.StatusConflict {
			return r
		}
		if r.header.Get("Retry-After") == "" {
			t.Fatalf("409 without Retry-After: %s", r.body)
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: still 409 after 15s", key)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func TestProxyClientTimeoutDoesNotCancelUpstream(t *testing.T) {
	t.Parallel()
	proxyStores(t, func(t *testing.T, store string) {
		up := newTestUpstream(t)
		p := startProxy(t, nil, "--upstream", up.URL, "--store", store)

		// The client gives up after 200ms; the upstream takes 1s.
		impatient := &http.Client{Timeout: 200 * time.Millisecond}
		req, _ := http.NewRequest("POST", p.url("/pay"), strings.NewReader(`{"amount":5}`))
		req.Header.Set("Content-Type", "application/json") // as send does: the fingerprint covers it
		req.Header.Set(idemhttp.HeaderKey, "gone-1")
		req.Header.Set("X-Test-Delay", "1s")
		if resp, err := impatient.Do(req); err == nil {
			resp.Body.Close()
			t.Fatalf("got %d from a client that should have timed out", resp.StatusCode)
		}
		// Its retry, with the same key, waits out the 409s and gets the
		// first execution's response.
		r := untilFinal(t, p.url("/pay"), "gone-1", `{"amount":5}`)
		wantStatus(t, "retry after the client's timeout", r, http.StatusCreated, "")
		if !r.replayed() {
			t.Fatalf("retry: got a fresh %d %s, want a replay", r.status, r.body)
		}
		if got := up.runsOf("gone-1"); got != 1 {
			t.Fatalf("got %d upstream executions, want 1", got)
		}
		if !p.awaitLog(`"outcome":"executed","status":201,`) || !p.awaitLog(`"client_gone":true`) {
			t.Errorf("log: no executed request with client_gone:\n%s", p.logText())
		}
		if strings.Contains(p.logText(), "upstream_aborted") {
			t.Errorf("log: a client timeout was logged as upstream_aborted")
		}
		if got := p.metric(`idem_client_gone_total{outcome="executed"}`); got != 1 {
			t.Errorf("idem_client_gone_total: got %v, want 1", got)
		}
	})
}

// streamingUpstream answers 201 with a body of n chunks: the first at once,
// the rest after release is closed. Each execution's body is unique.
type streamingUpstream struct {
	*httptest.Server
	release chan struct{}
	mu      sync.Mutex
	runs    int
	errs    []error // write errors the upstream saw
}

func newStreamingUpstream(t *testing.T, chunks, size int) *streamingUpstream {
	u := &streamingUpstream{release: make(chan struct{})}
	u.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		u.mu.Lock()
		u.runs++
		u.mu.Unlock()
		nonce := rand.Text()
		w.Header().Set("Content-Type", "text/plain")
		w.WriteHeader(http.StatusCreated)
		for i := range chunks {
			if i == 1 {
				<-u.release
			}
			chunk := fmt.Sprintf("%s %06d %s\n", nonce, i, strings.Repeat("x", size))
			if _, err := io.WriteString(w, chunk); err != nil {
				u.mu.Lock()
				u.errs = append(u.errs, err)
				u.mu.Unlock()
				return
			}
			http.NewResponseController(w).Flush()
		}
	}))
	t.Cleanup(u.Close)
	return u
}

func TestProxyClientLeavesMidBody(t *testing.T) {
	t.Parallel()
	proxyStores(t, func(t *testing.T, store string) {
		const chunks, size = 200, 1000 // about 200 KB, more than socket buffers hold
		up := newStreamingUpstream(t, chunks, size)
		p := startProxy(t, nil, "--upstream", up.URL, "--store", store)

		// A raw client: it reads the status line and the first chunk,
		// then closes its connection while the body still streams.
		conn, err := net.Dial("tcp", p.addr)
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(conn, "POST /report HTTP/1.1\r\nHost: 127.0.0.1\r\nIdempotency-Key: mid-1\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
		br := bufio.NewReader(conn)
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatal(err)
		}
		if resp.StatusCode != http.StatusCreated {
			t.Fatalf("first request: got status %d, want 201", resp.StatusCode)
		}
		if _, err := resp.Body.Read(make([]byte, 100)); err != nil {
			t.Fatal(err)
		}
		conn.(*net.TCPConn).SetLinger(0) // reset, as a killed client would
		conn.Close()
		close(up.release)

		r := untilFinal(t, p.url("/report"), "mid-1", "{}")
		wantStatus(t, "retry after the client left mid-body", r, http.StatusCreated, "")
		if !r.replayed() {
			t.Fatalf("retry: got a fresh %d, want a replay", r.status)
		}
		if lines := bytes.Count(r.body, []byte("\n")); lines != chunks {
			t.Fatalf("replayed body: got %d lines (%d bytes), want all %d", lines, len(r.body), chunks)
		}
		up.mu.Lock()
		runs, errs := up.runs, up.errs
		up.mu.Unlock()
		if runs != 1 || len(errs) != 0 {
			t.Fatalf("upstream: got %d executions and write errors %v, want 1 and none (the proxy reads it to its end)", runs, errs)
		}
		if !p.awaitLog(`"client_gone":true`) || strings.Contains(p.logText(), "upstream_aborted") {
			t.Errorf("log: want client_gone and no upstream_aborted:\n%s", p.logText())
		}
	})
}

// resettingUpstream is a raw HTTP/1.1 server that answers the first
// request on each connection with 201 and keeps the connection open, and
// resets the connection, without answering, after reading any later
// request on it: an upstream that acted, then broke a reused connection.
type resettingUpstream struct {
	ln       net.Listener
	mu       sync.Mutex
	arrivals map[string]int // requests read, per Idempotency-Key
}

func newResettingUpstream(t *testing.T) *resettingUpstream {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	u := &resettingUpstream{ln: ln, arrivals: map[string]int{}}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			go u.serve(conn)
		}
	}()
	return u
}

func (u *resettingUpstream) serve(conn net.Conn) {
	defer conn.Close()
	br := bufio.NewReader(conn)
	for n := 1; ; n++ {
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		io.Copy(io.Discard, req.Body)
		u.mu.Lock()
		u.arrivals[req.Header.Get(idemhttp.HeaderKey)]++
		u.mu.Unlock()
		if n > 1 {
			conn.(*net.TCPConn).SetLinger(0)
			return
		}
		io.WriteString(conn, "HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
	}
}

func (u *resettingUpstream) arrivalsOf(key string) int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.arrivals[key]
}

func TestProxyNeverResendsUpstream(t *testing.T) {
	t.Parallel()
	up := newResettingUpstream(t)
	p := startProxy(t, nil, "--upstream", "http://"+up.ln.Addr().String())
	for _, c := range []struct{ name, body string }{{"empty-body", ""}, {"with-body", `{"amount":5}`}} {
		// A first request opens a connection the proxy keeps; the keyed
		// request after it goes on that connection, which the upstream
		// resets once it has read (and acted on) the request.
		warm := "warm-" + c.name
		wantStatus(t, warm, mustSend(t, "POST", p.url("/pay"), warm, c.body), http.StatusCreated, "")
		key := "reset-" + c.name
		r := mustSend(t, "POST", p.url("/pay"), key, c.body)
		if got := up.arrivalsOf(key); got != 1 {
			t.Fatalf("%s: the upstream received the request %d times within one acquisition, want 1", c.name, got)
		}
		// The upstream's answer is unknown: 502, and the key is released
		// for the client's retry, as for any upstream failure.
		wantStatus(t, c.name+": upstream reset after acting", r, http.StatusBadGateway, ProblemBadGateway)
	}
}

func TestProxyMaxExecution(t *testing.T) {
	t.Parallel()
	up := newTestUpstream(t)
	p := startProxy(t, nil, "--upstream", up.URL, "--max-execution", "200ms")
	r := mustSend(t, "POST", p.url("/slow"), "max-1", "{}", "X-Test-Delay: 10s")
	wantStatus(t, "upstream past --max-execution", r, http.StatusGatewayTimeout, ProblemUpstreamTimeout)
	// 504 is released: the retry runs the request again.
	r = mustSend(t, "POST", p.url("/slow"), "max-1", "{}")
	if r.status != http.StatusCreated || r.replayed() || up.runsOf("max-1") != 2 {
		t.Fatalf("retry after 504: got %d replayed=%v and %d executions, want a fresh 201 and 2", r.status, r.replayed(), up.runsOf("max-1"))
	}
}

// The old behaviour, kept behind an option documented as unsafe: the
// client's timeout cancels the upstream request and releases the key, and
// the retry runs it again.
func TestProxyCancelOnDisconnect(t *testing.T) {
	t.Parallel()
	up := newTestUpstream(t)
	p := startProxy(t, nil, "--upstream", up.URL, "--cancel-on-disconnect")
	impatient := &http.Client{Timeout: 200 * time.Millisecond}
	req, _ := http.NewRequest("POST", p.url("/pay"), strings.NewReader("{}"))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(idemhttp.HeaderKey, "cancel-1")
	req.Header.Set("X-Test-Delay", "1s")
	if resp, err := impatient.Do(req); err == nil {
		resp.Body.Close()
		t.Fatalf("got %d from a client that should have timed out", resp.StatusCode)
	}
	r := untilFinal(t, p.url("/pay"), "cancel-1", "{}")
	if r.status != http.StatusCreated || r.replayed() || up.runsOf("cancel-1") != 2 {
		t.Fatalf("retry: got %d replayed=%v and %d executions, want a fresh 201 and 2", r.status, r.replayed(), up.runsOf("cancel-1"))
	}
}
