package natsjs

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/idemmsg"
	"github.com/idemkit/idem/idemmsg/internal/loop"
)

// pulled is one Next of the iterator: a message, or the error that ended
// the pulling.
type pulled struct {
	msg jetstream.Msg
	err error
}

// consumeBatches is consume with Consumer.Batch: a goroutine takes
// messages from the iterator as they come; the loop takes the first one
// waiting, and with it every other one already there (up to max), and
// decides them with one HandleBatch call.
func (c *Consumer) consumeBatches(ctx context.Context, it jetstream.MessagesContext, max int) (err error) {
	pull, stopPull := context.WithCancel(ctx)
	in := make(chan pulled, max)
	readerDone := make(chan struct{})
	var crashed atomic.Bool
	handBack := func(msg jetstream.Msg) { // taken but not handled: let it go at once
		if msg != nil && !crashed.Load() {
			c.nak(msg, 0)
		}
	}
	go func() {
		defer close(readerDone)
		// One option for every Next (it keeps no state): none made per
		// message.
		next := []jetstream.NextOpt{jetstream.NextContext(pull)}
		for {
			msg, err := it.Next(next...)
			if pull.Err() != nil {
				handBack(msg)
				return
			}
			select {
			case in <- pulled{msg: msg, err: err}:
			case <-pull.Done():
				handBack(msg)
				return
			}
			if err != nil {
				return
			}
		}
	}()
	defer func() {
		stopPull()
		<-readerDone
		close(in)
		for p := range in {
			handBack(p.msg)
		}
	}()
	// The batches overlap: the next one is taken and started while the one
	// before records and settles its last group (see loop.Pipeline).
	var pipe loop.Pipeline
	defer func() {
		if werr := pipe.Wait(); werr != nil && err == nil {
			err = werr
			crashed.Store(errors.Is(err, errCrashed))
		}
	}()
	for {
		batch := make([]jetstream.Msg, 0, max)
		var perr error
		select {
		case <-ctx.Done():
			return nil
		case p := <-in:
			if p.err != nil {
				return fmt.Errorf("natsjs: pull: %w", p.err)
			}
			batch = append(batch, p.msg)
		}
	more:
		for len(batch) < max {
			select {
			case p := <-in:
				if p.err != nil {
					perr = p.err
					break more
				}
				batch = append(batch, p.msg)
			default:
				break more
			}
		}
		keys := make([]string, len(batch))
		for i, msg := range batch {
			keys[i] = c.key(msg)
		}
		err := pipe.Run(keys, func(handled func()) error { return c.processBatch(ctx, batch, handled) })
		if err != nil {
			crashed.Store(errors.Is(err, errCrashed))
			return err
		}
		if perr != nil {
			return fmt.Errorf("natsjs: pull: %w", perr)
		}
	}
}

// batchEntry is one message of a batch, with what settle needs.
type batchEntry struct {
	msg     jetstream.Msg
	meta    *jetstream.MsgMetadata
	key     string
	attempt int
}

// processBatch decides batch with one HandleBatch call and settles each
// group as process settles one message. Messages the store could not
// decide are held (see hold) and decided again, with one HandleBatch call
// per try, until the store answers or ctx ends. Messages left undecided
// (the context ended first) are handed back at once. handled is
// BatchOptions.Handled.
func (c *Consumer) processBatch(ctx context.Context, batch []jetstream.Msg, handled func()) error {
	entries := make([]batchEntry, 0, len(batch))
	for _, msg := range batch {
		attempt, meta := attemptOf(msg)
		key := c.key(msg)
		if key == "" && c.Key == nil {
			if err := c.settle(ctx, msg, meta, key, attempt, idemmsg.Result{}, ErrNoMsgID); err != nil {
				return err
			}
			continue
		}
		entries = append(entries, batchEntry{msg, meta, key, attempt})
	}
	for try := 1; len(entries) > 0; try++ {
		retry, err := c.decideBatch(ctx, entries, handled)
		if err != nil || len(retry) == 0 {
			return err
		}
		msgs := make([]jetstream.Msg, len(retry))
		for i, e := range retry {
			msgs[i] = e.msg
		}
		c.hold(ctx, try, msgs...)
		entries = retry
	}
	return nil
}

// decideBatch is one HandleBatch call over entries. It returns the
// entries the store could not decide (while ctx lasts), to be decided
// again, and settles the others.
func (c *Consumer) decideBatch(ctx context.Context, entries []batchEntry, handled func()) (retry []batchEntry, err error) {
	dls := make([]idemmsg.Delivery, len(entries))
	for i, e := range entries {
		dls[i] = idemmsg.Delivery{Key: e.key, Attempt: e.attempt, Body: e.msg.Data()}
	}
	settled := make([]bool, len(entries))
	err = c.Dedup.HandleBatch(ctx, dls, idemmsg.BatchOptions{Concurrency: c.Concurrency, FlushInterval: c.FlushInterval, Handled: handled},
		func(ctx context.Context, i int) error { return c.Handler(ctx, entries[i].msg) },
		func(group []idemmsg.Settled) error {
			for _, st := range group {
				e := entries[st.Index]
				if undecided(st.Result, st.Err) && ctx.Err() == nil {
					c.onError(fmt.Errorf("natsjs: %s kept, to decide again: %w", describe(e.msg), st.Err))
					retry = append(retry, e)
				} else if err := c.settle(ctx, e.msg, e.meta, e.key, e.attempt, st.Result, st.Err); err != nil {
					return err
				}
				settled[st.Index] = true
			}
			return nil
		})
	if err != nil {
		return nil, err
	}
	for i, e := range entries {
		if !settled[i] {
			c.nak(e.msg, 0)
		}
	}
	return retry, nil
}
