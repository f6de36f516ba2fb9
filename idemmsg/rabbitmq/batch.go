package rabbitmq

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemmsg"
)

// runBatches is Run's loop with Consumer.Batch. A goroutine takes the
// deliveries as they arrive; the loop takes the first one waiting and
// every other one already there (up to the prefetch), decides them with
// one HandleBatch call, and settles each group: its acknowledgements with
// one multiple-ack where the channel allows it (see ackTracker).
func (r *run) runBatches(tag string, deliveries <-chan amqp.Delivery, max int) error {
	c, ctx := r.c, r.ctx
	in := make(chan amqp.Delivery, max)
	closed := make(chan struct{}) // deliveries closed
	stopRead := make(chan struct{})
	readerDone := make(chan struct{})
	go func() {
		defer close(readerDone)
		for {
			select {
			case <-stopRead:
				return
			case d, ok := <-deliveries:
				if !ok {
					close(closed)
					return
				}
				select {
				case in <- d:
				case <-stopRead:
					c.nack(d, c.key(d), true) // received, not handled: back at once
					return
				}
			}
		}
	}()
	crashed := false
	lost := false // the deliveries stopped: the channel is gone with what it held
	defer func() {
		close(stopRead)
		<-readerDone
		close(in)
		for d := range in { // received, not handled: back at once (abandoned after a crash)
			if !crashed && !lost {
				c.nack(d, c.key(d), true)
			}
		}
		if ctx.Err() != nil && !crashed {
			r.stop(tag, deliveries)
		}
	}()
	batch := make([]amqp.Delivery, 0, max)
	for {
		batch = batch[:0]
		select {
		case <-ctx.Done():
			return nil
		case d := <-in:
			batch = append(batch, d)
		case <-closed:
			select {
			case d := <-in: // the last ones first
				batch = append(batch, d)
			default:
				if ctx.Err() != nil {
					return nil
				}
				lost = true
				return ErrChannelLost
			}
		}
	more:
		for len(batch) < max {
			select {
			case d := <-in:
				batch = append(batch, d)
			default:
				break more
			}
		}
		for _, d := range batch {
			r.acks.took(d.DeliveryTag)
		}
		if err := r.processBatch(batch); err != nil {
			crashed = errors.Is(err, errCrashed)
			r.abandonHeld() // abandon held deliveries at once, as a crash would
			return err
		}
	}
}

// processBatch decides batch with one HandleBatch call and settles each
// group as process settles one delivery. Deliveries left undecided (the
// context ended first) are requeued at once.
func (r *run) processBatch(batch []amqp.Delivery) error {
	c := r.c
	type entry struct {
		d       amqp.Delivery
		key     string
		attempt int
	}
	entries := make([]entry, 0, len(batch))
	dls := make([]idemmsg.Delivery, 0, len(batch))
	var early []idemmsg.Settled // no key: decided without the Deduplicator
	for _, d := range batch {
		key := c.key(d)
		attempt, counted := deliveryCount(d)
		if key == "" && c.Key == nil {
			early = append(early, idemmsg.Settled{Index: len(entries), Err: ErrNoMessageID})
			entries = append(entries, entry{d, key, attempt})
			continue
		}
		if !counted {
			attempt = r.count(key, d.Redelivered)
		}
		entries = append(entries, entry{d, key, attempt})
		dls = append(dls, idemmsg.Delivery{Key: key, Attempt: attempt, Body: d.Body})
	}
	// at maps an index of dls to one of entries.
	at := make([]int, 0, len(dls))
	for i, e := range entries {
		if !(e.key == "" && c.Key == nil) {
			at = append(at, i)
		}
	}
	settled := make([]bool, len(entries))
	settle := func(group []idemmsg.Settled) error {
		var acks []uint64
		for _, st := range group {
			e := entries[st.Index]
			settled[st.Index] = true
			res, err := st.Result, st.Err
			if c.OnResult != nil {
				c.OnResult(e.d, res, err)
			}
			if err != nil {
				c.onError(fmt.Errorf("rabbitmq: %s: %w", describe(e.d, e.key), err))
			}
			outcome := res.Outcome
			if outcome == idemmsg.NoOutcome && (errors.Is(err, ErrNoMessageID) || errors.Is(err, idem.ErrInvalidKey) || errors.Is(err, idem.ErrMismatch) || errors.Is(err, idem.ErrUnsealable)) {
				outcome = idemmsg.DeadLettered // permanent: never handled
			}
			if c.beforeAck != nil && !c.beforeAck(e.d) {
				r.acks.ack(c, r.ch, acks) // those before it were settled
				return errCrashed
			}
			switch outcome {
			case idemmsg.Executed, idemmsg.Replayed:
				r.forget(e.key)
				acks = append(acks, e.d.DeliveryTag)
			case idemmsg.DeadLettered:
				r.forget(e.key)
				r.acks.nack(c, e.d, e.key, false)
			case idemmsg.InFlight:
				r.requeueAfter(e.d, e.key, max(res.RetryAfter, minRetryDelay))
			default: // Released, or the store could not decide
				r.requeueAfter(e.d, e.key, c.retryDelay(e.attempt))
			}
		}
		r.acks.ack(c, r.ch, acks)
		return nil
	}
	if len(early) > 0 {
		if err := settle(early); err != nil {
			return err
		}
	}
	err := c.Dedup.HandleBatch(r.ctx, dls, idemmsg.BatchOptions{Concurrency: c.Concurrency, FlushInterval: c.FlushInterval},
		func(ctx context.Context, i int) error { return c.Handler(ctx, entries[at[i]].d) },
		func(group []idemmsg.Settled) error {
			for k := range group {
				group[k].Index = at[group[k].Index]
			}
			return settle(group)
		})
	if err != nil {
		return err
	}
	for i, e := range entries {
		if !settled[i] { // the context ended first: hand it back at once
			r.acks.nack(c, e.d, e.key, true)
		}
	}
	return nil
}

// ackTracker keeps the delivery tags taken from the channel and not yet
// settled, so that a group of acknowledgements goes out as one
// multiple-ack (basic.ack with multiple set, which acknowledges every
// unacknowledged tag up to it on the channel) whenever every tag up to
// the group's highest is being acknowledged; the others of the group are
// acknowledged one by one. Tags on a channel increase, and the deliveries
// not yet taken have higher tags than any taken, so only the tags held
// here can be below a multiple-ack. Every settlement of a batch run goes
// through it (the lock keeps the frames in the order of the bookkeeping).
// It assumes the channel is Run's alone, with nothing unacknowledged from
// before (one channel per Run loop, as Consumer.Channel says).
type ackTracker struct {
	mu   sync.Mutex
	open []uint64 // taken and not settled, ascending
	// multiples counts the multiple-acks sent, for tests.
	multiples, singles int
}

func (t *ackTracker) took(tag uint64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	i, _ := slices.BinarySearch(t.open, tag)
	t.open = slices.Insert(t.open, i, tag)
}

func (t *ackTracker) drop(tag uint64) bool {
	i, ok := slices.BinarySearch(t.open, tag)
	if ok {
		t.open = slices.Delete(t.open, i, i+1)
	}
	return ok
}

// ack acknowledges tags: one multiple-ack for the longest run of them at
// the start of the open tags, then one ack for each of the rest.
func (t *ackTracker) ack(c *Consumer, ch *amqp.Channel, tags []uint64) {
	if len(tags) == 0 {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	want := make(map[uint64]bool, len(tags))
	for _, tag := range tags {
		want[tag] = true
	}
	n := 0
	for n < len(t.open) && want[t.open[n]] {
		n++
	}
	if n >= 2 {
		upTo := t.open[n-1]
		if err := ch.Ack(upTo, true); err != nil && !errors.Is(err, amqp.ErrClosed) {
			c.onError(fmt.Errorf("rabbitmq: ack up to delivery %d: %w", upTo, err))
		}
		for _, tag := range t.open[:n] {
			delete(want, tag)
		}
		t.open = slices.Delete(t.open, 0, n)
		t.multiples++
	}
	for _, tag := range tags {
		if !want[tag] {
			continue
		}
		t.drop(tag)
		if err := ch.Ack(tag, false); err != nil && !errors.Is(err, amqp.ErrClosed) {
			c.onError(fmt.Errorf("rabbitmq: ack delivery %d: %w", tag, err))
		}
		t.singles++
	}
}

// nack rejects d (requeued or to the dead-letter exchange).
func (t *ackTracker) nack(c *Consumer, d amqp.Delivery, key string, requeue bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.drop(d.DeliveryTag)
	c.nack(d, key, requeue)
}
