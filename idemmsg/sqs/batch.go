package sqs

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/idemkit/idem/idemmsg"
	"github.com/idemkit/idem/idemmsg/internal/loop"
	"github.com/idemkit/idem/idemmsg/internal/workpool"
)

// processBatch decides msgs (one receive) with one HandleBatch call
// (Consumer.Batch) and settles each group of decided messages: dead
// letters sent first, then one DeleteMessageBatch for the group, and one
// ChangeMessageVisibilityBatch for those to come back later. Messages the
// store could not decide stay held and are decided again, with one
// HandleBatch call per try, until the store answers or ctx ends. handled
// is BatchOptions.Handled.
//
// On a FIFO queue with Concurrency above 1, each message group of msgs
// gets a HandleBatch call of its own, in order within the group
// (BatchOptions.InOrder), Concurrency groups at a time.
func (r *runner) processBatch(ctx context.Context, msgs []types.Message, handled func()) error {
	if gs := r.groups(msgs); r.fifo && r.Concurrency > 1 && len(gs) > 1 {
		pool := workpool.New(r.Concurrency)
		var mu sync.Mutex
		var first error
		for _, g := range gs {
			if ctx.Err() != nil || !pool.Go(func() {
				if err := r.processGroup(ctx, g, nil); err != nil {
					mu.Lock()
					first = cmp.Or(first, err)
					mu.Unlock()
					pool.Stop()
				}
			}) {
				break
			}
		}
		pool.Wait()
		return first
	}
	return r.processGroup(ctx, msgs, handled)
}

// processGroup is processBatch with one HandleBatch call per try.
func (r *runner) processGroup(ctx context.Context, msgs []types.Message, handled func()) error {
	for try := 1; len(msgs) > 0; try++ {
		retry, err := r.decideBatch(ctx, msgs, handled)
		if err != nil || len(retry) == 0 || ctx.Err() != nil {
			return err // undecided ones stay held: Run hands them back
		}
		loop.Sleep(ctx, r.backoff(try))
		msgs = retry
	}
	return nil
}

// decideBatch is one HandleBatch call over msgs. It returns the messages
// the store could not decide (while ctx lasts), to be decided again, and
// settles the others. On a FIFO queue the handlers run in batch order and
// stop at the first message not acknowledged (BatchOptions.InOrder): the
// ones left undecided are handed back, behind it.
func (r *runner) decideBatch(ctx context.Context, msgs []types.Message, handled func()) (retry []types.Message, err error) {
	dls := make([]idemmsg.Delivery, len(msgs))
	for i, msg := range msgs {
		dls[i] = r.delivery(msg)
	}
	decided := make([]bool, len(msgs))
	err = r.Dedup.HandleBatch(ctx, dls, idemmsg.BatchOptions{Concurrency: r.Concurrency, FlushInterval: r.FlushInterval, Handled: handled, InOrder: r.fifo},
		func(ctx context.Context, i int) error { return r.Handler(ctx, msgs[i]) },
		func(group []idemmsg.Settled) error {
			var del []types.Message
			later := map[time.Duration][]types.Message{}
			for _, st := range group {
				msg, res, err := msgs[st.Index], st.Result, st.Err
				decided[st.Index] = true
				if undecided(res, err) && ctx.Err() == nil {
					r.onError(fmt.Errorf("sqs: %s kept, to decide again: %w", describe(msg), err))
					retry = append(retry, msg)
					continue
				}
				if r.OnResult != nil {
					r.OnResult(msg, res, err)
				}
				if err != nil {
					r.onError(fmt.Errorf("sqs: %s: %w", describe(msg), err))
				}
				outcome := r.outcome(&res, err)
				switch {
				case undecided(res, err): // ctx ended: held, Run hands it back
				case outcome.Ack():
					if r.crash(msg) {
						return errCrashed
					}
					if outcome == idemmsg.DeadLettered {
						sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), callTimeout)
						ok := r.deadLetter(sctx, msg, res.Err)
						cancel()
						if !ok {
							d := r.backoff(dls[st.Index].Attempt)
							later[d] = append(later[d], msg) // the next delivery is dead-lettered again
							continue
						}
					}
					del = append(del, msg)
				case outcome == idemmsg.InFlight:
					later[res.RetryAfter] = append(later[res.RetryAfter], msg)
				default: // Released
					d := r.backoff(dls[st.Index].Attempt)
					later[d] = append(later[d], msg)
				}
			}
			// The outcomes are recorded: settle them even if ctx ended.
			sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), callTimeout)
			defer cancel()
			r.delete(sctx, del...)
			for d, msgs := range later {
				r.setVisibility(sctx, d, msgs...)
			}
			return nil
		})
	if err != nil {
		if errors.Is(err, errCrashed) {
			return nil, errCrashed
		}
		return nil, err
	}
	if r.fifo && ctx.Err() == nil {
		var rest []types.Message
		for i, msg := range msgs {
			if !decided[i] {
				rest = append(rest, msg)
			}
		}
		r.handBack(ctx, rest...)
	}
	return retry, nil
}
