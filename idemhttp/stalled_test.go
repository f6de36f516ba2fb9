package idemhttp_test

// A client that stops reading (its TCP window full) is a client gone: once
// a write to it has not been taken for Config.ClientWriteTimeout, the
// middleware stops writing to it, keeps capturing, and the key completes
// for the retry.

import (
	"context"
	"crypto/sha256"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/nettest"
	"github.com/idemkit/idem/memstore"
)

// replayOf repeats the keyed POST for a body of size bytes, as a client
// honouring 409 would, until the answer is something else (bounded), and
// returns it with its body read into a digest.
func replayOf(t *testing.T, url, key string, size int64) got {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	client := &http.Client{Timeout: time.Minute}
	for {
		req, _ := http.NewRequest("POST", url+"/report?size="+strconv.FormatInt(size, 10), strings.NewReader("{}"))
		req.Header.Set(idemhttp.HeaderKey, key)
		resp, err := client.Do(req)
		if err != nil {
			t.Fatalf("retry of %s: %v", key, err)
		}
		g := got{status: resp.StatusCode, header: resp.Header}
		if resp.StatusCode != http.StatusConflict {
			sum := sha256.New()
			g.n, g.err = io.Copy(sum, resp.Body)
			sum.Sum(g.sum[:0])
			resp.Body.Close()
			return g
		}
		resp.Body.Close()
		if time.Now().After(deadline) {
			t.Fatalf("%s: still 409 after 30s: the client that stopped reading holds the key", key)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func TestClientStopsReading(t *testing.T) {
	eachStore(t, func(t *testing.T, store idem.Store) {
		const size = 16 << 20 // far more than the socket buffers hold
		app := newBigApp()
		cfg := idemhttp.Config{Blobs: newMemBlobs(), Logger: quietLogger(), ClientWriteTimeout: 300 * time.Millisecond}
		srv := httptest.NewUnstartedServer(idemhttp.Middleware(store, cfg)(app))
		srv.Config.ErrorLog = quietStdLogger()
		srv.Start()
		t.Cleanup(srv.Close)

		key := "stall-" + t.Name()
		nettest.DialStalled(t, srv.Listener.Addr().String(), fmt.Sprintf(
			"POST /report?size=%d HTTP/1.1\r\nHost: 127.0.0.1\r\nIdempotency-Key: %s\r\nContent-Length: 2\r\n\r\n{}", size, key))
		// The stalled request holds the key once the handler runs.
		deadline := time.Now().Add(10 * time.Second)
		for app.count(key) == 0 {
			if time.Now().After(deadline) {
				t.Fatal("the stalled request did not reach the handler within 10s")
			}
			time.Sleep(10 * time.Millisecond)
		}

		g := replayOf(t, srv.URL, key, size)
		if g.status != http.StatusOK || g.header.Get(idemhttp.HeaderReplayed) != "true" || g.err != nil || g.n != size {
			t.Fatalf("retry: got %d replayed=%q, %d bytes (%v), want the replay of all %d bytes",
				g.status, g.header.Get(idemhttp.HeaderReplayed), g.n, g.err, size)
		}
		if want, _ := digest(stream(key, size)); g.sum != want {
			t.Fatal("retry: the replayed body differs from what the handler wrote")
		}
		if n := app.count(key); n != 1 {
			t.Fatalf("the handler ran %d times, want 1", n)
		}
	})
}

// The deadline covers a write, not the time between writes: a handler that
// works longer than ClientWriteTimeout between two writes, to a client
// that reads, sends its whole response (HTTP/1 and HTTP/2), and the
// connection serves the next request as before.
func TestClientWriteTimeoutSparesPauses(t *testing.T) {
	const timeout = 100 * time.Millisecond
	for _, h2 := range []bool{false, true} {
		t.Run(map[bool]string{false: "http1", true: "http2"}[h2], func(t *testing.T) {
			var outcomes sync.Map
			cfg := idemhttp.Config{Logger: quietLogger(), ClientWriteTimeout: timeout,
				OnOutcome: func(r *http.Request, o idemhttp.Outcome) { outcomes.Store(r.Header.Get(idemhttp.HeaderKey), o) }}
			big := strings.Repeat("x", 1<<20)
			srv := httptest.NewUnstartedServer(idemhttp.Middleware(memstore.New(memstore.Options{}), cfg)(http.HandlerFunc(
				func(w http.ResponseWriter, r *http.Request) {
					w.Header().Set("Content-Type", "text/plain")
					w.WriteHeader(http.StatusCreated)
					io.WriteString(w, "first\n")
					http.NewResponseController(w).Flush()
					if r.Header.Get(idemhttp.HeaderKey) != "" {
						time.Sleep(5 * timeout) // work between two writes
					}
					io.WriteString(w, big)
				})))
			srv.Config.ErrorLog = quietStdLogger()
			srv.EnableHTTP2 = h2
			if h2 {
				srv.StartTLS()
			} else {
				srv.Start()
			}
			t.Cleanup(srv.Close)
			client := srv.Client()
			post := func(key string) (int, string, bool) {
				t.Helper()
				reused := false
				ctx := httptrace.WithClientTrace(context.Background(), &httptrace.ClientTrace{
					GotConn: func(i httptrace.GotConnInfo) { reused = i.Reused }})
				req, _ := http.NewRequestWithContext(ctx, "POST", srv.URL+"/pause", strings.NewReader("{}"))
				if key != "" {
					req.Header.Set(idemhttp.HeaderKey, key)
				}
				resp, err := client.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				defer resp.Body.Close()
				if h2 && resp.ProtoMajor != 2 {
					t.Fatalf("got %s, want HTTP/2", resp.Proto)
				}
				body, err := io.ReadAll(resp.Body)
				if err != nil {
					t.Fatalf("%s: reading the body: %v", key, err)
				}
				return resp.StatusCode, string(body), reused
			}
			if status, body, _ := post("pause-1"); status != http.StatusCreated || body != "first\n"+big {
				t.Fatalf("keyed request: got %d and %d bytes, want 201 and all %d", status, len(body), len("first\n"+big))
			}
			if o, _ := outcomes.Load("pause-1"); o != idemhttp.OutcomeExecuted {
				t.Fatalf("outcome: got %v, want %v", o, idemhttp.OutcomeExecuted)
			}
			time.Sleep(3 * timeout) // the connection idles past the timeout
			status, body, reused := post("")
			if status != http.StatusCreated || body != "first\n"+big || !reused {
				t.Fatalf("next request on the connection: got %d, %d bytes, reused %v; want 201, all %d bytes, reused",
					status, len(body), reused, len("first\n"+big))
			}
		})
	}
}

// http.Server.WriteTimeout is not extended by the per-write deadlines: a
// response still running when it passes is cut off for the client (as
// without the middleware), and stored whole for the retry.
func TestClientWriteTimeoutKeepsServerWriteTimeout(t *testing.T) {
	var runs atomic.Int64
	srv := httptest.NewUnstartedServer(idemhttp.Middleware(memstore.New(memstore.Options{}), idemhttp.Config{Logger: quietLogger()})(
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			w.Header().Set("Content-Type", "text/plain")
			w.WriteHeader(http.StatusCreated)
			io.WriteString(w, "first\n")
			http.NewResponseController(w).Flush()
			time.Sleep(600 * time.Millisecond) // past the server's WriteTimeout
			io.WriteString(w, "second\n")
		})))
	srv.Config.ErrorLog = quietStdLogger()
	srv.Config.WriteTimeout = 300 * time.Millisecond
	srv.Start()
	t.Cleanup(srv.Close)
	req, _ := http.NewRequest("POST", srv.URL+"/slow", strings.NewReader("{}"))
	req.Header.Set(idemhttp.HeaderKey, "wt-1")
	resp, err := srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err == nil && string(body) == "first\nsecond\n" {
		t.Fatal("the whole response arrived after the server's WriteTimeout: the middleware extended it")
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		req, _ := http.NewRequest("POST", srv.URL+"/slow", strings.NewReader("{}"))
		req.Header.Set(idemhttp.HeaderKey, "wt-1")
		resp, err := srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusConflict {
			if resp.StatusCode != http.StatusCreated || resp.Header.Get(idemhttp.HeaderReplayed) != "true" || err != nil || string(body) != "first\nsecond\n" || runs.Load() != 1 {
				t.Fatalf("retry: got %d replayed=%q %q (%v) after %d runs, want the whole replay after 1",
					resp.StatusCode, resp.Header.Get(idemhttp.HeaderReplayed), body, err, runs.Load())
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("retry: still 409 after 10s")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// A ResponseWriter that takes no write deadlines (a recorder, a wrapper
// without Unwrap) leaves writes unbounded, as before ClientWriteTimeout.
func TestClientWriteTimeoutWithoutDeadlines(t *testing.T) {
	big := strings.Repeat("y", 1<<20)
	h := idemhttp.Middleware(memstore.New(memstore.Options{}), idemhttp.Config{Logger: quietLogger(), ClientWriteTimeout: time.Nanosecond})(
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(http.StatusCreated)
			io.WriteString(w, big)
		}))
	for i, want := range []string{"", "true"} {
		req := httptest.NewRequest("POST", "/big", strings.NewReader("{}"))
		req.Header.Set(idemhttp.HeaderKey, "nodeadline-1")
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		if rec.Code != http.StatusCreated || rec.Body.String() != big || rec.Header().Get(idemhttp.HeaderReplayed) != want {
			t.Fatalf("request %d: got %d replayed=%q and %d bytes, want 201 replayed=%q and all %d",
				i+1, rec.Code, rec.Header().Get(idemhttp.HeaderReplayed), rec.Body.Len(), want, len(big))
		}
	}
}

// A client that stops reading a replay of a large stored body is gone
// after ClientWriteTimeout too: the replay ends and frees its blob reader
// and goroutine, instead of waiting for as long as the client keeps the
// connection open.
func TestClientStopsReadingReplay(t *testing.T) {
	const size = 16 << 20 // far more than the socket buffers hold
	var replays atomic.Int64
	app := newBigApp()
	cfg := idemhttp.Config{Blobs: newMemBlobs(), Logger: quietLogger(), ClientWriteTimeout: 300 * time.Millisecond,
		OnOutcome: func(_ *http.Request, o idemhttp.Outcome) {
			if o == idemhttp.OutcomeReplayed {
				replays.Add(1)
			}
		}}
	srv := httptest.NewUnstartedServer(idemhttp.Middleware(memstore.New(memstore.Options{}), cfg)(app))
	srv.Config.ErrorLog = quietStdLogger()
	srv.Start()
	t.Cleanup(srv.Close)

	key := "stalled-replay"
	if g := replayOf(t, srv.URL, key, size); g.status != http.StatusOK || g.err != nil || g.n != size {
		t.Fatalf("first request: %d, %d bytes, %v", g.status, g.n, g.err)
	}
	// Once a replay came back, the key is completed: the stalled
	// request's answer is a replay too.
	for replays.Load() == 0 {
		if g := replayOf(t, srv.URL, key, size); g.status != http.StatusOK || g.err != nil || g.n != size {
			t.Fatalf("replay: %d, %d bytes, %v", g.status, g.n, g.err)
		}
	}
	nettest.DialStalled(t, srv.Listener.Addr().String(), fmt.Sprintf(
		"POST /report?size=%d HTTP/1.1\r\nHost: 127.0.0.1\r\nIdempotency-Key: %s\r\nContent-Length: 2\r\n\r\n{}", size, key))
	deadline := time.Now().Add(10 * time.Second)
	for replays.Load() < 2 {
		if time.Now().After(deadline) {
			t.Fatal("the replay to a client that stopped reading still runs after 10s (ClientWriteTimeout 300ms)")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if n := app.count(key); n != 1 {
		t.Fatalf("the handler ran %d times, want 1", n)
	}
}
