package rabbitmq

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"
)

// TestBatchMultipleAck: with Batch, groups are acknowledged with
// multiple-acks where the channel allows, deliveries held for a requeue
// (failed ones) are never covered by one, and nothing is left
// unacknowledged: once the consumer's channel is closed, the queue is
// empty.
func TestBatchMultipleAck(t *testing.T) {
	for _, conc := range []int{1, 4} {
		t.Run(fmt.Sprint("concurrency=", conc), func(t *testing.T) {
			e := newEnv(t, envOpts{})
			keys := make([]string, 200)
			for i := range keys {
				keys[i] = fmt.Sprintf("order-%d", i%150)
			}
			e.publish(true, keys...)
			var mu sync.Mutex
			failed := map[string]bool{}
			var tracker *ackTracker
			c := e.consumer("c1", nil, nil, nil)
			c.Batch, c.Concurrency = true, conc
			c.watchTracker(func(a *ackTracker) { tracker = a })
			c.Handler = func(ctx context.Context, d amqp.Delivery) error {
				key := string(d.Body)
				mu.Lock()
				first := !failed[key]
				failed[key] = true
				mu.Unlock()
				if first && len(key)%3 == 0 { // some fail once: held, then requeued
					return errors.New("transient")
				}
				return e.ledger.Apply(ctx, key)
			}
			stop := e.start(c)
			waitFor(t, "every delivery settled", func() bool { return int(e.acked.Load()) >= len(keys) })
			e.checkLedger(keys, stop)
			tracker.mu.Lock()
			defer tracker.mu.Unlock()
			if tracker.multiples == 0 || len(tracker.open) != 0 {
				t.Errorf("%d multiple-acks, %d single acks, %d deliveries left open; want some multiple-acks and none open",
					tracker.multiples, tracker.singles, len(tracker.open))
			}
			t.Logf("%d multiple-acks, %d single acks", tracker.multiples, tracker.singles)
		})
	}
}
