package main

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/logwriter"
	"github.com/idemkit/idem/internal/redisserver"
)

// BenchmarkProxyHandler is what idem proxy's handler costs a request, in
// process, with its defaults (a JSON log line per request, here through
// the proxy's logwriter to io.Discard), in front of a static upstream on
// loopback that answers 201 {"ok":true} as scripts/proxybench.sh's nginx
// does (a few lines over a raw connection: next to nothing of its own in
// the allocation counts). The rows:
//   - reverseproxy: a bare httputil.ReverseProxy (proxybench.sh's), the
//     floor a pass-through is compared with;
//   - passthrough-get: a GET, which the defaults do not cover;
//   - keyed-memory, keyed-redis: a POST with a new Idempotency-Key, executed
//     and stored (memory store, a private redis-server);
//   - replay-memory: the same key again, answered from the store.
//
// Besides ns/op (wall time, moved by the machine's other load) it reports
// cpu-ns/op: the process's user and system time per request, the
// upstream's included.
//
//	go test -run '^$' -bench ProxyHandler -benchtime 2s -count 3 ./cmd/idem
func BenchmarkProxyHandler(b *testing.B) {
	up := startStaticUpstream(b)
	body := `{"amount":100}`
	post := func(key string) *http.Request {
		r := httptest.NewRequest(http.MethodPost, "http://proxy.example/payments", strings.NewReader(body))
		r.Header.Set("Content-Type", "application/json")
		if key != "" {
			r.Header.Set(idemhttp.HeaderKey, key)
		}
		return r
	}
	get := func(string) *http.Request {
		return httptest.NewRequest(http.MethodGet, "http://proxy.example/payments/7", nil)
	}
	var seq atomic.Int64
	newKey := func() string { return "bench-" + strconv.FormatInt(seq.Add(1), 10) }
	sameKey := func() string { return "bench-replay" }

	b.Run("reverseproxy", func(b *testing.B) {
		target, _ := url.Parse(up)
		t := http.DefaultTransport.(*http.Transport).Clone()
		t.MaxIdleConnsPerHost = 256
		defer t.CloseIdleConnections()
		rp := &httputil.ReverseProxy{Rewrite: func(pr *httputil.ProxyRequest) { pr.SetURL(target); pr.SetXForwarded() }, Transport: t}
		runProxyBench(b, rp, get, sameKey, http.StatusCreated, "")
	})
	b.Run("passthrough-get", func(b *testing.B) {
		runProxyBench(b, benchProxy(b, up), get, sameKey, http.StatusCreated, "")
	})
	b.Run("keyed-memory", func(b *testing.B) {
		// A --memory-limit (and so a per-tenant --quota-bytes, an eighth of
		// it) that the benchmark's new keys, all one tenant's, do not reach.
		runProxyBench(b, benchProxy(b, up, "--memory-limit", "4GiB"), post, newKey, http.StatusCreated, "")
	})
	b.Run("replay-memory", func(b *testing.B) {
		p := benchProxy(b, up)
		w := httptest.NewRecorder()
		p.ServeHTTP(w, post(sameKey()))
		if w.Code != http.StatusCreated {
			b.Fatalf("first request: %d %s", w.Code, w.Body)
		}
		runProxyBench(b, p, post, sameKey, http.StatusCreated, "true")
	})
	b.Run("keyed-redis", func(b *testing.B) {
		redis, err := redisserver.StartServer()
		if err != nil {
			b.Fatal(err)
		}
		defer redis.Stop()
		runProxyBench(b, benchProxy(b, up, "--store", "redis://"+redis.Addr()), post, newKey, http.StatusCreated, "")
	})
}

// runProxyBench sends h requests made by req (given a key from key) from
// parallel goroutines, and checks each answer's status and replay header.
func runProxyBench(b *testing.B, h http.Handler, req func(string) *http.Request, key func() string, status int, replayed string) {
	cpu0 := benchCPUTime(b)
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			w := deadlineRecorder{httptest.NewRecorder()}
			h.ServeHTTP(w, req(key()))
			if w.Code != status || w.Header().Get(idemhttp.HeaderReplayed) != replayed {
				b.Errorf("got %d (replayed %q) %s; want %d (replayed %q)", w.Code, w.Header().Get(idemhttp.HeaderReplayed), w.Body, status, replayed)
				return
			}
		}
	})
	b.StopTimer()
	b.ReportMetric(float64(benchCPUTime(b)-cpu0)/float64(b.N), "cpu-ns/op")
}

// deadlineRecorder is a recorder with net/http's SetWriteDeadline (which
// idemhttp bounds its writes to the client with): without it,
// http.ResponseController's call fails through fmt.Errorf, 4 allocations
// per keyed request and replay that a real connection does not make.
type deadlineRecorder struct{ *httptest.ResponseRecorder }

func (deadlineRecorder) SetWriteDeadline(time.Time) error { return nil }

// benchProxy is idem proxy's handler as runProxy makes it, with args
// after --upstream upstream; its log goes through a logwriter to
// io.Discard. Everything is closed when the benchmark ends.
func benchProxy(b *testing.B, upstream string, args ...string) *proxy {
	b.Helper()
	o, err := parseProxyFlags(append([]string{"--upstream", upstream}, args...), io.Discard)
	if err != nil {
		b.Fatal(err)
	}
	target, err := o.validate()
	if err != nil {
		b.Fatal(err)
	}
	logOut := logwriter.New(io.Discard)
	b.Cleanup(func() { logOut.Close() })
	logger, err := newLogger(logOut, o.logFormat, o.logLevel)
	if err != nil {
		b.Fatal(err)
	}
	bk, err := o.openBackends(context.Background(), logger)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(bk.close)
	p, err := newProxy(target, nil, bk.store, o.settings, nil, bk.metrics, logger, blobOptions{}, o.quota.tenants, o.v1Scopes.d, nil)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(p.stopWork)
	return p
}

// startStaticUpstream serves, on a loopback port, a static 201
// {"ok":true} on keep-alive HTTP/1.1 connections, reading each request's
// header and its Content-Length body: an nginx "return 201" that
// allocates next to nothing per request. It returns the upstream's URL.
func startStaticUpstream(b *testing.B) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { ln.Close() })
	resp := []byte("HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nContent-Length: 12\r\n\r\n{\"ok\":true}\n")
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				br := bufio.NewReader(c)
				for {
					n := 0
					for {
						line, err := br.ReadSlice('\n')
						if err != nil {
							return
						}
						if len(line) <= 2 {
							break
						}
						if k, v, ok := bytes.Cut(line, []byte(":")); ok && strings.EqualFold(string(k), "Content-Length") {
							n, _ = strconv.Atoi(string(bytes.TrimSpace(v)))
						}
					}
					if _, err := br.Discard(n); err != nil {
						return
					}
					if _, err := c.Write(resp); err != nil {
						return
					}
				}
			}()
		}
	}()
	return "http://" + ln.Addr().String()
}

// benchCPUTime is the process's user and system CPU time so far.
func benchCPUTime(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
