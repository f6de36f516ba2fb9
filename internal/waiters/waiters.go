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
	asks   map[idem.Key]ask  // requests of this process asking the store about a key not held here
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

// Joined is what JoinOrAsk did.
type Joined int

const (
	// Asking: nobody in this process holds key or is asking the store
	// about it for a request of the same fingerprint; the caller asks the
	// store, and must call Answer once with what it learnt (deferred, so
	// that a panic answers too).
	Asking Joined = iota
	// Waited: a request of this process with the same fingerprint held
	// key, or was asking the store about it; JoinOrAsk waited for it, as
	// Wait does.
	Waited
	// Neither: the key is held, or asked about, for a request of another
	// fingerprint; the caller asks the store (which answers the mismatch)
	// on its own.
	Neither
)

// ask is a request of this process asking the store about a key that no
// request here holds, and the copies of it that wait for its answer; once
// the asker acquired the key (held), its holder's Wake answers them. It is
// kept by value in Set.asks; what its copies wait on (copies) is made by
// the first copy that joins, under mu: most asks have none.
type ask struct {
	fp     idem.Fingerprint
	copies *copies // nil until a copy joins
	held   bool    // the asker acquired the key: Wake answers
}

// copies is what the copies of an asker wait on.
type copies struct {
	done chan struct{}
	res  *Result // set before done is closed
}

// answer wakes the copies waiting on c, if any, handing them res.
func (c *copies) answer(res *Result) {
	if c != nil {
		c.res = res
		close(c.done)
	}
}

// JoinOrAsk makes the copies of a request (same key and fingerprint) in
// this process ask the store one at a time. When a request of this
// process holds key (Hold), it waits for the holder's Wake as Wait does;
// when one is asking the store about key, it waits for that one's Answer
// (and, if that one acquired the key, for its Wake): up to d, or until
// ctx ends, and returns Waited with what Wait returns. When nobody does,
// the caller is the one asking (Asking).
//
// The copies that wait for an asker are woken by its Answer or Wake only;
// the requests that poll the store for a holder in another process (Wait)
// are not, and keep their own pace.
func (w *Set) JoinOrAsk(ctx context.Context, key idem.Key, fp idem.Fingerprint, d time.Duration) (j Joined, live bool, res *Result) {
	w.mu.Lock()
	if h := w.holds[key]; h.n > 0 {
		if h.fp != fp {
			w.mu.Unlock()
			return Neither, true, nil
		}
		l := w.enter(key)
		w.mu.Unlock()
		live, res = w.wait(ctx, key, l, d)
		return Waited, live, res
	}
	a, asked := w.asks[key]
	switch {
	case !asked:
		if w.asks == nil {
			w.asks = map[idem.Key]ask{}
		}
		w.asks[key] = ask{fp: fp}
		w.mu.Unlock()
		return Asking, true, nil
	case a.fp != fp:
		w.mu.Unlock()
		return Neither, true, nil
	}
	c := a.copies
	if c == nil {
		c = &copies{done: make(chan struct{})}
		a.copies = c
		w.asks[key] = a
	}
	w.active.Add(1)
	w.mu.Unlock()
	defer w.active.Add(-1)
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-c.done:
		return Waited, true, c.res
	case <-t.C:
		return Waited, true, nil
	case <-ctx.Done():
		return Waited, false, nil
	}
}

// Answer ends the caller's ask (JoinOrAsk returned Asking): with
// acquired, the caller now holds key (as after Hold), and its Wake
// answers the copies waiting for it; otherwise they are woken now, with
// res, the replay the store gave, which they answer with, or nil, and
// they ask the store themselves.
func (w *Set) Answer(key idem.Key, fp idem.Fingerprint, res *Result, acquired bool) {
	if acquired {
		w.mu.Lock()
		if w.holds == nil {
			w.holds = map[idem.Key]hold{}
		}
		w.holds[key] = hold{n: w.holds[key].n + 1, fp: fp}
		if a, ok := w.asks[key]; ok {
			a.held = true
			w.asks[key] = a
		}
		w.mu.Unlock()
		return
	}
	w.unask(key).answer(res)
}

// AnswerReplay is Answer(key, fp, &Result{Fingerprint: fp, Response:
// resp}, false), the store having given the replay resp: the Result is
// made only when copies wait for it.
func (w *Set) AnswerReplay(key idem.Key, fp idem.Fingerprint, resp *idem.Response) {
	if c := w.unask(key); c != nil {
		c.answer(&Result{Fingerprint: fp, Response: resp})
	}
}

// unask ends key's ask and returns the copies waiting for its answer
// (nil: none).
func (w *Set) unask(key idem.Key) *copies {
	w.mu.Lock()
	a := w.asks[key]
	delete(w.asks, key)
	w.mu.Unlock()
	return a.copies
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

// Waiting returns how many requests are waiting (in Wait or JoinOrAsk).
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
	var c *copies
	if a := w.asks[key]; a.held {
		delete(w.asks, key) // its asker held the key: this Wake answers its copies
		c = a.copies
	}
	w.mu.Unlock()
	if l != nil {
		l.result = res
		close(l.done)
	}
	c.answer(res)
}
