package idemhttp_test

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/memstore"
)

// countingStore counts Acquire calls, the InFlight answers among them,
// and the calls made after the first Complete.
type countingStore struct {
	idem.Store
	inFlight      atomic.Int64
	completed     atomic.Bool
	afterComplete atomic.Int64
}

func (s *countingStore) Acquire(ctx context.Context, req idem.AcquireRequest) (idem.Acquisition, error) {
	if s.completed.Load() {
		s.afterComplete.Add(1)
	}
	acq, err := s.Store.Acquire(ctx, req)
	if err == nil && acq.Outcome == idem.InFlight {
		s.inFlight.Add(1)
	}
	return acq, err
}

func (s *countingStore) Complete(ctx context.Context, l idem.Lease, resp *idem.Response, retention time.Duration) error {
	err := s.Store.Complete(ctx, l, resp, retention)
	s.completed.Store(true)
	return err
}

// Requests that wait (Config.Wait) for a key this process is running get
// the response it stored handed to them when it completes: a byte-identical
// replay, without a store round trip each (they wait for the holder in the
// process without asking the store). A waiter that reaches the middleware
// only after the completion asks the store; the scenario is tried up to
// three times for one run in which some were handed the response.
func TestWaitersHandedTheStoredResponse(t *testing.T) {
	const waiters = 12
	for try := 1; ; try++ {
		store := &countingStore{Store: memstore.New(memstore.Options{})}
		var active atomic.Int64 // requests read by the server
		s := &server{}
		s.Server = httptest.NewUnstartedServer(idemhttp.Middleware(store, idemhttp.Config{Wait: 10 * time.Second})(
			http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				s.runs.Add(1)
				// Run until every duplicate reached the server.
				for active.Load() < waiters+1 {
					time.Sleep(time.Millisecond)
				}
				w.Header().Add("X-Multi", "a")
				w.Header().Add("X-Multi", "b")
				charge(w, r)
			})))
		s.Config.ConnState = func(_ net.Conn, st http.ConnState) {
			if st == http.StateActive {
				active.Add(1)
			}
		}
		s.Start()
		t.Cleanup(s.Close)
		key := fmt.Sprint("handoff-", try)
		first := s.goDo(t, "POST", "/charges", key, "{}")
		for s.runs.Load() == 0 {
			time.Sleep(time.Millisecond)
		}
		answers := make([]answer, waiters)
		var wg sync.WaitGroup
		for i := range waiters {
			wg.Go(func() {
				a, err := s.try("POST", "/charges", key, "{}")
				if err != nil {
					t.Error(err)
				}
				answers[i] = a
			})
		}
		wg.Wait()
		f := <-first
		for i, a := range answers {
			if a.status != http.StatusCreated || a.body != f.body || a.header.Get(idemhttp.HeaderReplayed) != "true" ||
				fmt.Sprint(a.header.Values("X-Multi")) != "[a b]" || a.header.Get("X-Token") != f.header.Get("X-Token") {
				t.Fatalf("waiter %d: got %d %q %v, want the replay of %d %q %v", i, a.status, a.body, a.header, f.status, f.body, f.header)
			}
		}
		if n := s.runs.Load(); n != 1 {
			t.Fatalf("executions: %d, want 1", n)
		}
		after := store.afterComplete.Load()
		t.Logf("try %d: %d of %d waiters asked the store after the completion", try, after, waiters)
		if after < waiters {
			return // some (normally all) were handed the response
		}
		if try == 3 {
			t.Fatalf("in three tries every waiter asked the store again after the completion: the holder hands its response to none")
		}
	}
}
