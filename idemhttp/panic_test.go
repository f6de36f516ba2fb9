package idemhttp_test

import (
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/memstore"
)

// OnOutcome is called once per request (Config.OnOutcome). A panic after
// the handler returned and before the response is stored (here in
// OnBodyOmitted) releases the key and reports OutcomeReleased only; a
// retry runs the handler again.
func TestOutcomeOnceOnLatePanic(t *testing.T) {
	var mu sync.Mutex
	var got []idemhttp.Outcome
	var panicked atomic.Bool
	mw := idemhttp.Middleware(memstore.New(memstore.Options{}), idemhttp.Config{
		MaxResponseSize: 10,
		Logger:          quietLogger(),
		OnBodyOmitted: func(*http.Request) {
			if !panicked.Swap(true) {
				panic("metrics bug")
			}
		},
		OnOutcome: func(_ *http.Request, o idemhttp.Outcome) {
			mu.Lock()
			got = append(got, o)
			mu.Unlock()
		},
	})
	h := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Write([]byte(strings.Repeat("x", 100)))
	}))
	serve := func() (p any) {
		req := httptest.NewRequest("POST", "/charge", nil)
		req.Header.Set(idemhttp.HeaderKey, "k")
		defer func() { p = recover() }()
		h.ServeHTTP(httptest.NewRecorder(), req)
		return nil
	}
	if p := serve(); p != "metrics bug" {
		t.Fatalf("first request: recovered %v, want the panic to go on", p)
	}
	serve() // the retry runs the handler again
	mu.Lock()
	defer mu.Unlock()
	if want := []idemhttp.Outcome{idemhttp.OutcomeReleased, idemhttp.OutcomeExecuted}; !slices.Equal(got, want) {
		t.Fatalf("OnOutcome: got %v, want %v (one outcome per request)", got, want)
	}
}
