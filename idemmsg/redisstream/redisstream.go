// Package redisstream consumes a Redis stream through a consumer group with
// an idemmsg.Deduplicator: each message key's handler runs at most once per
// completed key, whatever Redis redelivers. It runs on a go-redis client
// (Consumer.Client) or a rueidis client (Consumer.Rueidis), like
// redisstore, with the same behaviour on both; handlers see a
// redis.XMessage either way. With rueidis, the blocking XREADGROUP goes
// out on a connection of rueidis's pool for blocking commands, so it does
// not hold up the commands that share the auto-pipelined connection.
//
// A Consumer reads new entries with XREADGROUP (">"), and every
// ClaimInterval takes over, with XAUTOCLAIM, entries left pending for longer
// than MinIdle by any consumer of the group (one that crashed, or this one
// after a handler error). For each entry it calls Deduplicator.Handle and
// then:
//
//	Executed, Replayed     XACK
//	DeadLettered           XADD to DeadLetterStream (when set), then XACK
//	InFlight, Released     nothing: the entry stays pending and is claimed
//	                       again once idle for MinIdle
//	invalid key, mismatch, as DeadLettered (permanent)
//	unsealable
//	store failure          nothing, as Released
//
// So MinIdle is the retry delay of a failed entry, and an entry whose
// handler outlives MinIdle may be claimed by another consumer meanwhile;
// that one gets InFlight and leaves it pending, and the holder's XACK
// settles it whoever owns it.
//
// # Delivery counts
//
// The Attempt given to Handle is Redis's delivery count for the entry: 1
// for an entry read with ">", and for a claimed entry the count XPENDING
// reports right after XAUTOCLAIM (which increments it but does not return
// it), looked up in one pipelined round trip per claimed batch. A claimed
// entry that is no longer pending by then was acknowledged meanwhile and
// is skipped. Claims that found the key InFlight, and claims made while the
// idempotency store was failing (the handler did not run), count as
// deliveries too: a handler that keeps outliving MinIdle, or a store
// outage longer than a few MinIdle periods, brings an entry nearer to
// MaxFailures.
//
// # Limits
//
// Delivery.Body is not set: a Config.Fingerprint of the Deduplicator sees
// no payload here, so duplicates are recognised by key alone. A handler
// that panics is released and the panic ends Run; the entry stays pending
// and is claimed again after MinIdle, so a message whose handler always
// panics is never dead-lettered: recover in the handler and return an
// error instead.
//
// # Lost connections
//
// Run rides out a Redis restart, a reset connection and a silent one
// without returning: it reports each failed step to OnError, waits (100ms,
// doubling to 5s; reset by a step that succeeds) and tries again, on
// whatever connection the client gives it. Both client libraries
// reconnect on their own: go-redis dials a new connection from its pool
// for the next command (and retries a command that met EOF or a refused
// dial itself, up to MaxRetries, so a short outage may not reach OnError
// at all); rueidis redials its pipelined and blocking connections on the
// next command. Nobody has to restart the consumer. Redis keeps the
// stream, the group and its pending entries across a restart only with
// persistence (an append-only file); one that forgot them gets the group
// created again at StartID, as after a deletion. Only at its start does
// Run give up on an unreachable Redis: creating the group is its first
// step, and an error there is returned, for the caller (or whatever
// restarts the process) to try again.
//
// A restart or a reset is noticed at once (EOF, connection refused,
// LOADING while Redis reads its append-only file back). A connection
// that goes silent (packets dropped, a proxy or load balancer whose
// server is gone) is noticed by timeouts, not by TCP keepalives, which a
// live middlebox answers:
//
//   - the blocking XREADGROUP fails Block+10s after it was sent: go-redis
//     sets that read deadline itself; rueidis sets none on a blocking
//     command and pings no connection that one occupies, so Run gives up
//     on the reply after Block+10s and rueidis closes the connection;
//   - other commands (XAUTOCLAIM, XPENDING, XACK, XADD) fail after
//     go-redis's ReadTimeout (default 5s), each retried up to MaxRetries
//     times on a new connection, or once the PING that rueidis sends on
//     a quiet connection (every Dialer.KeepAlive, default 1s) goes
//     unanswered for ConnWriteTimeout (default 10s); an XACK or
//     dead-letter XADD is not tried again past 5s.
//
// Run's end interrupts a rueidis read at once, but not a go-redis read:
// after ctx ends, Run may wait for the XREADGROUP in progress, up to
// Block (Block+10s on a silent connection).
//
// A message is never lost or run twice because its connection was: a
// handler running when the connection drops goes on (its lease is in the
// idempotency store, renewed there), its result is recorded there, and
// only its XACK fails. The entry stays pending in the group, as do the
// entries of a read whose reply was lost; once idle for MinIdle, this or
// another consumer claims them and, their keys completed, acknowledges
// them as Replayed. When the idempotency store is on the same Redis, an
// outage also fails Handle (a store error, the entry left pending, as
// above); a handler whose result meets the outage has it recorded once
// the store is back, within the lease left (idemmsg.Config.CompleteRetry);
// only an outage longer than that lets a later delivery of its key run
// again (the at-least-once of package idemmsg).
//
// # Dead letters
//
// A dead-lettered entry is added to DeadLetterStream with its fields and
// idem-stream, idem-group, idem-id (the original entry id) and idem-error
// (the kept error text), before it is acknowledged. A consumer that
// crashes between the two adds it again on redelivery: the dead-letter
// stream is at-least-once.
package redisstream

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/rueidis"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemmsg"
	"github.com/idemkit/idem/idemmsg/internal/loop"
	"github.com/idemkit/idem/idemmsg/internal/workpool"
)

// Defaults for Consumer's zero fields.
const (
	DefaultBlock = time.Second
	DefaultCount = 16
)

// Fields added to a dead-lettered entry.
const (
	FieldStream = "idem-stream"
	FieldGroup  = "idem-group"
	FieldID     = "idem-id"
	FieldError  = "idem-error"
)

// ackTimeout bounds an XACK or dead-letter XADD that runs after Run's
// context ended (the handler's result is already recorded).
const ackTimeout = 5 * time.Second

// Consumer is one member of a consumer group. Fill in the fields and call
// Run. Client or Rueidis, Stream, Group, Consumer, Dedup and Handler are
// required.
type Consumer struct {
	// Client is the caller's go-redis client; Run does not close it.
	// Exactly one of Client and Rueidis must be set.
	Client redis.UniversalClient
	// Rueidis is the caller's rueidis client, instead of Client; Run does
	// not close it. Messages still reach Handler, Key and OnResult as
	// redis.XMessage, with string values.
	Rueidis rueidis.Client
	// Stream is the stream's key.
	Stream string
	// Group is the consumer group, created by Run when missing (XGROUP
	// CREATE ... MKSTREAM) at StartID.
	Group string
	// Consumer names this consumer within the group. Give every process
	// its own name; a restarted process may reuse its name.
	Consumer string

	// Dedup decides each delivery. Scope its Namespace to the stream and
	// group, e.g. "orders/billing".
	Dedup *idemmsg.Deduplicator
	// Handler performs the message's effect. It runs with the lease in its
	// context (idem.LeaseFromContext) and is not run again for a key that
	// completed. A panic in it is passed on (after the key is released).
	Handler func(ctx context.Context, msg redis.XMessage) error

	// Key returns a message's key. Default: the value of field KeyField
	// when KeyField is set, else the entry id. A message without a valid
	// key (idem.ValidateKey) is dead-lettered.
	Key func(msg redis.XMessage) string
	// KeyField names the field holding the key, for the default Key.
	KeyField string

	// StartID is where a group created by Run starts. Default "0": the
	// whole stream, so entries added before the first consumer started are
	// not skipped. Use "$" for new entries only.
	StartID string
	// Block is how long one XREADGROUP waits for new entries. Default 1s.
	Block time.Duration
	// Count is the most entries read or claimed at once. Default 16.
	Count int64
	// MinIdle is how long an entry stays pending before any consumer of
	// the group may claim it. Default: the Deduplicator's lease.
	MinIdle time.Duration
	// ClaimInterval is how often XAUTOCLAIM runs. Default MinIdle/2.
	ClaimInterval time.Duration
	// Concurrency is how many entries of a batch (up to Count) are handled
	// at once. Default 1: one after another, in stream order. With more,
	// the handlers of a batch run in parallel and finish in any order; the
	// next batch is read when the whole batch is settled. Two entries of
	// one batch with the same key then run side by side: the second is
	// answered InFlight and left pending, and is acknowledged as Replayed
	// only when claimed after MinIdle. Several Run loops of one group give
	// the same parallelism, with one connection each blocked in
	// XREADGROUP.
	Concurrency int

	// DeadLetterStream, when set, receives dead-lettered entries (see the
	// package documentation). Default: they are only acknowledged.
	DeadLetterStream string

	// Batch decides each batch read or claimed with one
	// Deduplicator.HandleBatch call instead of one Handle call per entry:
	// with a store that implements idem.BatchStore (redisstore,
	// memstore, pgstore), the batch's keys are acquired in one step, and
	// the entries whose handlers finished are recorded in one step and
	// acknowledged with one XACK per group (see FlushInterval). Handlers
	// still run Concurrency at a time. The leases of a whole batch are
	// taken at once, so a consumer that crashes holds up to Count keys
	// until their lease ends, not only those it was handling. Two entries
	// of one batch with the same key: the second is decided once the
	// first is recorded (Replayed, usually), instead of InFlight. The
	// next batch is read while a full batch is handled, and its handlers
	// start while the batch before records and settles its last group,
	// unless the two share a key (then it waits for that batch).
	Batch bool
	// FlushInterval, with Batch, bounds how long a decided entry waits
	// for the others of its batch before it is recorded and acknowledged.
	// Default idemmsg.DefaultFlushInterval.
	FlushInterval time.Duration

	// OnResult, when set, is called after each entry is decided, with
	// Handle's result and error. For metrics and logs; it must not block.
	OnResult func(msg redis.XMessage, res idemmsg.Result, err error)
	// OnError, when set, receives Redis errors of the read, claim, ack and
	// dead-letter steps (Run retries them). Default: logged with
	// slog.Default at warning level.
	OnError func(err error)

	beforeAck func(msg redis.XMessage) bool // crash hook, nil but in tests: see export_test.go
}

// errCrashed is what Run returns when beforeAck simulated a crash.
var errCrashed = errors.New("redisstream: simulated crash")

// Run creates the group if needed and consumes until ctx ends, then
// returns nil. An entry whose handler is running when ctx ends gets a
// cancelled context; its outcome is still acknowledged if it calls for it,
// and the other entries of its batch stay pending for another consumer to
// claim. Redis errors are reported to OnError and retried with backoff;
// Run returns an error only for an invalid configuration or a group it
// cannot create.
func (c *Consumer) Run(ctx context.Context) (rerr error) {
	r, err := c.runner()
	if err != nil {
		return err
	}
	if err := r.createGroup(ctx); err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	var lastClaim time.Time // zero: claim at once, picking up what a crash left
	failures := 0
	defer func() {
		if err := r.pipe.Wait(); errors.Is(err, errCrashed) && rerr == nil {
			rerr = err
		}
	}()
	for ctx.Err() == nil {
		var err error
		if time.Since(lastClaim) >= r.claimEvery {
			err = r.claim(ctx)
			if err == nil {
				lastClaim = time.Now()
			}
		}
		if err == nil {
			err = r.read(ctx, max(time.Millisecond, min(r.block, time.Until(lastClaim.Add(r.claimEvery)))))
		}
		switch {
		case errors.Is(err, errCrashed):
			return err
		case err == nil:
			failures = 0
		case ctx.Err() != nil:
		default:
			r.onError(err)
			if isRedisError(err, "NOGROUP") { // the stream or group was deleted
				if err := r.createGroup(ctx); err != nil && ctx.Err() == nil {
					r.onError(err)
				}
			}
			failures++
			loop.Sleep(ctx, loop.Backoff(failures))
		}
	}
	return nil
}

// runner is a Consumer with its defaults filled in.
type runner struct {
	*Consumer
	rc                         streamClient
	block, minIdle, claimEvery time.Duration
	count                      int64
	// ahead, with Batch, is the read of the next batch, sent while the
	// current one is handled (see readBatch); nil when none is.
	ahead chan readResult
	// pipe, with Batch, overlaps the batches read (see readBatch).
	pipe loop.Pipeline
}

type readResult struct {
	msgs []redis.XMessage
	err  error
}

func (c *Consumer) runner() (*runner, error) {
	switch {
	case c.Client == nil && c.Rueidis == nil:
		return nil, errors.New("redisstream: Consumer.Client and Consumer.Rueidis are nil: set one")
	case c.Client != nil && c.Rueidis != nil:
		return nil, errors.New("redisstream: Consumer.Client and Consumer.Rueidis are both set: set one")
	case c.Stream == "" || c.Group == "" || c.Consumer == "":
		return nil, errors.New("redisstream: Consumer.Stream, Group and Consumer are required")
	case c.Dedup == nil:
		return nil, errors.New("redisstream: Consumer.Dedup is nil")
	case c.Handler == nil:
		return nil, errors.New("redisstream: Consumer.Handler is nil")
	case c.Block < 0 || c.Count < 0 || c.MinIdle < 0 || c.ClaimInterval < 0 || c.Concurrency < 0 || c.FlushInterval < 0:
		return nil, errors.New("redisstream: negative Block, Count, MinIdle, ClaimInterval, Concurrency or FlushInterval")
	}
	if c.Key == nil && c.KeyField == "" { // entry ids: unique within the stream only
		if err := c.Dedup.Serve("redis stream " + c.Stream); err != nil {
			return nil, fmt.Errorf("redisstream: %w", err)
		}
	}
	r := &runner{Consumer: c, block: c.Block, minIdle: c.MinIdle, claimEvery: c.ClaimInterval, count: c.Count}
	if c.Client != nil {
		r.rc = goredisClient{c.Client}
	} else {
		r.rc = rueidisClient{c.Rueidis}
	}
	if r.block == 0 {
		r.block = DefaultBlock
	}
	if r.count == 0 {
		r.count = DefaultCount
	}
	if r.minIdle == 0 {
		r.minIdle = c.Dedup.Config().Lease
	}
	if r.claimEvery == 0 {
		r.claimEvery = max(r.minIdle/2, time.Millisecond)
	}
	return r, nil
}

func (r *runner) createGroup(ctx context.Context) error {
	start := r.StartID
	if start == "" {
		start = "0"
	}
	err := r.rc.createGroup(ctx, r.Stream, r.Group, start)
	if err != nil && !isRedisError(err, "BUSYGROUP") {
		return fmt.Errorf("redisstream: create group %s on %s: %w", r.Group, r.Stream, err)
	}
	return nil
}

// read handles one batch of new entries.
func (r *runner) read(ctx context.Context, block time.Duration) error {
	if r.Batch {
		return r.readBatch(ctx, block)
	}
	msgs, err := r.rc.readGroup(ctx, r.Stream, r.Group, r.Consumer.Consumer, r.count, block)
	if err != nil {
		return fmt.Errorf("redisstream: XREADGROUP %s: %w", r.Stream, err)
	}
	return r.processAll(ctx, msgs, func(redis.XMessage) (int, bool) { return 1, true })
}

// processAll decides msgs, Concurrency at a time, skipping those for which
// attempt reports false. Once ctx ends the rest stay pending, for a claim.
// It returns errCrashed if a simulated crash happened, and passes a
// handler's panic on.
func (r *runner) processAll(ctx context.Context, msgs []redis.XMessage, attempt func(redis.XMessage) (int, bool)) error {
	if r.Batch {
		if err := r.pipe.Wait(); err != nil { // the reads' batches first
			return err
		}
		return r.processBatch(ctx, msgs, attempt, nil)
	}
	pool := workpool.New(r.Concurrency)
	var crashed atomic.Bool
	for _, msg := range msgs {
		if ctx.Err() != nil || pool.Stopped() {
			break
		}
		n, ok := attempt(msg)
		if !ok {
			continue
		}
		ran := pool.Go(func() {
			if r.process(ctx, msg, n) != nil {
				crashed.Store(true)
				pool.Stop()
			}
		})
		if !ran {
			break // stopped meanwhile: the rest stays pending
		}
	}
	pool.Wait()
	if crashed.Load() {
		return errCrashed
	}
	return nil
}

// claim takes over and handles the entries idle for MinIdle, one batch at
// a time, until a pass over the pending list ends.
func (r *runner) claim(ctx context.Context) error {
	start := "0-0"
	for ctx.Err() == nil {
		msgs, next, err := r.rc.autoClaim(ctx, r.Stream, r.Group, r.Consumer.Consumer, r.minIdle, start, r.count)
		if err != nil {
			return fmt.Errorf("redisstream: XAUTOCLAIM %s: %w", r.Stream, err)
		}
		if len(msgs) > 0 {
			counts, err := r.deliveryCounts(ctx, msgs)
			if err != nil {
				return err
			}
			err = r.processAll(ctx, msgs, func(msg redis.XMessage) (int, bool) {
				n, pending := counts[msg.ID] // not pending: acknowledged meanwhile
				return int(n), pending
			})
			if err != nil {
				return err
			}
		}
		if next == "0-0" || next == "" {
			return nil
		}
		start = next
	}
	return nil
}

// deliveryCounts returns the delivery count of each claimed entry still
// pending, from one pipeline of XPENDING calls.
func (r *runner) deliveryCounts(ctx context.Context, msgs []redis.XMessage) (map[string]int64, error) {
	ids := make([]string, len(msgs))
	for i, msg := range msgs {
		ids[i] = msg.ID
	}
	counts, err := r.rc.deliveryCounts(ctx, r.Stream, r.Group, ids)
	if err != nil {
		return nil, fmt.Errorf("redisstream: XPENDING %s: %w", r.Stream, err)
	}
	for id, n := range counts {
		counts[id] = max(n, 1)
	}
	return counts, nil
}

// process decides one entry and settles it with Redis. It returns only
// errCrashed; other errors go to OnError and leave the entry pending.
func (r *runner) process(ctx context.Context, msg redis.XMessage, attempt int) error {
	res, err := r.Dedup.Handle(ctx, idemmsg.Delivery{Key: r.key(msg), Attempt: attempt},
		func(ctx context.Context) error { return r.Handler(ctx, msg) })
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
		return nil // pending: claimed again after MinIdle
	}
	if r.beforeAck != nil && !r.beforeAck(msg) {
		return errCrashed
	}
	// The outcome is recorded: settle it even if ctx ended meanwhile.
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), ackTimeout)
	defer cancel()
	if outcome == idemmsg.DeadLettered && r.DeadLetterStream != "" {
		if err := r.rc.add(sctx, r.DeadLetterStream, r.deadLetterValues(msg, res.Err)); err != nil {
			r.onError(fmt.Errorf("redisstream: XADD %s (dead letter of %s): %w", r.DeadLetterStream, msg.ID, err))
			return nil // pending: the next delivery is dead-lettered again
		}
	}
	if err := r.rc.ack(sctx, r.Stream, r.Group, msg.ID); err != nil {
		r.onError(fmt.Errorf("redisstream: XACK %s %s: %w", r.Stream, msg.ID, err))
	}
	return nil
}

func (r *runner) key(msg redis.XMessage) string {
	switch {
	case r.Key != nil:
		return r.Key(msg)
	case r.KeyField != "":
		s, _ := msg.Values[r.KeyField].(string)
		return s
	}
	return msg.ID
}

// deadLetterValues returns the dead letter's fields and values. Values
// read from Redis are strings; any other value is formatted with
// fmt.Sprint, nil as "".
func (r *runner) deadLetterValues(msg redis.XMessage, cause error) []string {
	text := ""
	if cause != nil {
		text = cause.Error()
	}
	names := make([]string, 0, len(msg.Values))
	for name := range msg.Values {
		names = append(names, name)
	}
	slices.Sort(names)
	vals := make([]string, 0, 2*len(names)+8)
	for _, name := range names {
		var s string
		switch v := msg.Values[name].(type) {
		case string:
			s = v
		case nil:
		default:
			s = fmt.Sprint(v)
		}
		vals = append(vals, name, s)
	}
	return append(vals, FieldStream, r.Stream, FieldGroup, r.Group, FieldID, msg.ID, FieldError, text)
}

func (r *runner) onError(err error) {
	if r.OnError != nil {
		r.OnError(err)
		return
	}
	slog.Default().Warn("redisstream", "stream", r.Stream, "group", r.Group, "consumer", r.Consumer.Consumer, "err", err)
}
