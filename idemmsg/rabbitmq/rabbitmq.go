// Package rabbitmq consumes a RabbitMQ queue (AMQP 0-9-1, amqp091-go) with
// an idemmsg.Deduplicator: each message key's handler runs at most once per
// completed key, whatever RabbitMQ redelivers.
//
// A Consumer consumes the caller's queue on the caller's channel (or on
// channels it opens, surviving lost connections: see Lost connections)
// with manual acknowledgements, handles deliveries one at a time (or
// Concurrency at a time), and settles each one. For each delivery it
// calls Deduplicator.Handle and then:
//
//	Executed, Replayed     Ack
//	DeadLettered           Nack(requeue=false): to the queue's dead-letter
//	                       exchange
//	InFlight               Nack(requeue=true) after Result.RetryAfter
//	Released               Nack(requeue=true) after RetryDelay(attempt),
//	                       default min(attempt·1s, 30s)
//	no key, invalid key,   as DeadLettered (permanent)
//	mismatch, unsealable
//	store failure          as Released
//
// Several Run loops, on several channels, in one process or many, may
// consume one queue: RabbitMQ hands each message to one of them at a time,
// and the Deduplicator settles duplicates published as separate messages.
//
// # Keys
//
// The default key is the message's message-id property (MessageId). A
// message without one is dead-lettered with ErrNoMessageID. Set Key to
// derive the key from a header or the payload.
//
// # Dead letters
//
// A dead-lettered delivery is rejected without requeueing, so RabbitMQ
// routes it to the queue's dead-letter exchange: the queue must be declared
// with the x-dead-letter-exchange argument (and optionally
// x-dead-letter-routing-key), or a policy with dead-letter-exchange, and a
// dead-letter queue bound to that exchange. Without one, RabbitMQ drops
// dead-lettered messages. RabbitMQ adds the x-death header that names the
// queue and the reason ("rejected"); the kept error text is in
// Result.Err (see OnResult), not in the message.
//
// # Delivery counts
//
// The Attempt given to Handle is the delivery count: for a quorum queue,
// 1 plus its x-delivery-count header (RabbitMQ counts each return of the
// message, so InFlight requeues count too; the queue's delivery-limit,
// when set, must be above the Deduplicator's MaxFailures or RabbitMQ drops
// or dead-letters a failing message before it is dead-lettered here).
// Classic queues do not count redeliveries, only set the Redelivered flag:
// for them the Consumer counts the deliveries of each key in the process
// (starting at 2 for a delivery flagged Redelivered that it did not see
// before), so a message that fails on several consumers in turn may be
// tried more than MaxFailures times before it is dead-lettered. A key's
// count is dropped once one of its deliveries is acknowledged or
// dead-lettered.
//
// # Delayed requeue
//
// AMQP 0-9-1 has no delayed negative acknowledgement. The Consumer holds an
// InFlight or Released delivery unacknowledged for its delay (RetryAfter, or
// RetryDelay(attempt); at most MaxRetryDelay) in the process, without
// blocking the next deliveries, then Nacks it with requeue. The held
// deliveries count against Prefetch. For long delays, a delay queue is the
// alternative: a queue with x-message-ttl whose dead-letter exchange routes
// back to the work queue; publish the message there and Ack it (not done
// by this package).
//
// # Lost connections
//
// amqp091-go does not reconnect: once a channel or its connection closes,
// its deliveries stop. With Consumer.Channel, Run then returns an error
// wrapping ErrChannelLost, and the caller opens a new channel and runs
// again. With Consumer.NewChannel (Dialer.Channel, or the caller's own),
// Run does it: it passes the loss to OnError, waits Backoff (100ms,
// doubling to 5s), opens a new channel (the Dialer dials a new connection
// once the old one is closed, and keeps trying while the broker is away)
// and consumes again, until ctx ends. It returns only when ctx ends, when
// Qos or Consume are refused (a missing queue, no access), or with a
// handler's panic. Share one Dialer between the Consumers of a process:
// one connection, one channel each.
//
// How soon Run notices:
//
//   - The broker restarts or stops: at once (it closes every connection,
//     CONNECTION_FORCED). Dialing fails until it is back.
//   - The connection is reset (a proxy, a load balancer): at once.
//   - The connection goes silent (a partition, a firewall dropping
//     packets): after 1.5 heartbeat intervals without a frame from the
//     broker, when amqp091-go closes the connection: 15s with its default
//     Config.Heartbeat of 10s (the interval is the lower of the client's
//     and the broker's, RabbitMQ's heartbeat setting, default 60s). A dial
//     into the silence gives up after Dialer.Timeout (default 30s). The
//     broker, on its side, drops the connection after two intervals
//     without a frame from the client.
//   - A consumer timeout: RabbitMQ closes a channel whose oldest
//     delivery stays unacknowledged longer than its consumer_timeout
//     (PRECONDITION_FAILED; 30 minutes by default; in 3.10 a node setting,
//     rabbitmq.conf, checked every channel_tick_interval, 60s; per queue
//     from 3.12) and hands its deliveries to other consumers. Run opens a
//     new channel.
//   - The server cancels the consumer (its queue deleted): Run opens a
//     new channel, and returns the error of a refused Consume.
//
// What happens to the messages: the broker requeues every delivery
// unacknowledged on a lost channel (for a silent connection, once it has
// dropped it) and delivers it again, to this or another consumer. Run lets
// the handlers running on the lost channel finish, with Run's context (a
// lost channel does not cancel them): their results are recorded in the
// store, but their acknowledgements are lost with the channel (not
// reported: amqp091-go's ErrClosed). Deliveries held for a delayed requeue
// and those received but not handled are left to the broker. Delivered
// again, a key that completed is answered Replayed and acknowledged, and
// one still running elsewhere InFlight until its result is recorded or
// its lease ends (the lease is renewed while the handler runs): one effect
// per key. An acknowledgement sent into a silent connection is lost the
// same way. Handlers longer than consumer_timeout are safe but wasteful:
// each one costs its channel and a redelivery; raise consumer_timeout
// above the longest handler instead.
//
// The queue must outlive a broker restart: a durable classic queue with
// persistent messages (amqp.Persistent), or a quorum queue (durable, its
// messages always persistent, replicated across a cluster's nodes). A
// non-durable queue is gone after a restart, with its messages: Consume
// is refused (NOT_FOUND) and Run returns.
//
// # Stopping and crashes
//
// When Run's context ends, the consumer is cancelled, deliveries received
// but not handled and held delayed ones are requeued at once, and Run
// returns nil. Unacknowledged deliveries of a consumer that crashes return
// to the queue when its channel or connection closes and, if their key
// completed, are answered Replayed and acknowledged.
package rabbitmq

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemmsg"
	"github.com/idemkit/idem/idemmsg/internal/workpool"
)

// DefaultPrefetch is Consumer.Prefetch's default.
const DefaultPrefetch = 16

// MaxRetryDelay bounds the in-process delay before an InFlight or Released
// delivery is requeued.
const MaxRetryDelay = 30 * time.Second

// DeliveryCountHeader is the header in which quorum queues count the
// earlier deliveries of a message.
const DeliveryCountHeader = "x-delivery-count"

// ErrNoMessageID is the error of a message dead-lettered by the default Key
// because it has no message-id property.
var ErrNoMessageID = errors.New("rabbitmq: message has no message-id property (publish with MessageId, or set Consumer.Key)")

const (
	// minRetryDelay keeps an InFlight delivery from spinning.
	minRetryDelay = 10 * time.Millisecond
	// drainTimeout bounds the requeueing of received deliveries once Run's
	// context ended.
	drainTimeout = 5 * time.Second
	// maxLocalCounts bounds the in-process delivery counts of classic
	// queues; beyond it they are forgotten (and start again at 1).
	maxLocalCounts = 100_000
)

// Consumer is one Run loop over a queue. Fill in the fields and call Run.
// Channel or NewChannel, Queue, Dedup and Handler are required.
type Consumer struct {
	// Channel is the caller's channel. Run sets its Qos and consumes on it;
	// it does not close it, and returns when it closes. Use one channel
	// per Run loop. Set NewChannel instead for a Run that survives a lost
	// channel or connection.
	Channel *amqp.Channel
	// NewChannel, set instead of Channel, opens a channel for Run: Run
	// calls it when it starts and again whenever the channel or its
	// connection is lost while ctx is live (a broker restart, a reset or
	// silent connection, a consumer timeout, the consumer cancelled by
	// the server), after Backoff, and resumes consuming on the new
	// channel (see Lost connections in the package documentation). Run
	// closes the channels it opened. Dialer.Channel is one: it keeps a
	// connection and dials it again once it is closed.
	NewChannel func(ctx context.Context) (*amqp.Channel, error)
	// Backoff, with NewChannel, is how long Run waits before its n-th
	// attempt in a row (n >= 1) to open a channel after one was lost or
	// could not be opened. Default DefaultBackoff: 100ms doubling to 5s,
	// with jitter.
	Backoff func(n int) time.Duration
	// Queue is the queue to consume. For dead letters it needs a
	// dead-letter exchange (see the package documentation).
	Queue string
	// Tag is the consumer tag. Default: a unique tag made by the client.
	Tag string
	// Prefetch is the channel's prefetch count (Qos): how many deliveries
	// may be unacknowledged at once, including those held for a delayed
	// requeue. Default 16, or Concurrency if more; it must be at least
	// Concurrency.
	Prefetch int
	// Concurrency is how many deliveries are handled at once. Default 1:
	// one after another, in delivery order. With more, handlers run in
	// parallel and finish in any order. Several Run loops on the queue,
	// each on its own channel, give the same parallelism.
	Concurrency int

	// Dedup decides each delivery. Scope its Namespace to the queue and
	// the consuming application, e.g. "orders/billing".
	Dedup *idemmsg.Deduplicator
	// Handler performs the message's effect. It runs with the lease in its
	// context (idem.LeaseFromContext) and is not run again for a key that
	// completed. A panic in it is passed on (after the key is released).
	Handler func(ctx context.Context, d amqp.Delivery) error

	// Key returns a delivery's key. Default: its MessageId; a message
	// without one is dead-lettered with ErrNoMessageID. A message without a
	// valid key (idem.ValidateKey) is dead-lettered.
	Key func(d amqp.Delivery) string

	// RetryDelay is how long a Released delivery (or one the store could not
	// decide) is held before it is requeued, given its attempt. Default
	// min(attempt·1s, 30s); at most MaxRetryDelay.
	RetryDelay func(attempt int) time.Duration

	// Batch decides the deliveries received (up to the prefetch, taken as
	// they are there, without waiting for more) with one
	// Deduplicator.HandleBatch call instead of one Handle call per
	// delivery: with a store that implements idem.BatchStore (redisstore,
	// memstore, pgstore), their keys are acquired in one step, and the
	// deliveries whose handlers finished are recorded in one step per
	// group and acknowledged together: with one multiple-ack when every
	// delivery up to the group's last is being acknowledged, else one by
	// one (see FlushInterval). Handlers still run Concurrency at a time.
	// The leases of a whole batch are taken at once, so a Run loop that
	// crashes holds up to Prefetch keys until their lease ends. Two
	// deliveries of one batch with the same key: the second is decided
	// once the first is recorded (Replayed, usually), instead of
	// InFlight. The channel must be this Run's alone, with nothing
	// unacknowledged from before: a multiple-ack covers every
	// unacknowledged delivery of the channel up to its tag.
	Batch bool
	// FlushInterval, with Batch, bounds how long a decided delivery waits
	// for the others of its batch before it is recorded and settled.
	// Default idemmsg.DefaultFlushInterval.
	FlushInterval time.Duration

	// OnResult, when set, is called after each delivery is decided, with
	// Handle's result and error. For metrics and logs; it must not block.
	// With Concurrency above 1 it is called from several goroutines at
	// once.
	OnResult func(d amqp.Delivery, res idemmsg.Result, err error)
	// OnError, when set, receives the errors of the settle steps and of
	// Handle. Default: logged with slog.Default at warning level. It may
	// be called from several goroutines, one at a time per delivery.
	OnError func(err error)

	// Hooks, nil but in tests: see export_test.go.
	onTracker func(*ackTracker)
	beforeAck func(d amqp.Delivery) bool // crash hook
}

// errCrashed is what Run returns when beforeAck simulated a crash.
var errCrashed = errors.New("rabbitmq: simulated crash")

// ErrChannelLost is in the error Run returns when the deliveries stop while
// its context is live (the channel or its connection closed, or the
// consumer was cancelled by the server) and it has no NewChannel to open
// another; with NewChannel, Run passes it to OnError and opens a new
// channel.
var ErrChannelLost = errors.New("rabbitmq: channel lost")

// lostError is a lost channel of consumer tag on queue: errors.Is it
// ErrChannelLost.
type lostError struct {
	tag, queue, what string
	err              error // the cause, when known
	consumed         bool  // the channel consumed before it was lost
}

func (e *lostError) Error() string {
	s := "rabbitmq: consumer " + e.tag + " on " + e.queue + ": channel lost (" + e.what + ")"
	if e.err != nil {
		s += ": " + e.err.Error()
	}
	return s
}

func (e *lostError) Is(target error) bool { return target == ErrChannelLost }
func (e *lostError) Unwrap() error        { return e.err }

var tagSeq atomic.Uint64

// DefaultBackoff is Consumer.Backoff's default: 100ms before the first
// attempt to open a channel again, doubling up to 5s, each within ±20%.
func DefaultBackoff(n int) time.Duration {
	d := 5 * time.Second
	if n <= 6 {
		d = min(100*time.Millisecond<<max(n-1, 0), d)
	}
	return time.Duration(float64(d) * (0.8 + 0.4*rand.Float64()))
}

// Run consumes until ctx ends, then returns nil (see the package
// documentation). A delivery whose handler is running when ctx ends gets a
// cancelled context; its outcome is still settled. Run returns an error
// for an invalid configuration and when Qos or Consume are refused (a
// missing queue, no access). With Channel, it also returns an error
// wrapping ErrChannelLost when the deliveries stop while ctx is live (the
// channel or connection closed): open a new channel and run again. With
// NewChannel, it opens a new channel and resumes instead (see Lost
// connections in the package documentation).
func (c *Consumer) Run(ctx context.Context) error {
	if err := c.validate(); err != nil {
		return err
	}
	prefetch := c.Prefetch
	if prefetch == 0 {
		prefetch = max(DefaultPrefetch, c.Concurrency)
	}
	tag := c.Tag
	if tag == "" {
		tag = "idem-" + strconv.FormatInt(time.Now().UnixNano(), 36) + "-" + strconv.FormatUint(tagSeq.Add(1), 10)
	}
	counts := &counts{n: map[string]int{}}
	if c.NewChannel == nil {
		return c.session(ctx, c.Channel, tag, prefetch, counts)
	}
	backoff := c.Backoff
	if backoff == nil {
		backoff = DefaultBackoff
	}
	for fails := 0; ; {
		ch, err := c.NewChannel(ctx)
		if err == nil {
			err = func() error {
				defer ch.Close() // also when a handler's panic goes through
				return c.session(ctx, ch, tag, prefetch, counts)
			}()
			if err == nil || ctx.Err() != nil {
				return nil
			}
			if !errors.Is(err, ErrChannelLost) {
				return err
			}
			if le := (*lostError)(nil); errors.As(err, &le) && le.consumed {
				fails = 0 // it consumed: start the backoff again
			}
		} else if ctx.Err() != nil {
			return nil
		} else {
			err = fmt.Errorf("rabbitmq: consumer %s on %s: open a channel: %w", tag, c.Queue, err)
		}
		fails++
		wait := backoff(fails)
		c.onError(fmt.Errorf("%w; opening a new channel in %v", err, wait.Round(time.Millisecond)))
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-t.C:
		}
	}
}

// lost reports whether err, from Qos or Consume, means that the channel
// or its connection is gone (try again on a new one) rather than a refusal
// (a missing queue, no access: a channel-level exception from the server).
func lost(err error) bool {
	var e *amqp.Error
	if !errors.As(err, &e) {
		return true
	}
	if !e.Server {
		return true // ErrClosed and the like: the client's view of a closed channel
	}
	switch e.Code {
	case amqp.ContentTooLarge, amqp.NoRoute, amqp.NoConsumers, amqp.AccessRefused, amqp.NotFound, amqp.ResourceLocked, amqp.PreconditionFailed:
		return false // channel-level exceptions: the request was refused
	}
	return true // connection-level: connection-forced (a broker stopping), internal errors
}

// session consumes on ch until ctx ends (nil), the deliveries stop (an
// error wrapping ErrChannelLost), a simulated crash (errCrashed), or a
// refused Qos or Consume.
func (c *Consumer) session(ctx context.Context, ch *amqp.Channel, tag string, prefetch int, counts *counts) error {
	closes := ch.NotifyClose(make(chan *amqp.Error, 1))
	if err := ch.Qos(prefetch, 0, false); err != nil {
		if lost(err) {
			return &lostError{tag: tag, queue: c.Queue, what: "qos", err: err}
		}
		return fmt.Errorf("rabbitmq: qos: %w", err)
	}
	deliveries, err := ch.Consume(c.Queue, tag, false, false, false, false, nil)
	if err != nil {
		if lost(err) {
			return &lostError{tag: tag, queue: c.Queue, what: "consume", err: err}
		}
		return fmt.Errorf("rabbitmq: consume %s: %w", c.Queue, err)
	}
	r := &run{c: c, ch: ch, ctx: ctx, abandon: make(chan struct{}), halt: make(chan struct{}), counts: counts}
	defer r.wg.Wait() // the held deliveries, requeued (or abandoned on a crash or a lost channel)
	lostErr := func() error {
		r.abandonHeld() // their channel is gone: they are back in the queue
		le := &lostError{tag: tag, queue: c.Queue, what: "consumer cancelled by the server", consumed: true}
		select {
		case e, ok := <-closes:
			le.what = "channel closed"
			if ok && e != nil {
				le.err = e
			}
		default:
			if ch.IsClosed() {
				le.what = "channel closed"
			}
		}
		return le
	}
	if c.Batch {
		r.acks = new(ackTracker)
		if c.onTracker != nil {
			c.onTracker(r.acks)
		}
		err := r.runBatches(tag, deliveries, prefetch)
		if errors.Is(err, ErrChannelLost) {
			return lostErr()
		}
		return err
	}
	pool := workpool.New(c.Concurrency)
	var crashed atomic.Bool
	for {
		// A simulated crash or a handler's panic ends the loop before the
		// next delivery is taken.
		select {
		case <-r.halt:
			return r.halted(pool, &crashed)
		default:
		}
		select {
		case <-ctx.Done():
			pool.Wait()
			r.stop(tag, deliveries)
			return nil
		case <-r.halt:
			return r.halted(pool, &crashed)
		case d, ok := <-deliveries:
			if !ok {
				// The handlers running finish (their outcomes are
				// recorded; their acks are lost with the channel).
				pool.Wait()
				if ctx.Err() != nil {
					return nil
				}
				return lostErr()
			}
			ran := pool.Go(func() {
				finished := false
				defer func() {
					if !finished { // the handler panicked: the pool passes it on
						r.stopLoop()
					}
				}()
				if r.process(d) != nil {
					crashed.Store(true)
					pool.Stop()
					r.stopLoop()
				}
				finished = true
			})
			if !ran && !crashed.Load() {
				// Taken while a handler panicked: hand it back. (After a
				// simulated crash it is abandoned, as a crash would.)
				d.Nack(false, true)
			}
		}
	}
}

// halted ends Run after a simulated crash or a handler's panic: it waits
// for the handlers still running, passes a panic on, and otherwise
// returns errCrashed, abandoning the held deliveries.
func (r *run) halted(pool *workpool.Pool, crashed *atomic.Bool) error {
	wasCrash := crashed.Load()
	if wasCrash {
		r.abandonHeld() // abandon held deliveries at once, as a crash would
	}
	pool.Wait() // panics if a handler panicked
	if !wasCrash {
		return nil // not reached: halt is only closed on a crash or a panic
	}
	return errCrashed
}

func (c *Consumer) validate() error {
	switch {
	case c.Channel == nil && c.NewChannel == nil:
		return errors.New("rabbitmq: Consumer.Channel and Consumer.NewChannel are nil")
	case c.Channel != nil && c.NewChannel != nil:
		return errors.New("rabbitmq: set Consumer.Channel or Consumer.NewChannel, not both")
	case c.Queue == "":
		return errors.New("rabbitmq: Consumer.Queue is empty")
	case c.Dedup == nil:
		return errors.New("rabbitmq: Consumer.Dedup is nil")
	case c.Handler == nil:
		return errors.New("rabbitmq: Consumer.Handler is nil")
	case c.Prefetch < 0 || c.Concurrency < 0 || c.FlushInterval < 0:
		return errors.New("rabbitmq: negative Prefetch, Concurrency or FlushInterval")
	case c.Prefetch > 0 && c.Prefetch < c.Concurrency:
		return fmt.Errorf("rabbitmq: Prefetch %d is below Concurrency %d", c.Prefetch, c.Concurrency)
	}
	// A message-id is the publisher's: one message fanned out to two
	// queues keeps it.
	if c.Key == nil {
		if err := c.Dedup.Serve("rabbitmq queue " + c.Queue); err != nil {
			return fmt.Errorf("rabbitmq: %w", err)
		}
	}
	return nil
}

// run is the state of one channel of a Run call.
type run struct {
	c   *Consumer
	ch  *amqp.Channel
	ctx context.Context
	wg  sync.WaitGroup
	// abandon is closed after a simulated crash or once the channel is
	// lost: the held deliveries are then left to the broker.
	abandon     chan struct{}
	abandonOnce sync.Once
	// halt is closed by a handler goroutine after a simulated crash or a
	// panic, to end the Run loop.
	halt     chan struct{}
	haltOnce sync.Once
	counts   *counts
	// acks, with Consumer.Batch, settles every delivery taken.
	acks *ackTracker
}

// counts are the in-process delivery counts per key of a Run call, for
// queues without x-delivery-count.
type counts struct {
	mu sync.Mutex
	n  map[string]int
}

func (r *run) stopLoop()    { r.haltOnce.Do(func() { close(r.halt) }) }
func (r *run) abandonHeld() { r.abandonOnce.Do(func() { close(r.abandon) }) }

// count returns the in-process attempt of a delivery of key.
func (r *run) count(key string, redelivered bool) int {
	r.counts.mu.Lock()
	defer r.counts.mu.Unlock()
	if len(r.counts.n) >= maxLocalCounts {
		clear(r.counts.n)
	}
	n := r.counts.n[key] + 1
	if n == 1 && redelivered {
		n = 2
	}
	r.counts.n[key] = n
	return n
}

// forget drops key's in-process count, once a delivery of it is settled.
func (r *run) forget(key string) {
	r.counts.mu.Lock()
	defer r.counts.mu.Unlock()
	delete(r.counts.n, key)
}

// stop cancels the consumer and requeues what it had received.
func (r *run) stop(tag string, deliveries <-chan amqp.Delivery) {
	if err := r.ch.Cancel(tag, false); err != nil {
		// The channel is gone: its deliveries are back in the queue.
		r.c.onError(fmt.Errorf("rabbitmq: cancel consumer %s: %w", tag, err))
		return
	}
	timeout := time.NewTimer(drainTimeout)
	defer timeout.Stop()
	for {
		select {
		case d, ok := <-deliveries:
			if !ok {
				return
			}
			r.c.nack(d, r.c.key(d), true)
		case <-timeout.C:
			return
		}
	}
}

// process decides one delivery and settles it (or schedules its requeue).
// It returns only errCrashed.
func (r *run) process(d amqp.Delivery) error {
	c := r.c
	key := c.key(d)
	attempt, counted := deliveryCount(d)
	var res idemmsg.Result
	var err error
	if key == "" && c.Key == nil {
		err = ErrNoMessageID
	} else {
		if !counted {
			attempt = r.count(key, d.Redelivered)
		}
		res, err = c.Dedup.Handle(r.ctx, idemmsg.Delivery{Key: key, Attempt: attempt, Body: d.Body},
			func(ctx context.Context) error { return c.Handler(ctx, d) })
	}
	if c.OnResult != nil {
		c.OnResult(d, res, err)
	}
	if err != nil {
		c.onError(fmt.Errorf("rabbitmq: %s: %w", describe(d, key), err))
	}
	outcome := res.Outcome
	if outcome == idemmsg.NoOutcome && (errors.Is(err, ErrNoMessageID) || errors.Is(err, idem.ErrInvalidKey) || errors.Is(err, idem.ErrMismatch) || errors.Is(err, idem.ErrUnsealable)) {
		outcome = idemmsg.DeadLettered // permanent: never handled
	}
	if c.beforeAck != nil && !c.beforeAck(d) {
		return errCrashed
	}
	switch outcome {
	case idemmsg.Executed, idemmsg.Replayed:
		r.forget(key)
		if err := d.Ack(false); err != nil && !errors.Is(err, amqp.ErrClosed) {
			c.onError(fmt.Errorf("rabbitmq: ack %s: %w", describe(d, key), err))
		}
	case idemmsg.DeadLettered:
		r.forget(key)
		c.nack(d, key, false)
	case idemmsg.InFlight:
		r.requeueAfter(d, key, max(res.RetryAfter, minRetryDelay))
	default: // Released, or the store could not decide
		r.requeueAfter(d, key, c.retryDelay(attempt))
	}
	return nil
}

// requeueAfter holds d for delay, then Nacks it with requeue: at once if
// Run's context ends, never if Run crashed or the channel was lost (the
// broker requeued it then).
func (r *run) requeueAfter(d amqp.Delivery, key string, delay time.Duration) {
	delay = min(max(delay, 0), MaxRetryDelay)
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		t := time.NewTimer(delay)
		defer t.Stop()
		select {
		case <-r.abandon:
			return
		case <-r.ctx.Done():
		case <-t.C:
		}
		select {
		case <-r.abandon:
		default:
			if r.acks != nil {
				r.acks.nack(r.c, d, key, true)
			} else {
				r.c.nack(d, key, true)
			}
		}
	}()
}

// deliveryCount returns the delivery's attempt from x-delivery-count, and
// false when the header is missing (classic queues).
func deliveryCount(d amqp.Delivery) (int, bool) {
	var n int64
	switch v := d.Headers[DeliveryCountHeader].(type) {
	case int64:
		n = v
	case int32:
		n = int64(v)
	case int16:
		n = int64(v)
	case int8:
		n = int64(v)
	case int:
		n = int64(v)
	case uint8:
		n = int64(v)
	case uint16:
		n = int64(v)
	case uint32:
		n = int64(v)
	default:
		return 1, false
	}
	return int(min(max(n, 0), math.MaxInt32-1)) + 1, true
}

func (c *Consumer) key(d amqp.Delivery) string {
	if c.Key != nil {
		return c.Key(d)
	}
	return d.MessageId
}

func (c *Consumer) retryDelay(attempt int) time.Duration {
	if c.RetryDelay != nil {
		return c.RetryDelay(attempt)
	}
	return min(time.Duration(max(attempt, 1))*time.Second, MaxRetryDelay)
}

func (c *Consumer) nack(d amqp.Delivery, key string, requeue bool) {
	// On a closed channel (ErrClosed) the delivery is back in the queue
	// already; Run reports the lost channel once.
	if err := d.Nack(false, requeue); err != nil && !errors.Is(err, amqp.ErrClosed) {
		c.onError(fmt.Errorf("rabbitmq: nack %s (requeue %t): %w", describe(d, key), requeue, err))
	}
}

func (c *Consumer) onError(err error) {
	if c.OnError != nil {
		c.OnError(err)
		return
	}
	slog.Default().Warn("rabbitmq", "err", err)
}

// describe names a delivery in errors: its queue's routing key, delivery
// tag and key.
func describe(d amqp.Delivery, key string) string {
	return fmt.Sprintf("delivery %d (routing key %q, key %q)", d.DeliveryTag, d.RoutingKey, key)
}
