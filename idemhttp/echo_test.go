package idemhttp_test

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/memstore"
)

// echoEnv is a server behind a middleware with EchoKey and
// LifetimeHeader, whose handler sets its own Idempotency-Key and
// Idempotency-Key-Lifetime (in another case, twice, and as trailers) to be
// replaced. Its OnKey keeps the keys it was given.
type echoEnv struct {
	srv     *httptest.Server
	store   idem.Store
	entered chan struct{} // a request to /block reached the handler
	release chan struct{} // closed: /block answers
	mu      sync.Mutex
	keys    []idem.Key // OnKey's
	runs    atomic.Int64
}

const echoLifetime = "PT1H30M" // the Retention of newEchoEnv

func newEchoEnv(t *testing.T, store idem.Store, cfg idemhttp.Config) *echoEnv {
	t.Helper()
	e := &echoEnv{store: store, entered: make(chan struct{}, 8), release: make(chan struct{})}
	cfg.EchoKey, cfg.LifetimeHeader = true, true
	cfg.Retention = 90 * time.Minute
	cfg.Logger = quietLogger()
	if cfg.Tenant == nil {
		cfg.Tenant = func(*http.Request) string { return "acme" }
	}
	cfg.OnKey = func(_ *http.Request, k idem.Key) {
		e.mu.Lock()
		e.keys = append(e.keys, k)
		e.mu.Unlock()
	}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		e.runs.Add(1)
		body, _ := io.ReadAll(r.Body)
		if r.URL.Path == "/block" {
			e.entered <- struct{}{}
			<-e.release
		}
		h := w.Header()
		h["idempotency-key"] = []string{"handler-own"} // net/http would send it as written
		h.Add(idemhttp.HeaderKey, "handler-own-2")
		h.Set(idemhttp.HeaderKeyLifetime, "P7D")
		h.Set("X-Handler", "yes")
		h.Set("Content-Type", "text/plain")
		h.Set("Trailer", idemhttp.HeaderKeyLifetime)
		w.WriteHeader(http.StatusCreated)
		if r.URL.Path == "/big" {
			io.WriteString(w, strings.Repeat("b", 64))
		} else {
			w.Write(body)
		}
		h[http.TrailerPrefix+"idempotency-key"] = []string{"handler-trailer"}
		h.Set(idemhttp.HeaderKeyLifetime, "P1D") // announced: a trailer
	})
	e.srv = httptest.NewServer(idemhttp.Middleware(store, cfg)(h))
	t.Cleanup(e.srv.Close)
	return e
}

// send sends a request with the Idempotency-Key header key (none if ""),
// and header pairs.
func (e *echoEnv) send(t *testing.T, method, path, key, body string, header ...string) *http.Response {
	t.Helper()
	req, err := http.NewRequest(method, e.srv.URL+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if key != "" {
		req.Header.Set(idemhttp.HeaderKey, key)
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Add(header[i], header[i+1])
	}
	resp, err := e.srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp
}

func (e *echoEnv) onKeys() []idem.Key {
	e.mu.Lock()
	defer e.mu.Unlock()
	return slices.Clone(e.keys)
}

// own checks the middleware's headers of resp (its body read):
// Idempotency-Key exactly key (absent for ""), Idempotency-Key-Lifetime
// exactly lifetime (absent for ""), and neither as a trailer.
func own(t *testing.T, what string, resp *http.Response, key, lifetime string) {
	t.Helper()
	for _, name := range []string{idemhttp.HeaderKey, idemhttp.HeaderKeyLifetime} {
		if got := resp.Trailer.Values(name); len(got) > 0 {
			t.Errorf("%s (%d): trailer %s %q, want none", what, resp.StatusCode, name, got)
		}
	}
	var wantKey, wantLife []string
	if key != "" {
		wantKey = []string{key}
	}
	if lifetime != "" {
		wantLife = []string{lifetime}
	}
	if got := resp.Header.Values(idemhttp.HeaderKey); !slices.Equal(got, wantKey) {
		t.Errorf("%s (%d): Idempotency-Key %q, want %q", what, resp.StatusCode, got, wantKey)
	}
	if got := resp.Header.Values(idemhttp.HeaderKeyLifetime); !slices.Equal(got, wantLife) {
		t.Errorf("%s (%d): Idempotency-Key-Lifetime %q, want %q", what, resp.StatusCode, got, wantLife)
	}
}

// noOwnHeaders fails if the stored record of key holds either header, in
// any case, as a header or a trailer.
func noOwnHeaders(t *testing.T, store idem.Store, key idem.Key) {
	t.Helper()
	rec, ok, err := store.Get(context.Background(), key)
	if err != nil || !ok || rec.State != idem.StateCompleted {
		t.Fatalf("record of %v: got %+v %v %v, want a completed record", key, rec, ok, err)
	}
	for name := range rec.Response.Header {
		n := strings.TrimPrefix(name, http.TrailerPrefix)
		if strings.EqualFold(n, idemhttp.HeaderKey) || strings.EqualFold(n, idemhttp.HeaderKeyLifetime) {
			t.Errorf("stored record holds %s: %q; want neither Idempotency-Key nor Idempotency-Key-Lifetime stored", name, rec.Response.Header[name])
		}
	}
	if rec.Response.Header.Get("X-Handler") != "yes" {
		t.Errorf("stored header %v: want the handler's X-Handler: yes kept", rec.Response.Header)
	}
}

func status(t *testing.T, what string, resp *http.Response, want int) {
	t.Helper()
	if resp.StatusCode != want {
		t.Fatalf("%s: status %d, want %d", what, resp.StatusCode, want)
	}
}

// Executed and replayed: the key and the lifetime once each, the handler's
// own replaced; neither in the record.
func TestEchoExecutedAndReplayed(t *testing.T) {
	e := newEchoEnv(t, memstore.New(memstore.Options{}), idemhttp.Config{})
	first := e.send(t, "POST", "/charges", "k-1", `{"a":1}`)
	status(t, "executed", first, http.StatusCreated)
	own(t, "executed", first, "k-1", echoLifetime)
	replay := e.send(t, "POST", "/charges", "k-1", `{"a":1}`)
	status(t, "replayed", replay, http.StatusCreated)
	if replay.Header.Get(idemhttp.HeaderReplayed) != "true" || replay.Header.Get("X-Handler") != "yes" {
		t.Fatalf("replay header %v: want Idempotent-Replayed: true and the stored X-Handler", replay.Header)
	}
	own(t, "replayed", replay, "k-1", echoLifetime)
	keys := e.onKeys()
	if len(keys) != 2 || keys[0] != keys[1] {
		t.Fatalf("OnKey keys %v: want the same key twice", keys)
	}
	noOwnHeaders(t, e.store, keys[0])
	// A quoted key is echoed as the key source returned it: unquoted.
	q := e.send(t, "POST", "/charges", `"k 2"`, `{}`)
	own(t, "quoted key", q, "k 2", echoLifetime)
}

// A header an outer middleware set before the middleware ran, of either
// name, is replaced too, and not stored.
func TestEchoOuterHeaderReplaced(t *testing.T) {
	store := memstore.New(memstore.Options{})
	var key idem.Key
	mw := idemhttp.Middleware(store, idemhttp.Config{EchoKey: true, LifetimeHeader: true, Logger: quietLogger(),
		Tenant: func(*http.Request) string { return "acme" }, OnKey: func(_ *http.Request, k idem.Key) { key = k }})
	inner := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Handler", "yes")
		w.WriteHeader(http.StatusCreated)
	}))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set(idemhttp.HeaderKey, "outer")
		w.Header().Set(idemhttp.HeaderKeyLifetime, "PT1S")
		inner.ServeHTTP(w, r)
	}))
	defer srv.Close()
	for _, what := range []string{"executed", "replayed"} {
		req, _ := http.NewRequest("POST", srv.URL, strings.NewReader("x"))
		req.Header.Set(idemhttp.HeaderKey, "k-outer")
		resp, err := srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		own(t, what, resp, "k-outer", "PT24H")
	}
	noOwnHeaders(t, store, key)
}

// The middleware's own answers to a keyed request carry both headers.
func TestEchoProblems(t *testing.T) {
	t.Run("in-flight 409 and waited replay", func(t *testing.T) {
		for _, wait := range []time.Duration{-1, 10 * time.Second} {
			e := newEchoEnv(t, memstore.New(memstore.Options{}), idemhttp.Config{Wait: wait})
			done := make(chan *http.Response, 1)
			go func() {
				req, _ := http.NewRequest("POST", e.srv.URL+"/block", strings.NewReader("x"))
				req.Header.Set(idemhttp.HeaderKey, "k-block")
				resp, err := e.srv.Client().Do(req)
				if err != nil {
					t.Error(err)
					done <- nil
					return
				}
				resp.Body.Close()
				done <- resp
			}()
			<-e.entered
			if wait < 0 {
				resp := e.send(t, "POST", "/block", "k-block", "x")
				status(t, "in flight", resp, http.StatusConflict)
				own(t, "in flight", resp, "k-block", echoLifetime)
				close(e.release)
			} else {
				waiter := make(chan *http.Response, 1)
				go func() {
					req, _ := http.NewRequest("POST", e.srv.URL+"/block", strings.NewReader("x"))
					req.Header.Set(idemhttp.HeaderKey, "k-block")
					resp, err := e.srv.Client().Do(req)
					if err != nil {
						t.Error(err)
						waiter <- nil
						return
					}
					resp.Body.Close()
					waiter <- resp
				}()
				time.Sleep(100 * time.Millisecond)
				select {
				case <-waiter:
					t.Fatal("the copy answered while the key was in flight; want it to wait")
				default:
				}
				close(e.release)
				resp := <-waiter
				if resp == nil {
					return
				}
				status(t, "waited", resp, http.StatusCreated)
				if resp.Header.Get(idemhttp.HeaderReplayed) != "true" {
					t.Fatalf("waited: header %v, want a replay", resp.Header)
				}
				own(t, "waited then replayed", resp, "k-block", echoLifetime)
			}
			if resp := <-done; resp != nil {
				own(t, "executed after a wait", resp, "k-block", echoLifetime)
			}
		}
	})
	t.Run("mismatch 422", func(t *testing.T) {
		e := newEchoEnv(t, memstore.New(memstore.Options{}), idemhttp.Config{})
		e.send(t, "POST", "/charges", "k-m", "one")
		resp := e.send(t, "POST", "/charges", "k-m", "two")
		status(t, "mismatch", resp, http.StatusUnprocessableEntity)
		own(t, "mismatch", resp, "k-m", echoLifetime)
	})
	t.Run("quota 429", func(t *testing.T) {
		e := newEchoEnv(t, memstore.New(memstore.Options{}), idemhttp.Config{Quota: &idemhttp.Quota{Records: 1}})
		status(t, "first", e.send(t, "POST", "/charges", "k-q1", "x"), http.StatusCreated)
		resp := e.send(t, "POST", "/charges", "k-q2", "x")
		status(t, "over quota", resp, http.StatusTooManyRequests)
		own(t, "over quota", resp, "k-q2", echoLifetime)
	})
	t.Run("store 503 and fail-open", func(t *testing.T) {
		for _, failOpen := range []bool{false, true} {
			e := newEchoEnv(t, downStore{memstore.New(memstore.Options{})}, idemhttp.Config{FailOpen: failOpen})
			resp := e.send(t, "POST", "/charges", "k-s", "x")
			if want := map[bool]int{false: http.StatusServiceUnavailable, true: http.StatusCreated}[failOpen]; resp.StatusCode != want {
				t.Fatalf("store down, FailOpen %v: status %d, want %d", failOpen, resp.StatusCode, want)
			}
			own(t, "store down", resp, "k-s", echoLifetime)
		}
	})
	t.Run("anonymous 401", func(t *testing.T) {
		e := newEchoEnv(t, memstore.New(memstore.Options{}), idemhttp.Config{RefuseAnonymous: true,
			Tenant: func(*http.Request) string { return "" }})
		resp := e.send(t, "POST", "/charges", "k-a", "x")
		status(t, "anonymous", resp, http.StatusUnauthorized)
		own(t, "anonymous", resp, "k-a", echoLifetime)
		if keys := e.onKeys(); len(keys) != 0 {
			t.Errorf("OnKey called with %v for a refused anonymous request; want no call", keys)
		}
	})
	t.Run("body too large 413", func(t *testing.T) {
		e := newEchoEnv(t, memstore.New(memstore.Options{}), idemhttp.Config{MaxBodySize: 4})
		resp := e.send(t, "POST", "/charges", "k-big", "0123456789")
		status(t, "too large", resp, http.StatusRequestEntityTooLarge)
		own(t, "too large", resp, "k-big", echoLifetime)
		if keys := e.onKeys(); len(keys) != 0 {
			t.Errorf("OnKey called with %v for a 413; want no call", keys)
		}
	})
	t.Run("not kept 500 and blob replay", func(t *testing.T) {
		for _, blobs := range []bool{false, true} {
			cfg := idemhttp.Config{MaxResponseSize: 8}
			if blobs {
				cfg.Blobs = newMemBlobs()
			}
			e := newEchoEnv(t, memstore.New(memstore.Options{}), cfg)
			own(t, "large executed", e.send(t, "POST", "/big", "k-l", "x"), "k-l", echoLifetime)
			resp := e.send(t, "POST", "/big", "k-l", "x")
			if want := map[bool]int{false: http.StatusInternalServerError, true: http.StatusCreated}[blobs]; resp.StatusCode != want {
				t.Fatalf("large replay, blobs %v: status %d, want %d", blobs, resp.StatusCode, want)
			}
			own(t, "large replay", resp, "k-l", echoLifetime)
			noOwnHeaders(t, e.store, e.onKeys()[0])
		}
	})
}

// downStore fails every Acquire, as a store that does not answer.
type downStore struct{ idem.Store }

func (downStore) Acquire(context.Context, idem.AcquireRequest) (idem.Acquisition, error) {
	return idem.Acquisition{}, errors.New("store down")
}

// No key read, no echo (and no OnKey); the lifetime still, on every
// request of a covered method; neither on other methods.
func TestEchoWithoutKey(t *testing.T) {
	e := newEchoEnv(t, memstore.New(memstore.Options{}), idemhttp.Config{})
	unkeyed := e.send(t, "POST", "/charges", "", "x")
	status(t, "unkeyed", unkeyed, http.StatusCreated)
	// The handler's own Idempotency-Key passes through on an unkeyed
	// request (there is no key to echo); its lifetime is replaced.
	if got := unkeyed.Header.Values(idemhttp.HeaderKey); len(got) == 0 {
		t.Errorf("unkeyed: Idempotency-Key %q, want the handler's own", got)
	}
	if got := unkeyed.Header.Values(idemhttp.HeaderKeyLifetime); !slices.Equal(got, []string{echoLifetime}) {
		t.Errorf("unkeyed: Idempotency-Key-Lifetime %q, want [%s]", got, echoLifetime)
	}
	invalid := e.send(t, "POST", "/charges", "", "x", idemhttp.HeaderKey, "a", idemhttp.HeaderKey, "b")
	status(t, "two keys", invalid, http.StatusBadRequest)
	own(t, "two keys", invalid, "", echoLifetime)
	get := e.send(t, "GET", "/charges", "k-get", "")
	if got := get.Header.Values(idemhttp.HeaderKeyLifetime); !slices.Equal(got, []string{"P7D"}) {
		t.Errorf("GET (not covered): Idempotency-Key-Lifetime %q, want the handler's [P7D] untouched", got)
	}
	if keys := e.onKeys(); len(keys) != 0 {
		t.Errorf("OnKey called with %v for unkeyed, invalid and uncovered requests; want no call", keys)
	}

	unverified := newEchoEnv(t, memstore.New(memstore.Options{}), idemhttp.Config{KeySource: idemhttp.KeySource{
		Key: func(*http.Request, []byte) (string, error) { return "", idemhttp.ErrKeyUnverified }}})
	resp := unverified.send(t, "POST", "/charges", "k-u", "x")
	status(t, "unverified", resp, http.StatusUnauthorized)
	own(t, "unverified", resp, "", echoLifetime)
	if keys := unverified.onKeys(); len(keys) != 0 || unverified.runs.Load() != 0 {
		t.Errorf("unverified: OnKey keys %v, runs %d; want neither", keys, unverified.runs.Load())
	}
}

// A key from the body is echoed as KeyFromJSON read it, and OnKey's key
// is the one the memstore holds.
func TestEchoKeyFromJSON(t *testing.T) {
	store := memstore.New(memstore.Options{})
	e := newEchoEnv(t, store, idemhttp.Config{KeySource: idemhttp.KeyFromJSON("/id")})
	for _, c := range []struct{ body, key string }{{`{"id":"evt_1"}`, "evt_1"}, {`{"id":1e3}`, "1e3"}} {
		for _, what := range []string{"executed", "replayed"} {
			resp := e.send(t, "POST", "/hooks", "", c.body)
			status(t, what, resp, http.StatusCreated)
			own(t, what+" "+c.body, resp, c.key, echoLifetime)
		}
	}
	keys := e.onKeys()
	if len(keys) != 4 || keys[0] != keys[1] || keys[2] != keys[3] || keys[0] == keys[2] {
		t.Fatalf("OnKey keys %v: want two keys, each twice", keys)
	}
	if store.Len() != 2 {
		t.Fatalf("memstore holds %d records, want 2", store.Len())
	}
	for _, k := range []idem.Key{keys[0], keys[2]} {
		noOwnHeaders(t, store, k)
	}
	if e.send(t, "POST", "/hooks", "", `{"other":1}`); len(e.onKeys()) != 4 {
		t.Errorf("OnKey called for a body without the key")
	}
}

// OnKey gets the key the record is stored under, derived from the scope,
// once per keyed request and before the key is claimed.
func TestOnKey(t *testing.T) {
	store := memstore.New(memstore.Options{})
	var calls []idem.Key
	var claimedBefore []bool
	h := idemhttp.Middleware(store, idemhttp.Config{Logger: quietLogger(),
		Tenant: func(*http.Request) string { return "acme" },
		Route:  func(*http.Request) string { return "/charges/{id}" },
		OnKey: func(r *http.Request, k idem.Key) {
			_, ok, _ := store.Get(r.Context(), k)
			calls, claimedBefore = append(calls, k), append(claimedBefore, ok)
		}})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusCreated) }))
	srv := httptest.NewServer(h)
	defer srv.Close()
	for range 2 {
		req, _ := http.NewRequest("POST", srv.URL+"/charges/7", strings.NewReader("x"))
		req.Host = "Shop.Example:8443"
		req.Header.Set(idemhttp.HeaderKey, "k-on")
		resp, err := srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.Header.Get(idemhttp.HeaderKey) != "" || resp.Header.Get(idemhttp.HeaderKeyLifetime) != "" {
			t.Errorf("header %v: want neither Idempotency-Key nor Idempotency-Key-Lifetime with EchoKey and LifetimeHeader off", resp.Header)
		}
	}
	want, err := idem.Scope{Tenant: "acme", Method: "POST", Route: "/charges/{id}", Authority: "shop.example"}.Key("k-on")
	if err != nil {
		t.Fatal(err)
	}
	if len(calls) != 2 || calls[0] != want || calls[1] != want {
		t.Fatalf("OnKey keys %v, want %v twice", calls, want)
	}
	if !slices.Equal(claimedBefore, []bool{false, true}) {
		t.Errorf("record present when OnKey ran: %v, want [false true] (absent before the first claim)", claimedBefore)
	}
	if rec, ok, err := store.Get(context.Background(), want); err != nil || !ok || rec.State != idem.StateCompleted || store.Len() != 1 {
		t.Fatalf("memstore under OnKey's key: %+v %v %v (%d records), want the one completed record", rec, ok, err, store.Len())
	}
}

// Without EchoKey a handler's Idempotency-Key is its own: stored and
// replayed as before.
func TestEchoKeyOffHandlerHeaderStored(t *testing.T) {
	h := idemhttp.Middleware(memstore.New(memstore.Options{}), idemhttp.Config{Logger: quietLogger(), LifetimeHeader: true})(
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set(idemhttp.HeaderKey, "handler-own")
			w.WriteHeader(http.StatusCreated)
		}))
	srv := httptest.NewServer(h)
	defer srv.Close()
	for _, what := range []string{"executed", "replayed"} {
		req, _ := http.NewRequest("POST", srv.URL, strings.NewReader("x"))
		req.Header.Set(idemhttp.HeaderKey, "k-off")
		resp, err := srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		own(t, what, resp, "handler-own", "PT24H")
	}
}

// The ResponseWriter of a covered request keeps Flush, write deadlines
// (Unwrap) and Hijack for a handler, keyed or not.
func TestEchoWriterKeepsInterfaces(t *testing.T) {
	var got sync.Map
	h := idemhttp.Middleware(memstore.New(memstore.Options{}), idemhttp.Config{Logger: quietLogger(), EchoKey: true, LifetimeHeader: true})(
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			rc := http.NewResponseController(w)
			got.Store(r.Header.Get("X-Case")+":deadline", rc.SetWriteDeadline(time.Now().Add(time.Minute)))
			_, hijacker := w.(http.Hijacker)
			got.Store(r.Header.Get("X-Case")+":hijacker", hijacker)
			got.Store(r.Header.Get("X-Case")+":flush", rc.Flush()) // the header goes out here
			io.WriteString(w, "flushed")
		}))
	srv := httptest.NewServer(h)
	defer srv.Close()
	for _, key := range []string{"", "k-if"} {
		req, _ := http.NewRequest("POST", srv.URL, strings.NewReader("x"))
		req.Header.Set("X-Case", key)
		if key != "" {
			req.Header.Set(idemhttp.HeaderKey, key)
		}
		resp, err := srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		own(t, "flushed "+key, resp, key, "PT24H")
		for _, what := range []string{"deadline", "flush"} {
			if v, _ := got.Load(key + ":" + what); v != nil {
				t.Errorf("key %q: %s: %v, want nil", key, what, v)
			}
		}
		if v, _ := got.Load(key + ":hijacker"); v != true {
			t.Errorf("key %q: ResponseWriter is not an http.Hijacker", key)
		}
	}
}
