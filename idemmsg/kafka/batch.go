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
// of the next batch. It returns only errCrashed.
func (r *runner) partitionBatches(ctx context.Context, recs []*kgo.Record) error {
	pos, failures, tries := 0, 0, 0
	for pos < len(recs) {
		if ctx.Err() != nil {
			return nil // the rest is left uncommitted, for the group to re-read
		}
		if r.crashed.Load() { // in tests: another partition crashed
			return errCrashed
		}
		chunk := recs[pos:min(pos+r.batchSize, len(recs))]
		dls := make([]idemmsg.Delivery, len(chunk))
		for i, rec := range chunk {
			attempt := 1
			if i == 0 {
				attempt = failures + 1
			}
			dls[i] = idemmsg.Delivery{Key: r.key(rec), Attempt: attempt, Body: rec.Value}
		}
		type verdict struct {
			done       bool
			outcome    idemmsg.Outcome
			retryAfter time.Duration
			failed     bool
		}
		verdicts := make([]verdict, len(chunk))
		err := r.Dedup.HandleBatch(ctx, dls, idemmsg.BatchOptions{InOrder: true, FlushInterval: r.FlushInterval},
			func(ctx context.Context, i int) error { return r.Handler(ctx, chunk[i]) },
			func(group []idemmsg.Settled) error {
				for _, st := range group {
					rec := chunk[st.Index]
					outcome, retryAfter, failed := r.decide(ctx, rec, st.Result, st.Err)
					v := verdict{outcome: outcome, retryAfter: retryAfter, failed: failed}
					if outcome.Ack() {
						if r.crashed.Load() || (r.beforeCommit != nil && !r.beforeCommit(rec)) {
							r.crashed.Store(true)
							return errCrashed
						}
						v.done = true
					}
					verdicts[st.Index] = v
				}
				return nil
			})
		if errors.Is(err, errCrashed) {
			return errCrashed
		}
		k := 0
		for k < len(chunk) && verdicts[k].done {
			k++
		}
		if k > 0 {
			r.commit(ctx, chunk[k-1])
			pos += k
			failures, tries = 0, 0
		}
		if k == len(chunk) {
			continue
		}
		// chunk[k] stopped the batch (or ctx ended before it was decided).
		v := verdicts[k]
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
