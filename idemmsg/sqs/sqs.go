package sqs

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemmsg"
	"github.com/idemkit/idem/idemmsg/internal/loop"
	"github.com/idemkit/idem/idemmsg/internal/workpool"
)

// API is the part of the SQS client a Consumer uses; *sqs.Client of
// aws-sdk-go-v2 implements it.
type API interface {
	ReceiveMessage(ctx context.Context, in *awssqs.ReceiveMessageInput, opts ...func(*awssqs.Options)) (*awssqs.ReceiveMessageOutput, error)
	DeleteMessageBatch(ctx context.Context, in *awssqs.DeleteMessageBatchInput, opts ...func(*awssqs.Options)) (*awssqs.DeleteMessageBatchOutput, error)
	ChangeMessageVisibilityBatch(ctx context.Context, in *awssqs.ChangeMessageVisibilityBatchInput, opts ...func(*awssqs.Options)) (*awssqs.ChangeMessageVisibilityBatchOutput, error)
	SendMessage(ctx context.Context, in *awssqs.SendMessageInput, opts ...func(*awssqs.Options)) (*awssqs.SendMessageOutput, error)
	GetQueueAttributes(ctx context.Context, in *awssqs.GetQueueAttributesInput, opts ...func(*awssqs.Options)) (*awssqs.GetQueueAttributesOutput, error)
}

// Defaults for Consumer's zero fields.
const (
	// DefaultKeyAttribute is the message attribute read by the default Key.
	DefaultKeyAttribute = "Idempotency-Key"
	// DefaultMaxMessages is the most messages one ReceiveMessage returns
	// (SQS's limit).
	DefaultMaxMessages = 10
	// DefaultWaitTime is how long one ReceiveMessage waits for messages
	// (long polling; SQS's limit).
	DefaultWaitTime = 20 * time.Second
)

// Message attributes added to a dead-lettered message.
const (
	AttrKey    = "idem-key"
	AttrError  = "idem-error"
	AttrSource = "idem-source" // "<queue URL>#<message id>"
)

const (
	// callTimeout bounds each call but ReceiveMessage, and a delete or
	// dead-letter send that runs after Run's context ended.
	callTimeout = 5 * time.Second
	// receiveSlack is added to the long poll for ReceiveMessage's bound.
	receiveSlack = 10 * time.Second
	// minVisibility is the shortest visibility the adapter sets: SQS
	// counts in whole seconds, and a shorter one would make an InFlight
	// message spin.
	minVisibility = time.Second
	// maxVisibility is SQS's limit.
	maxVisibility = 12 * time.Hour
	maxBackoff    = 30 * time.Second
	maxAttributes = 10 // per message, SQS's limit
)

// ErrRedrivePolicy is returned by Run for a queue whose redrive policy
// would move a failing message to its dead-letter queue before the
// Deduplicator dead-letters it (maxReceiveCount below MaxFailures).
var ErrRedrivePolicy = errors.New("sqs: the queue's redrive policy has a maxReceiveCount below the Deduplicator's MaxFailures")

// Consumer is one Run loop over an SQS queue. Fill in the fields and call
// Run. Client, QueueURL, Dedup and Handler are required.
type Consumer struct {
	// Client is the caller's SQS client (an *sqs.Client). Many Run loops
	// may share it.
	Client API
	// QueueURL is the queue's URL. A URL that ends in ".fifo" is a FIFO
	// queue: see the package documentation.
	QueueURL string

	// Dedup decides each delivery. Scope its Namespace to the queue and
	// the consuming service, e.g. "orders/billing".
	Dedup *idemmsg.Deduplicator
	// Handler performs the message's effect. It runs with the lease in its
	// context (idem.LeaseFromContext) and is not run again for a key that
	// completed. A panic in it is passed on (after the key is released).
	Handler func(ctx context.Context, msg types.Message) error

	// Key returns a message's key. Default: the string value of the message
	// attribute KeyAttribute when the message has it, else the MessageId. A
	// message without a valid key (idem.ValidateKey) is dead-lettered.
	Key func(msg types.Message) string
	// KeyAttribute names the message attribute holding the key, for the
	// default Key. Default DefaultKeyAttribute.
	KeyAttribute string

	// MaxMessages is the most messages one ReceiveMessage returns, 1 to
	// 10. Default 10.
	MaxMessages int
	// WaitTime is how long one ReceiveMessage waits for a message (long
	// polling), in whole seconds, at most 20s. Default 20s; negative: no
	// wait (short polling).
	WaitTime time.Duration
	// VisibilityTimeout is the visibility a received message gets, and
	// gets again at every extension while it is held (see ExtendEvery), in
	// whole seconds (rounded up). Default: the Deduplicator's lease.
	VisibilityTimeout time.Duration
	// ExtendEvery is how often the visibility of the messages held (being
	// handled, or waiting in their batch) is extended to
	// VisibilityTimeout, with ChangeMessageVisibilityBatch. Default
	// VisibilityTimeout/3, as the Deduplicator renews its lease at a third
	// of it. Negative: never; a handler that outlives VisibilityTimeout
	// then sees its message handed to another consumer (answered
	// InFlight there).
	ExtendEvery time.Duration
	// Concurrency is how many messages of a received batch are handled at
	// once. Default 1: one after another. On a FIFO queue, the messages of
	// one message group are always handled one after another, in order.
	Concurrency int
	// Backoff is the visibility a Released message gets (its redelivery
	// delay), given its attempt, and the wait before deciding again a
	// message the store could not decide, given the tries so far. Default
	// min(n·1s, 30s). At least 1s, at most 12h.
	Backoff func(attempt int) time.Duration

	// DeadLetterQueueURL, when set, receives dead-lettered messages (see
	// the package documentation); a FIFO queue for a FIFO QueueURL.
	// Default: they are only deleted.
	DeadLetterQueueURL string

	// Batch decides each received batch with one
	// Deduplicator.HandleBatch call instead of one Handle call per
	// message: with a store that implements idem.BatchStore (redisstore,
	// memstore, pgstore), the batch's keys are acquired in one step, and
	// the messages whose handlers finished are recorded in one step per
	// group and deleted with one DeleteMessageBatch (see FlushInterval).
	// Handlers still run Concurrency at a time; on a FIFO queue, one at a
	// time in batch order, and once one is not acknowledged the later ones
	// are handed back (idemmsg.BatchOptions.InOrder). The leases of a
	// whole batch are taken at once, so a consumer that crashes holds up
	// to MaxMessages keys until their lease ends. The next batch is
	// received and started while the one before records and deletes its
	// last group, unless the two share a key.
	Batch bool
	// FlushInterval, with Batch, bounds how long a decided message waits
	// for the others of its batch before it is recorded and deleted.
	// Default idemmsg.DefaultFlushInterval.
	FlushInterval time.Duration

	// OnResult, when set, is called after each message is decided, with
	// Handle's result and error. For metrics and logs; it must not block.
	OnResult func(msg types.Message, res idemmsg.Result, err error)
	// OnError, when set, receives the errors of the receive, delete,
	// visibility and dead-letter steps (Run retries them). Default: logged
	// with slog.Default at warning level.
	OnError func(err error)

	beforeAck func(msg types.Message) bool // crash hook, nil but in tests: see export_test.go
}

// errCrashed is what Run returns when beforeAck simulated a crash.
var errCrashed = errors.New("sqs: simulated crash")

// Run consumes until ctx ends, then returns nil. A message whose handler
// is running when ctx ends gets a cancelled context; its outcome is still
// settled, and messages received but not decided are handed back
// (visible again after a second). SQS errors are reported to OnError and
// retried with backoff. Run returns an error only for an invalid
// configuration, or ErrRedrivePolicy.
func (c *Consumer) Run(ctx context.Context) (rerr error) {
	r, err := c.runner()
	if err != nil {
		return err
	}
	if err := r.checkRedrive(ctx); err != nil {
		return err
	}
	hctx, stopExtend := context.WithCancel(context.WithoutCancel(ctx))
	var extending sync.WaitGroup
	if r.extendEvery > 0 {
		extending.Go(func() { r.extendLoop(hctx) })
	}
	var pipe loop.Pipeline
	defer func() {
		if err := pipe.Wait(); errors.Is(err, errCrashed) && rerr == nil {
			rerr = err
		}
		stopExtend()
		extending.Wait()
		if rerr == nil {
			// Received but never decided: hand them back now rather than
			// after their visibility.
			r.handBack(context.WithoutCancel(ctx), r.heldMessages()...)
		}
	}()
	failures := 0
	for ctx.Err() == nil {
		msgs, err := r.receive(ctx)
		if err != nil {
			if ctx.Err() != nil {
				break
			}
			r.onError(err)
			failures++
			loop.Sleep(ctx, loop.Backoff(failures))
			continue
		}
		failures = 0
		if len(msgs) == 0 {
			continue
		}
		r.hold(msgs)
		if r.Batch {
			keys := make([]string, len(msgs))
			for i, msg := range msgs {
				keys[i] = r.key(msg)
			}
			// The batches overlap: the next one is received and started
			// while the one before records and settles its last group
			// (see loop.Pipeline).
			err = pipe.Run(keys, func(handled func()) error { return r.processBatch(ctx, msgs, handled) })
		} else {
			err = r.processAll(ctx, msgs)
		}
		if errors.Is(err, errCrashed) {
			return err
		}
	}
	return nil
}

// runner is a Consumer with its defaults filled in, and the messages it
// holds.
type runner struct {
	*Consumer
	fifo        bool
	keyAttr     string
	max         int32
	wait        int32         // seconds
	vis         time.Duration // whole seconds
	extendEvery time.Duration // 0: never

	mu   sync.Mutex
	held map[string]types.Message // by receipt handle: received, not settled
	// visMu orders the visibility extensions with the visibility changes
	// of settled messages, so that an extension never undoes a backoff.
	visMu sync.Mutex
	// crashed is set once the crash hook asked for a crash (tests only).
	crashed atomic.Bool
}

func (c *Consumer) runner() (*runner, error) {
	switch {
	case c.Client == nil:
		return nil, errors.New("sqs: Consumer.Client is nil")
	case c.QueueURL == "":
		return nil, errors.New("sqs: Consumer.QueueURL is empty")
	case c.Dedup == nil:
		return nil, errors.New("sqs: Consumer.Dedup is nil")
	case c.Handler == nil:
		return nil, errors.New("sqs: Consumer.Handler is nil")
	case c.MaxMessages < 0 || c.MaxMessages > 10:
		return nil, fmt.Errorf("sqs: Consumer.MaxMessages %d is not between 1 and 10 (or 0, the default)", c.MaxMessages)
	case c.WaitTime > DefaultWaitTime:
		return nil, fmt.Errorf("sqs: Consumer.WaitTime %v is above SQS's 20s", c.WaitTime)
	case c.VisibilityTimeout < 0 || c.VisibilityTimeout > maxVisibility:
		return nil, fmt.Errorf("sqs: Consumer.VisibilityTimeout %v is not between 1s and 12h (or 0, the default)", c.VisibilityTimeout)
	case c.Concurrency < 0 || c.FlushInterval < 0:
		return nil, errors.New("sqs: negative Concurrency or FlushInterval")
	case c.DeadLetterQueueURL != "" && isFIFO(c.QueueURL) != isFIFO(c.DeadLetterQueueURL):
		return nil, fmt.Errorf("sqs: Consumer.DeadLetterQueueURL %s and QueueURL %s are not both FIFO queues or both standard queues",
			c.DeadLetterQueueURL, c.QueueURL)
	}
	r := &runner{Consumer: c, fifo: isFIFO(c.QueueURL), keyAttr: cmp.Or(c.KeyAttribute, DefaultKeyAttribute),
		max: int32(cmp.Or(c.MaxMessages, DefaultMaxMessages)), held: map[string]types.Message{}}
	switch {
	case c.WaitTime == 0:
		r.wait = int32(DefaultWaitTime / time.Second)
	case c.WaitTime > 0:
		r.wait = int32(seconds(c.WaitTime))
	}
	r.vis = time.Duration(seconds(cmp.Or(c.VisibilityTimeout, c.Dedup.Config().Lease))) * time.Second
	switch {
	case c.ExtendEvery == 0:
		r.extendEvery = r.vis / 3
	case c.ExtendEvery > 0:
		r.extendEvery = c.ExtendEvery
	}
	return r, nil
}

func isFIFO(queueURL string) bool { return strings.HasSuffix(queueURL, ".fifo") }

// seconds is d in whole seconds, rounded up, at least 1.
func seconds(d time.Duration) int64 {
	return max(1, int64(math.Ceil(d.Seconds())))
}

// checkRedrive refuses a queue whose redrive policy moves messages away
// before MaxFailures deliveries. A failed look-up is reported and
// ignored: the policy is SQS's business, and it may be set later.
func (r *runner) checkRedrive(ctx context.Context) error {
	cctx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	out, err := r.Client.GetQueueAttributes(cctx, &awssqs.GetQueueAttributesInput{QueueUrl: aws.String(r.QueueURL),
		AttributeNames: []types.QueueAttributeName{types.QueueAttributeNameRedrivePolicy}})
	if err != nil {
		if ctx.Err() == nil {
			r.onError(fmt.Errorf("sqs: GetQueueAttributes %s (redrive policy not checked): %w", r.QueueURL, err))
		}
		return nil
	}
	policy, ok := out.Attributes[string(types.QueueAttributeNameRedrivePolicy)]
	if !ok || policy == "" {
		return nil
	}
	var p struct {
		MaxReceiveCount json.RawMessage `json:"maxReceiveCount"`
	}
	if err := json.Unmarshal([]byte(policy), &p); err != nil {
		r.onError(fmt.Errorf("sqs: %s: redrive policy %q not understood: %w", r.QueueURL, policy, err))
		return nil
	}
	n, err := strconv.Atoi(strings.Trim(string(p.MaxReceiveCount), `"`))
	if err != nil {
		r.onError(fmt.Errorf("sqs: %s: redrive policy %q: maxReceiveCount not understood", r.QueueURL, policy))
		return nil
	}
	if mf := r.Dedup.Config().MaxFailures; n < mf {
		return fmt.Errorf("%w: %s has maxReceiveCount %d, MaxFailures is %d: failing messages would leave the queue before they are dead-lettered with their error",
			ErrRedrivePolicy, r.QueueURL, n, mf)
	}
	return nil
}

// receive is one ReceiveMessage (long polling).
func (r *runner) receive(ctx context.Context) ([]types.Message, error) {
	rctx, cancel := context.WithTimeout(ctx, time.Duration(r.wait)*time.Second+receiveSlack)
	defer cancel()
	out, err := r.Client.ReceiveMessage(rctx, &awssqs.ReceiveMessageInput{
		QueueUrl:            aws.String(r.QueueURL),
		MaxNumberOfMessages: r.max,
		WaitTimeSeconds:     r.wait,
		VisibilityTimeout:   int32(r.vis / time.Second),
		MessageSystemAttributeNames: []types.MessageSystemAttributeName{
			types.MessageSystemAttributeNameApproximateReceiveCount, types.MessageSystemAttributeNameMessageGroupId},
		MessageAttributeNames: []string{"All"},
	})
	if err != nil {
		return nil, fmt.Errorf("sqs: ReceiveMessage %s: %w", r.QueueURL, err)
	}
	return out.Messages, nil
}

// processAll decides msgs (one receive): on a FIFO queue, the messages of
// a group one after another, in order, the groups Concurrency at a time;
// on a standard queue, every message Concurrency at a time. Once ctx
// ends, the messages not started stay held (Run hands them back). It
// returns errCrashed if a simulated crash happened, and passes a
// handler's panic on.
func (r *runner) processAll(ctx context.Context, msgs []types.Message) error {
	pool := workpool.New(r.Concurrency)
	var crashed atomic.Bool
	for _, g := range r.groups(msgs) {
		if ctx.Err() != nil || pool.Stopped() {
			break
		}
		ran := pool.Go(func() {
			for i, msg := range g {
				if ctx.Err() != nil || pool.Stopped() {
					return
				}
				acked, err := r.process(ctx, msg)
				if err != nil {
					crashed.Store(true)
					pool.Stop()
					return
				}
				if !acked && r.fifo {
					// Keep the group's order: the later messages come back
					// after this one, which still holds the group.
					r.handBack(ctx, g[i+1:]...)
					return
				}
			}
		})
		if !ran {
			break
		}
	}
	pool.Wait()
	if crashed.Load() {
		return errCrashed
	}
	return nil
}

// groups splits msgs by message group on a FIFO queue, keeping their
// order; on a standard queue each message is a group of its own.
func (r *runner) groups(msgs []types.Message) [][]types.Message {
	if !r.fifo {
		gs := make([][]types.Message, len(msgs))
		for i := range msgs {
			gs[i] = msgs[i : i+1]
		}
		return gs
	}
	var gs [][]types.Message
	index := map[string]int{}
	for _, msg := range msgs {
		g := msg.Attributes[string(types.MessageSystemAttributeNameMessageGroupId)]
		i, ok := index[g]
		if !ok {
			i = len(gs)
			index[g] = i
			gs = append(gs, nil)
		}
		gs[i] = append(gs[i], msg)
	}
	return gs
}

// process decides one message and settles it with SQS. It reports
// whether the message was acknowledged (deleted), and returns only
// errCrashed as error; other errors go to OnError.
func (r *runner) process(ctx context.Context, msg types.Message) (bool, error) {
	var (
		res idemmsg.Result
		err error
	)
	dl := r.delivery(msg)
	for try := 1; ; try++ {
		res, err = r.Dedup.Handle(ctx, dl, func(ctx context.Context) error { return r.Handler(ctx, msg) })
		if !undecided(res, err) || ctx.Err() != nil {
			break
		}
		// Held (its visibility extended) while the store is away, rather
		// than handed back: each receive would count as a delivery.
		r.onError(fmt.Errorf("sqs: %s kept, to decide again: %w", describe(msg), err))
		loop.Sleep(ctx, r.backoff(try))
	}
	return r.settle(ctx, msg, dl.Attempt, res, err)
}

func (r *runner) delivery(msg types.Message) idemmsg.Delivery {
	return idemmsg.Delivery{Key: r.key(msg), Attempt: attemptOf(msg), Body: []byte(aws.ToString(msg.Body))}
}

// undecided reports whether Handle could not decide a delivery because the
// store failed before the handler ran.
func undecided(res idemmsg.Result, err error) bool {
	var se *idem.StoreError
	return res.Outcome == idemmsg.NoOutcome && errors.As(err, &se)
}

// attemptOf is msg's ApproximateReceiveCount, 1 when missing.
func attemptOf(msg types.Message) int {
	n, err := strconv.Atoi(msg.Attributes[string(types.MessageSystemAttributeNameApproximateReceiveCount)])
	if err != nil {
		return 1
	}
	return max(n, 1)
}

// settle reports a decided message and settles it with SQS, as the
// package documentation says. It reports whether the message was
// acknowledged, and returns only errCrashed as error.
func (r *runner) settle(ctx context.Context, msg types.Message, attempt int, res idemmsg.Result, err error) (bool, error) {
	if r.OnResult != nil {
		r.OnResult(msg, res, err)
	}
	if err != nil {
		r.onError(fmt.Errorf("sqs: %s: %w", describe(msg), err))
	}
	outcome := r.outcome(&res, err)
	if undecided(res, err) && ctx.Err() != nil {
		return false, nil // held: Run hands it back
	}
	if outcome.Ack() && r.crash(msg) {
		return false, errCrashed
	}
	// The outcome is recorded: settle it even if ctx ended meanwhile.
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), callTimeout)
	defer cancel()
	switch outcome {
	case idemmsg.Executed, idemmsg.Replayed:
		r.delete(sctx, msg)
		return true, nil
	case idemmsg.DeadLettered:
		if !r.deadLetter(sctx, msg, res.Err) {
			r.setVisibility(sctx, r.backoff(attempt), msg) // the next delivery is dead-lettered again
			return false, nil
		}
		r.delete(sctx, msg)
		return true, nil
	case idemmsg.InFlight:
		r.setVisibility(sctx, res.RetryAfter, msg)
	default: // Released, or the store could not decide
		r.setVisibility(sctx, r.backoff(attempt), msg)
	}
	return false, nil
}

// crash reports whether the crash hook (tests only) asks for a crash
// before msg is acknowledged, or asked for one before: then nothing more
// is settled.
func (r *runner) crash(msg types.Message) bool {
	if r.beforeAck == nil {
		return false
	}
	if r.crashed.Load() || !r.beforeAck(msg) {
		r.crashed.Store(true)
		return true
	}
	return false
}

// outcome is res's Outcome, with the permanent errors (an invalid key, a
// mismatch) made DeadLettered and kept in res.Err.
func (r *runner) outcome(res *idemmsg.Result, err error) idemmsg.Outcome {
	if res.Outcome == idemmsg.NoOutcome && (errors.Is(err, idem.ErrInvalidKey) || errors.Is(err, idem.ErrMismatch) || errors.Is(err, idem.ErrUnsealable)) {
		res.Outcome, res.Err = idemmsg.DeadLettered, err // permanent: never handled
	}
	return res.Outcome
}

func (r *runner) key(msg types.Message) string {
	if r.Key != nil {
		return r.Key(msg)
	}
	if a, ok := msg.MessageAttributes[r.keyAttr]; ok && a.StringValue != nil {
		return *a.StringValue
	}
	return aws.ToString(msg.MessageId)
}

func (r *runner) backoff(attempt int) time.Duration {
	if r.Backoff != nil {
		return r.Backoff(attempt)
	}
	return min(time.Duration(max(attempt, 1))*time.Second, maxBackoff)
}

// hold adds msgs to the messages whose visibility is extended.
func (r *runner) hold(msgs []types.Message) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, msg := range msgs {
		r.held[aws.ToString(msg.ReceiptHandle)] = msg
	}
}

// release removes msgs from the held messages.
func (r *runner) release(msgs ...types.Message) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, msg := range msgs {
		delete(r.held, aws.ToString(msg.ReceiptHandle))
	}
}

func (r *runner) isHeld(handle string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	_, ok := r.held[handle]
	return ok
}

func (r *runner) heldMessages() []types.Message {
	r.mu.Lock()
	defer r.mu.Unlock()
	msgs := make([]types.Message, 0, len(r.held))
	for _, msg := range r.held {
		msgs = append(msgs, msg)
	}
	return msgs
}

// extendLoop extends the visibility of the held messages every
// extendEvery, until ctx ends.
func (r *runner) extendLoop(ctx context.Context) {
	t := time.NewTicker(r.extendEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			r.extend(ctx)
		}
	}
}

// extend sets the visibility of every held message to VisibilityTimeout.
// A message whose receipt handle SQS no longer knows (its visibility
// ended before, and it may be with another consumer now) is dropped from
// the held messages and reported.
func (r *runner) extend(ctx context.Context) {
	r.visMu.Lock()
	defer r.visMu.Unlock()
	msgs := r.heldMessages()
	for chunk := range slices.Chunk(msgs, 10) {
		failed := r.changeVisibility(ctx, r.vis, chunk, "extend")
		for _, msg := range failed {
			if r.isHeld(aws.ToString(msg.ReceiptHandle)) {
				r.release(msg)
			}
		}
	}
}

// setVisibility stops holding msgs and sets their visibility to d (at
// least 1s, at most 12h): they come back after it.
func (r *runner) setVisibility(ctx context.Context, d time.Duration, msgs ...types.Message) {
	if len(msgs) == 0 {
		return
	}
	r.visMu.Lock()
	defer r.visMu.Unlock()
	r.release(msgs...)
	d = min(max(d, minVisibility), maxVisibility)
	for chunk := range slices.Chunk(msgs, 10) {
		r.changeVisibility(ctx, d, chunk, "backoff")
	}
}

// handBack makes msgs visible again after a second (see minVisibility).
func (r *runner) handBack(ctx context.Context, msgs ...types.Message) {
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), callTimeout)
	defer cancel()
	r.setVisibility(sctx, minVisibility, msgs...)
}

// changeVisibility is one ChangeMessageVisibilityBatch (up to 10
// messages); it returns the messages it failed for, after reporting them.
func (r *runner) changeVisibility(ctx context.Context, d time.Duration, msgs []types.Message, why string) []types.Message {
	entries := make([]types.ChangeMessageVisibilityBatchRequestEntry, len(msgs))
	for i, msg := range msgs {
		entries[i] = types.ChangeMessageVisibilityBatchRequestEntry{Id: aws.String(strconv.Itoa(i)), ReceiptHandle: msg.ReceiptHandle,
			VisibilityTimeout: int32(seconds(d))}
	}
	cctx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	out, err := r.Client.ChangeMessageVisibilityBatch(cctx, &awssqs.ChangeMessageVisibilityBatchInput{QueueUrl: aws.String(r.QueueURL), Entries: entries})
	if err != nil {
		if ctx.Err() == nil {
			r.onError(fmt.Errorf("sqs: ChangeMessageVisibilityBatch %s (%s, %d messages from %s): %w", r.QueueURL, why, len(msgs), describe(msgs[0]), err))
		}
		return nil // not known to have failed for any one
	}
	var failed []types.Message
	for _, f := range out.Failed {
		i, err := strconv.Atoi(aws.ToString(f.Id))
		if err != nil || i < 0 || i >= len(msgs) {
			continue
		}
		failed = append(failed, msgs[i])
		if why == "extend" && !r.isHeld(aws.ToString(msgs[i].ReceiptHandle)) {
			continue // settled meanwhile
		}
		r.onError(fmt.Errorf("sqs: ChangeMessageVisibility %s (%s): %s: %s", describe(msgs[i]), why, aws.ToString(f.Code), aws.ToString(f.Message)))
	}
	return failed
}

// delete stops holding msgs and deletes them, with one
// DeleteMessageBatch per 10.
func (r *runner) delete(ctx context.Context, msgs ...types.Message) {
	r.release(msgs...)
	for chunk := range slices.Chunk(msgs, 10) {
		entries := make([]types.DeleteMessageBatchRequestEntry, len(chunk))
		for i, msg := range chunk {
			entries[i] = types.DeleteMessageBatchRequestEntry{Id: aws.String(strconv.Itoa(i)), ReceiptHandle: msg.ReceiptHandle}
		}
		out, err := r.Client.DeleteMessageBatch(ctx, &awssqs.DeleteMessageBatchInput{QueueUrl: aws.String(r.QueueURL), Entries: entries})
		if err != nil {
			r.onError(fmt.Errorf("sqs: DeleteMessageBatch %s (%d messages from %s): %w", r.QueueURL, len(chunk), describe(chunk[0]), err))
			continue
		}
		for _, f := range out.Failed {
			if i, err := strconv.Atoi(aws.ToString(f.Id)); err == nil && i >= 0 && i < len(chunk) {
				r.onError(fmt.Errorf("sqs: DeleteMessage %s: %s: %s", describe(chunk[i]), aws.ToString(f.Code), aws.ToString(f.Message)))
			}
		}
	}
}

// deadLetter sends msg to DeadLetterQueueURL, when set, and reports
// whether it is there (or none is set).
func (r *runner) deadLetter(ctx context.Context, msg types.Message, cause error) bool {
	if r.DeadLetterQueueURL == "" {
		return true
	}
	text := ""
	if cause != nil {
		text = cause.Error()
	}
	attrs := map[string]types.MessageAttributeValue{
		AttrKey:    {DataType: aws.String("String"), StringValue: aws.String(validText(r.key(msg)))},
		AttrError:  {DataType: aws.String("String"), StringValue: aws.String(validText(text))},
		AttrSource: {DataType: aws.String("String"), StringValue: aws.String(r.QueueURL + "#" + aws.ToString(msg.MessageId))},
	}
	names := make([]string, 0, len(msg.MessageAttributes))
	for name := range msg.MessageAttributes {
		if _, ours := attrs[name]; !ours {
			names = append(names, name)
		}
	}
	slices.Sort(names)
	for _, name := range names[:min(len(names), maxAttributes-len(attrs))] {
		a := msg.MessageAttributes[name]
		attrs[name] = types.MessageAttributeValue{DataType: a.DataType, StringValue: a.StringValue, BinaryValue: a.BinaryValue}
	}
	in := &awssqs.SendMessageInput{QueueUrl: aws.String(r.DeadLetterQueueURL), MessageBody: msg.Body, MessageAttributes: attrs}
	if r.fifo {
		// The original's group keeps the dead letters of a group in order;
		// its message id makes a send repeated within 5 minutes (a crash
		// before the delete) a duplicate SQS drops.
		in.MessageGroupId = aws.String(cmp.Or(msg.Attributes[string(types.MessageSystemAttributeNameMessageGroupId)], "idem"))
		in.MessageDeduplicationId = msg.MessageId
	}
	if _, err := r.Client.SendMessage(ctx, in); err != nil {
		r.onError(fmt.Errorf("sqs: SendMessage %s (dead letter of %s): %w", r.DeadLetterQueueURL, describe(msg), err))
		return false
	}
	return true
}

// validText replaces the characters SQS refuses in a message attribute
// with U+FFFD.
func validText(s string) string {
	return strings.Map(func(c rune) rune {
		switch {
		case c == 0x9 || c == 0xA || c == 0xD,
			c >= 0x20 && c <= 0xD7FF,
			c >= 0xE000 && c <= 0xFFFD,
			c >= 0x10000 && c <= 0x10FFFF:
			return c
		}
		return '\uFFFD'
	}, s)
}

func (r *runner) onError(err error) {
	if r.OnError != nil {
		r.OnError(err)
		return
	}
	slog.Default().Warn("sqs", "queue", r.QueueURL, "err", err)
}

// describe names a message in errors.
func describe(msg types.Message) string {
	return "message " + aws.ToString(msg.MessageId)
}
