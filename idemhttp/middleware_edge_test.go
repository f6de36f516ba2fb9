package idemhttp_test

import (
	"bufio"
	"context"
	"io"
	"maps"
	"net"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/memstore"
)

// Headers that outer middleware set for this request are not part of the
// stored response, and a replay leaves the new request's values alone.
func TestOuterHeadersNotStored(t *testing.T) {
	var n atomic.Int64
	inner := idemhttp.Middleware(memstore.New(memstore.Options{}), idemhttp.Config{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Handler", "h")
		w.Header().Set("X-Overridden", "by the handler")
		io.WriteString(w, "ok")
	}))
	outer := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Request-Id", "req-"+string(rune('a'+n.Add(1))))
		w.Header().Set("X-Overridden", "by the outer middleware")
		inner.ServeHTTP(w, r)
	})
	srv := httptest.NewServer(outer)
	defer srv.Close()
	s := &server{Server: srv}
	first := s.do(t, "POST", "/", "k", "")
	again := s.do(t, "POST", "/", "k", "")
	if again.header.Get(idemhttp.HeaderReplayed) != "true" {
		t.Fatal("second request not replayed")
	}
	if got, want := again.header.Get("X-Request-Id"), "req-c"; got != want || first.header.Get("X-Request-Id") != "req-b" {
		t.Errorf("X-Request-Id: first %q, replay %q; want each request's own (req-b, %s)", first.header.Get("X-Request-Id"), got, want)
	}
	if got := again.header.Get("X-Handler"); got != "h" {
		t.Errorf("replay X-Handler: got %q, want the handler's h", got)
	}
	if got := again.header.Get("X-Overridden"); got != "by the handler" {
		t.Errorf("replay X-Overridden: got %q, want the handler's value", got)
	}
}

// A handler whose Hijack fails (HTTP/2, a recorder) and then answers
// normally is stored like any other: a retry must not run it again.
func TestFailedHijackStillStored(t *testing.T) {
	var runs atomic.Int64
	h := idemhttp.Middleware(memstore.New(memstore.Options{}), idemhttp.Config{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		if _, _, err := http.NewResponseController(w).Hijack(); err == nil {
			t.Error("Hijack on a recorder succeeded")
		}
		w.WriteHeader(http.StatusCreated)
	}))
	for range 2 {
		req := httptest.NewRequest("POST", "/", nil)
		req.Header.Set(idemhttp.HeaderKey, "k")
		h.ServeHTTP(httptest.NewRecorder(), req)
	}
	if n := runs.Load(); n != 1 {
		t.Fatalf("executions: got %d, want 1", n)
	}
}

// A request whose context ended before the key was acquired is not a store
// failure: even with FailOpen the handler must not run without a lease.
func TestCancelledRequestDoesNotFailOpen(t *testing.T) {
	var runs atomic.Int64
	h := idemhttp.Middleware(memstore.New(memstore.Options{}), idemhttp.Config{FailOpen: true, Logger: quietLogger()})(
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { runs.Add(1) }))
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	req := httptest.NewRequestWithContext(ctx, "POST", "/", nil)
	req.Header.Set(idemhttp.HeaderKey, "k")
	h.ServeHTTP(httptest.NewRecorder(), req)
	if n := runs.Load(); n != 0 {
		t.Fatalf("handler ran %d times for a gone client, want 0", n)
	}
}

// zeroOutcome is a broken store that answers no outcome at all.
type zeroOutcome struct{ idem.Store }

func (zeroOutcome) Acquire(context.Context, idem.AcquireRequest) (idem.Acquisition, error) {
	return idem.Acquisition{}, nil
}

func TestUnknownOutcome(t *testing.T) {
	var runs atomic.Int64
	h := idemhttp.Middleware(zeroOutcome{memstore.New(memstore.Options{})}, idemhttp.Config{Logger: quietLogger()})(
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { runs.Add(1) }))
	req := httptest.NewRequest("POST", "/", nil)
	req.Header.Set(idemhttp.HeaderKey, "k")
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	if rec.Code != http.StatusServiceUnavailable || runs.Load() != 0 {
		t.Fatalf("got %d with %d executions, want 503 and none", rec.Code, runs.Load())
	}
}

func TestBodyLimits(t *testing.T) {
	s := newServer(t, memstore.New(memstore.Options{}), idemhttp.Config{MaxBodySize: 10}, charge)
	if a := s.do(t, "POST", "/", "exact", strings.Repeat("x", 10)); a.status != http.StatusCreated {
		t.Errorf("body of exactly MaxBodySize: got %d, want 201", a.status)
	}
	// A declared length longer than what arrives: the read fails, the
	// client gets 400 and nothing runs.
	conn, err := net.Dial("tcp", s.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	io.WriteString(conn, "POST / HTTP/1.1\r\nHost: t\r\n"+idemhttp.HeaderKey+": short\r\nContent-Length: 5\r\n\r\nab")
	conn.(*net.TCPConn).CloseWrite()
	before := s.runs.Load()
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatalf("declared length longer than the body: no answer: %v", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadRequest || s.runs.Load() != before {
		t.Errorf("declared length longer than the body: got %d with %d executions, want 400 and none", resp.StatusCode, s.runs.Load()-before)
	}
}

// With the ServeMux outside the middleware (the middleware wraps one
// route's handler), the route is the matched pattern.
func TestRouteFromPattern(t *testing.T) {
	keys := make(chan idem.Key, 2)
	mw := idemhttp.Middleware(memstore.New(memstore.Options{}), idemhttp.Config{})
	mux := http.NewServeMux()
	mux.Handle("POST /orders/{id}/pay", mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		l, _ := idem.LeaseFromContext(r.Context())
		keys <- l.Key
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	s := &server{Server: srv}
	s.do(t, "POST", "/orders/1/pay", "k1", "")
	want, _ := idem.Scope{Method: "POST", Route: "POST /orders/{id}/pay"}.Key("k1")
	if got := <-keys; got != want {
		t.Fatalf("record key: got %v, want the one scoped by the pattern %v", got, want)
	}
	// The same key on another order matches the same record: its request
	// differs (the path is in the fingerprint), so it is a mismatch.
	if a := s.do(t, "POST", "/orders/2/pay", "k1", ""); a.status != http.StatusUnprocessableEntity {
		t.Fatalf("same key, same pattern, other path: got %d, want 422", a.status)
	}
}

func TestDefaultShouldStore(t *testing.T) {
	for status, want := range map[int]bool{
		200: true, 201: true, 204: true, 303: true, 304: true, 400: true, 404: true, 422: true,
		408: false, 409: false, 425: false, 429: false, 500: false, 502: false, 503: false, 101: false,
	} {
		if got := idemhttp.DefaultShouldStore(nil, status); got != want {
			t.Errorf("DefaultShouldStore(%d): got %t, want %t", status, got, want)
		}
	}
}

// The Config hooks are used: tenant, route, fingerprint, storage policy
// and error handler.
func TestConfigHooks(t *testing.T) {
	var problems []string
	cfg := idemhttp.Config{
		RequireKey:  true,
		Tenant:      func(r *http.Request) string { return r.Header.Get("X-Account") },
		Route:       func(*http.Request) string { return "all" },
		Fingerprint: func(*http.Request, []byte) idem.Fingerprint { return idem.Fingerprint{} }, // bodies ignored
		ShouldStore: func(_ *http.Request, status int) bool { return status != http.StatusAccepted },
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, p *idemhttp.Problem) {
			problems = append(problems, p.Type)
			w.WriteHeader(p.Status)
		},
	}
	s := newServer(t, memstore.New(memstore.Options{}), cfg, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/accepted" {
			w.WriteHeader(http.StatusAccepted)
			return
		}
		charge(w, r)
	})
	s.do(t, "POST", "/a", "k", "one", "X-Account", "acme")
	if a := s.do(t, "POST", "/b", "k", "two", "X-Account", "acme"); a.header.Get(idemhttp.HeaderReplayed) != "true" {
		t.Errorf("custom route and fingerprint: got %d without a replay, want a replay", a.status)
	}
	if a := s.do(t, "POST", "/a", "k", "one", "X-Account", "other"); a.header.Get(idemhttp.HeaderReplayed) != "" {
		t.Error("custom tenant: another account got a replay")
	}
	s.do(t, "POST", "/accepted", "k2", "")
	if a := s.do(t, "POST", "/accepted", "k2", ""); a.header.Get(idemhttp.HeaderReplayed) != "" {
		t.Error("custom ShouldStore: a 202 was stored")
	}
	if a := s.do(t, "POST", "/a", "", ""); a.status != http.StatusBadRequest || len(problems) != 1 || problems[0] != idemhttp.ProblemKeyMissing {
		t.Errorf("RequireKey with a custom ErrorHandler: got %d and problems %v", a.status, problems)
	}
}

// OnOutcome reports what happened to each covered request, once.
func TestOnOutcome(t *testing.T) {
	var mu sync.Mutex
	got := map[idemhttp.Outcome]int{}
	block := make(chan struct{})
	started := make(chan struct{}, 1)
	cfg := idemhttp.Config{RequireKeyFunc: func(r *http.Request) bool { return r.URL.Path == "/required" },
		OnOutcome: func(_ *http.Request, o idemhttp.Outcome) { mu.Lock(); got[o]++; mu.Unlock() }}
	s := newServer(t, memstore.New(memstore.Options{}), cfg, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			started <- struct{}{}
			<-block
		}
		io.WriteString(w, "ok")
	})
	s.do(t, "POST", "/a", "k", "x")             // executed
	s.do(t, "POST", "/a", "k", "x")             // replayed
	s.do(t, "POST", "/a", "k", "y")             // mismatch
	s.do(t, "POST", "/a", "", "")               // passed through
	s.do(t, "POST", "/required", "", "")        // rejected
	s.do(t, "GET", "/a", "k", "")               // not covered: not reported
	slow := s.goDo(t, "POST", "/slow", "s", "") // executed
	<-started
	s.do(t, "POST", "/slow", "s", "") // conflict
	close(block)
	<-slow
	want := map[idemhttp.Outcome]int{idemhttp.OutcomeExecuted: 2, idemhttp.OutcomeReplayed: 1, idemhttp.OutcomeMismatch: 1,
		idemhttp.OutcomePassedThrough: 1, idemhttp.OutcomeRejected: 1, idemhttp.OutcomeInFlight: 1}
	mu.Lock()
	defer mu.Unlock()
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("outcomes: got %v, want %v", got, want)
	}
}

// A request whose handler ran but whose key was released (a status
// ShouldStore refuses, a panic, a hijack) is reported as released, not
// executed, once the handler has returned.
func TestOnOutcomeReleased(t *testing.T) {
	var mu sync.Mutex
	got := map[string]idemhttp.Outcome{}
	cfg := idemhttp.Config{Logger: quietLogger(), OnOutcome: func(r *http.Request, o idemhttp.Outcome) {
		mu.Lock()
		defer mu.Unlock()
		got[r.URL.Path] = o
	}}
	s := newServer(t, memstore.New(memstore.Options{}), cfg, func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/fail":
			w.WriteHeader(http.StatusInternalServerError)
		case "/panic":
			panic("handler failed")
		case "/hijack":
			conn, _, err := http.NewResponseController(w).Hijack()
			if err == nil {
				io.WriteString(conn, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
				conn.Close()
			}
		default:
			w.WriteHeader(http.StatusCreated)
		}
	})
	for _, path := range []string{"/fail", "/panic", "/hijack", "/ok"} {
		s.try("POST", path, "k"+path, "{}") // the panic aborts the response
	}
	want := map[string]idemhttp.Outcome{"/fail": idemhttp.OutcomeReleased, "/panic": idemhttp.OutcomeReleased,
		"/hijack": idemhttp.OutcomeReleased, "/ok": idemhttp.OutcomeExecuted}
	deadline := time.Now().Add(10 * time.Second)
	for {
		mu.Lock()
		same := reflect.DeepEqual(got, want)
		snapshot := maps.Clone(got)
		mu.Unlock()
		if same {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("outcomes: got %v, want %v", snapshot, want)
		}
		time.Sleep(10 * time.Millisecond)
	}
	// Released keys run again.
	before := s.runs.Load()
	if a := s.do(t, "POST", "/fail", "k/fail", "{}"); a.status != http.StatusInternalServerError || s.runs.Load() != before+1 {
		t.Fatalf("retry of a released key: got %d and %d more runs, want 500 and 1", a.status, s.runs.Load()-before)
	}
}

// The handler of a keyed request gets the body the middleware read with
// its length: ContentLength set and no Transfer-Encoding, whether the
// client sent it chunked or with a Content-Length, so that a handler that
// forwards the request (a reverse proxy) sends a Content-Length; a request
// without a body has ContentLength 0 and http.NoBody.
func TestHandlerSeesBodyLength(t *testing.T) {
	type seen struct {
		length int64
		te     []string
		body   string
		noBody bool
	}
	got := make(chan seen, 1)
	h := idemhttp.Middleware(memstore.New(memstore.Options{}), idemhttp.Config{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		got <- seen{r.ContentLength, r.TransferEncoding, string(b), r.Body == http.NoBody}
		w.WriteHeader(http.StatusCreated)
	}))
	srv := httptest.NewServer(h)
	defer srv.Close()
	for _, tc := range []struct {
		name string
		body io.Reader
		want seen
	}{
		{"chunked", io.MultiReader(strings.NewReader(`{"a":1}`)), seen{7, nil, `{"a":1}`, false}},
		{"content-length", strings.NewReader(`{"a":2}`), seen{7, nil, `{"a":2}`, false}},
		{"none", nil, seen{0, nil, "", true}},
	} {
		req, _ := http.NewRequest("POST", srv.URL, tc.body)
		req.Header.Set(idemhttp.HeaderKey, "len-"+tc.name)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if s := <-got; !reflect.DeepEqual(s, tc.want) {
			t.Errorf("%s: the handler saw %+v, want %+v", tc.name, s, tc.want)
		}
	}
}
