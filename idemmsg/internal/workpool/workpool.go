// Package workpool runs an adapter's message handlers a bounded number at
// a time, passing a handler's panic on to the goroutine that waits for
// them, as if the handler had run there.
package workpool

import "sync"

// Pool runs functions on at most n goroutines at once. With n <= 1 it runs
// each function in the caller's goroutine, in order. The zero value is not
// usable; use New.
type Pool struct {
	sem chan struct{}
	wg  sync.WaitGroup

	mu       sync.Mutex
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

// Go runs f, waiting first while n functions run. After a function
// panicked, Go runs nothing more: the panic comes out of Wait.
func (p *Pool) Go(f func()) {
	if p.sem == nil {
		f()
		return
	}
	p.sem <- struct{}{}
	if p.Panicked() {
		<-p.sem
		return
	}
	p.wg.Go(func() {
		defer func() { <-p.sem }()
		defer func() {
			if v := recover(); v != nil {
				p.mu.Lock()
				if !p.panicked {
					p.panicked, p.panicVal = true, v
				}
				p.mu.Unlock()
			}
		}()
		f()
	})
}

// Panicked reports whether a function run by Go panicked.
func (p *Pool) Panicked() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.panicked
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
