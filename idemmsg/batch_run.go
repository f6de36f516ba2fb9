package idemmsg

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemmsg/internal/workpool"
)

// One HandleBatch call, in the order it happens: run calls prepare, which
// decides what needs no handler and acquires the rest, and starts the
// flusher; work runs the handlers; finishUp frees the keys of those that
// never ran; meanwhile the flusher records and settles the decided
// deliveries in groups (flush).
//
// To stop is to start no more handlers: a delivery that stops the batch
// (InOrder), a handler's panic and a failed settle raise stop; the end
// of ctx stops the batch too (stopped). A failed settle also raises
// crashed: from then on nothing is recorded or settled, as after a crash.

// batchRun is one HandleBatch call.
type batchRun struct {
	d       *Deduplicator
	ctx     context.Context
	dls     []Delivery
	opts    BatchOptions
	fn      func(ctx context.Context, i int) error
	settle  func([]Settled) error
	batched bool // the store does batches: acquire here, record in groups

	att     []*idem.Attempt // pre-acquired, by index (batched)
	mu      sync.Mutex
	started []bool // under mu: a worker took the delivery

	dups   map[int][]int // first index of a key → its later indexes; read-only once running
	stopAt int           // InOrder: the first index decided in prepare so that it stops the batch
	items  chan batchItem
	ready  chan readyDup // later deliveries whose first one is recorded

	stop     signal // no handler starts any more (see stopped)
	crashed  signal // settle failed: nothing more is recorded or settled
	crashErr error  // settle's error; set before crashed is raised
	flushed  signal // the flusher returned
}

// batchItem is a delivery whose handler returned (att set: the result is
// still to be recorded) or that is decided (att nil).
type batchItem struct {
	i           int
	att         *idem.Attempt
	ferr        error // the handler's error, with att
	interrupted bool  // with att: the handler was stopped from outside (ctx, lost lease)
	res         Result
	err         error
	panicked    bool // the handler panicked: nothing to settle
}

// readyDup is a later delivery of a key whose first delivery is recorded.
type readyDup struct {
	i    int
	skip bool // its first delivery panicked or was not decided: do not run it
}

// signal is something that happens once: raise may be called any number
// of times, from any goroutine; done is closed by the first.
type signal struct {
	once sync.Once
	c    chan struct{}
}

func newSignal() signal { return signal{c: make(chan struct{})} }

func (s *signal) raise()                { s.once.Do(func() { close(s.c) }) }
func (s *signal) done() <-chan struct{} { return s.c }

func (s *signal) raised() bool {
	select {
	case <-s.c:
		return true
	default:
		return false
	}
}

func newBatchRun(d *Deduplicator, ctx context.Context, dls []Delivery, opts BatchOptions,
	fn func(ctx context.Context, i int) error, settle func([]Settled) error, batched bool) *batchRun {
	return &batchRun{
		d: d, ctx: ctx, dls: dls, opts: opts, fn: fn, settle: settle,
		batched: batched,
		stopAt:  len(dls),
		att:     make([]*idem.Attempt, len(dls)),
		started: make([]bool, len(dls)),
		items:   make(chan batchItem, len(dls)),
		ready:   make(chan readyDup, len(dls)),
		stop:    newSignal(),
		crashed: newSignal(),
		flushed: newSignal(),
	}
}

// ---- run ----

// run decides the batch: the first delivery of each key, then each later
// delivery once the one before it is recorded, until every handler ran or
// the batch stopped.
func (b *batchRun) run() (err error) {
	initial := b.prepare()
	go b.flusher()

	pool := workpool.New(b.opts.Concurrency)
	work := b.work // made once, not once per delivery
	finished := false
	defer func() {
		if finished {
			return
		}
		// A handler's panic, passed on by the pool (or a runtime.Goexit,
		// which goes on by itself): clean up first.
		v := recover()
		b.finishUp()
		if v != nil {
			panic(v)
		}
	}()
	for _, i := range initial {
		if b.stopped() {
			break
		}
		if !b.take(i) {
			continue
		}
		if !pool.GoIndex(work, i) {
			b.untake(i)
			break
		}
	}
	pending := 0
	for _, later := range b.dups {
		pending += len(later)
	}
	for ; pending > 0 && !b.stopped(); pending-- {
		var r readyDup
		select {
		case r = <-b.ready:
		case <-b.stop.done():
			continue
		case <-b.ctx.Done():
			continue
		}
		if r.skip || !b.take(r.i) {
			continue
		}
		if !pool.GoIndex(work, r.i) {
			b.untake(r.i)
			break
		}
	}
	pool.Wait()
	finished = true
	if b.opts.Handled != nil {
		b.opts.Handled()
	}
	b.finishUp()
	return b.crashErr
}

// stopped reports whether no more handlers should start. (A handler that
// panics raises stop before the pool learns of it, so the pool never
// stops first.)
func (b *batchRun) stopped() bool {
	return b.stop.raised() || b.ctx.Err() != nil
}

// stopsBatch reports whether, with InOrder, a delivery decided so stops
// the deliveries after it: InFlight, Released, or a store error.
func (b *batchRun) stopsBatch(res Result, err error) bool {
	if !b.opts.InOrder {
		return false
	}
	switch res.Outcome {
	case InFlight, Released:
		return true
	case 0:
		return err != nil && !errors.Is(err, idem.ErrInvalidKey) && !errors.Is(err, idem.ErrMismatch) && !errors.Is(err, idem.ErrUnsealable)
	}
	return false
}

// take marks delivery i started, unless it was.
func (b *batchRun) take(i int) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.started[i] {
		return false
	}
	b.started[i] = true
	return true
}

func (b *batchRun) untake(i int) {
	b.mu.Lock()
	b.started[i] = false
	b.mu.Unlock()
}

// ---- prepare ----

// prepare derives the keys, sets the later deliveries of repeated keys
// apart, decides what needs no handler and, on a batch store, acquires
// the rest in one step. It returns the indexes to run, in order.
func (b *batchRun) prepare() []int {
	var (
		reqs  []idem.BeginRequest
		at    []int
		first = make(map[idem.Key]int, len(b.dls))
		run   = make([]int, 0, len(b.dls))
	)
	if b.batched {
		reqs, at = make([]idem.BeginRequest, 0, len(b.dls)), make([]int, 0, len(b.dls))
	}
	for i, dl := range b.dls {
		key, err := b.d.scope.Key(dl.Key)
		if err != nil {
			b.decided(i, Result{}, err)
			continue
		}
		if j, ok := first[key]; ok {
			if b.dups == nil {
				b.dups = map[int][]int{}
			}
			b.dups[j] = append(b.dups[j], i)
			continue
		}
		first[key] = i
		if !b.batched {
			run = append(run, i)
			continue
		}
		var fp idem.Fingerprint
		if b.d.cfg.Fingerprint != nil {
			fp = b.d.cfg.Fingerprint(dl)
		}
		reqs = append(reqs, idem.BeginRequest{Key: key, Fingerprint: fp})
		at = append(at, i)
	}
	if len(reqs) == 0 {
		return run
	}
	for j, bg := range b.d.guard.BeginMany(b.ctx, reqs) {
		i := at[j]
		if bg.Err != nil {
			b.d.unsealable(b.ctx, bg.Err) // logged when it is
			b.decided(i, Result{}, bg.Err)
			continue
		}
		switch acq := bg.Acquisition; acq.Outcome {
		case idem.Acquired:
			b.att[i] = bg.Attempt
			run = append(run, i)
		case idem.Replay:
			if text, ok := deadLetterText(acq.Response); ok {
				b.decided(i, Result{Outcome: DeadLettered, Err: &DeadLetterError{Text: text}}, nil)
			} else {
				b.decided(i, Result{Outcome: Replayed}, nil)
			}
		case idem.InFlight:
			b.decided(i, Result{Outcome: InFlight, RetryAfter: acq.RetryAfter}, nil)
		case idem.Mismatch:
			b.decided(i, Result{}, idem.ErrMismatch)
		default:
			b.decided(i, Result{}, &idem.StoreError{Op: "acquire", Key: reqs[j].Key, Err: fmt.Errorf("unknown outcome %v", acq.Outcome)})
		}
	}
	slices.Sort(run)
	if b.opts.InOrder {
		for k, i := range run {
			if i > b.stopAt {
				return run[:k]
			}
		}
	}
	return run
}

// decided hands the flusher delivery i, decided in prepare.
func (b *batchRun) decided(i int, res Result, err error) {
	if b.stopsBatch(res, err) {
		b.stopAt = min(b.stopAt, i)
	}
	b.items <- batchItem{i: i, res: res, err: err}
}

// ---- work ----

// work runs delivery i: with its pre-acquired attempt, the handler only
// (the flusher records the result); otherwise all of Handle.
func (b *batchRun) work(i int) {
	dl := b.dls[i]
	att := b.att[i]
	if att == nil {
		done := false
		defer func() {
			if !done {
				b.onPanic(i)
			}
		}()
		res, err := b.d.handle(b.ctx, dl, func(ctx context.Context) error { return b.fn(ctx, i) })
		done = true
		if b.stopsBatch(res, err) {
			b.stop.raise()
		}
		b.items <- batchItem{i: i, res: res, err: err}
		return
	}
	done := false
	defer func() {
		if !done { // the handler panicked: free the key, let the panic go on
			att.Release(context.WithoutCancel(b.ctx))
			b.onPanic(i)
		}
	}()
	ferr := b.fn(att.Context(), i)
	done = true
	// A handler stopped from outside (the consumer shutting down, the
	// lease lost) did not fail on its own: never dead-letter for that.
	interrupted := b.ctx.Err() != nil || context.Cause(att.Context()) != nil
	if b.opts.InOrder && ferr != nil && (interrupted || max(dl.Attempt, 1) < b.d.cfg.MaxFailures) {
		b.stop.raise() // Released
	}
	b.items <- batchItem{i: i, att: att, ferr: ferr, interrupted: interrupted}
}

// onPanic: the handler of delivery i panicked. No handler starts any
// more, and the flusher learns that i has nothing to settle.
func (b *batchRun) onPanic(i int) {
	b.stop.raise()
	b.items <- batchItem{i: i, panicked: true}
}

// finishUp, once no handler runs any more, frees the keys acquired for
// handlers that never started (or, after a crash, leaves them to expire,
// as a crash would) and waits for the flusher to record and settle the
// rest.
func (b *batchRun) finishUp() {
	var release []idem.Finish
	crashed := b.crashed.raised()
	b.mu.Lock()
	for i, att := range b.att {
		if att != nil && !b.started[i] {
			b.started[i] = true
			if crashed {
				att.Stop()
			} else {
				release = append(release, idem.Finish{Attempt: att})
			}
		}
	}
	b.mu.Unlock()
	if len(release) > 0 {
		b.d.guard.FinishMany(context.WithoutCancel(b.ctx), release)
	}
	close(b.items)
	<-b.flushed.done()
}

// ---- flush ----

// flusher collects decided deliveries and flushes them in groups: when
// every delivery of the batch is decided, or FlushInterval after the
// first of a group arrived.
func (b *batchRun) flusher() {
	defer b.flushed.raise()
	var (
		group   = make([]batchItem, 0, len(b.dls))
		timer   *time.Timer
		timeout <-chan time.Time
		decided int
	)
	flush := func() {
		if timer != nil {
			timer.Stop()
			timer, timeout = nil, nil
		}
		if len(group) > 0 {
			b.flush(group)
			group = group[:0]
		}
	}
	for {
		select {
		case it, ok := <-b.items:
			if !ok {
				flush()
				return
			}
			decided++
			group = append(group, it)
			if decided == len(b.dls) {
				flush()
			} else if timer == nil {
				timer = time.NewTimer(b.opts.FlushInterval)
				timeout = timer.C
			}
		case <-timeout:
			flush()
		}
	}
}

// flush records the results of a group, settles it and releases the
// later deliveries of its keys.
func (b *batchRun) flush(group []batchItem) {
	finish := context.WithoutCancel(b.ctx)
	if b.crashed.raised() {
		for _, it := range group {
			if it.att != nil {
				it.att.Stop()
			}
			b.releaseDups(it.i, true)
		}
		return
	}
	var (
		fins []idem.Finish
		at   []int
		// The Executed responses of the group, one allocation for all
		// (cap len(group): never moved, so each keeps its own address).
		executed []idem.Response
	)
	for k, it := range group {
		if it.att == nil {
			continue
		}
		if fins == nil {
			fins = make([]idem.Finish, 0, len(group))
			at = make([]int, 0, len(group))
		}
		var resp *idem.Response
		switch {
		case it.ferr == nil:
			if executed == nil {
				executed = make([]idem.Response, 0, len(group))
			}
			executed = append(executed, idem.Response{Status: StatusExecuted})
			resp = &executed[len(executed)-1]
		case !it.interrupted && max(b.dls[it.i].Attempt, 1) >= b.d.cfg.MaxFailures:
			resp = deadLetterResponse(it.ferr)
		}
		fins = append(fins, idem.Finish{Attempt: it.att, Response: resp})
		at = append(at, k)
	}
	if len(fins) > 0 {
		errs := b.d.guard.FinishMany(finish, fins)
		for j, k := range at {
			it, err := &group[k], errs[j]
			switch resp := fins[j].Response; {
			case it.ferr == nil:
				it.res, it.err = Result{Outcome: Executed}, err
			case resp != nil: // dead letter
				switch {
				case err == nil:
					it.res = Result{Outcome: DeadLettered, Err: it.ferr}
				case errors.Is(err, idem.ErrNotReplicated):
					it.res, it.err = Result{Outcome: DeadLettered, Err: it.ferr}, err // recorded
				default:
					// Not recorded (the key was released unless the lease
					// was lost): the next delivery fails and tries again.
					it.res, it.err = Result{Outcome: Released, Err: it.ferr}, err
				}
			default:
				it.res, it.err = Result{Outcome: Released, Err: it.ferr}, err
			}
		}
	}
	settled := make([]Settled, 0, len(group))
	for _, it := range group {
		if it.panicked {
			continue
		}
		if b.d.tel != nil {
			b.d.observe(b.ctx, b.dls[it.i], it.res, it.err)
		}
		settled = append(settled, Settled{Index: it.i, Result: it.res, Err: it.err})
	}
	slices.SortFunc(settled, func(x, y Settled) int { return x.Index - y.Index })
	if len(settled) > 0 {
		if err := b.settle(settled); err != nil {
			b.crash(err)
		}
	}
	for _, it := range group {
		b.releaseDups(it.i, it.panicked || b.crashed.raised())
	}
}

// crash stops the batch as a crashed consumer would stop: settle failed
// with err. Only the flusher settles, never after a crash, so it is
// called once. crashed is raised before stop, so that whoever sees stop
// raised by a crash sees crashed too (finishUp).
func (b *batchRun) crash(err error) {
	b.crashErr = err
	b.crashed.raise()
	b.stop.raise()
}

// releaseDups hands run the later deliveries of delivery i's key; skip:
// not to be run.
func (b *batchRun) releaseDups(i int, skip bool) {
	for _, j := range b.dups[i] {
		b.ready <- readyDup{i: j, skip: skip}
	}
}
