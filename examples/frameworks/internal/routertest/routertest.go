// Package routertest holds the checks every framework example passes: the
// same payments API, wired into gin, echo, chi or gorilla/mux, must honour
// the Idempotency-Key header exactly as idemhttp documents it.
//
// Each check builds a fresh handler on memstore with the example's own
// constructor, serves it with httptest (a real HTTP server, so the router
// runs as in production) and counts how often the charge handler ran.
package routertest

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/memstore"
)

// NewHandler is the constructor each example exports to its tests: the
// router with idemhttp in front, whose POST /charges handler adds one to
// charges each time it runs.
type NewHandler func(store idem.Store, charges *atomic.Int64) http.Handler

const (
	chargeBody = `{"amount":1000,"currency":"usd"}`
	otherBody  = `{"amount":9999,"currency":"usd"}`
	badBody    = `{"amount":`
)

// Run runs every check against the handlers newHandler builds.
func Run(t *testing.T, newHandler NewHandler) {
	t.Run("FirstRequestRuns", func(t *testing.T) { firstRequestRuns(t, newHandler) })
	t.Run("RepeatIsReplayed", func(t *testing.T) { repeatIsReplayed(t, newHandler) })
	t.Run("OtherBodySameKeyIs422", func(t *testing.T) { otherBodySameKey(t, newHandler) })
	t.Run("NewKeyRunsAgain", func(t *testing.T) { newKeyRunsAgain(t, newHandler) })
	t.Run("ConcurrentCopiesRunOnce", func(t *testing.T) { concurrentCopiesRunOnce(t, newHandler) })
	t.Run("HandlerErrorIsReplayed", func(t *testing.T) { handlerErrorIsReplayed(t, newHandler) })
	t.Run("NoKeyPassesThrough", func(t *testing.T) { noKeyPassesThrough(t, newHandler) })
	t.Run("GetPassesThrough", func(t *testing.T) { getPassesThrough(t, newHandler) })
}

type server struct {
	url     string
	charges *atomic.Int64
}

func start(t *testing.T, newHandler NewHandler) *server {
	t.Helper()
	charges := new(atomic.Int64)
	ts := httptest.NewServer(newHandler(memstore.New(memstore.Options{}), charges))
	t.Cleanup(ts.Close)
	return &server{url: ts.URL, charges: charges}
}

type response struct {
	status int
	header http.Header
	body   []byte
}

// do sends one request; key "" sends no Idempotency-Key.
func (s *server) do(t *testing.T, method, path, key, body string) response {
	t.Helper()
	r, err := s.send(method, path, key, body)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// send is do for goroutines other than the test's, which must not call
// t.Fatal.
func (s *server) send(method, path, key, body string) (response, error) {
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequest(method, s.url+path, rd)
	if err != nil {
		return response{}, err
	}
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	if key != "" {
		req.Header.Set(idemhttp.HeaderKey, key)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return response{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return response{status: resp.StatusCode, header: resp.Header, body: b}, err
}

func (s *server) post(t *testing.T, key, body string) response {
	t.Helper()
	return s.do(t, http.MethodPost, "/charges", key, body)
}

// charge is what the examples answer to POST /charges.
type charge struct {
	ID           string `json:"id"`
	Amount       int64  `json:"amount"`
	Currency     string `json:"currency"`
	FencingToken uint64 `json:"fencing_token"`
}

func decodeCharge(t *testing.T, r response) charge {
	t.Helper()
	var c charge
	if err := json.Unmarshal(r.body, &c); err != nil {
		t.Fatalf("response body %q: %v", r.body, err)
	}
	return c
}

func wantCreated(t *testing.T, r response) {
	t.Helper()
	if r.status != http.StatusCreated {
		t.Fatalf("status: got %d, want %d (body %q)", r.status, http.StatusCreated, r.body)
	}
}

func wantCharges(t *testing.T, s *server, want int64) {
	t.Helper()
	if got := s.charges.Load(); got != want {
		t.Fatalf("charge handler ran: got %d times, want %d", got, want)
	}
}

func wantReplayed(t *testing.T, r response, want string) {
	t.Helper()
	if got := r.header.Get(idemhttp.HeaderReplayed); got != want {
		t.Fatalf("%s header: got %q, want %q", idemhttp.HeaderReplayed, got, want)
	}
}

func wantSameResponse(t *testing.T, got, want response) {
	t.Helper()
	if got.status != want.status {
		t.Fatalf("replayed status: got %d, want %d", got.status, want.status)
	}
	if !bytes.Equal(got.body, want.body) {
		t.Fatalf("replayed body: got %q, want %q", got.body, want.body)
	}
	for _, h := range []string{"Content-Type", "Content-Length"} {
		if g, w := got.header.Get(h), want.header.Get(h); g != w {
			t.Fatalf("replayed %s: got %q, want %q", h, g, w)
		}
	}
}

func firstRequestRuns(t *testing.T, newHandler NewHandler) {
	s := start(t, newHandler)
	r := s.post(t, "charge-1", chargeBody)
	wantCreated(t, r)
	wantCharges(t, s, 1)
	wantReplayed(t, r, "")
	c := decodeCharge(t, r)
	if c.ID == "" {
		t.Fatalf("charge id: got %q, want non-empty", c.ID)
	}
	if c.Amount != 1000 || c.Currency != "usd" {
		t.Fatalf("charge: got %d %s, want 1000 usd", c.Amount, c.Currency)
	}
	if c.FencingToken == 0 {
		t.Fatalf("fencing_token: got 0, want the lease's token (> 0)")
	}
}

func repeatIsReplayed(t *testing.T, newHandler NewHandler) {
	s := start(t, newHandler)
	first := s.post(t, "charge-1", chargeBody)
	wantCreated(t, first)
	for range 2 {
		again := s.post(t, "charge-1", chargeBody)
		wantSameResponse(t, again, first)
		wantReplayed(t, again, "true")
		wantCharges(t, s, 1)
	}
}

func otherBodySameKey(t *testing.T, newHandler NewHandler) {
	s := start(t, newHandler)
	wantCreated(t, s.post(t, "charge-1", chargeBody))
	r := s.post(t, "charge-1", otherBody)
	if r.status != http.StatusUnprocessableEntity {
		t.Fatalf("status: got %d, want %d (body %q)", r.status, http.StatusUnprocessableEntity, r.body)
	}
	if got, want := r.header.Get("Content-Type"), "application/problem+json"; got != want {
		t.Fatalf("Content-Type: got %q, want %q", got, want)
	}
	wantReplayed(t, r, "")
	wantCharges(t, s, 1)
}

func newKeyRunsAgain(t *testing.T, newHandler NewHandler) {
	s := start(t, newHandler)
	a := s.post(t, "charge-1", chargeBody)
	b := s.post(t, "charge-2", chargeBody)
	wantCreated(t, a)
	wantCreated(t, b)
	wantReplayed(t, b, "")
	wantCharges(t, s, 2)
	if ida, idb := decodeCharge(t, a).ID, decodeCharge(t, b).ID; ida == idb {
		t.Fatalf("charge ids: got %q twice, want two different charges", ida)
	}
}

// concurrentCopiesRunOnce sends the same request several times at once:
// the handler runs once; every other copy gets its replay or 409.
func concurrentCopiesRunOnce(t *testing.T, newHandler NewHandler) {
	s := start(t, newHandler)
	const copies = 8
	responses := make([]response, copies)
	errs := make([]error, copies)
	var wg sync.WaitGroup
	for i := range copies {
		wg.Go(func() { responses[i], errs[i] = s.send(http.MethodPost, "/charges", "charge-1", chargeBody) })
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	wantCharges(t, s, 1)
	final := s.post(t, "charge-1", chargeBody) // the stored result
	wantReplayed(t, final, "true")
	for _, r := range responses {
		switch r.status {
		case http.StatusCreated:
			wantSameResponse(t, r, final)
		case http.StatusConflict:
			if got, want := r.header.Get("Retry-After"), "1"; got != want {
				t.Fatalf("409 Retry-After: got %q, want %q", got, want)
			}
		default:
			t.Fatalf("status of a concurrent copy: got %d, want %d or %d (body %q)",
				r.status, http.StatusCreated, http.StatusConflict, r.body)
		}
	}
}

// handlerErrorIsReplayed checks that the router's own error path (a 400
// for a malformed body) runs inside idemhttp: the 400 is stored and
// replayed like any other final answer.
func handlerErrorIsReplayed(t *testing.T, newHandler NewHandler) {
	s := start(t, newHandler)
	first := s.post(t, "charge-bad", badBody)
	if first.status != http.StatusBadRequest {
		t.Fatalf("status: got %d, want %d (body %q)", first.status, http.StatusBadRequest, first.body)
	}
	if len(first.body) == 0 {
		t.Fatalf("400 body: got empty, want an error message")
	}
	wantReplayed(t, first, "")
	again := s.post(t, "charge-bad", badBody)
	wantSameResponse(t, again, first)
	wantReplayed(t, again, "true")
	wantCharges(t, s, 0)
}

// noKeyPassesThrough: keys are optional by default; without one every
// request runs, with no lease in its context.
func noKeyPassesThrough(t *testing.T, newHandler NewHandler) {
	s := start(t, newHandler)
	for i := range 2 {
		r := s.post(t, "", chargeBody)
		wantCreated(t, r)
		wantReplayed(t, r, "")
		wantCharges(t, s, int64(i+1))
		if tok := decodeCharge(t, r).FencingToken; tok != 0 {
			t.Fatalf("fencing_token without a key: got %d, want 0 (no lease)", tok)
		}
	}
}

// getPassesThrough: GET is not a covered method, so even with an
// Idempotency-Key it reaches the router untouched, every time.
func getPassesThrough(t *testing.T, newHandler NewHandler) {
	s := start(t, newHandler)
	for range 2 {
		r := s.do(t, http.MethodGet, "/charges/ch_42", "charge-1", "")
		if r.status != http.StatusOK {
			t.Fatalf("status: got %d, want %d (body %q)", r.status, http.StatusOK, r.body)
		}
		wantReplayed(t, r, "")
		var got struct{ ID string }
		if err := json.Unmarshal(r.body, &got); err != nil {
			t.Fatalf("response body %q: %v", r.body, err)
		}
		if got.ID != "ch_42" {
			t.Fatalf("id: got %q, want %q", got.ID, "ch_42")
		}
	}
	wantCharges(t, s, 0)
}
