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

// DefaultFlushInterval is BatchOptions.FlushInterval's default.
const DefaultFlushInterval = 2 * time.Millisecond

// BatchOptions tunes HandleBatch.
type BatchOptions struct {
	// Concurrency is how many handlers of the batch run at once. Default
	// 1: one after another, in batch order.
	Concurrency int

	// InOrder keeps a partition's order, for brokers such as Kafka that
	// commit an offset rather than acknowledge each message: handlers run
	// one at a time, in batch order (Concurrency is ignored), and once a
	// delivery is decided InFlight or Failed, or fails with a store error,
	// no later delivery's handler runs: the later ones are left
	// undecided (settle never sees them; their keys are released), for
	// the caller to retry from the one that stopped the batch. A later
	// delivery that needs no handler (Duplicate, say) may still be
	// settled.
	InOrder bool

	// Handled, when set, is called once every handler of the batch has
	// returned and none will start, before the last groups are recorded
	// and settled: a consumer loop may then fetch, and start deciding, its
	// next batch (the adapters overlap their batches so).
	Handled func()

	// FlushInterval bounds how long a decided delivery waits for others
	// before its group is recorded and settled: a group is flushed when
	// every delivery of the batch is decided, or when its first delivery
	// has waited this long, whichever comes first, so a slow handler
	// never holds up the others. Default DefaultFlushInterval.
	FlushInterval time.Duration
}

// Settled is one decided delivery of a batch, as HandleBatch hands it to
// its settle function: the index of the delivery in the batch, and what
// Handle would have returned for it.
type Settled struct {
	Index  int
	Result Result
	Err    error
}

// HandleBatch decides a batch of deliveries, as fetched from the broker,
// with the same outcomes as Handle, for fewer store round trips: when the
// store implements idem.BatchStore, the keys are acquired in one step,
// and the results of finished handlers are recorded in groups, one step
// per group. fn(ctx, i) is the handler of dls[i]; the handlers run
// Concurrency at a time (one after another, in batch order, by default),
// as with Handle.
//
// settle is called with each group of decided deliveries, in index order
// within the group, once their outcomes are recorded: the adapter
// acknowledges them together (one ack round trip per group). The calls
// never overlap, and the next group is being decided (handlers run) while
// settle runs. A group is flushed when every delivery of the batch is
// decided, or after FlushInterval; Duplicate, InFlight and the other
// outcomes that need no handler are in the first group.
//
// A key that appears more than once in dls is decided once first; its
// later deliveries are decided after that one is recorded, each as Handle
// would decide a delivery that came after it (Duplicate, usually).
//
// With a store that does not implement idem.BatchStore, each delivery is
// decided by Handle (its own acquire and completion), Concurrency at a
// time, and only the settling is grouped.
//
// When ctx ends, deliveries whose handlers have not started are not
// decided (their keys are released, and settle never sees them: leave
// them for redelivery); running handlers get a cancelled context and
// their outcomes are still recorded and settled, as with Handle. If a
// handler panics, its key is released, the handlers not started are not
// run (their keys are released), the decided deliveries are recorded and
// settled, and the panic goes on once the others have returned. If settle
// returns an error, HandleBatch stops as a crashed consumer would: no
// further handler starts, nothing more is recorded or settled, the leases
// held are left to expire; it returns that error once the running
// handlers have returned.
func (d *Deduplicator) HandleBatch(ctx context.Context, dls []Delivery, opts BatchOptions,
	fn func(ctx context.Context, i int) error, settle func(group []Settled) error) error {
	if len(dls) == 0 || ctx.Err() != nil {
		return nil // nothing decided
	}
	if opts.FlushInterval <= 0 {
		opts.FlushInterval = DefaultFlushInterval
	}
	if opts.InOrder {
		opts.Concurrency = 1
	}
	_, batched := d.guard.Store().(idem.BatchStore)
	b := &batchRun{
		d: d, ctx: ctx, dls: dls, opts: opts, fn: fn, settle: settle,
		batched:  batched,
		stopAt:   len(dls),
		att:      make([]*idem.Attempt, len(dls)),
		started:  make([]bool, len(dls)),
		dups:     map[int][]int{},
		items:    make(chan batchItem, len(dls)),
		ready:    make(chan readyDup, len(dls)),
		halt:     make(chan struct{}),
		abort:    make(chan struct{}),
		panicked: make(chan struct{}),
		flushed:  make(chan struct{}),
	}
	return b.run()
}

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
	stopAt int           // InOrder: the first index decided in prepare so that it stops the rest
	items  chan batchItem
	ready  chan readyDup // later deliveries whose first one is recorded

	haltOnce sync.Once
	halt     chan struct{} // InOrder: closed when a delivery stopped the batch

	abortOnce sync.Once
	abort     chan struct{} // closed when settle failed
	panicOnce sync.Once
	panicked  chan struct{} // closed when a handler panicked
	abortErr  error
	flushed   chan struct{} // closed when the flusher returned
}

// batchItem is a delivery whose handler returned (att set: the result is
// still to be recorded) or that is decided (att nil).
type batchItem struct {
	i        int
	att      *idem.Attempt
	ferr     error // the handler's error, with att
	stopped  bool  // with att: the handler was stopped from outside
	res      Result
	err      error
	panicked bool // the handler panicked: nothing to settle
}

type readyDup struct {
	i    int
	skip bool // its first delivery panicked or was not decided: do not run it
}

func (b *batchRun) run() (err error) {
	initial := b.prepare()
	go b.flusher()

	pool := workpool.New(b.opts.Concurrency)
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
		if b.stopping() || pool.Stopped() {
			break
		}
		if !b.take(i) {
			continue
		}
		if !pool.Go(func() { b.work(i) }) {
			b.untake(i)
			break
		}
	}
	pending := 0
	for _, later := range b.dups {
		pending += len(later)
	}
	for ; pending > 0 && !b.stopping() && !pool.Stopped(); pending-- {
		var r readyDup
		select {
		case r = <-b.ready:
		case <-b.abort:
			continue
		case <-b.panicked:
			continue
		case <-b.halt:
			continue
		case <-b.ctx.Done():
			continue
		}
		if r.skip || !b.take(r.i) {
			continue
		}
		if !pool.Go(func() { b.work(r.i) }) {
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
	return b.abortErr
}

// stopping reports whether no more handlers should start.
func (b *batchRun) stopping() bool {
	select {
	case <-b.abort:
		return true
	case <-b.panicked:
		return true
	case <-b.halt:
		return true
	default:
	}
	return b.ctx.Err() != nil
}

// stops reports whether, with InOrder, a delivery decided so stops the
// deliveries after it: InFlight, Failed, or a store error.
func (b *batchRun) stops(res Result, err error) bool {
	if !b.opts.InOrder {
		return false
	}
	switch res.Outcome {
	case InFlight, Failed:
		return true
	case 0:
		return err != nil && !errors.Is(err, idem.ErrInvalidKey) && !errors.Is(err, idem.ErrMismatch)
	}
	return false
}

func (b *batchRun) stopHere() { b.haltOnce.Do(func() { close(b.halt) }) }

func (b *batchRun) onPanic(i int) {
	b.panicOnce.Do(func() { close(b.panicked) })
	b.items <- batchItem{i: i, panicked: true}
}

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

// prepare derives the keys, sets the later deliveries of repeated keys
// apart, decides what needs no handler and, on a batch store, acquires
// the rest in one step. It returns the indexes to run, in order.
func (b *batchRun) prepare() []int {
	var (
		reqs  []idem.BeginRequest
		at    []int
		first = map[idem.Key]int{}
		run   []int
	)
	for i, dl := range b.dls {
		key, err := b.d.scope.Key(dl.Key)
		if err != nil {
			b.decided(i, Result{}, err)
			continue
		}
		if j, ok := first[key]; ok {
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
				b.decided(i, Result{Outcome: Duplicate}, nil)
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

func (b *batchRun) decided(i int, res Result, err error) {
	if b.stops(res, err) {
		b.stopAt = min(b.stopAt, i)
	}
	b.items <- batchItem{i: i, res: res, err: err}
}

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
		if b.stops(res, err) {
			b.stopHere()
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
	stopped := b.ctx.Err() != nil || context.Cause(att.Context()) != nil
	if b.opts.InOrder && ferr != nil && (stopped || max(dl.Attempt, 1) < b.d.cfg.MaxFailures) {
		b.stopHere() // Failed
	}
	b.items <- batchItem{i: i, att: att, ferr: ferr, stopped: stopped}
}

// finishUp, once no handler runs any more, frees the keys acquired for
// handlers that never started (or, after an abort, leaves them to expire,
// as a crash would) and waits for the flusher to record and settle the
// rest.
func (b *batchRun) finishUp() {
	var release []idem.Finish
	aborted := b.aborted()
	b.mu.Lock()
	for i, att := range b.att {
		if att != nil && !b.started[i] {
			b.started[i] = true
			if aborted {
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
	<-b.flushed
}

func (b *batchRun) aborted() bool {
	select {
	case <-b.abort:
		return true
	default:
		return false
	}
}

// flusher collects decided deliveries and flushes them in groups: when
// every delivery of the batch is decided, or FlushInterval after the
// first of a group arrived.
func (b *batchRun) flusher() {
	defer close(b.flushed)
	var (
		group   []batchItem
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
	if b.aborted() {
		for _, it := range group {
			if it.att != nil {
				it.att.Stop()
			}
			b.releaseDups(it.i, true)
		}
		return
	}
	var fins []idem.Finish
	var at []int
	for k, it := range group {
		if it.att == nil {
			continue
		}
		var resp *idem.Response
		switch {
		case it.ferr == nil:
			resp = &idem.Response{Status: StatusProcessed}
		case !it.stopped && max(b.dls[it.i].Attempt, 1) >= b.d.cfg.MaxFailures:
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
				it.res, it.err = Result{Outcome: Processed}, err
			case resp != nil: // dead letter
				switch {
				case err == nil:
					it.res = Result{Outcome: DeadLettered, Err: it.ferr}
				case errors.Is(err, idem.ErrNotReplicated):
					it.res, it.err = Result{Outcome: DeadLettered, Err: it.ferr}, err // recorded
				default:
					// Not recorded (the key was released unless the lease
					// was lost): the next delivery fails and tries again.
					it.res, it.err = Result{Outcome: Failed, Err: it.ferr}, err
				}
			default:
				it.res, it.err = Result{Outcome: Failed, Err: it.ferr}, err
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
			b.abortOnce.Do(func() {
				b.abortErr = err
				close(b.abort)
			})
		}
	}
	for _, it := range group {
		b.releaseDups(it.i, it.panicked || b.aborted())
	}
}

func (b *batchRun) releaseDups(i int, skip bool) {
	for _, j := range b.dups[i] {
		b.ready <- readyDup{i: j, skip: skip}
	}
}
