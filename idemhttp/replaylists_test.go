package idemhttp_test

import (
	"bytes"
	"compress/gzip"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/memstore"
)

// keptStore is a store that keeps the encoded form of the last response
// completed on it: the bytes a store holds.
type keptStore struct {
	idem.Store
	mu   sync.Mutex
	last []byte
}

func (s *keptStore) Complete(ctx context.Context, l idem.Lease, resp *idem.Response, retention time.Duration) error {
	b, err := resp.AppendBinary(nil)
	if err != nil {
		return err
	}
	s.mu.Lock()
	s.last = b
	s.mu.Unlock()
	return s.Store.Complete(ctx, l, resp, retention)
}

func (s *keptStore) stored() []byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.last
}

// sensitive answers with a gzip body, a session token, a debug header, a
// cookie and a custom trailer.
func sensitive(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Encoding", "gzip")
	h.Set("X-Session-Token", "tok-canary")
	h.Set("X-Debug", "trace-1")
	h["x-request-ref"] = []string{"ref-1"} // not canonical: matched anyway
	h.Set("Location", "/charges/1")
	h.Set("Trailer", "X-Audit")
	http.SetCookie(w, &http.Cookie{Name: "session", Value: "cookie-canary"})
	w.WriteHeader(http.StatusCreated)
	zw := gzip.NewWriter(w)
	io.WriteString(zw, `{"id":1}`)
	zw.Close()
	h.Set("X-Audit", "audit-canary")
}

// callRaw posts with its own Accept-Encoding, so that the client hands
// back the bytes and header as sent.
func callRaw(t *testing.T, url, key string) (*http.Response, []byte) {
	t.Helper()
	req, _ := http.NewRequest("POST", url, strings.NewReader("{}"))
	req.Header.Set(idemhttp.HeaderKey, key)
	req.Header.Set("Accept-Encoding", "gzip")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp, b
}

func gunzip(t *testing.T, b []byte) string {
	t.Helper()
	zr, err := gzip.NewReader(bytes.NewReader(b))
	if err != nil {
		t.Fatalf("replayed body is not gzip: %v", err)
	}
	out, err := io.ReadAll(zr)
	if err != nil {
		t.Fatal(err)
	}
	return string(out)
}

// TestReplayHeaderLists: with an allowlist only its headers (and those
// that say what the body is) are stored and replayed, the denylist wins
// over it, Set-Cookie goes whatever the lists say, and the first answer
// carries every header.
func TestReplayHeaderLists(t *testing.T) {
	for _, tc := range []struct {
		name       string
		cfg        idemhttp.Config
		replayed   []string // headers the replay carries
		dropped    []string // headers it does not, nor the record
		trailerKep bool     // X-Audit replayed as a trailer
	}{
		{"deny", idemhttp.Config{ReplayHeaderDenylist: []string{"x-session-TOKEN"}},
			[]string{"Content-Type", "Content-Encoding", "X-Debug", "X-Request-Ref", "Location"}, []string{"X-Session-Token", "Set-Cookie"}, true},
		{"allow", idemhttp.Config{ReplayHeaderAllowlist: []string{"x-REQUEST-ref", "Location", "X-Debug"}, ReplayHeaderDenylist: []string{"X-Debug"}},
			[]string{"Content-Type", "Content-Encoding", "X-Request-Ref", "Location"}, []string{"X-Session-Token", "X-Debug", "Set-Cookie"}, false},
		{"allow-trailer", idemhttp.Config{ReplayHeaderAllowlist: []string{"X-Audit"}},
			[]string{"Content-Type", "Content-Encoding"}, []string{"X-Session-Token", "X-Debug", "X-Request-Ref", "Location", "Set-Cookie"}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			store := &keptStore{Store: memstore.New(memstore.Options{})}
			tc.cfg.Logger = quietLogger()
			s := newServer(t, store, tc.cfg, sensitive)
			first, firstBody := callRaw(t, s.URL+"/charges", "k-"+tc.name)
			for _, h := range []string{"Content-Type", "Content-Encoding", "X-Session-Token", "X-Debug", "X-Request-Ref", "Location", "Set-Cookie"} {
				if first.Header.Get(h) == "" {
					t.Errorf("first answer lacks %s: %v", h, first.Header)
				}
			}
			if first.Trailer.Get("X-Audit") != "audit-canary" {
				t.Errorf("first answer lacks its trailer: %v", first.Trailer)
			}
			again, againBody := callRaw(t, s.URL+"/charges", "k-"+tc.name)
			if again.Header.Get(idemhttp.HeaderReplayed) != "true" || s.runs.Load() != 1 {
				t.Fatalf("second answer is not a replay (%d runs): %v", s.runs.Load(), again.Header)
			}
			if again.StatusCode != http.StatusCreated || !bytes.Equal(againBody, firstBody) || gunzip(t, againBody) != `{"id":1}` {
				t.Errorf("replay: %d %q, want 201 and the first answer's gzip bytes", again.StatusCode, againBody)
			}
			for _, h := range tc.replayed {
				if again.Header.Get(h) != first.Header.Get(h) {
					t.Errorf("replayed %s %q, want %q", h, again.Header.Get(h), first.Header.Get(h))
				}
			}
			for _, h := range tc.dropped {
				if v := again.Header.Values(h); len(v) > 0 {
					t.Errorf("replay carries %s %q", h, v)
				}
			}
			if got := again.Trailer.Get("X-Audit"); (got == "audit-canary") != tc.trailerKep {
				t.Errorf("replayed trailer X-Audit %q, want it kept: %v", got, tc.trailerKep)
			}
			rec := store.stored()
			for _, canary := range []string{"tok-canary", "cookie-canary"} {
				if bytes.Contains(rec, []byte(canary)) {
					t.Errorf("the stored record holds %q", canary)
				}
			}
			if bytes.Contains(rec, []byte("audit-canary")) != tc.trailerKep {
				t.Errorf("stored record holds the trailer: %v, want %v", !tc.trailerKep, tc.trailerKep)
			}
			if tc.name == "allow" && bytes.Contains(rec, []byte("trace-1")) {
				t.Error("the stored record holds X-Debug, which the denylist names")
			}
		})
	}
}

// TestAllowlistAtReplay: a record stored before the allowlist replays
// only what it names.
func TestAllowlistAtReplay(t *testing.T) {
	store := memstore.New(memstore.Options{})
	before := newServer(t, store, idemhttp.Config{Logger: quietLogger()}, sensitive)
	if r, _ := callRaw(t, before.URL+"/c", "a-1"); r.Header.Get("X-Session-Token") == "" {
		t.Fatalf("first answer lacks X-Session-Token: %v", r.Header)
	}
	after := newServer(t, store, idemhttp.Config{Logger: quietLogger(), ReplayHeaderAllowlist: []string{"X-Request-Ref"}}, sensitive)
	r, b := callRaw(t, after.URL+"/c", "a-1")
	if r.Header.Get(idemhttp.HeaderReplayed) != "true" {
		t.Fatalf("not a replay: %v", r.Header)
	}
	if r.Header.Get("X-Session-Token") != "" || r.Header.Get("X-Debug") != "" || r.Trailer.Get("X-Audit") != "" {
		t.Errorf("replay carries headers the allowlist leaves out: %v %v", r.Header, r.Trailer)
	}
	if r.Header.Get("X-Request-Ref") != "ref-1" || r.Header.Get("Content-Encoding") != "gzip" || gunzip(t, b) != `{"id":1}` {
		t.Errorf("replay lost what it must keep: %v", r.Header)
	}
}

// TestAllowlistGRPC: an allowlist that names no gRPC header still
// replays a gRPC answer: its status and message, as trailers or as the
// headers of a trailers-only answer, and its message encoding.
func TestAllowlistGRPC(t *testing.T) {
	cfg := idemhttp.Config{Logger: quietLogger(), ReplayHeaderAllowlist: []string{"X-Other"}}
	trailersOnly := func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/grpc")
		w.Header().Set("Grpc-Status", "5")
		w.Header().Set("Grpc-Message", "no%20such%20thing")
		w.Header().Set("Grpc-Status-Details-Bin", "CAU")
		w.Header().Set("X-Secret", "private")
		w.WriteHeader(http.StatusOK)
	}
	withBody := func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Grpc-Encoding", "gzip")
		trailered("message")(w, r)
	}
	for _, tc := range []struct {
		name    string
		h       http.HandlerFunc
		trailer bool
		want    map[string]string
	}{
		{"trailers", withBody, true, map[string]string{"Grpc-Status": "3", "Grpc-Message": "bad%20thing"}},
		{"trailers-only", trailersOnly, false, map[string]string{"Grpc-Status": "5", "Grpc-Message": "no%20such%20thing", "Grpc-Status-Details-Bin": "CAU"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := httptest.NewUnstartedServer(idemhttp.Middleware(memstore.New(memstore.Options{}), cfg)(tc.h))
			srv.EnableHTTP2 = true
			srv.StartTLS()
			defer srv.Close()
			call := func() *http.Response {
				req, _ := http.NewRequest("POST", srv.URL+"/pkg.Svc/Do", strings.NewReader("req"))
				req.Header.Set(idemhttp.HeaderKey, "g-1")
				req.Header.Set("Content-Type", "application/grpc")
				resp, err := srv.Client().Do(req)
				if err != nil {
					t.Fatal(err)
				}
				defer resp.Body.Close()
				io.ReadAll(resp.Body)
				return resp
			}
			call()
			again := call()
			if again.Header.Get(idemhttp.HeaderReplayed) != "true" {
				t.Fatalf("not a replay: %v", again.Header)
			}
			got := again.Header
			if tc.trailer {
				got = again.Trailer
				if again.Header.Get("Grpc-Encoding") != "gzip" {
					t.Errorf("replay lost Grpc-Encoding: %v", again.Header)
				}
				if again.Trailer.Get("X-Secret") != "" {
					t.Errorf("replayed trailer X-Secret, which the allowlist leaves out")
				}
			}
			for name, v := range tc.want {
				if got.Get(name) != v {
					t.Errorf("replayed %s %q, want %q (header %v, trailers %v)", name, got.Get(name), v, again.Header, again.Trailer)
				}
			}
			if again.Header.Get("Content-Type") != "application/grpc" || again.Header.Get("X-Secret") != "" {
				t.Errorf("replay header: %v", again.Header)
			}
		})
	}
}

// TestReplayHeaderListsRefused: a bad name in either list is refused, in
// an error that names it.
func TestReplayHeaderListsRefused(t *testing.T) {
	for _, tc := range []struct {
		allow, deny []string
		want        string
	}{
		{allow: []string{""}, want: `ReplayHeaderAllowlist: "" is not a header name`},
		{allow: []string{"X Debug"}, want: `ReplayHeaderAllowlist: "X Debug" is not a header name`},
		{allow: []string{"X-Ok", "X-Débug"}, want: `"X-Débug" is not a header name`},
		{allow: []string{"set-cookie"}, want: "ReplayHeaderAllowlist: Set-Cookie is never stored"},
		{allow: []string{"Connection"}, want: "ReplayHeaderAllowlist: Connection is never stored"},
		{allow: []string{"TE"}, want: "ReplayHeaderAllowlist: Te is never stored"},
		{allow: []string{"Idempotent-Replayed"}, want: "Idempotent-Replayed is never stored"},
		{deny: []string{""}, want: `ReplayHeaderDenylist: "" is not a header name`},
		{deny: []string{"X:Y"}, want: `ReplayHeaderDenylist: "X:Y" is not a header name`},
		{deny: []string{"content-encoding"}, want: "ReplayHeaderDenylist: Content-Encoding says how to read the stored body"},
		{deny: []string{"grpc-status"}, want: "ReplayHeaderDenylist: Grpc-Status says how"},
		{deny: []string{"Grpc-Encoding"}, want: "ReplayHeaderDenylist: Grpc-Encoding says how"},
	} {
		_, err := idemhttp.NewMiddleware(memstore.New(memstore.Options{}), idemhttp.Config{ReplayHeaderAllowlist: tc.allow, ReplayHeaderDenylist: tc.deny})
		if err == nil || !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), "\n") {
			t.Errorf("allow %q deny %q: got %v, want one line with %q", tc.allow, tc.deny, err, tc.want)
		}
	}
	// What the lists may say.
	for _, cfg := range []idemhttp.Config{
		{ReplayHeaderDenylist: []string{"Set-Cookie", "Content-Type", "X-Debug"}},
		{ReplayHeaderAllowlist: []string{"content-type", "Content-Encoding", "X-Debug"}, ReplayHeaderDenylist: []string{"x-debug"}},
	} {
		if _, err := idemhttp.NewMiddleware(memstore.New(memstore.Options{}), cfg); err != nil {
			t.Errorf("%+v: %v", cfg, err)
		}
	}
}
