package redisstream

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/idemmsg"
	"github.com/idemkit/idem/redisstore"
)

// TestTwoStreamsEmptyNamespace: one Deduplicator with an empty Namespace
// for two streams whose entries have the same id (1-1 in both: entry ids
// are per stream). Before, the second stream's refund was acked without
// running (the first stream's record answered it); now its consumer is
// refused at Run with ErrSharedNamespace, and the entry stays pending.
// With a Namespace per stream, both run.
func TestTwoStreamsEmptyNamespace(t *testing.T) {
	ctx := context.Background()
	c := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	defer c.Close()
	name := fmt.Sprintf("two-%d", time.Now().UnixNano())
	store, err := redisstore.New(c, redisstore.Options{Prefix: "idem:" + name + ":", Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	payments, refunds := name+":payments", name+":refunds"
	for _, s := range []string{payments, refunds} {
		if err := c.XAdd(ctx, &redis.XAddArgs{Stream: s, ID: "1-1", Values: []any{"op", s}}).Err(); err != nil {
			t.Fatal(err)
		}
	}
	var ran [2]atomic.Int32
	consumer := func(d *idemmsg.Deduplicator, stream string, n *atomic.Int32) *Consumer {
		return &Consumer{Client: c, Stream: stream, Group: "g", Consumer: "c", Dedup: d, Block: 50 * time.Millisecond,
			Handler: func(ctx context.Context, msg redis.XMessage) error { n.Add(1); return nil },
			OnError: func(err error) { t.Logf("%s: %v", stream, err) }}
	}
	run := func(cons *Consumer, until func() bool) error {
		rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		done := make(chan error, 1)
		go func() { done <- cons.Run(rctx) }()
		for until == nil || !until() {
			select {
			case err := <-done:
				return err
			case <-time.After(10 * time.Millisecond):
			}
		}
		cancel()
		return <-done
	}
	shared, err := idemmsg.New(store, idemmsg.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if err := run(consumer(shared, payments, &ran[0]), func() bool { return ran[0].Load() == 1 }); err != nil {
		t.Fatal(err)
	}
	err = run(consumer(shared, refunds, &ran[1]), nil)
	if !errors.Is(err, idemmsg.ErrSharedNamespace) {
		t.Fatalf("the refunds consumer on the payments' Deduplicator: Run returned %v (the refund ran %d times); want ErrSharedNamespace",
			err, ran[1].Load())
	}
	t.Log(err)
	if pending, _ := c.XPending(ctx, refunds, "g").Result(); ran[1].Load() != 0 || (pending != nil && pending.Count != 0) {
		t.Errorf("refund ran %d times, %v pending; want it not run, not acked", ran[1].Load(), pending)
	}
	// The same Deduplicator on its own stream again is fine (a restart).
	if err := shared.Serve("redis stream " + payments); err != nil {
		t.Errorf("Serve of the same stream again: %v", err)
	}
	// A Deduplicator per stream, each with its Namespace: the refund runs.
	own, err := idemmsg.New(store, idemmsg.Config{Namespace: refunds + "/g"})
	if err != nil {
		t.Fatal(err)
	}
	if err := run(consumer(own, refunds, &ran[1]), func() bool { return ran[1].Load() == 1 }); err != nil {
		t.Fatal(err)
	}
	// A key the caller chose is the caller's: no refusal.
	keyed := consumer(shared, refunds, &ran[1])
	keyed.KeyField = "op"
	if _, err := keyed.runner(); err != nil {
		t.Errorf("with KeyField: %v", err)
	}
}
