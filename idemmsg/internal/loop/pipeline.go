package loop

import "sync"

// Pipeline overlaps the batches of one consumer loop: the end of
// one Deduplicator.HandleBatch call (its last groups recorded and
// settled) with the start of the next (its keys acquired, its handlers
// run), when the two share no key. Keys shared with the batch before go
// the safe way: the next batch waits until that one has returned, so that
// a repeated key finds its first delivery recorded (Replayed) instead of
// in flight. Its methods are for one goroutine, the loop's.
type Pipeline struct {
	prev *call
}

type call struct {
	keys     map[string]struct{}
	handled  chan struct{} // closed by handled, or when the call returned
	done     chan struct{} // closed when the call returned
	once     sync.Once
	err      error
	panicked bool
	panicVal any
}

func (c *call) handledNow() { c.once.Do(func() { close(c.handled) }) }

// Run runs batch in a goroutine of its own, once the batch before has
// returned if the two share a key, and returns when batch has called
// handled (every handler of it returned: pass it as
// idemmsg.BatchOptions.Handled) or returned, and the batch before has
// returned. It returns the error of the batch before, if it returned one
// (batch may have started meanwhile: it overlaps the end of the one
// before; stop the loop and call Wait); a panic of the batch before goes
// on here. If the batch before had already returned with an error when
// Run was called, batch does not run.
func (p *Pipeline) Run(keys []string, batch func(handled func()) error) error {
	set := make(map[string]struct{}, len(keys))
	for _, k := range keys {
		set[k] = struct{}{}
	}
	if prev := p.prev; prev != nil {
		shared := false
		for k := range set {
			if _, ok := prev.keys[k]; ok {
				shared = true
				break
			}
		}
		select {
		case <-prev.done:
			shared = true // collect its result now
		default:
		}
		if shared {
			if err := p.Wait(); err != nil {
				return err
			}
		}
	}
	c := &call{keys: set, handled: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(c.done)
		defer c.handledNow()
		defer func() {
			if v := recover(); v != nil {
				c.panicked, c.panicVal = true, v
			}
		}()
		c.err = batch(c.handledNow)
	}()
	<-c.handled
	if prev := p.prev; prev != nil {
		// Both the batch before and this one are running: wait for the
		// one before, so that at most two overlap.
		p.prev = c
		if err := waitCall(prev); err != nil {
			return err
		}
		return nil
	}
	p.prev = c
	return nil
}

// Wait waits for the last batch and returns its error; its panic goes on
// here.
func (p *Pipeline) Wait() error {
	c := p.prev
	p.prev = nil
	if c == nil {
		return nil
	}
	return waitCall(c)
}

func waitCall(c *call) error {
	<-c.done
	if c.panicked {
		panic(c.panicVal)
	}
	return c.err
}
