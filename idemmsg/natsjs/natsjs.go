// Package natsjs consumes a NATS JetStream durable pull consumer with an
// idemmsg.Deduplicator: each message key's handler runs at most once per
// completed key, whatever JetStream redelivers.
//
// A Consumer pulls messages from the caller's consumer (which must use
// AckPolicy explicit) through one Messages iterator, handles them one at a
// time, and settles each one. For each message it calls
// Deduplicator.Handle and then:
//
//	Executed, Replayed     Ack
//	DeadLettered           publish to DeadLetterSubject (when set), then Term
//	InFlight               NakWithDelay(Result.RetryAfter)
//	Released               NakWithDelay(Backoff(attempt)), default
//	                       min(attempt·1s, 30s)
//	no key, invalid key,   as DeadLettered (permanent)
//	mismatch, unsealable
//	store failure before   held: InProgress, and decided again after
//	the handler ran        Backoff(try), until the store answers
//	store failure after    by its Outcome (Executed: Ack)
//	the handler ran
//
// Several Run loops, in one process or many, may share one durable
// consumer: JetStream hands each message to one of them at a time, and the
// Deduplicator settles duplicates published as separate messages.
//
// # Keys
//
// The default key is the message's Nats-Msg-Id header. JetStream itself
// drops a message whose Nats-Msg-Id repeats one stored within the stream's
// Duplicates window, so the Deduplicator then guards redeliveries and
// republications after the window. A message without the header is
// dead-lettered with an error that says so. Set Key to derive the key from
// the subject, another header or the payload.
//
// # Delivery counts and timing
//
// The Attempt given to Handle is JetStream's delivery count
// (Msg.Metadata's NumDelivered), 1 for the first delivery. Naks count as
// deliveries, including those of InFlight messages. So:
//
//   - the consumer's MaxDeliver, when set, must be at least the
//     Deduplicator's MaxFailures, or JetStream stops redelivering a failing
//     message before it is dead-lettered (Run refuses such a consumer);
//   - the consumer's AckWait should be at least the Deduplicator's lease
//     and longer than a handler usually runs: a message not settled within
//     AckWait is redelivered, to this or another Run loop, and answered
//     InFlight while the handler still holds the key;
//   - a message left unsettled (a crash, or messages buffered when Run
//     stops) is redelivered after AckWait and, if its key completed, is
//     answered Replayed and acknowledged.
//
// # Lost connections
//
// Run does not reconnect by itself: the nats.Conn under the
// jetstream.Consumer does, and Run resumes on it. Give that connection
// the options that make it reconnect for ever and notice a silent
// network soon:
//
//	nats.Connect(url,
//		nats.MaxReconnects(-1),              // default 60 tries, 2s apart
//		nats.PingInterval(10*time.Second),   // default 2 minutes
//		nats.MaxPingsOutstanding(2))         // the default
//
// When the server restarts or the connection is reset, the client notices
// at once and reconnects every ReconnectWait (default 2s); when the
// network goes silent (no reset), it notices only when MaxPingsOutstanding
// pings went unanswered: after about PingInterval × (MaxPingsOutstanding+1)
// (some 6 minutes with the defaults, 30s with the options above). A Run
// loop meanwhile waits for messages; once reconnected, its Messages
// iterator sends a new pull request and handling goes on, without an
// error. A durable consumer of a file-storage stream survives a server
// restart with its state; if the consumer is gone (a memory stream after
// a restart, or deleted), Run reports the pull errors to OnError and
// keeps trying until it is back.
//
// Messages in flight when the connection went: a handler that is running
// goes on (its lease lives in the idempotency store, not in NATS). Acks,
// Naks and InProgress published while the client knows it is
// disconnected are buffered (nats.ReconnectBufSize) and sent once it
// reconnects; those written into a silent connection before the client
// noticed are lost, and so are the messages the server sent into it.
// JetStream redelivers every message not acknowledged after AckWait; its
// key is then Replayed (the handler completed) or InFlight (still
// running), so no handler runs twice. An ack from an earlier delivery
// still settles a message JetStream redelivered meanwhile. Right after a
// reconnect the client may report "slow consumer, messages dropped" to its
// ErrorHandler: the iterator asked for a full batch again while it still
// held messages, and the ones that did not fit come back after AckWait.
//
// A connection closed for good (MaxReconnects exhausted, or closed by the
// program) never opens again: Run then returns ErrConnectionClosed.
// Make a new connection and a Consumer on it to go on, or use
// MaxReconnects(-1) so that it does not happen.
//
// A message that JetStream hands to a second Run loop after AckWait while
// the first still runs its handler (a handler slower than AckWait) is
// answered InFlight there: the lease, renewed while the handler runs,
// keeps the second from running it, and the copy is Naked with the time
// left on the lease (each such Nak counts as a delivery). The first
// loop's Ack then settles the message. Set AckWait above the usual
// handler time, and MaxDeliver (if set) with room for these deliveries.
//
// When the idempotency store cannot decide a message (it is down), Run
// does not Nak it, which would spend one of its MaxDeliver deliveries per
// try: it holds the message, telling JetStream it is in progress every
// third of AckWait, and decides it again after Backoff(try), until the
// store answers or ctx ends. The store errors go to OnError. A store
// outage thus pauses the Run loops instead of burning deliveries; only
// the messages the iterator buffered meanwhile may come back after
// AckWait, once each per AckWait. A store that fails after a handler ran,
// when its result is recorded, is another matter: the message is settled
// by its outcome (the effect happened), but the key is not recorded, so a
// later delivery of it runs the handler again (idemmsg's at-least-once
// with fencing).
//
// # Dead letters
//
// A dead-lettered message is published with JetStream (so the dead-letter
// subject must be captured by a stream) with its data and headers, except
// the headers named Nats-* that the server interprets (Nats-Msg-Id,
// Nats-Expected-*, ...), plus HeaderStream, HeaderConsumer, HeaderSubject,
// HeaderSequence (the stream sequence), HeaderKey and HeaderError (the kept
// error text). Once the publication is acknowledged the message is Termed.
// If publishing fails, the message is Naked for another try (its key
// stays dead-lettered, so the handler does not run again). A consumer that
// crashes between the two publishes it again on redelivery: the
// dead-letter subject is at-least-once.
package natsjs

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemmsg"
	"github.com/idemkit/idem/idemmsg/internal/loop"
	"github.com/idemkit/idem/idemmsg/internal/workpool"
)

// DefaultMaxMessages is Consumer.MaxMessages's default.
const DefaultMaxMessages = 16

// Headers added to a dead-lettered message.
const (
	HeaderStream   = "idem-stream"
	HeaderConsumer = "idem-consumer"
	HeaderSubject  = "idem-subject"
	HeaderSequence = "idem-sequence"
	HeaderKey      = "idem-key"
	HeaderError    = "idem-error"
)

// ErrConnectionClosed is what Run returns when the consumer's NATS
// connection is closed for good: it gave up reconnecting (its
// MaxReconnects), or it was closed. A nats.Conn never opens again: make a
// new one, and a Consumer on it, to go on (see Lost connections).
var ErrConnectionClosed = errors.New("natsjs: the NATS connection is closed")

// ErrNoMsgID is the error of a message dead-lettered by the default Key
// because it has no Nats-Msg-Id header.
var ErrNoMsgID = errors.New("natsjs: message has no " + jetstream.MsgIDHeader + " header (publish with one, or set Consumer.Key)")

const (
	// ackTimeout bounds a dead-letter publication that runs after Run's
	// context ended (the handler's result is already recorded).
	ackTimeout = 5 * time.Second
	// minNakDelay keeps an InFlight message from spinning.
	minNakDelay = 10 * time.Millisecond
	// maxBackoff caps the default Backoff.
	maxBackoff = 30 * time.Second
	// defaultAckWait is JetStream's, for a consumer whose AckWait is
	// not known.
	defaultAckWait = 30 * time.Second
)

// Consumer is one Run loop over a durable pull consumer. Fill in the fields
// and call Run. Consumer, Dedup and Handler are required, and JetStream
// when DeadLetterSubject is set.
type Consumer struct {
	// Consumer is the caller's durable pull consumer (AckPolicy explicit),
	// from jetstream.JetStream's Consumer or CreateOrUpdateConsumer. Many
	// Run loops may share it.
	Consumer jetstream.Consumer
	// JetStream publishes dead letters; required when DeadLetterSubject
	// is set.
	JetStream jetstream.JetStream

	// Dedup decides each delivery. Scope its Namespace to the stream and
	// consumer, e.g. "ORDERS/billing".
	Dedup *idemmsg.Deduplicator
	// Handler performs the message's effect. It runs with the lease in its
	// context (idem.LeaseFromContext) and is not run again for a key that
	// completed. A panic in it is passed on (after the key is released).
	Handler func(ctx context.Context, msg jetstream.Msg) error

	// Key returns a message's key. Default: its Nats-Msg-Id header; a
	// message without one is dead-lettered with ErrNoMsgID. A message
	// without a valid key (idem.ValidateKey) is dead-lettered.
	Key func(msg jetstream.Msg) string

	// MaxMessages is how many messages the iterator buffers ahead
	// (jetstream.PullMaxMessages). Default 16. Buffered messages are not
	// settled when Run stops: they are redelivered after AckWait.
	MaxMessages int
	// Concurrency is how many messages are handled at once. Default 1: one
	// after another, in delivery order. With more, handlers run in
	// parallel and finish in any order; MaxMessages should then be at
	// least Concurrency. Several Run loops sharing the durable consumer
	// give the same parallelism.
	Concurrency int
	// Backoff is the redelivery delay of a Released delivery, given its
	// attempt, and the wait before deciding again a delivery the store
	// could not decide, given the number of tries so far (see Lost
	// connections). Default min(n·1s, 30s).
	Backoff func(attempt int) time.Duration

	// DeadLetterSubject, when set, receives dead-lettered messages (see
	// the package documentation); it must be captured by a stream.
	// Default: they are only Termed.
	DeadLetterSubject string

	// Batch decides the messages the iterator has buffered (up to
	// MaxMessages, taken as they are there, without waiting for more) with
	// one Deduplicator.HandleBatch call instead of one Handle call per
	// message: with a store that implements idem.BatchStore (redisstore,
	// memstore, pgstore), their keys are acquired in one step, and the
	// messages whose handlers finished are recorded in one step per group
	// and then settled together (see FlushInterval). Handlers still run
	// Concurrency at a time. The leases of a whole batch are taken at
	// once, so a Run loop that crashes holds up to MaxMessages keys until
	// their lease ends. Two messages of one batch with the same key: the
	// second is decided once the first is recorded (Replayed, usually),
	// instead of InFlight. A batch's handlers start while the batch before
	// records and settles its last group, unless the two share a key
	// (then it waits for that batch).
	Batch bool
	// FlushInterval, with Batch, bounds how long a decided message waits
	// for the others of its batch before it is recorded and settled.
	// Default idemmsg.DefaultFlushInterval.
	FlushInterval time.Duration

	// OnResult, when set, is called after each message is decided, with
	// Handle's result and error. For metrics and logs; it must not block.
	OnResult func(msg jetstream.Msg, res idemmsg.Result, err error)
	// OnError, when set, receives the errors of the pull, settle and
	// dead-letter steps (Run retries them). Default: logged with
	// slog.Default at warning level.
	OnError func(err error)

	beforeAck func(msg jetstream.Msg) bool // crash hook, nil but in tests: see export_test.go
}

// errCrashed is what Run returns when beforeAck simulated a crash.
var errCrashed = errors.New("natsjs: simulated crash")

// Run consumes until ctx ends, then returns nil. A message whose handler
// is running when ctx ends gets a cancelled context; its outcome is still
// settled, and messages buffered but not handled are left for redelivery
// after AckWait. Pull errors are reported to OnError and retried with
// backoff; while the connection reconnects, Run waits (see Lost
// connections). Run returns an error only for an invalid configuration,
// and ErrConnectionClosed when the connection is closed for good.
func (c *Consumer) Run(ctx context.Context) error {
	if err := c.validate(); err != nil {
		return err
	}
	failures := 0
	for ctx.Err() == nil {
		err := c.consume(ctx)
		switch {
		case errors.Is(err, errCrashed):
			return err
		case ctx.Err() != nil:
			return nil
		case errors.Is(err, nats.ErrConnectionClosed) || errors.Is(err, jetstream.ErrConnectionClosed):
			return fmt.Errorf("%w: %w", ErrConnectionClosed, err)
		}
		c.onError(err)
		failures++
		loop.Sleep(ctx, loop.Backoff(failures))
	}
	return nil
}

func (c *Consumer) validate() error {
	switch {
	case c.Consumer == nil:
		return errors.New("natsjs: Consumer.Consumer is nil")
	case c.Dedup == nil:
		return errors.New("natsjs: Consumer.Dedup is nil")
	case c.Handler == nil:
		return errors.New("natsjs: Consumer.Handler is nil")
	case c.DeadLetterSubject != "" && c.JetStream == nil:
		return errors.New("natsjs: Consumer.JetStream is required with DeadLetterSubject")
	case c.MaxMessages < 0 || c.Concurrency < 0 || c.FlushInterval < 0:
		return errors.New("natsjs: negative MaxMessages, Concurrency or FlushInterval")
	}
	if info := c.Consumer.CachedInfo(); info != nil {
		cfg := info.Config
		if cfg.AckPolicy != jetstream.AckExplicitPolicy {
			return fmt.Errorf("natsjs: consumer %s has AckPolicy %v, want explicit", info.Name, cfg.AckPolicy)
		}
		if mf := c.Dedup.Config().MaxFailures; cfg.MaxDeliver > 0 && cfg.MaxDeliver < mf {
			return fmt.Errorf("natsjs: consumer %s has MaxDeliver %d, below the Deduplicator's MaxFailures %d: failing messages would never be dead-lettered",
				info.Name, cfg.MaxDeliver, mf)
		}
		// Nats-Msg-Id is unique within a stream (its duplicate window) only.
		if c.Key == nil {
			if err := c.Dedup.Serve("jetstream stream " + info.Stream); err != nil {
				return fmt.Errorf("natsjs: %w", err)
			}
		}
	}
	return nil
}

// consume runs one Messages iterator until ctx ends (nil), a simulated
// crash (errCrashed) or a pull error.
func (c *Consumer) consume(ctx context.Context) error {
	n := c.MaxMessages
	if n == 0 {
		n = DefaultMaxMessages
	}
	it, err := c.Consumer.Messages(jetstream.PullMaxMessages(n))
	if err != nil {
		return fmt.Errorf("natsjs: pull: %w", err)
	}
	defer it.Stop()
	if c.Batch {
		return c.consumeBatches(ctx, it, n)
	}
	// pull ends when ctx does, and when a handler panics or crashes (in
	// a test), so that the loop does not wait in Next for another message
	// before passing that on.
	pull, stopPull := context.WithCancel(ctx)
	defer stopPull()
	pool := workpool.New(c.Concurrency)
	defer pool.Wait() // passes a handler's panic on
	var crashed atomic.Bool
	for {
		msg, err := it.Next(jetstream.NextContext(pull))
		if pull.Err() != nil {
			if msg != nil && !crashed.Load() {
				// Taken but not handled: let it go at once rather than
				// after AckWait.
				c.nak(msg, 0)
			}
			break
		}
		if err != nil {
			return fmt.Errorf("natsjs: pull: %w", err)
		}
		ran := pool.Go(func() {
			settled := false
			defer func() {
				if !settled { // a panic, or a simulated crash
					stopPull()
				}
			}()
			if c.process(ctx, msg) != nil {
				crashed.Store(true)
				pool.Stop()
				return
			}
			settled = true
		})
		if !ran {
			if !crashed.Load() {
				c.nak(msg, 0) // taken while a handler panicked: hand it back
			}
			break
		}
	}
	if crashed.Load() {
		return errCrashed
	}
	return nil
}

// process decides one message and settles it with JetStream. It returns
// only errCrashed; other errors go to OnError.
func (c *Consumer) process(ctx context.Context, msg jetstream.Msg) error {
	attempt, meta := attemptOf(msg)
	var (
		res idemmsg.Result
		err error
	)
	key := c.key(msg)
	if key == "" && c.Key == nil {
		err = ErrNoMsgID
	} else {
		for try := 1; ; try++ {
			res, err = c.Dedup.Handle(ctx, idemmsg.Delivery{Key: key, Attempt: attempt, Body: msg.Data()},
				func(ctx context.Context) error { return c.Handler(ctx, msg) })
			if !undecided(res, err) || ctx.Err() != nil {
				break
			}
			c.onError(fmt.Errorf("natsjs: %s kept, to decide again: %w", describe(msg), err))
			c.hold(ctx, try, msg)
		}
	}
	return c.settle(ctx, msg, meta, key, attempt, res, err)
}

// undecided reports whether Handle could not decide a delivery because the
// store failed before the handler ran.
func undecided(res idemmsg.Result, err error) bool {
	if err == nil || res.Outcome != idemmsg.NoOutcome {
		return false // without allocating se, for the usual answer
	}
	var se *idem.StoreError
	return errors.As(err, &se)
}

// hold waits Backoff(try), or until ctx ends, before a delivery the store
// could not decide is decided again, and meanwhile keeps JetStream from
// redelivering msgs: InProgress now and every third of the consumer's
// AckWait. Naking them instead would spend a delivery on every try, and a
// store outage longer than MaxDeliver tries would leave the messages for
// good.
func (c *Consumer) hold(ctx context.Context, try int, msgs ...jetstream.Msg) {
	every := defaultAckWait
	if info := c.Consumer.CachedInfo(); info != nil && info.Config.AckWait > 0 {
		every = info.Config.AckWait
	}
	every /= 3
	for left := c.backoff(try); left > 0 && ctx.Err() == nil; left -= every {
		for _, msg := range msgs {
			if err := msg.InProgress(); err != nil {
				c.onError(fmt.Errorf("natsjs: in progress %s: %w", describe(msg), err))
			}
		}
		loop.Sleep(ctx, min(left, every))
	}
}

// attemptOf returns msg's delivery count and its metadata (nil if it has
// none).
func attemptOf(msg jetstream.Msg) (int, *jetstream.MsgMetadata) {
	meta, err := msg.Metadata()
	if err != nil {
		return 1, nil
	}
	return int(min(max(meta.NumDelivered, 1), 1<<31-1)), meta
}

// settle reports a decided message and settles it with JetStream. It
// returns only errCrashed; other errors go to OnError.
func (c *Consumer) settle(ctx context.Context, msg jetstream.Msg, meta *jetstream.MsgMetadata, key string, attempt int, res idemmsg.Result, err error) error {
	if c.OnResult != nil {
		c.OnResult(msg, res, err)
	}
	if err != nil {
		c.onError(fmt.Errorf("natsjs: %s: %w", describe(msg), err))
	}
	outcome := res.Outcome
	if outcome == idemmsg.NoOutcome && (errors.Is(err, ErrNoMsgID) || errors.Is(err, idem.ErrInvalidKey) || errors.Is(err, idem.ErrMismatch) || errors.Is(err, idem.ErrUnsealable)) {
		outcome, res.Err = idemmsg.DeadLettered, err // permanent: never handled
	}
	if c.beforeAck != nil && !c.beforeAck(msg) {
		return errCrashed
	}
	switch outcome {
	case idemmsg.Executed, idemmsg.Replayed:
		if err := msg.Ack(); err != nil {
			c.onError(fmt.Errorf("natsjs: ack %s: %w", describe(msg), err))
		}
	case idemmsg.DeadLettered:
		if c.DeadLetterSubject != "" {
			// The outcome is recorded: publish it even if ctx ended.
			pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), ackTimeout)
			_, err := c.JetStream.PublishMsg(pctx, c.deadLetter(msg, meta, key, res.Err))
			cancel()
			if err != nil {
				c.onError(fmt.Errorf("natsjs: publish to %s (dead letter of %s): %w", c.DeadLetterSubject, describe(msg), err))
				c.nak(msg, c.backoff(attempt)) // the next delivery is dead-lettered again
				return nil
			}
		}
		if err := msg.Term(); err != nil {
			c.onError(fmt.Errorf("natsjs: term %s: %w", describe(msg), err))
		}
	case idemmsg.InFlight:
		c.nak(msg, max(res.RetryAfter, minNakDelay))
	default: // Released, or the store could not decide
		c.nak(msg, c.backoff(attempt))
	}
	return nil
}

func (c *Consumer) key(msg jetstream.Msg) string {
	if c.Key != nil {
		return c.Key(msg)
	}
	return msg.Headers().Get(jetstream.MsgIDHeader)
}

func (c *Consumer) backoff(attempt int) time.Duration {
	if c.Backoff != nil {
		return c.Backoff(attempt)
	}
	return min(time.Duration(max(attempt, 1))*time.Second, maxBackoff)
}

func (c *Consumer) nak(msg jetstream.Msg, delay time.Duration) {
	if err := msg.NakWithDelay(delay); err != nil {
		c.onError(fmt.Errorf("natsjs: nak %s: %w", describe(msg), err))
	}
}

// deadLetter builds the dead-letter message of msg; meta may be nil.
func (c *Consumer) deadLetter(msg jetstream.Msg, meta *jetstream.MsgMetadata, key string, cause error) *nats.Msg {
	dl := nats.NewMsg(c.DeadLetterSubject)
	dl.Data = msg.Data()
	for name, vals := range msg.Headers() {
		if !strings.HasPrefix(strings.ToLower(name), "nats-") {
			dl.Header[name] = append([]string(nil), vals...)
		}
	}
	text := ""
	if cause != nil {
		text = cause.Error()
	}
	dl.Header.Set(HeaderSubject, msg.Subject())
	dl.Header.Set(HeaderKey, key)
	dl.Header.Set(HeaderError, text)
	if meta != nil {
		dl.Header.Set(HeaderStream, meta.Stream)
		dl.Header.Set(HeaderConsumer, meta.Consumer)
		dl.Header.Set(HeaderSequence, strconv.FormatUint(meta.Sequence.Stream, 10))
	}
	return dl
}

func (c *Consumer) onError(err error) {
	if c.OnError != nil {
		c.OnError(err)
		return
	}
	slog.Default().Warn("natsjs", "err", err)
}

// describe names a message in errors: its stream and sequence, or its
// subject.
func describe(msg jetstream.Msg) string {
	if meta, err := msg.Metadata(); err == nil {
		return meta.Stream + " #" + strconv.FormatUint(meta.Sequence.Stream, 10)
	}
	return msg.Subject()
}
