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
	holds  map[idem.Key]hold // requests of this process holding the key
}

// hold counts the requests of this process holding a key, and the
// fingerprint of the latest.
type hold struct {
	n  int
	fp idem.Fingerprint
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

// Hold records that a request of this process, with fingerprint fp,
// acquired key. Its holder must call Wake once it is done with the key
// (completed, released, or given up), exactly once per Hold.
func (w *Set) Hold(key idem.Key, fp idem.Fingerprint) {
	w.mu.Lock()
	if w.holds == nil {
		w.holds = map[idem.Key]hold{}
	}
	w.holds[key] = hold{n: w.holds[key].n + 1, fp: fp}
	w.mu.Unlock()
}

// Joined is what JoinOrHold did.
type Joined int

const (
	// Holding: nobody in this process held or was acquiring key; the
	// caller now holds it (as after Hold) while it asks the store, and
	// must Wake it once: with the replay the store gave, with nil when
	// the store answered anything but acquired, or once done with the
	// key it acquired.
	Holding Joined = iota
	// Waited: a request of this process with the same fingerprint held
	// key (or was asking the store for it); JoinOrHold waited for its
	// Wake, as Wait does.
	Waited
	// Neither: the key is held for a request of another fingerprint; the
	// caller asks the store (which answers the mismatch) without holding.
	Neither
)

// JoinOrHold makes the requests of this process for one key and
// fingerprint ask the store one at a time: when another such request
// holds key (or is acquiring it), it waits for that one's Wake, up to d
// or until ctx ends, and returns Waited with what Wait returns; when
// nobody holds key, the caller holds it and asks the store (Holding).
func (w *Set) JoinOrHold(ctx context.Context, key idem.Key, fp idem.Fingerprint, d time.Duration) (j Joined, live bool, res *Result) {
	w.mu.Lock()
	switch h := w.holds[key]; {
	case h.n == 0:
		if w.holds == nil {
			w.holds = map[idem.Key]hold{}
		}
		w.holds[key] = hold{n: 1, fp: fp}
		w.mu.Unlock()
		return Holding, true, nil
	case h.fp != fp:
		w.mu.Unlock()
		return Neither, true, nil
	}
	l := w.enter(key)
	w.mu.Unlock()
	live, res = w.wait(ctx, key, l, d)
	return Waited, live, res
}

// Wait blocks until key is woken, d passes, or ctx ends; when a request
// of this process holds key (Hold), its Wake is awaited up to held
// instead of d: there is no need to ask the store before the holder is
// done. It reports whether ctx is still live, and the holder's Result
// when the holder woke it with one.
func (w *Set) Wait(ctx context.Context, key idem.Key, d, held time.Duration) (live bool, res *Result) {
	w.mu.Lock()
	if w.holds[key].n > 0 {
		d = max(d, held)
	}
	l := w.enter(key)
	w.mu.Unlock()
	return w.wait(ctx, key, l, d)
}

// Waiting returns how many requests are waiting (in Wait or Join).
func (w *Set) Waiting() int64 { return w.active.Load() }

// enter adds a waiter to key's list, under mu.
func (w *Set) enter(key idem.Key) *waitList {
	w.active.Add(1)
	if w.keys == nil {
		w.keys = map[idem.Key]*waitList{}
	}
	l := w.keys[key]
	if l == nil {
		l = &waitList{done: make(chan struct{})}
		w.keys[key] = l
	}
	l.n++
	return l
}

// wait waits on l, which enter joined, and leaves it.
func (w *Set) wait(ctx context.Context, key idem.Key, l *waitList, d time.Duration) (live bool, res *Result) {
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
	if h := w.holds[key]; h.n > 1 {
		h.n--
		w.holds[key] = h
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
