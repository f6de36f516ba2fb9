package idemhttp_test

// The work belongs to the key, not to the connection: what the middleware
// does when the client leaves before the key is acquired, while the
// handler runs, and while the response streams.

import (
	"bufio"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/memstore"
)

// untilFinal repeats a request, as a client honouring 409 and Retry-After
// would (with shorter pauses), until the answer is something else.
func untilFinal(t *testing.T, s *server, path, key, body string) answer {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		a := s.do(t, "POST", path, key, body)
		if a.status != http.StatusConflict {
			return a
		}
		if a.header.Get("Retry-After") == "" {
			t.Fatalf("409 without Retry-After: %s", a.body)
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: still 409 after 10s", key)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// timeOut sends a keyed POST from a client that gives up after d, and
// fails the test if an answer came back.
func timeOut(t *testing.T, s *server, path, key, body string, d time.Duration) {
	t.Helper()
	client := &http.Client{Timeout: d}
	req, _ := http.NewRequest("POST", s.URL+path, strings.NewReader(body))
	req.Header.Set(idemhttp.HeaderKey, key)
	if resp, err := client.Do(req); err == nil {
		resp.Body.Close()
		t.Fatalf("got %d from a client that should have timed out", resp.StatusCode)
	}
}

// provider stands for a downstream service (a payment provider) that a
// handler calls with r.Context(), as idiomatic Go does: it acts after
// delay unless the context ends first.
type provider struct {
	delay     time.Duration
	effects   atomic.Int64
	abandoned atomic.Int64 // calls whose context ended before they acted
	causes    chan error   // context.Cause after each call
}

func (p *provider) handler(w http.ResponseWriter, r *http.Request) {
	select {
	case <-time.After(p.delay):
		p.effects.Add(1)
	case <-r.Context().Done():
		p.abandoned.Add(1)
		p.causes <- context.Cause(r.Context())
		w.WriteHeader(http.StatusBadGateway)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"payment":%q}`, rand.Text()) // unique per execution
}

func TestClientTimeoutWorkRunsToEnd(t *testing.T) {
	eachStore(t, func(t *testing.T, store idem.Store) {
		p := &provider{delay: 400 * time.Millisecond, causes: make(chan error, 10)}
		s := newServer(t, store, idemhttp.Config{}, p.handler)
		timeOut(t, s, "/pay", "timeout-1", "{}", 100*time.Millisecond)
		first := untilFinal(t, s, "/pay", "timeout-1", "{}")
		again := s.do(t, "POST", "/pay", "timeout-1", "{}")
		if first.status != http.StatusCreated || first.header.Get(idemhttp.HeaderReplayed) != "true" || again.body != first.body {
			t.Fatalf("retries: got %d replayed=%q %s and then %s, want two identical replays of a 201",
				first.status, first.header.Get(idemhttp.HeaderReplayed), first.body, again.body)
		}
		if e, a, runs := p.effects.Load(), p.abandoned.Load(), s.runs.Load(); e != 1 || a != 0 || runs != 1 {
			t.Fatalf("got %d effects, %d abandoned calls and %d executions, want 1, 0 and 1", e, a, runs)
		}
	})
}

func TestClientLeavesMidBody(t *testing.T) {
	eachStore(t, func(t *testing.T, store idem.Store) {
		const chunks = 200 // about 200 KB: more than the sockets buffer
		release := make(chan struct{})
		var writeErrs atomic.Int64
		s := newServer(t, store, idemhttp.Config{}, func(w http.ResponseWriter, r *http.Request) {
			nonce := rand.Text()
			w.WriteHeader(http.StatusCreated)
			for i := range chunks {
				if i == 1 {
					<-release
				}
				if _, err := fmt.Fprintf(w, "%s %04d %s\n", nonce, i, strings.Repeat("x", 1000)); err != nil {
					writeErrs.Add(1)
				}
				if err := http.NewResponseController(w).Flush(); err != nil {
					writeErrs.Add(1)
				}
			}
		})
		conn, err := net.Dial("tcp", s.Listener.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		io.WriteString(conn, "POST /report HTTP/1.1\r\nHost: 127.0.0.1\r\nIdempotency-Key: mid-1\r\nContent-Length: 2\r\n\r\n{}")
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := resp.Body.Read(make([]byte, 100)); err != nil {
			t.Fatal(err)
		}
		conn.(*net.TCPConn).SetLinger(0)
		conn.Close()
		close(release)

		a := untilFinal(t, s, "/report", "mid-1", "{}")
		if a.status != http.StatusCreated || a.header.Get(idemhttp.HeaderReplayed) != "true" || strings.Count(a.body, "\n") != chunks {
			t.Fatalf("retry: got %d replayed=%q with %d lines, want a replay of all %d", a.status, a.header.Get(idemhttp.HeaderReplayed), strings.Count(a.body, "\n"), chunks)
		}
		if n, runs := writeErrs.Load(), s.runs.Load(); n != 0 || runs != 1 {
			t.Fatalf("got %d write errors in the handler and %d executions, want 0 and 1", n, runs)
		}
	})
}

// The old behaviour, behind an option documented as unsafe.
func TestCancelOnDisconnect(t *testing.T) {
	p := &provider{delay: 2 * time.Second, causes: make(chan error, 10)}
	s := newServer(t, memstore.New(memstore.Options{}), idemhttp.Config{CancelOnDisconnect: true}, p.handler)
	timeOut(t, s, "/pay", "cancel-1", "{}", 100*time.Millisecond)
	select {
	case cause := <-p.causes:
		if !errors.Is(cause, context.Canceled) {
			t.Fatalf("cause: got %v, want context.Canceled", cause)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the handler's context was not cancelled when the client left")
	}
	p.delay = 0
	if a := untilFinal(t, s, "/pay", "cancel-1", "{}"); a.status != http.StatusCreated || a.header.Get(idemhttp.HeaderReplayed) != "" || s.runs.Load() != 2 {
		t.Fatalf("retry: got %d replayed=%q after %d executions, want a fresh 201 and 2", a.status, a.header.Get(idemhttp.HeaderReplayed), s.runs.Load())
	}
}

func TestMaxExecutionAndStopContext(t *testing.T) {
	stop, cancelStop := context.WithCancel(context.Background())
	defer cancelStop()
	for _, c := range []struct {
		name  string
		cfg   idemhttp.Config
		after func()
		want  error
	}{
		{"MaxExecution", idemhttp.Config{MaxExecution: 50 * time.Millisecond}, func() {}, idem.ErrMaxExecution},
		{"StopContext", idemhttp.Config{StopContext: stop}, cancelStop, idem.ErrStopped},
	} {
		t.Run(c.name, func(t *testing.T) {
			p := &provider{delay: 10 * time.Second, causes: make(chan error, 10)}
			store := memstore.New(memstore.Options{})
			s := newServer(t, store, c.cfg, p.handler)
			done := s.goDo(t, "POST", "/pay", "k", "{}")
			time.AfterFunc(100*time.Millisecond, c.after)
			if a := <-done; a.status != http.StatusBadGateway {
				t.Fatalf("got %d, want the handler's 502", a.status)
			}
			if cause := <-p.causes; !errors.Is(cause, c.want) {
				t.Fatalf("cause: got %v, want %v", cause, c.want)
			}
			// The handler's 502 released the key: a retry runs it again. It
			// goes to a server whose StopContext is not done (as after a
			// restart): under a done one, its context would be cancelled at
			// once too.
			p.delay = 0
			again := newServer(t, store, idemhttp.Config{}, p.handler)
			if a := again.do(t, "POST", "/pay", "k", "{}"); a.status != http.StatusCreated || s.runs.Load()+again.runs.Load() != 2 {
				t.Fatalf("retry: got %d after %d executions, want 201 and 2", a.status, s.runs.Load()+again.runs.Load())
			}
		})
	}
}

// blockingStore holds Acquire until the request it serves has ended.
type blockingStore struct {
	idem.Store
	requestDone chan (<-chan struct{})
}

func (b blockingStore) Acquire(ctx context.Context, req idem.AcquireRequest) (idem.Acquisition, error) {
	select {
	case done := <-b.requestDone:
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			return idem.Acquisition{}, errors.New("test: the client did not leave within 10s")
		}
	default:
	}
	return b.Store.Acquire(ctx, req)
}

func TestClientGoneBeforeAcquire(t *testing.T) {
	eachStore(t, func(t *testing.T, store idem.Store) {
		bs := blockingStore{Store: store, requestDone: make(chan (<-chan struct{}), 1)}
		var runs atomic.Int64
		var outcomes sync.Map
		mw := idemhttp.Middleware(bs, idemhttp.Config{Logger: quietLogger(),
			OnOutcome: func(r *http.Request, o idemhttp.Outcome) { outcomes.Store(r.Header.Get("X-N"), o) }})
		h := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { runs.Add(1); w.WriteHeader(http.StatusCreated) }))
		s := &server{}
		s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Header.Get("X-N") == "1" {
				bs.requestDone <- r.Context().Done()
			}
			h.ServeHTTP(w, r)
		}))
		t.Cleanup(s.Close)
		client := &http.Client{Timeout: 100 * time.Millisecond}
		req, _ := http.NewRequest("POST", s.URL+"/pay", strings.NewReader("{}"))
		req.Header.Set(idemhttp.HeaderKey, "early-1")
		req.Header.Set("X-N", "1")
		if resp, err := client.Do(req); err == nil {
			resp.Body.Close()
			t.Fatalf("got %d from a client that should have timed out", resp.StatusCode)
		}
		// Nothing ran, and the key was released at once: a retry runs it.
		deadline := time.Now().Add(10 * time.Second)
		for o, _ := outcomes.Load("1"); o != idemhttp.OutcomeGone; o, _ = outcomes.Load("1") {
			if time.Now().After(deadline) {
				t.Fatalf("outcome of the gone client: got %v, want %v", o, idemhttp.OutcomeGone)
			}
			time.Sleep(10 * time.Millisecond)
		}
		if n := runs.Load(); n != 0 {
			t.Fatalf("handler ran %d times for a client gone before the acquire, want 0", n)
		}
		if a := s.do(t, "POST", "/pay", "early-1", "{}"); a.status != http.StatusCreated || runs.Load() != 1 {
			t.Fatalf("retry: got %d after %d executions, want 201 and 1", a.status, runs.Load())
		}
	})
}

// A Transport whose attempts time out retries with the same key, as
// urllib3 does after a read timeout, and ends with the first attempt's
// stored response.
func TestTransportAttemptTimeout(t *testing.T) {
	eachStore(t, func(t *testing.T, store idem.Store) {
		p := &provider{delay: 500 * time.Millisecond, causes: make(chan error, 10)}
		s := newServer(t, store, idemhttp.Config{}, p.handler)
		client := &http.Client{Transport: &idemhttp.Transport{AttemptTimeout: 100 * time.Millisecond,
			MinBackoff: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond, MaxAttempts: 20}}
		resp, err := client.Post(s.URL+"/pay", "application/json", strings.NewReader("{}"))
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusCreated || resp.Header.Get(idemhttp.HeaderReplayed) != "true" {
			t.Fatalf("got %d replayed=%q %s, want the replay of a 201", resp.StatusCode, resp.Header.Get(idemhttp.HeaderReplayed), body)
		}
		if e, runs := p.effects.Load(), s.runs.Load(); e != 1 || runs != 1 {
			t.Fatalf("got %d effects and %d executions, want 1 and 1", e, runs)
		}

		// With one attempt allowed, the timeout is the answer.
		client.Transport = &idemhttp.Transport{AttemptTimeout: 50 * time.Millisecond, MaxAttempts: 1}
		_, err = client.Post(s.URL+"/pay", "application/json", strings.NewReader("{}"))
		if err == nil || !strings.Contains(err.Error(), "idemhttp: attempt timed out after 50ms") {
			t.Fatalf("one attempt: got error %v, want the attempt timeout", err)
		}
	})
}

// AttemptTimeout bounds the wait for the response headers, not the body.
func TestTransportAttemptTimeoutSparesTheBody(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
		http.NewResponseController(w).Flush()
		time.Sleep(200 * time.Millisecond)
		io.WriteString(w, "late body")
	}))
	defer srv.Close()
	client := &http.Client{Transport: &idemhttp.Transport{AttemptTimeout: 50 * time.Millisecond}}
	resp, err := client.Post(srv.URL, "text/plain", strings.NewReader("x"))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if body, err := io.ReadAll(resp.Body); err != nil || string(body) != "late body" {
		t.Fatalf("body: got %q, %v, want %q", body, err, "late body")
	}
}
