package redisstream

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemmsg"
)

// readBatch is read with Batch. After a read that returned a full batch
// (a backlog, likely), the next read is sent at once, without BLOCK,
// while this batch is handled, so that its round trip overlaps the
// batch's; the next call takes its entries (or, if it found none, reads
// again, blocking). Entries read ahead when Run stops stay pending, as
// the rest of a batch does, for a claim.
func (r *runner) readBatch(ctx context.Context, block time.Duration) error {
	var msgs []redis.XMessage
	if r.ahead != nil {
		res := <-r.ahead
		r.ahead = nil
		if res.err != nil {
			r.onError(fmt.Errorf("redisstream: XREADGROUP %s (ahead): %w", r.Stream, res.err))
		}
		msgs = res.msgs
	}
	if len(msgs) == 0 {
		var err error
		msgs, err = r.rc.readGroup(ctx, r.Stream, r.Group, r.Consumer.Consumer, r.count, block)
		if err != nil {
			return fmt.Errorf("redisstream: XREADGROUP %s: %w", r.Stream, err)
		}
	}
	if int64(len(msgs)) == r.count && ctx.Err() == nil {
		ahead := make(chan readResult, 1)
		go func() {
			msgs, err := r.rc.readGroup(ctx, r.Stream, r.Group, r.Consumer.Consumer, r.count, -1)
			ahead <- readResult{msgs, err}
		}()
		r.ahead = ahead
	}
	keys := make([]string, len(msgs))
	for i, msg := range msgs {
		keys[i] = r.key(msg)
	}
	// The batches overlap: the next one is read and started while the one
	// before records and settles its last group (see loop.Pipeline).
	return r.pipe.Run(keys, func(handled func()) error {
		return r.processBatch(ctx, msgs, func(redis.XMessage) (int, bool) { return 1, true }, handled)
	})
}

// processBatch decides msgs with one Deduplicator.HandleBatch call
// (Consumer.Batch), skipping those for which attempt reports false, and
// settles each group of decided entries: the dead letters added first,
// then one XACK for the group. handled, if not nil, is
// BatchOptions.Handled.
func (r *runner) processBatch(ctx context.Context, msgs []redis.XMessage, attempt func(redis.XMessage) (int, bool), handled func()) error {
	batch := make([]redis.XMessage, 0, len(msgs))
	dls := make([]idemmsg.Delivery, 0, len(msgs))
	for _, msg := range msgs {
		n, ok := attempt(msg)
		if !ok {
			continue
		}
		batch = append(batch, msg)
		dls = append(dls, idemmsg.Delivery{Key: r.key(msg), Attempt: n})
	}
	err := r.Dedup.HandleBatch(ctx, dls, idemmsg.BatchOptions{Concurrency: r.Concurrency, FlushInterval: r.FlushInterval, Handled: handled},
		func(ctx context.Context, i int) error { return r.Handler(ctx, batch[i]) },
		func(group []idemmsg.Settled) error { return r.settleGroup(ctx, batch, group) })
	if errors.Is(err, errCrashed) {
		return errCrashed
	}
	return err
}

// settleGroup acknowledges a group of decided entries, as process does
// one entry: XADD for each dead letter, then one XACK for the group.
func (r *runner) settleGroup(ctx context.Context, batch []redis.XMessage, group []idemmsg.Settled) error {
	ids := make([]string, 0, len(group))
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), ackTimeout)
	defer cancel()
	for _, st := range group {
		msg, res, err := batch[st.Index], st.Result, st.Err
		if r.OnResult != nil {
			r.OnResult(msg, res, err)
		}
		if err != nil {
			r.onError(fmt.Errorf("redisstream: %s %s: %w", r.Stream, msg.ID, err))
		}
		outcome := res.Outcome
		if outcome == idemmsg.NoOutcome && (errors.Is(err, idem.ErrInvalidKey) || errors.Is(err, idem.ErrMismatch) || errors.Is(err, idem.ErrUnsealable)) {
			outcome, res.Err = idemmsg.DeadLettered, err // permanent: never handled
		}
		if !outcome.Ack() {
			continue // pending: claimed again after MinIdle
		}
		if r.beforeAck != nil && !r.beforeAck(msg) {
			return errCrashed
		}
		if outcome == idemmsg.DeadLettered && r.DeadLetterStream != "" {
			if err := r.rc.add(sctx, r.DeadLetterStream, r.deadLetterValues(msg, res.Err)); err != nil {
				r.onError(fmt.Errorf("redisstream: XADD %s (dead letter of %s): %w", r.DeadLetterStream, msg.ID, err))
				continue // pending: the next delivery is dead-lettered again
			}
		}
		ids = append(ids, msg.ID)
	}
	if len(ids) == 0 {
		return nil
	}
	if err := r.rc.ack(sctx, r.Stream, r.Group, ids...); err != nil {
		r.onError(fmt.Errorf("redisstream: XACK %s (%d entries from %s): %w", r.Stream, len(ids), ids[0], err))
	}
	return nil
}
