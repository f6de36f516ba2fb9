// Package workpool runs an adapter's message handlers a bounded number at
// a time, passing a handler's panic on to the goroutine that waits for
// them, as if the handler had run there.
package workpool

import "sync"

// Pool runs functions on at most n goroutines at once. With n <= 1 it runs
// each function in the caller's goroutine, in order (a panic then goes
// straight up). The zero value is not usable; use New.
type Pool struct {
	sem chan struct{}
	wg  sync.WaitGroup

	mu       sync.Mutex
	stopped  bool // Stop, or a panic
	panicked bool
	panicVal any
}

// New returns a Pool of n goroutines.
func New(n int) *Pool {
	p := &Pool{}
	if n > 1 {
		p.sem = make(chan struct{}, n)
	}
	return p
}

// Go runs f, waiting first while n functions run, and reports whether it
// did: once the pool is stopped (Stop, or a function panicked), Go runs
// nothing more and returns false, so that the caller can hand the work
// back.
func (p *Pool) Go(f func()) bool {
	if !p.enter() {
		return false
	}
	if p.sem == nil {
		f()
		return true
	}
	p.wg.Go(func() {
		defer p.done()
		f()
	})
	return true
}

// enter takes a slot (waiting while n functions run), and reports false,
// the slot given back, once the pool is stopped.
func (p *Pool) enter() bool {
	if p.sem == nil {
		return !p.Stopped()
	}
	p.sem <- struct{}{}
	if p.Stopped() {
		<-p.sem
		return false
	}
	return true
}

// GoIndex is Go(func() { f(i) }), without making that function: a caller
// that runs one f for many i makes f once (with n <= 1, nothing is made
// per call).
func (p *Pool) GoIndex(f func(int), i int) bool {
	if !p.enter() {
		return false
	}
	if p.sem == nil {
		f(i)
		return true
	}
	p.wg.Go(func() {
		defer p.done()
		f(i)
	})
	return true
}

// done ends a function run on a goroutine of the pool: it frees its place
// and keeps its panic, if any (recovered here, as the deferred call of
// that goroutine).
func (p *Pool) done() {
	defer func() { <-p.sem }()
	if v := recover(); v != nil {
		p.mu.Lock()
		if !p.panicked {
			p.panicked, p.panicVal = true, v
		}
		p.stopped = true
		p.mu.Unlock()
	}
}

// Stop makes later calls of Go run nothing; functions already started
// run on.
func (p *Pool) Stop() {
	p.mu.Lock()
	p.stopped = true
	p.mu.Unlock()
}

// Stopped reports whether Stop was called or a function run by Go
// panicked.
func (p *Pool) Stopped() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.stopped
}

// Wait waits for every function started by Go to return, then panics with
// the first panic's value if one panicked.
func (p *Pool) Wait() {
	p.wg.Wait()
	p.mu.Lock()
	panicked, v := p.panicked, p.panicVal
	p.mu.Unlock()
	if panicked {
		panic(v)
	}
}
