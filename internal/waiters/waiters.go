// Package waiters lets requests that wait for an in-flight duplicate wake as
// soon as this process finishes the key (idemhttp and idemgrpc, with Wait).
package waiters

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem"
)

// FirstPause and MaxPause are the first pause, and the cap of the doubling
// pauses, between two store checks of a request waiting for a holder in
// another process.
const (
	FirstPause = 5 * time.Millisecond
	MaxPause   = 250 * time.Millisecond
)

// Set lets requests that wait for an in-flight duplicate wake as soon
// as this process finishes the key, instead of polling. A holder in
// another process is not seen here; the waiter then wakes when its backoff
// ends and asks the store again. A key held in this process (Hold) is
// waited for without polling: its holder's Wake ends the wait.
type Set struct {
	active atomic.Int64 // waiting requests
	mu     sync.Mutex
	keys   map[idem.Key]*waitList
	holds  map[idem.Key]int // requests of this process holding the key
}

type waitList struct {
	done   chan struct{}
	n      int     // requests waiting on done
	result *Result // set before done is closed
}

// Result is what a holder in this process hands to the requests waiting
// for its key once its response is stored: a waiter whose request has the
// same fingerprint answers with it as a replay, without asking the store
// again (what the store would answer, minus a round trip per waiter). A
// waiter must not change Response: every waiter shares it.
type Result struct {
	Fingerprint idem.Fingerprint
	Response    *idem.Response
}

// For returns the stored response if r holds one for a request with
// fingerprint fp; otherwise nil, and the waiter asks the store.
func (r *Result) For(fp idem.Fingerprint) *idem.Response {
	if r == nil || r.Response == nil || r.Fingerprint != fp {
		return nil
	}
	return r.Response
}

// Hold records that a request of this process acquired key. Its holder
// must call Wake once it is done with the key (completed, released, or
// given up), exactly once per Hold.
func (w *Set) Hold(key idem.Key) {
	w.mu.Lock()
	if w.holds == nil {
		w.holds = map[idem.Key]int{}
	}
	w.holds[key]++
	w.mu.Unlock()
}

// Wait blocks until key is woken, d passes, or ctx ends; when a request
// of this process holds key (Hold), its Wake is awaited up to held
// instead of d: there is no need to ask the store before the holder is
// done. It reports whether ctx is still live, and the holder's Result
// when the holder woke it with one.
func (w *Set) Wait(ctx context.Context, key idem.Key, d, held time.Duration) (live bool, res *Result) {
	w.active.Add(1)
	w.mu.Lock()
	if w.keys == nil {
		w.keys = map[idem.Key]*waitList{}
	}
	if w.holds[key] > 0 {
		d = max(d, held)
	}
	l := w.keys[key]
	if l == nil {
		l = &waitList{done: make(chan struct{})}
		w.keys[key] = l
	}
	l.n++
	w.mu.Unlock()

	t := time.NewTimer(d)
	select {
	case <-l.done:
		res = l.result
	case <-t.C:
	case <-ctx.Done():
	}
	t.Stop()

	w.mu.Lock()
	if l.n--; l.n == 0 && w.keys[key] == l {
		delete(w.keys, key)
	}
	w.mu.Unlock()
	w.active.Add(-1)
	return ctx.Err() == nil, res
}

// Wake ends one Hold of key and releases every request waiting on key,
// handing them res: the response the holder stored, or nil when it stored
// none (the key was released, the completion failed or was not
// confirmed).
func (w *Set) Wake(key idem.Key, res *Result) {
	w.mu.Lock()
	if n := w.holds[key]; n > 1 {
		w.holds[key] = n - 1
	} else {
		delete(w.holds, key)
	}
	var l *waitList
	if w.active.Load() > 0 {
		l = w.keys[key]
		delete(w.keys, key)
	}
	w.mu.Unlock()
	if l != nil {
		l.result = res
		close(l.done)
	}
}
