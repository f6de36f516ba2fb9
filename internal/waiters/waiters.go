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
// ends and asks the store again.
type Set struct {
	active atomic.Int64 // waiting requests: lets wake skip the lock when zero
	mu     sync.Mutex
	keys   map[idem.Key]*waitList
}

type waitList struct {
	done chan struct{}
	n    int // requests waiting on done
}

// Wait blocks until key is woken, d passes, or ctx ends. It reports
// whether ctx is still live.
func (w *Set) Wait(ctx context.Context, key idem.Key, d time.Duration) bool {
	w.active.Add(1)
	w.mu.Lock()
	if w.keys == nil {
		w.keys = map[idem.Key]*waitList{}
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
	return ctx.Err() == nil
}

// Wake releases every request waiting on key.
func (w *Set) Wake(key idem.Key) {
	if w.active.Load() == 0 {
		return
	}
	w.mu.Lock()
	l := w.keys[key]
	delete(w.keys, key)
	w.mu.Unlock()
	if l != nil {
		close(l.done)
	}
}
