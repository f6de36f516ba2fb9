package idemhttp_test

import (
	"context"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/memstore"
)

// A request that reuses an in-flight key with another body is a mismatch
// (422), told at once: not a duplicate to answer 409, nor one to wait for
// with Config.Wait. The holder runs until the mismatched request has been
// answered, so a store that took it for a duplicate would answer 409 (or,
// with Wait, nothing before the Wait ended, then 409).
func TestMismatchWhileInFlight(t *testing.T) {
	for _, wait := range []time.Duration{-1, 2 * time.Second} {
		name := "NoWait"
		if wait > 0 {
			name = "Wait"
		}
		t.Run(name, func(t *testing.T) {
			eachStore(t, func(t *testing.T, store idem.Store) {
				running, finish := make(chan struct{}), make(chan struct{})
				s := newServer(t, store, idemhttp.Config{Wait: wait}, func(w http.ResponseWriter, r *http.Request) {
					close(running)
					<-finish
					charge(w, r)
				})
				first := s.goDo(t, "POST", "/charges", "busy", `{"amount":1}`)
				<-running
				a := s.do(t, "POST", "/charges", "busy", `{"amount":2}`)
				close(finish)
				if a.status != http.StatusUnprocessableEntity || !strings.Contains(a.body, idemhttp.ProblemMismatch) {
					t.Errorf("another body while the key is in flight: got %d %q, want 422 %s", a.status, a.body, idemhttp.ProblemMismatch)
				}
				if f := <-first; f.status != http.StatusCreated || !strings.Contains(f.body, `amount\":1`) {
					t.Errorf("holder: got %d %q, want 201 with its own body", f.status, f.body)
				}
				if n := s.runs.Load(); n != 1 {
					t.Errorf("executions: got %d, want 1", n)
				}
			})
		})
	}
}

// windowStore is the store of the waiter's process in
// TestWaiterNotHandedAnotherBody. The first request it sees is the
// waiter's; after the waiter's seventh InFlight answer (its pauses have
// grown to 250ms) it closes opened and, until shut is closed, holds the
// waiter's further Acquires, so the key can change hands without the
// waiter seeing it free.
type windowStore struct {
	idem.Store
	mu       sync.Mutex
	waiterFP *idem.Fingerprint
	inFlight int
	opened   chan struct{}
	shut     chan struct{}
}

func (s *windowStore) Acquire(ctx context.Context, req idem.AcquireRequest) (idem.Acquisition, error) {
	s.mu.Lock()
	if s.waiterFP == nil {
		s.waiterFP = &req.Fingerprint
	}
	waiter, open := *s.waiterFP == req.Fingerprint, s.inFlight >= 7
	s.mu.Unlock()
	if waiter && open {
		select {
		case <-s.shut:
		case <-ctx.Done():
			return idem.Acquisition{}, ctx.Err()
		}
	}
	acq, err := s.Store.Acquire(ctx, req)
	if waiter && err == nil && acq.Outcome == idem.InFlight {
		s.mu.Lock()
		if s.inFlight++; s.inFlight == 7 {
			close(s.opened)
		}
		s.mu.Unlock()
	}
	return acq, err
}

// A request waiting (Config.Wait) for a key is handed the response of a
// holder in its process only when that holder ran the same request. Here
// the waiter waits for a holder in another process that then gives the key
// up (500, released); a request with another body takes the key in the
// waiter's process and completes, waking the waiter with its response. The
// waiter must answer 422, not replay the other request's response.
func TestWaiterNotHandedAnotherBody(t *testing.T) {
	store := memstore.New(memstore.Options{}) // shared by both processes
	giveUp := make(chan struct{})
	handler := func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		r.Body = io.NopCloser(strings.NewReader(string(body)))
		if string(body) == `{"amount":1}` {
			<-giveUp
			w.WriteHeader(http.StatusInternalServerError) // released, not stored
			return
		}
		charge(w, r)
	}
	holder := newServer(t, store, idemhttp.Config{}, handler)
	ws := &windowStore{Store: store, opened: make(chan struct{}), shut: make(chan struct{})}
	waiters := newServer(t, ws, idemhttp.Config{Wait: 10 * time.Second}, handler)

	first := holder.goDo(t, "POST", "/charges", "k", `{"amount":1}`)
	for holder.runs.Load() == 0 {
		time.Sleep(time.Millisecond)
	}
	waiter := waiters.goDo(t, "POST", "/charges", "k", `{"amount":1}`)
	<-ws.opened
	close(giveUp)
	if a := <-first; a.status != http.StatusInternalServerError {
		t.Fatalf("holder: got %d %q, want 500", a.status, a.body)
	}
	other := waiters.do(t, "POST", "/charges", "k", `{"amount":2}`)
	close(ws.shut)
	if other.status != http.StatusCreated {
		t.Fatalf("another body after the key was released: got %d %q, want 201", other.status, other.body)
	}
	a := <-waiter
	if a.status != http.StatusUnprocessableEntity || !strings.Contains(a.body, idemhttp.ProblemMismatch) {
		t.Errorf("waiter after another body completed the key: got %d %q %v, want 422 %s", a.status, a.body, a.header, idemhttp.ProblemMismatch)
	}
	if h, w := holder.runs.Load(), waiters.runs.Load(); h != 1 || w != 1 {
		t.Errorf("executions: got %d in the holder's process and %d in the waiter's, want 1 and 1", h, w)
	}
}
