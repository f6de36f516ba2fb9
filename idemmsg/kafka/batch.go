package kafka

import (
	"context"
	"errors"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemkit/idem/idemmsg"
	"github.com/idemkit/idem/idemmsg/internal/loop"
)

// partitionBatches is partition with Consumer.Batch: the records, in
// offset order, in batches of up to BatchSize, each decided with one
// HandleBatch call (InOrder). After each batch the offset is committed
// past the records done; the first record not done (InFlight or Released:
// it stopped its batch) is retried in place after a backoff, at the head
// of the next batch. A later record the stopped batch settled anyway (one
// that needed no handler: Replayed, DeadLettered) is done and not decided
// again. It returns only errCrashed.
func (r *runner) partitionBatches(ctx context.Context, recs []*kgo.Record) error {
	type verdict struct {
		done       bool
		outcome    idemmsg.Outcome
		retryAfter time.Duration
		failed     bool
	}
	verdicts := make([]verdict, len(recs)) // by position in recs
	pos, failures, tries := 0, 0, 0        // recs[:pos] are done and committed
	for pos < len(recs) {
		if ctx.Err() != nil {
			return nil // the rest is left uncommitted, for the group to re-read
		}
		if r.crashed.Load() { // in tests: another partition crashed
			return errCrashed
		}
		// The batch: the next records not done, recs[pos] first.
		var at []int // positions in recs
		for i := pos; i < len(recs) && len(at) < r.batchSize; i++ {
			if !verdicts[i].done {
				at = append(at, i)
			}
		}
		dls := make([]idemmsg.Delivery, len(at))
		for j, i := range at {
			attempt := 1
			if j == 0 {
				attempt = failures + 1
			}
			dls[j] = idemmsg.Delivery{Key: r.key(recs[i]), Attempt: attempt, Body: recs[i].Value}
		}
		for _, i := range at {
			verdicts[i] = verdict{} // not done: decided again by this batch, or left undecided
		}
		err := r.Dedup.HandleBatch(ctx, dls, idemmsg.BatchOptions{InOrder: true, FlushInterval: r.FlushInterval},
			func(ctx context.Context, j int) error { return r.Handler(ctx, recs[at[j]]) },
			func(group []idemmsg.Settled) error {
				for _, st := range group {
					rec := recs[at[st.Index]]
					outcome, retryAfter, failed := r.decide(ctx, rec, st.Result, st.Err)
					v := verdict{outcome: outcome, retryAfter: retryAfter, failed: failed}
					if outcome.Ack() {
						if r.crashed.Load() || (r.beforeCommit != nil && !r.beforeCommit(rec)) {
							r.crashed.Store(true)
							return errCrashed
						}
						v.done = true
					}
					verdicts[at[st.Index]] = v
				}
				return nil
			})
		if errors.Is(err, errCrashed) {
			return errCrashed
		}
		k := pos
		for k < len(recs) && verdicts[k].done {
			k++
		}
		if k > pos {
			r.commit(ctx, recs[k-1])
			pos = k
			failures, tries = 0, 0
		}
		if pos == len(recs) || pos > at[len(at)-1] {
			continue // every record of the batch is done
		}
		// recs[pos] stopped the batch (or ctx ended before it was decided).
		v := verdicts[pos]
		if v.failed {
			failures++
		}
		tries++
		wait := backoff(tries)
		if v.outcome == idemmsg.InFlight && v.retryAfter > 0 && v.retryAfter < wait {
			wait = v.retryAfter
		}
		loop.Sleep(ctx, wait)
	}
	return nil
}
