package idemhttp_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/redisserver"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/redisstore"
)

var redisSrv *redisserver.Server

func TestMain(m *testing.M) { os.Exit(redistest.Run(m, &redisSrv)) }

// eachStore runs f against memstore and against the real Redis store.
func eachStore(t *testing.T, f func(t *testing.T, store idem.Store)) {
	t.Run("memstore", func(t *testing.T) { f(t, memstore.New(memstore.Options{})) })
	t.Run("redis", func(t *testing.T) { f(t, redistest.Store(t, redisSrv, redisstore.Options{})) })
}

// server is a test API behind the middleware; runs counts handler
// executions.
type server struct {
	*httptest.Server
	runs atomic.Int64
}

func newServer(t *testing.T, store idem.Store, cfg idemhttp.Config, h http.HandlerFunc) *server {
	s := &server{}
	mux := http.NewServeMux()
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		s.runs.Add(1)
		h(w, r)
	})
	s.Server = httptest.NewUnstartedServer(idemhttp.Middleware(store, cfg)(mux))
	s.Config.ErrorLog = quietStdLogger() // panicking handlers are expected
	s.Start()
	t.Cleanup(s.Close)
	return s
}

// charge is a handler that answers 201 with a body naming the request.
func charge(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	lease, _ := idem.LeaseFromContext(r.Context())
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Token", strconv.FormatUint(lease.Token, 10))
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"charged":%q,"auth":%q}`, body, r.Header.Get("Authorization"))
}

type answer struct {
	status int
	header http.Header
	body   string
}

func (s *server) do(t testing.TB, method, path, key, body string, header ...string) answer {
	t.Helper()
	a, err := s.try(method, path, key, body, header...)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// try is do for goroutines other than the test's: it returns the error.
func (s *server) try(method, path, key, body string, header ...string) (answer, error) {
	req, err := http.NewRequest(method, s.URL+path, strings.NewReader(body))
	if err != nil {
		return answer{}, err
	}
	if key != "" {
		req.Header.Set(idemhttp.HeaderKey, key)
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Add(header[i], header[i+1])
	}
	resp, err := s.Client().Do(req)
	if err != nil {
		return answer{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return answer{resp.StatusCode, resp.Header, string(b)}, err
}

// raw sends one POST over its own TCP connection, with header lines
// written as given (net/http's client refuses control bytes, and resends an
// Idempotency-Key request once when the connection dies). It returns the
// status, or 0 when the connection ended without a response.
func (s *server) raw(t *testing.T, path string, headerLines ...string) int {
	t.Helper()
	conn, err := net.Dial("tcp", s.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	req := "POST " + path + " HTTP/1.1\r\nHost: test\r\nContent-Length: 2\r\nConnection: close\r\n"
	for _, l := range headerLines {
		req += l + "\r\n"
	}
	if _, err := io.WriteString(conn, req+"\r\n{}"); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		return 0
	}
	resp.Body.Close()
	return resp.StatusCode
}

// goDo runs a request in another goroutine and delivers its answer.
func (s *server) goDo(t *testing.T, method, path, key, body string) <-chan answer {
	ch := make(chan answer, 1)
	go func() {
		a, err := s.try(method, path, key, body)
		if err != nil {
			t.Error(err)
		}
		ch <- a
	}()
	return ch
}

// Without a wait (Config.Wait negative), copies that meet the key in
// flight get 409 at once; the one execution's response is replayed to the
// rest.
func TestConcurrentDuplicates(t *testing.T) {
	eachStore(t, func(t *testing.T, store idem.Store) {
		var release = make(chan struct{})
		counted := &countingStore{Store: store}
		s := newServer(t, counted, idemhttp.Config{Wait: -1}, func(w http.ResponseWriter, r *http.Request) {
			<-release // hold the first request so the others meet it in flight
			charge(w, r)
		})
		const n = 200
		answers := make([]answer, n)
		var wg sync.WaitGroup
		for i := range n {
			wg.Go(func() { answers[i] = <-s.goDo(t, "POST", "/charges", "dup-1", `{"amount":1000}`) })
		}
		for deadline := time.Now().Add(10 * time.Second); counted.inFlight.Load() == 0 && time.Now().Before(deadline); {
			time.Sleep(time.Millisecond) // until a copy met the key in flight
		}
		time.Sleep(100 * time.Millisecond)
		close(release)
		wg.Wait()
		if got := s.runs.Load(); got != 1 {
			t.Fatalf("handler executions: got %d, want 1", got)
		}
		var first *answer
		conflicts, replays := 0, 0
		for i := range answers {
			a := &answers[i]
			switch {
			case a.status == http.StatusConflict:
				conflicts++
				if a.header.Get("Retry-After") == "" || a.header.Get("Content-Type") != "application/problem+json" {
					t.Errorf("409 without Retry-After or problem+json: %v", a.header)
				}
			case a.status == http.StatusCreated && a.header.Get(idemhttp.HeaderReplayed) == "":
				if first != nil {
					t.Fatal("two original (non-replayed) answers")
				}
				first = a
			case a.status == http.StatusCreated:
				replays++
			default:
				t.Fatalf("unexpected answer %d %q", a.status, a.body)
			}
		}
		if first == nil {
			t.Fatal("no original answer")
		}
		for _, a := range answers {
			if a.status == http.StatusCreated && (a.body != first.body || a.header.Get("X-Token") != first.header.Get("X-Token") ||
				a.header.Get("Content-Type") != first.header.Get("Content-Type")) {
				t.Fatalf("replay differs: got %q %v, want %q %v", a.body, a.header, first.body, first.header)
			}
		}
		// Later repeats are replays, byte for byte.
		again := s.do(t, "POST", "/charges", "dup-1", `{"amount":1000}`)
		if again.status != 201 || again.body != first.body || again.header.Get(idemhttp.HeaderReplayed) != "true" {
			t.Fatalf("later repeat: got %d %q %v, want a replay of %q", again.status, again.body, again.header, first.body)
		}
		if conflicts == 0 {
			t.Error("no 409: the copies waited, want 409 at once with Wait negative")
		}
		t.Logf("%d requests: 1 execution, %d replays, %d conflicts", n, replays, conflicts)
	})
}

// With the zero Config, a copy that meets its key in flight waits up to
// DefaultWait: it gets the replay of work that ends within it, and 409
// only for work that outlasts it. Wait negative is 409 at once.
func TestDefaultWait(t *testing.T) {
	eachStore(t, func(t *testing.T, store idem.Store) {
		started, finish := make(chan struct{}, 1), make(chan struct{})
		handler := func(w http.ResponseWriter, r *http.Request) {
			started <- struct{}{}
			<-finish
			charge(w, r)
		}
		s := newServer(t, store, idemhttp.Config{}, handler)

		// Work that ends within the wait: the copy gets its replay.
		first := s.goDo(t, "POST", "/charges", "short", "{}")
		<-started
		copyDone := s.goDo(t, "POST", "/charges", "short", "{}")
		time.Sleep(idemhttp.DefaultWait / 5) // the copy waits
		finish <- struct{}{}
		f, c := <-first, <-copyDone
		if c.status != http.StatusCreated || c.body != f.body || c.header.Get(idemhttp.HeaderReplayed) != "true" {
			t.Fatalf("copy while the work runs: got %d %q %v, want the replay of %q", c.status, c.body, c.header, f.body)
		}

		// Work that outlasts the wait: 409, after the wait.
		long := s.goDo(t, "POST", "/charges", "long", "{}")
		<-started
		begin := time.Now()
		a := s.do(t, "POST", "/charges", "long", "{}")
		if waited := time.Since(begin); a.status != http.StatusConflict || waited < idemhttp.DefaultWait {
			t.Fatalf("copy of long work: got %d after %v, want 409 after the %v wait", a.status, waited, idemhttp.DefaultWait)
		}

		// Wait negative: 409 at once, while the same work still runs
		// (one store check; a waiting copy of this other middleware, which
		// does not see the holder, would ask again and again).
		counted := &countingStore{Store: store}
		now := newServer(t, counted, idemhttp.Config{Wait: -1}, handler)
		if a = now.do(t, "POST", "/charges", "long", "{}"); a.status != http.StatusConflict || counted.inFlight.Load() != 1 {
			t.Fatalf("Wait -1: got %d after %d store checks, want 409 after one", a.status, counted.inFlight.Load())
		}
		finish <- struct{}{}
		<-long
		if n := s.runs.Load(); n != 2 {
			t.Fatalf("executions: got %d, want 2 (one per key)", n)
		}
	})
}

func TestMismatch(t *testing.T) {
	eachStore(t, func(t *testing.T, store idem.Store) {
		s := newServer(t, store, idemhttp.Config{}, charge)
		s.do(t, "POST", "/charges", "k", `{"amount":1000}`)
		for _, c := range []struct{ path, body string }{
			{"/charges", `{"amount":9999}`},
			{"/charges?x=1", `{"amount":1000}`},
		} {
			a := s.do(t, "POST", c.path, "k", c.body)
			if a.status != http.StatusUnprocessableEntity || !strings.Contains(a.body, idemhttp.ProblemMismatch) {
				t.Errorf("%s %s: got %d %q, want 422 %s", c.path, c.body, a.status, a.body, idemhttp.ProblemMismatch)
			}
		}
		// Another Content-Type with the same bytes is another request too.
		a := s.do(t, "POST", "/charges", "k", `{"amount":1000}`, "Content-Type", "text/plain")
		if a.status != http.StatusUnprocessableEntity {
			t.Errorf("other Content-Type: got %d, want 422", a.status)
		}
		if got := s.runs.Load(); got != 1 {
			t.Fatalf("handler executions: got %d, want 1", got)
		}
	})
}

func TestBadKeys(t *testing.T) {
	store := memstore.New(memstore.Options{})
	required := newServer(t, store, idemhttp.Config{RequireKeyFunc: func(r *http.Request) bool {
		return strings.HasPrefix(r.URL.Path, "/charges")
	}}, charge)
	if a := required.do(t, "POST", "/charges", "", "{}"); a.status != 400 || !strings.Contains(a.body, idemhttp.ProblemKeyMissing) {
		t.Errorf("missing key on a required route: got %d %q, want 400 %s", a.status, a.body, idemhttp.ProblemKeyMissing)
	}
	if a := required.do(t, "POST", "/other", "", "{}"); a.status != 201 || a.header.Get(idemhttp.HeaderReplayed) != "" {
		t.Errorf("missing key on an optional route: got %d, want the handler's 201", a.status)
	}
	if a := required.do(t, "GET", "/charges", "", ""); a.status != 201 {
		t.Errorf("GET passes through: got %d, want the handler's 201", a.status)
	}
	bad := map[string][]string{
		"too long":        {strings.Repeat("k", 256)},
		"non-ASCII":       {"caf\xc3\xa9"},
		"control byte":    {"a\x01b"},
		"DEL byte":        {"a\x7fb"},
		"two headers":     {"a", "b"},
		"space in token":  {"a b"},
		"bad sf-string":   {`"unterminated`},
		"bad escape":      {`"a\nb"`},
		"after the quote": {`"a"b`},
		"empty string":    {`""`},
	}
	before := required.runs.Load()
	for name, values := range bad {
		var lines []string
		for _, v := range values {
			lines = append(lines, idemhttp.HeaderKey+": "+v)
		}
		if got := required.raw(t, "/charges", lines...); got != 400 {
			t.Errorf("%s: got %d, want 400", name, got)
		}
	}
	if got := required.runs.Load() - before; got != 0 {
		t.Errorf("handler ran %d times for bad keys, want 0", got)
	}
	a := required.do(t, "POST", "/charges", strings.Repeat("k", 256), "{}")
	if a.status != 400 || !strings.Contains(a.body, idemhttp.ProblemKeyInvalid) || a.header.Get("Content-Type") != "application/problem+json" {
		t.Errorf("key too long: got %d %q, want 400 problem+json %s", a.status, a.body, idemhttp.ProblemKeyInvalid)
	}
	// A quoted key and the same bare key are the same key.
	required.do(t, "POST", "/charges", `"k-1"`, "{}")
	if a := required.do(t, "POST", "/charges", "k-1", "{}"); a.header.Get(idemhttp.HeaderReplayed) != "true" {
		t.Errorf(`"k-1" then k-1: got %d without a replay, want a replay`, a.status)
	}
}

// ParseKey's errors: a missing key is idem.ErrMissingKey, a bad one
// idem.ErrInvalidKey, never both.
func TestParseKeyErrors(t *testing.T) {
	if _, err := idemhttp.ParseKey(http.Header{}); !errors.Is(err, idem.ErrMissingKey) || errors.Is(err, idem.ErrInvalidKey) {
		t.Errorf("no header: got %v, want idem.ErrMissingKey", err)
	}
	for _, v := range []string{"", "a b", `"unterminated`, "caf\xc3\xa9"} {
		if _, err := idemhttp.ParseKey(http.Header{idemhttp.HeaderKey: {v}}); !errors.Is(err, idem.ErrInvalidKey) || errors.Is(err, idem.ErrMissingKey) {
			t.Errorf("%q: got %v, want idem.ErrInvalidKey", v, err)
		}
	}
}

func TestBodyTooLarge(t *testing.T) {
	eachStore(t, func(t *testing.T, store idem.Store) {
		s := newServer(t, store, idemhttp.Config{MaxBodySize: 100}, charge)
		a := s.do(t, "POST", "/charges", "big", strings.Repeat("x", 101))
		if a.status != http.StatusRequestEntityTooLarge || !strings.Contains(a.body, idemhttp.ProblemBodyTooLarge) {
			t.Fatalf("got %d %q, want 413", a.status, a.body)
		}
		if s.runs.Load() != 0 {
			t.Fatal("handler ran for a body over the limit")
		}
		// Nothing was stored: the same key with a small body runs.
		if a := s.do(t, "POST", "/charges", "big", "ok"); a.status != 201 || a.header.Get(idemhttp.HeaderReplayed) != "" {
			t.Fatalf("same key, small body: got %d %v, want a first execution", a.status, a.header)
		}
		// Chunked (no Content-Length) over the limit: also 413.
		req, _ := http.NewRequest("POST", s.URL+"/charges", io.MultiReader(strings.NewReader(strings.Repeat("y", 150))))
		req.ContentLength = -1
		req.Header.Set(idemhttp.HeaderKey, "chunked")
		resp, err := s.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusRequestEntityTooLarge {
			t.Fatalf("chunked body over the limit: got %d, want 413", resp.StatusCode)
		}
		// As after http.MaxBytesReader's limit: the server closes the
		// connection, whose rest of the body is not read.
		if !resp.Close {
			t.Errorf("chunked body over the limit: the connection stays open (%v), want Connection: close", resp.Header)
		}
	})
}

func TestTenantsIsolated(t *testing.T) {
	eachStore(t, func(t *testing.T, store idem.Store) {
		s := newServer(t, store, idemhttp.Config{}, charge)
		a := s.do(t, "POST", "/charges", "shared", "{}", "Authorization", "Bearer tenant-a")
		b := s.do(t, "POST", "/charges", "shared", "{}", "Authorization", "Bearer tenant-b")
		if b.header.Get(idemhttp.HeaderReplayed) != "" || strings.Contains(b.body, "tenant-a") {
			t.Fatalf("tenant B got %q %v, want its own execution, never A's body %q", b.body, b.header, a.body)
		}
		if s.runs.Load() != 2 {
			t.Fatalf("executions: got %d, want 2", s.runs.Load())
		}
		if again := s.do(t, "POST", "/charges", "shared", "{}", "Authorization", "Bearer tenant-a"); again.body != a.body {
			t.Fatalf("tenant A's repeat: got %q, want %q", again.body, a.body)
		}
	})
}

func TestReplayDropsHeaders(t *testing.T) {
	eachStore(t, func(t *testing.T, store idem.Store) {
		s := newServer(t, store, idemhttp.Config{ReplayHeaderDenylist: []string{"X-Secret"}}, func(w http.ResponseWriter, r *http.Request) {
			http.SetCookie(w, &http.Cookie{Name: "session", Value: "s3cr3t"})
			w.Header().Set("X-Secret", "private")
			w.Header().Set("X-Kept", "yes")
			w.Header().Set("Connection", "X-Hop")
			w.Header().Set("X-Hop", "1")
			w.Write([]byte("done"))
		})
		first := s.do(t, "POST", "/x", "cookie", "")
		if first.header.Get("Set-Cookie") == "" || first.header.Get("X-Secret") == "" {
			t.Fatalf("first answer lost its own headers: %v", first.header)
		}
		again := s.do(t, "POST", "/x", "cookie", "")
		if again.header.Get(idemhttp.HeaderReplayed) != "true" {
			t.Fatalf("not a replay: %v", again.header)
		}
		for _, h := range []string{"Set-Cookie", "X-Secret", "X-Hop"} {
			if v := again.header.Get(h); v != "" {
				t.Errorf("replay carries %s: %q", h, v)
			}
		}
		if again.header.Get("X-Kept") != "yes" || again.body != "done" {
			t.Errorf("replay: got %v %q, want X-Kept and body done", again.header, again.body)
		}
	})
}

func TestReleaseOnFailureAndPanic(t *testing.T) {
	eachStore(t, func(t *testing.T, store idem.Store) {
		var fail atomic.Value
		fail.Store("5xx")
		s := newServer(t, store, idemhttp.Config{Logger: quietLogger()}, func(w http.ResponseWriter, r *http.Request) {
			switch fail.Load() {
			case "5xx":
				http.Error(w, "upstream down", http.StatusBadGateway)
			case "panic":
				panic("handler bug")
			case "429":
				w.WriteHeader(http.StatusTooManyRequests)
			default:
				charge(w, r)
			}
		})
		if a := s.do(t, "POST", "/x", "k", ""); a.status != 502 {
			t.Fatalf("got %d, want 502", a.status)
		}
		fail.Store("429")
		if a := s.do(t, "POST", "/x", "k", ""); a.status != 429 {
			t.Fatalf("after a 502 the retry ran? got %d, want the handler's 429", a.status)
		}
		fail.Store("panic")
		if got := s.raw(t, "/x", idemhttp.HeaderKey+": k"); got != 0 {
			t.Fatalf("panicking handler: got %d, want the connection aborted", got)
		}
		fail.Store("ok")
		if a := s.do(t, "POST", "/x", "k", ""); a.status != 201 || a.header.Get(idemhttp.HeaderReplayed) != "" {
			t.Fatalf("after a panic the retry: got %d %v, want a first execution", a.status, a.header)
		}
		if got := s.runs.Load(); got != 4 {
			t.Fatalf("executions: got %d, want 4 (502, 429, panic, 201)", got)
		}
	})
}

func TestCapture(t *testing.T) {
	cases := map[string]struct {
		h          http.HandlerFunc
		wantStatus int
		wantBody   string
	}{
		"writes nothing": {func(w http.ResponseWriter, r *http.Request) {}, 200, ""},
		"header only": {func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(http.StatusAccepted)
		}, 202, ""},
		"WriteHeader twice": {func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(http.StatusCreated)
			w.WriteHeader(http.StatusOK)
			io.WriteString(w, "a")
		}, 201, "a"},
		"late WriteHeader": {func(w http.ResponseWriter, r *http.Request) {
			io.WriteString(w, "b")
			w.WriteHeader(http.StatusTeapot)
		}, 200, "b"},
		"1xx then final": {func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Link", "</a.css>; rel=preload")
			w.WriteHeader(http.StatusEarlyHints)
			w.WriteHeader(http.StatusCreated)
			io.WriteString(w, "c")
		}, 201, "c"},
		"flushed stream": {func(w http.ResponseWriter, r *http.Request) {
			for i := range 3 {
				fmt.Fprintf(w, "part%d;", i)
				http.NewResponseController(w).Flush()
			}
		}, 200, "part0;part1;part2;"},
		"flushed before the body": {func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(http.StatusCreated)
			http.NewResponseController(w).Flush() // no Content-Type is sniffed
			io.WriteString(w, "<html>late</html>")
		}, 201, "<html>late</html>"},
		"sniffed type": {func(w http.ResponseWriter, r *http.Request) {
			io.WriteString(w, "<html>hi</html>")
		}, 200, "<html>hi</html>"},
		"204 with a body": {func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(http.StatusNoContent)
			io.WriteString(w, "dropped by net/http")
		}, 204, ""},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			s := newServer(t, memstore.New(memstore.Options{}), idemhttp.Config{}, c.h)
			first := s.do(t, "POST", "/", "k", "")
			again := s.do(t, "POST", "/", "k", "")
			if first.status != c.wantStatus || first.body != c.wantBody {
				t.Errorf("first: got %d %q, want %d %q", first.status, first.body, c.wantStatus, c.wantBody)
			}
			if again.status != c.wantStatus || again.body != c.wantBody || again.header.Get(idemhttp.HeaderReplayed) != "true" {
				t.Errorf("replay: got %d %q %v, want %d %q replayed", again.status, again.body, again.header, c.wantStatus, c.wantBody)
			}
			// The same header, but for the replay mark, the date and the
			// framing (a flushed original is chunked, its replay is not).
			strip := func(h http.Header) http.Header {
				h = h.Clone()
				for _, name := range []string{"Date", "Content-Length", "Transfer-Encoding", idemhttp.HeaderReplayed} {
					delete(h, name)
				}
				return h
			}
			if got, want := strip(again.header), strip(first.header); !reflect.DeepEqual(got, want) {
				t.Errorf("replay header: got %v, want %v", got, want)
			}
			if s.runs.Load() != 1 {
				t.Errorf("executions: got %d, want 1", s.runs.Load())
			}
		})
	}
}

// A response larger than MaxResponseSize, without a blob store: the first
// client gets all of it; the work never runs again; a replay is a 500
// problem that says the request ran, with what status, and why its body
// is gone (never a 2xx with an empty body); the omission is logged once
// per route and counted for every response.
func TestLargeResponseNotRerun(t *testing.T) {
	eachStore(t, func(t *testing.T, store idem.Store) {
		big := strings.Repeat("z", 2000)
		var logs logRecorder
		var omitted atomic.Int64
		var outcomes sync.Map // idemhttp.Outcome -> *atomic.Int64
		cfg := idemhttp.Config{MaxResponseSize: 1000, Logger: slog.New(&logs),
			OnBodyOmitted: func(*http.Request) { omitted.Add(1) },
			OnOutcome: func(_ *http.Request, o idemhttp.Outcome) {
				n, _ := outcomes.LoadOrStore(o, new(atomic.Int64))
				n.(*atomic.Int64).Add(1)
			}}
		mux := http.NewServeMux()
		var runs atomic.Int64
		mux.HandleFunc("POST /reports/{id}", func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			w.Header().Set("Content-Type", "text/plain")
			w.Header().Set("Location", "/reports/"+r.PathValue("id"))
			w.Header().Set("Content-Length", strconv.Itoa(len(big)))
			w.WriteHeader(http.StatusCreated)
			io.WriteString(w, big)
		})
		s := &server{Server: httptest.NewServer(idemhttp.Middleware(store, cfg)(mux))}
		t.Cleanup(s.Close)

		for _, id := range []string{"1", "2"} { // two omissions on one route
			if first := s.do(t, "POST", "/reports/"+id, "k"+id, ""); first.status != http.StatusCreated || first.body != big ||
				first.header.Get(idemhttp.HeaderBodyOmitted) != "" {
				t.Fatalf("first answer: got %d, %d bytes, %v; want 201 with the full %d bytes", first.status, len(first.body), first.header, len(big))
			}
		}
		for range 2 { // a retry gets the same answer every time
			again := s.do(t, "POST", "/reports/1", "k1", "")
			if again.status != http.StatusInternalServerError || again.header.Get("Content-Type") != "application/problem+json" ||
				again.header.Get(idemhttp.HeaderReplayed) != "true" || again.header.Get(idemhttp.HeaderBodyOmitted) != "true" ||
				again.header.Get(idemhttp.HeaderOriginalStatus) != "201" {
				t.Fatalf("replay: got %d %v; want 500 problem+json, replayed, body omitted, original status 201", again.status, again.header)
			}
			var p map[string]any
			if err := json.Unmarshal([]byte(again.body), &p); err != nil {
				t.Fatalf("replay body %q: %v", again.body, err)
			}
			detail, _ := p["detail"].(string)
			if p["type"] != idemhttp.ProblemResponseNotKept || p["status"] != 500.0 || p["status_executed"] != 201.0 ||
				!strings.Contains(detail, "executed") || !strings.Contains(detail, "no blob store") || !strings.Contains(detail, "larger than the limit") {
				t.Errorf("replay problem: got %s, want type %s, status 500, status_executed 201 and a detail saying it ran and why", again.body,
					idemhttp.ProblemResponseNotKept)
			}
		}
		if n := runs.Load(); n != 2 {
			t.Errorf("executions: got %d, want 2 (one per key)", n)
		}
		if n := omitted.Load(); n != 2 {
			t.Errorf("OnBodyOmitted: called %d times, want 2", n)
		}
		count := func(o idemhttp.Outcome) int64 {
			if n, ok := outcomes.Load(o); ok {
				return n.(*atomic.Int64).Load()
			}
			return 0
		}
		if count(idemhttp.OutcomeExecuted) != 2 || count(idemhttp.OutcomeReplayed) != 2 {
			t.Errorf("outcomes: executed %d, replayed %d; want 2 and 2", count(idemhttp.OutcomeExecuted), count(idemhttp.OutcomeReplayed))
		}
		warns := logs.matching(slog.LevelWarn, "stored without its body")
		if len(warns) != 1 {
			t.Fatalf("got %d warnings of an omitted body, want 1 for the route: %v", len(warns), logs.all())
		}
		if w := warns[0]; w["route"] != "POST /reports/{id}" || w["max_response_size"] != "1000" ||
			!strings.Contains(w["msg"], "Blobs") || !strings.Contains(w["msg"], "--blob") || !strings.Contains(w["msg"], "MaxResponseSize") {
			t.Errorf("warning: got %v, want the route, the limit and the fix", w)
		}
	})
}

// logRecorder is a slog.Handler that keeps every record, its attributes
// as strings.
type logRecorder struct {
	mu   sync.Mutex
	recs []map[string]string
	lvls []slog.Level
}

func (l *logRecorder) Enabled(context.Context, slog.Level) bool { return true }
func (l *logRecorder) WithAttrs([]slog.Attr) slog.Handler       { return l }
func (l *logRecorder) WithGroup(string) slog.Handler            { return l }
func (l *logRecorder) Handle(_ context.Context, r slog.Record) error {
	m := map[string]string{"msg": r.Message}
	r.Attrs(func(a slog.Attr) bool {
		m[a.Key] = a.Value.String()
		return true
	})
	l.mu.Lock()
	defer l.mu.Unlock()
	l.recs = append(l.recs, m)
	l.lvls = append(l.lvls, r.Level)
	return nil
}

// matching returns the records of level whose message contains msg.
func (l *logRecorder) matching(level slog.Level, msg string) []map[string]string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []map[string]string
	for i, r := range l.recs {
		if l.lvls[i] == level && strings.Contains(r["msg"], msg) {
			out = append(out, r)
		}
	}
	return out
}

func (l *logRecorder) all() []map[string]string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.recs)
}

func TestWaitForInFlight(t *testing.T) {
	eachStore(t, func(t *testing.T, store idem.Store) {
		started := make(chan struct{})
		s := newServer(t, store, idemhttp.Config{Wait: 5 * time.Second}, func(w http.ResponseWriter, r *http.Request) {
			close(started)
			time.Sleep(200 * time.Millisecond)
			charge(w, r)
		})
		firstDone := s.goDo(t, "POST", "/charges", "w", "{}")
		<-started
		waited := s.do(t, "POST", "/charges", "w", "{}")
		first := <-firstDone
		if waited.status != 201 || waited.body != first.body || waited.header.Get(idemhttp.HeaderReplayed) != "true" {
			t.Fatalf("waiting duplicate: got %d %q %v, want the replay of %q", waited.status, waited.body, waited.header, first.body)
		}
		if s.runs.Load() != 1 {
			t.Fatalf("executions: got %d, want 1", s.runs.Load())
		}
	})
	// The wait is bounded: past it, 409.
	started := make(chan struct{})
	unblock := make(chan struct{})
	s := newServer(t, memstore.New(memstore.Options{}), idemhttp.Config{Wait: 50 * time.Millisecond}, func(w http.ResponseWriter, r *http.Request) {
		close(started)
		<-unblock
	})
	slow := s.goDo(t, "POST", "/", "slow", "")
	<-started
	if a := s.do(t, "POST", "/", "slow", ""); a.status != http.StatusConflict {
		t.Fatalf("wait past its bound: got %d, want 409", a.status)
	}
	close(unblock)
	<-slow
}

func TestStoreDown(t *testing.T) {
	srv, err := redisserver.StartServer()
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Stop()
	for _, failOpen := range []bool{false, true} {
		t.Run(fmt.Sprintf("FailOpen=%t", failOpen), func(t *testing.T) {
			s := newServer(t, redistest.Store(t, srv, redisstore.Options{}), idemhttp.Config{FailOpen: failOpen, Logger: quietLogger()}, charge)
			if a := s.do(t, "POST", "/charges", "before", "{}"); a.status != 201 {
				t.Fatalf("Redis up: got %d, want 201", a.status)
			}
			srv.Kill()
			runs := s.runs.Load()
			a := s.do(t, "POST", "/charges", "during", "{}")
			switch {
			case failOpen && (a.status != 201 || s.runs.Load() != runs+1):
				t.Fatalf("Redis down, fail-open: got %d, want the handler's 201", a.status)
			case !failOpen && (a.status != 503 || a.header.Get("Retry-After") == "" || !strings.Contains(a.body, idemhttp.ProblemStoreUnavailable)):
				t.Fatalf("Redis down: got %d %v %q, want 503 with Retry-After", a.status, a.header, a.body)
			case !failOpen && s.runs.Load() != runs:
				t.Fatal("Redis down: the handler ran")
			}
			if err := srv.Restart(); err != nil {
				t.Fatal(err)
			}
			deadline := time.Now().Add(10 * time.Second)
			for {
				a := s.do(t, "POST", "/charges", "after", "{}")
				if a.status == 201 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("Redis back: still %d after 10s", a.status)
				}
				time.Sleep(50 * time.Millisecond)
			}
		})
	}
}

// A bounded memstore that is full refuses new keys: 503 with the
// store-full problem, the handler not run; completed keys still replay.
// With FailOpen the handler runs unprotected, as for any store failure.
func TestStoreFull(t *testing.T) {
	for _, failOpen := range []bool{false, true} {
		t.Run(fmt.Sprintf("FailOpen=%t", failOpen), func(t *testing.T) {
			store := memstore.New(memstore.Options{MaxBytes: 2 * memstore.RecordOverhead})
			var outcomes []idemhttp.Outcome
			var mu sync.Mutex
			// Without a quota: the default one (an eighth of the store per
			// tenant) would refuse the second key before the store fills.
			s := newServer(t, store, idemhttp.Config{Quota: idemhttp.NoQuota, FailOpen: failOpen, Logger: quietLogger(), OnOutcome: func(_ *http.Request, o idemhttp.Outcome) {
				mu.Lock()
				outcomes = append(outcomes, o)
				mu.Unlock()
			}}, charge)
			first := s.do(t, "POST", "/charges", "first", "{}")
			if first.status != 201 {
				t.Fatalf("first key: got %d, want 201", first.status)
			}
			runs := s.runs.Load()
			a := s.do(t, "POST", "/charges", "second", "{}")
			switch {
			case failOpen && (a.status != 201 || s.runs.Load() != runs+1):
				t.Fatalf("store full, fail-open: got %d, want the handler's 201", a.status)
			case !failOpen && (a.status != 503 || a.header.Get("Retry-After") != "1" || !strings.Contains(a.body, idemhttp.ProblemStoreFull) ||
				!strings.Contains(a.body, "takes no new key")):
				t.Fatalf("store full: got %d %v %q, want 503 store-full with Retry-After", a.status, a.header, a.body)
			case !failOpen && s.runs.Load() != runs:
				t.Fatal("store full: the handler ran")
			}
			again := s.do(t, "POST", "/charges", "first", "{}")
			if again.status != 201 || again.header.Get(idemhttp.HeaderReplayed) != "true" || again.body != first.body {
				t.Fatalf("completed key in a full store: got %d %q, want the replay of %q", again.status, again.body, first.body)
			}
			mu.Lock()
			defer mu.Unlock()
			if len(outcomes) != 3 || outcomes[1] != idemhttp.OutcomeStoreError {
				t.Fatalf("outcomes: got %v, want store_error for the refused key", outcomes)
			}
			if st := store.Stats(); st.Refused != 1 {
				t.Fatalf("refusals: got %d, want 1", st.Refused)
			}
		})
	}
}

func TestHandlerContext(t *testing.T) {
	type seen struct {
		lease idem.Lease
		ok    bool
	}
	ch := make(chan seen, 1)
	s := newServer(t, memstore.New(memstore.Options{}), idemhttp.Config{}, func(w http.ResponseWriter, r *http.Request) {
		l, ok := idem.LeaseFromContext(r.Context())
		ch <- seen{l, ok}
	})
	s.do(t, "POST", "/pay", "ctx-key", "")
	sn := <-ch
	got, ok := sn.lease, sn.ok
	want, _ := idem.Scope{Method: "POST", Route: "/"}.Key("ctx-key")
	if !ok || got.Key != want || got.Token == 0 {
		t.Fatalf("lease in the handler's context: got %+v (ok %t), want key %s (route = the mux pattern \"/\") and a token", got, ok, want)
	}
}

func TestConfigValidation(t *testing.T) {
	s := memstore.New(memstore.Options{})
	for _, cfg := range []idemhttp.Config{
		{MaxBodySize: -1}, {Methods: []string{"post"}}, {Lease: time.Millisecond},
	} {
		if _, err := idemhttp.NewMiddleware(s, cfg); err == nil {
			t.Errorf("NewMiddleware(%+v): got nil error, want one", cfg)
		}
	}
	if _, err := idemhttp.NewMiddleware(nil, idemhttp.Config{}); err == nil {
		t.Error("nil store: got nil error, want one")
	}
	var typedNil *redisstore.Store // as left by a failed redisstore.Open
	if _, err := idemhttp.NewMiddleware(typedNil, idemhttp.Config{}); err == nil {
		t.Error("typed nil store: got nil error, want one")
	}
}

func TestProblemBody(t *testing.T) {
	rec := httptest.NewRecorder()
	idemhttp.WriteProblem(rec, nil, &idemhttp.Problem{Type: idemhttp.ProblemInFlight, Title: "t", Status: 409, RetryAfter: 2})
	if rec.Code != 409 || rec.Header().Get("Retry-After") != "2" || !bytes.Contains(rec.Body.Bytes(), []byte(`"type":"urn:idem:problem:in-flight"`)) {
		t.Fatalf("got %d %v %s", rec.Code, rec.Header(), rec.Body)
	}
}
