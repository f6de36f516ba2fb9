package idemhttp_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"sync"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/memstore"
)

// oneResponseStore hands every replay of a key the same *idem.Response,
// as a store that caches what it decoded may, and as the requests of
// this process waiting for one key are handed one response.
type oneResponseStore struct {
	idem.Store
	mu   sync.Mutex
	seen map[idem.Key]*idem.Response
}

func (s *oneResponseStore) Acquire(ctx context.Context, req idem.AcquireRequest) (idem.Acquisition, error) {
	acq, err := s.Store.Acquire(ctx, req)
	if err == nil && acq.Outcome == idem.Replay {
		s.mu.Lock()
		if first, ok := s.seen[req.Key]; ok {
			acq.Response = first
		} else {
			s.seen[req.Key] = acq.Response
		}
		s.mu.Unlock()
	}
	return acq, err
}

// A replay's header values are its own: code after the middleware that
// writes into them in place (as Caddy's header replace does) changes
// neither the response the next replay is handed nor that replay, and the
// Idempotency-Key-Lifetime value every response shares stays as it was.
// (The stored header is the one that went out, outer rewrites included,
// as the capture has always taken it.)
func TestReplayHeaderValuesAreItsOwn(t *testing.T) {
	store := &oneResponseStore{Store: memstore.New(memstore.Options{}), seen: map[idem.Key]*idem.Response{}}
	mw := idemhttp.Middleware(store, idemhttp.Config{LifetimeHeader: true})
	h := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header()["X-Tag"] = []string{"a", "b"}
		w.WriteHeader(http.StatusCreated)
		w.Write([]byte(`{"id":1}`))
	}))
	// rewrite is an outer handler whose writer rewrites, in place, every
	// value of the header when it goes out, as Caddy's header replace does.
	rewrite := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h.ServeHTTP(&rewriter{ResponseWriter: w}, r)
	})
	send := func() http.Header {
		r := httptest.NewRequest(http.MethodPost, "/charges", strings.NewReader(`{}`))
		r.Header.Set("Authorization", "Bearer tok")
		r.Header.Set(idemhttp.HeaderKey, "k1")
		w := httptest.NewRecorder()
		rewrite.ServeHTTP(w, r)
		if w.Code != http.StatusCreated {
			t.Fatalf("status %d %s", w.Code, w.Body)
		}
		return w.Result().Header // as it went out
	}
	send() // runs the handler; its header is stored as it went out
	var first http.Header
	for i := range 4 {
		got := send()
		if got.Get(idemhttp.HeaderReplayed) != "true!" {
			t.Fatalf("replay %d: not replayed (or not rewritten once): %v", i, got)
		}
		// The shared lifetime value is rewritten once, by this response's
		// own writer, never by an earlier one's.
		if lt := got.Get(idemhttp.HeaderKeyLifetime); !strings.HasSuffix(lt, "!") || strings.HasSuffix(lt, "!!") {
			t.Errorf("replay %d: %s %q, want it rewritten once", i, idemhttp.HeaderKeyLifetime, lt)
		}
		// Every replay answers the same: no replay's rewrite reaches the
		// stored response that the next one is handed.
		if first == nil {
			first = got
		} else if !reflect.DeepEqual(got, first) {
			t.Errorf("replay %d: header %v, want the first replay's %v", i, got, first)
		}
	}
	if first.Get("X-Tag") == "" {
		t.Fatalf("no X-Tag replayed: %v", first)
	}
}

// rewriter appends "!" to every header value, in place, when the header
// goes out.
type rewriter struct {
	http.ResponseWriter
	wrote bool
}

func (w *rewriter) WriteHeader(code int) {
	if !w.wrote {
		w.wrote = true
		for _, vs := range w.Header() {
			for i := range vs {
				vs[i] += "!"
			}
		}
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *rewriter) Write(p []byte) (int, error) {
	w.WriteHeader(http.StatusOK)
	return w.ResponseWriter.Write(p)
}
