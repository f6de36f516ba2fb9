package idemhttp_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/webhooktest"
	"github.com/idemkit/idem/memstore"
)

// TestKeySourcesFromOutside: an idemhttp server keyed by a field of the
// body (KeyFromJSON) and by a sender's header (KeyFromHeader), with a
// fingerprint that leaves the sender's retry counter out
// (FingerprintJSON), receives deliveries that Stripe's and GitHub's own
// libraries signed and Node's fetch sent: each runs once, a redelivery
// (re-signed, its attempt counter changed, its members reordered) is
// replayed, another amount under the same id is 422, and a body without
// the field or not JSON gets the missing-key and invalid-key answers.
// (Verifying the signature is the sidecars' part: internal/webhook.)
func TestKeySourcesFromOutside(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	runs := map[string]int{}
	app := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		runs[r.URL.Path]++
		n := runs[r.URL.Path]
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"run":%d}`, n)
	})
	store := memstore.New(memstore.Options{})
	byField := idemhttp.Middleware(store, idemhttp.Config{
		KeySource:   idemhttp.KeyFromJSON("/id"),
		Fingerprint: idemhttp.FingerprintJSON("/attempt"),
	})(app)
	byHeader := idemhttp.Middleware(store, idemhttp.Config{KeySource: idemhttp.KeyFromHeader("X-GitHub-Delivery")})(app)
	mux := http.NewServeMux()
	mux.Handle("/stripe", byField)
	mux.Handle("/github", byHeader)
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	ranOnce := func(path string) {
		t.Helper()
		mu.Lock()
		defer mu.Unlock()
		if runs[path] != 1 {
			t.Errorf("%s ran %d times, want once", path, runs[path])
		}
	}

	stripeSecret := webhooktest.NewSecret("stripe")
	stripe := func(body string) webhooktest.Answer {
		return webhooktest.Send(t, webhooktest.Delivery{Preset: "stripe", URL: srv.URL + "/stripe", Secrets: []string{stripeSecret}, Body: body})
	}
	first := stripe(`{"id":"evt_1","amount":5,"attempt":1}`)
	if first.Status != http.StatusCreated || first.Replayed() {
		t.Fatalf("the first delivery of evt_1: got %d replayed %v %s, want 201 executed", first.Status, first.Replayed(), first.Body)
	}
	for _, body := range []string{`{"id":"evt_1","amount":5,"attempt":2}`, `{"attempt":3, "amount":5, "id":"evt_1"}`} {
		if a := stripe(body); a.Status != http.StatusCreated || !a.Replayed() || a.Body != first.Body {
			t.Errorf("redelivery %s: got %d replayed %v %s, want the stored %s replayed", body, a.Status, a.Replayed(), a.Body, first.Body)
		}
	}
	if a := stripe(`{"id":"evt_1","amount":6,"attempt":4}`); a.Status != http.StatusUnprocessableEntity || !strings.Contains(a.Body, idemhttp.ProblemMismatch) {
		t.Errorf("evt_1 with another amount: got %d %s, want 422 %s", a.Status, a.Body, idemhttp.ProblemMismatch)
	}
	ranOnce("/stripe")
	if a := stripe(`{"amount":5}`); a.Status != http.StatusCreated || a.Replayed() {
		t.Errorf("a body without /id: got %d replayed %v, want 201 passed through (no key, none required)", a.Status, a.Replayed())
	}
	if a := stripe(`id=evt_2`); a.Status != http.StatusBadRequest || !strings.Contains(a.Body, idemhttp.ProblemKeyInvalid) || !strings.Contains(a.Body, "not JSON") {
		t.Errorf("a body that is not JSON: got %d %s, want 400 %s saying it is not JSON", a.Status, a.Body, idemhttp.ProblemKeyInvalid)
	}

	ghSecret := webhooktest.NewSecret("github")
	github := func(id string) webhooktest.Answer {
		return webhooktest.Send(t, webhooktest.Delivery{Preset: "github", URL: srv.URL + "/github", Secrets: []string{ghSecret},
			Body: `{"action":"opened","number":7}`, ID: id})
	}
	gh := github("d-1")
	if gh.Status != http.StatusCreated || gh.Replayed() {
		t.Fatalf("the first delivery d-1: got %d replayed %v, want 201 executed", gh.Status, gh.Replayed())
	}
	if a := github("d-1"); !a.Replayed() || a.Body != gh.Body {
		t.Errorf("the redelivery of d-1: got %d replayed %v %s, want the stored %s", a.Status, a.Replayed(), a.Body, gh.Body)
	}
	ranOnce("/github")
}
