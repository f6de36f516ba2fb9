// Package kafka consumes Kafka topics through a consumer group with an
// idemmsg.Deduplicator: each message key's handler runs at most once per
// completed key, whatever Kafka redelivers. It uses franz-go (kgo).
//
// Kafka has no per-message acknowledgement, only a committed offset per
// partition, so a Consumer keeps each partition's order: it polls a batch,
// handles each partition's records in order (the partitions of a batch in
// parallel, one goroutine each), and commits a partition's offset only past
// records that are done. For each record it calls Deduplicator.Handle and
// then:
//
//	Executed, Replayed     done
//	DeadLettered           produced to DeadLetterTopic (when set), then done
//	InFlight, Released     retried in place after a backoff; the records
//	                       after it in its partition wait
//	invalid key, mismatch, as DeadLettered (permanent)
//	unsealable
//	store failure          retried in place, as Released
//
// The backoff is min(100ms·n, 5s) for the n-th retry of a record, or, for
// InFlight, Result.RetryAfter when shorter. Done records are committed
// (CommitRecords) when their partition's part of the batch is finished,
// before each backoff, and when Run stops; never past a record that is not
// done. The next batch is polled once every partition of the current one
// is finished, so a record being retried holds up its whole batch.
//
// # The client
//
// Client is the caller's, created with kgo.ConsumerGroup, kgo.ConsumeTopics
// and kgo.DisableAutoCommit (auto-commit would commit records not yet
// done). Run does not close it. With kgo.BlockRebalanceOnPoll a partition
// stays with this consumer until its batch is finished (Run calls
// AllowRebalance after each batch), at the cost of holding up rebalances
// while a record is retried; without it, a partition may move to another
// member mid-batch, and both may handle its records for a while: the
// Deduplicator answers the second one Replayed or InFlight, so effects are
// not repeated. Run commits a partition only while the client holds it
// (franz-go's CommittedOffsets lists it) and only forward of the client's
// last known commit, since the broker accepts a commit from any current
// member for any partition, and a late one from the former owner would
// move the new owner's offset back; a partition lost between that check
// and the commit is not covered.
//
// When Run stops, records it polled but did not finish are not committed,
// and the client's fetch position is already past them: close the client
// (the group then re-reads them from the last commit) rather than calling
// Run again on it.
//
// # Lost connections
//
// franz-go reconnects on its own, so Run does not return when the broker
// goes away: it keeps polling, reports what fails meanwhile (polls,
// commits, dead-letter produces) to OnError, and resumes once the client
// has reconnected; the client redials with its own backoff
// (kgo.RetryBackoffFn, by default 250ms to 5s with jitter). Run returns
// only when ctx ends or the client is closed, so there is no reconnect
// loop to write.
//
//   - The broker restarts, or the connections are reset: every request
//     fails at once and the client dials again until the broker is back.
//     The group and its commits live in the broker's log, so a member
//     whose session has not ended (kgo.SessionTimeout, default 45s) keeps
//     its partitions; one whose session ended rejoins and may be given
//     other partitions.
//   - The connection goes silent (a black-holed network, a dead load
//     balancer): the client notices only by its request deadlines. A
//     fetch is given up after its wait (kgo.FetchMaxWait, default 5s) plus
//     kgo.RequestTimeoutOverhead (default 10s); any other request (a
//     heartbeat, every kgo.HeartbeatInterval, default 3s; a commit) after
//     the overhead (a JoinGroup after the overhead plus
//     kgo.RebalanceTimeout); the client then closes the connection and
//     dials again. Lower RequestTimeoutOverhead to notice sooner (it also
//     bounds how long a busy broker may take to answer). The coordinator,
//     on its side, removes a member it has not heard from for the session
//     timeout and hands its partitions to the others.
//   - A handler already running goes on (its lease is in the
//     Deduplicator's store, not in Kafka) and its outcome is recorded
//     there; only the commit needs the broker. A commit that fails is
//     reported to OnError and retried at the next poll, at most a second
//     later, until one past it succeeds; it is dropped once the client no
//     longer holds the partition (see The client): the partition's new
//     owner starts from the last commit that succeeded, and the records
//     past it are delivered again and answered Replayed. Nothing is lost
//     and no effect repeats; the cost is redelivery.
//   - A member removed from the group while its handler runs (its session
//     ended, or it exceeded the rebalance timeout with
//     kgo.BlockRebalanceOnPoll) finds its partitions handed to another
//     member: that member's delivery of the record is answered InFlight
//     while the first holds the key's lease (renewed while the handler
//     runs), then Replayed once the first completes. The first member's
//     commits are refused (UNKNOWN_MEMBER_ID or ILLEGAL_GENERATION) and
//     reported to OnError, or, once its client has rejoined the group
//     without the partition, not made.
//
// # Delivery counts
//
// Kafka keeps no delivery count, so the Attempt given to Handle is counted
// by the Consumer, in memory: 1, plus one for each time the handler failed
// on this record in this process. A record whose handler fails MaxFailures
// times in a row is dead-lettered and committed past. The count is lost
// when the process restarts or the partition moves to another member, and
// starts again at 1 there.
//
// # Dead letters
//
// A dead-lettered record is produced, with the same client, to
// DeadLetterTopic with its key, value and headers, plus idem-topic,
// idem-partition, idem-offset (where it came from) and idem-error (the kept
// error text), before its offset is committed. A consumer that crashes
// between the two produces it again on redelivery: the dead-letter topic is
// at-least-once.
//
// # Tests
//
// The package's tests run against franz-go's in-process fake cluster
// (kfake), not a real Kafka broker. The broker faults of the shared suite
// (idemmsg/adaptertest) restart a kfake cluster that persists to disk on
// the same port, and cut the consumers' connections with a TCP proxy.
package kafka

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemmsg"
	"github.com/idemkit/idem/idemmsg/internal/loop"
)

// DefaultKeyHeader is the header read by the default Key.
const DefaultKeyHeader = "Idempotency-Key"

// DefaultMaxPollRecords is Consumer.MaxPollRecords's default.
const DefaultMaxPollRecords = 500

// DefaultBatchSize is Consumer.BatchSize's default.
const DefaultBatchSize = 64

// Headers added to a dead-lettered record.
const (
	HeaderTopic     = "idem-topic"
	HeaderPartition = "idem-partition"
	HeaderOffset    = "idem-offset"
	HeaderError     = "idem-error"
)

// Retry backoff: min(backoffStep·n, maxBackoff) for the n-th retry.
const (
	backoffStep = 100 * time.Millisecond
	maxBackoff  = 5 * time.Second
)

// commitTimeout bounds a commit or dead-letter produce that runs after
// Run's context ended (the records' results are already recorded).
const commitTimeout = 5 * time.Second

// commitRetryInterval is the longest a failed commit waits to be retried.
const commitRetryInterval = time.Second

// Consumer is one member of a consumer group. Fill in the fields and call
// Run. Client, Dedup and Handler are required.
type Consumer struct {
	// Client is the caller's franz-go client, created with
	// kgo.ConsumerGroup, kgo.ConsumeTopics and kgo.DisableAutoCommit; Run
	// does not close it.
	Client *kgo.Client

	// Dedup decides each delivery. Scope its Namespace to the topic and
	// group, e.g. "orders/billing".
	Dedup *idemmsg.Deduplicator
	// Handler performs the record's effect. It runs with the lease in its
	// context (idem.LeaseFromContext) and is not run again for a key that
	// completed. A panic in it is passed on to Run's caller (after the key
	// is released, the done records of its partition committed and the
	// other partitions of its batch finished).
	Handler func(ctx context.Context, rec *kgo.Record) error

	// Key returns a record's key. Default: the value of the first header
	// named KeyHeader, else "topic/partition/offset". A record without a
	// valid key (idem.ValidateKey) is dead-lettered.
	Key func(rec *kgo.Record) string
	// KeyHeader names the header holding the key, for the default Key.
	// Default DefaultKeyHeader.
	KeyHeader string

	// MaxPollRecords is the most records polled at once. Default
	// DefaultMaxPollRecords.
	MaxPollRecords int

	// DeadLetterTopic, when set, receives dead-lettered records (see the
	// package documentation). Default: they are only committed past.
	DeadLetterTopic string

	// Batch decides each partition's records of a poll in batches of up
	// to BatchSize with one Deduplicator.HandleBatch call each (InOrder)
	// instead of one Handle call per record: with a store that
	// implements idem.BatchStore (redisstore, memstore, pgstore), a
	// batch's keys are acquired in one step and the records whose
	// handlers finished are recorded in one step per group (see
	// FlushInterval); the partition's offset is committed once per batch,
	// after its completions, past the records done. Handlers still run
	// one at a time in offset order, and a record InFlight or Released
	// stops its batch: the records after it wait, and it is retried in
	// place after a backoff, as without Batch. The leases of a whole
	// batch are taken at once, so a consumer that crashes holds up to
	// BatchSize keys per partition until their lease ends.
	Batch bool
	// BatchSize, with Batch, is the most records of one partition decided
	// in one HandleBatch call. Default DefaultBatchSize.
	BatchSize int
	// FlushInterval, with Batch, bounds how long a decided record waits
	// for the others of its batch before it is recorded. Default
	// idemmsg.DefaultFlushInterval.
	FlushInterval time.Duration

	// OnResult, when set, is called after each delivery of a record is
	// decided, with Handle's result and error (so a retried record is
	// reported once per try). For metrics and logs; it must not block, and
	// it is called from one goroutine per partition at once.
	OnResult func(rec *kgo.Record, res idemmsg.Result, err error)
	// OnError, when set, receives the errors of the poll, commit,
	// dead-letter and store steps (Run retries them). It is called from
	// several goroutines at once. Default: logged with slog.Default at
	// warning level.
	OnError func(err error)

	beforeCommit func(rec *kgo.Record) bool // crash hook, nil but in tests: see export_test.go
}

// errCrashed is what Run returns when beforeCommit simulated a crash.
var errCrashed = errors.New("kafka: simulated crash")

// Run consumes until ctx ends, then commits the records that are done and
// returns nil. A record whose handler is running when ctx ends gets a
// cancelled context; its outcome is still committed if it calls for it.
// Poll, commit and store errors are reported to OnError and retried; Run
// returns an error only for an invalid configuration or a client closed
// under it (kgo.ErrClientClosed).
func (c *Consumer) Run(ctx context.Context) error {
	r, err := c.runner()
	if err != nil {
		return err
	}
	failures := 0
	for ctx.Err() == nil {
		// With a commit to retry, the poll waits at most
		// commitRetryInterval, so that an idle partition's commit is
		// retried too.
		pctx, cancel := ctx, context.CancelFunc(func() {})
		if r.retrying() {
			pctx, cancel = context.WithTimeout(ctx, commitRetryInterval)
		}
		fetches := r.Client.PollRecords(pctx, r.maxPoll)
		cancel()
		if fetches.IsClientClosed() {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("kafka: %w", kgo.ErrClientClosed)
		}
		pollErr := false
		fetches.EachError(func(topic string, p int32, err error) {
			if pctx.Err() != nil && (errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)) {
				return
			}
			pollErr = true
			r.onError(fmt.Errorf("kafka: poll %s/%d: %w", topic, p, err))
		})
		r.retryCommits(ctx)
		err := r.batch(ctx, fetches)
		r.Client.AllowRebalance()
		if err != nil {
			return err
		}
		if pollErr {
			failures++
			loop.Sleep(ctx, backoff(failures))
		} else {
			failures = 0
		}
	}
	r.retryCommits(ctx)
	return nil
}

// runner is a Consumer with its defaults filled in.
type runner struct {
	*Consumer
	keyHeader string
	maxPoll   int
	batchSize int
	commitMu  sync.Mutex  // one commit at a time, so a partition's commits stay in order
	crashed   atomic.Bool // in tests: a simulated crash, nothing more is committed

	retryMu sync.Mutex
	retry   map[topicPartition]*kgo.Record // failed commits to retry, past these records
}

type topicPartition struct {
	topic     string
	partition int32
}

func (c *Consumer) runner() (*runner, error) {
	switch {
	case c.Client == nil:
		return nil, errors.New("kafka: Consumer.Client is nil")
	case c.Dedup == nil:
		return nil, errors.New("kafka: Consumer.Dedup is nil")
	case c.Handler == nil:
		return nil, errors.New("kafka: Consumer.Handler is nil")
	case c.MaxPollRecords < 0 || c.BatchSize < 0 || c.FlushInterval < 0:
		return nil, errors.New("kafka: negative Consumer.MaxPollRecords, BatchSize or FlushInterval")
	}
	r := &runner{Consumer: c, keyHeader: c.KeyHeader, maxPoll: c.MaxPollRecords}
	if r.keyHeader == "" {
		r.keyHeader = DefaultKeyHeader
	}
	if r.maxPoll == 0 {
		r.maxPoll = DefaultMaxPollRecords
	}
	if r.batchSize = c.BatchSize; r.batchSize == 0 {
		r.batchSize = DefaultBatchSize
	}
	return r, nil
}

// batch handles one poll's records: each partition's in order, the
// partitions in parallel. It returns only errCrashed. A handler's panic is
// passed on to Run's caller once the other partitions are finished.
func (r *runner) batch(ctx context.Context, fetches kgo.Fetches) error {
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		crash    error
		panicked any
	)
	fetches.EachPartition(func(p kgo.FetchTopicPartition) {
		if len(p.Records) == 0 {
			return
		}
		wg.Go(func() {
			defer func() {
				if v := recover(); v != nil {
					mu.Lock()
					panicked = v
					mu.Unlock()
				}
			}()
			partition := r.partition
			if r.Batch {
				partition = r.partitionBatches
			}
			if err := partition(ctx, p.Records); err != nil {
				mu.Lock()
				crash = err
				mu.Unlock()
			}
		})
	})
	wg.Wait()
	if panicked != nil {
		panic(panicked)
	}
	return crash
}

// partition handles one partition's records in order and commits those
// done. It returns only errCrashed.
func (r *runner) partition(ctx context.Context, recs []*kgo.Record) error {
	var done *kgo.Record // last record done and not yet committed
	commit := func() {
		if done != nil {
			r.commit(ctx, done)
			done = nil
		}
	}
	defer commit()
	for _, rec := range recs {
		failures, tries := 0, 0
		for {
			if ctx.Err() != nil {
				return nil // the rest is left uncommitted, for the group to re-read
			}
			if r.crashed.Load() { // in tests: another partition crashed
				return errCrashed
			}
			outcome, retryAfter, failed := r.process(ctx, rec, failures+1)
			if outcome.Ack() {
				break
			}
			if failed {
				failures++
			}
			tries++
			commit() // what is done, before waiting
			wait := backoff(tries)
			if outcome == idemmsg.InFlight && retryAfter > 0 && retryAfter < wait {
				wait = retryAfter
			}
			loop.Sleep(ctx, wait)
		}
		if r.crashed.Load() || (r.beforeCommit != nil && !r.beforeCommit(rec)) {
			r.crashed.Store(true)
			done = nil
			return errCrashed
		}
		done = rec
	}
	return nil
}

// process decides one delivery of rec and, when it is dead-lettered,
// produces it to DeadLetterTopic. It reports the outcome to act on (an
// Ack outcome means rec is done), the InFlight holder's remaining lease,
// and whether the handler failed.
func (r *runner) process(ctx context.Context, rec *kgo.Record, attempt int) (idemmsg.Outcome, time.Duration, bool) {
	res, err := r.Dedup.Handle(ctx, idemmsg.Delivery{Key: r.key(rec), Attempt: attempt, Body: rec.Value},
		func(ctx context.Context) error { return r.Handler(ctx, rec) })
	return r.decide(ctx, rec, res, err)
}

// decide reports a decided record and produces its dead letter. It
// returns what process returns.
func (r *runner) decide(ctx context.Context, rec *kgo.Record, res idemmsg.Result, err error) (idemmsg.Outcome, time.Duration, bool) {
	if r.OnResult != nil {
		r.OnResult(rec, res, err)
	}
	if err != nil {
		r.onError(fmt.Errorf("kafka: %s/%d@%d: %w", rec.Topic, rec.Partition, rec.Offset, err))
	}
	outcome := res.Outcome
	if outcome == idemmsg.NoOutcome && (errors.Is(err, idem.ErrInvalidKey) || errors.Is(err, idem.ErrMismatch) || errors.Is(err, idem.ErrUnsealable)) {
		outcome, res.Err = idemmsg.DeadLettered, err // permanent: never handled
	}
	if outcome == idemmsg.DeadLettered && r.DeadLetterTopic != "" {
		if err := r.deadLetter(ctx, rec, res.Err); err != nil {
			r.onError(fmt.Errorf("kafka: produce %s (dead letter of %s/%d@%d): %w", r.DeadLetterTopic, rec.Topic, rec.Partition, rec.Offset, err))
			return idemmsg.Released, 0, false // retried: the next delivery is dead-lettered again
		}
	}
	return outcome, res.RetryAfter, outcome == idemmsg.Released && res.Err != nil
}

func (r *runner) deadLetter(ctx context.Context, rec *kgo.Record, cause error) error {
	text := ""
	if cause != nil {
		text = cause.Error()
	}
	headers := make([]kgo.RecordHeader, 0, len(rec.Headers)+4)
	headers = append(headers, rec.Headers...)
	headers = append(headers,
		kgo.RecordHeader{Key: HeaderTopic, Value: []byte(rec.Topic)},
		kgo.RecordHeader{Key: HeaderPartition, Value: []byte(strconv.FormatInt(int64(rec.Partition), 10))},
		kgo.RecordHeader{Key: HeaderOffset, Value: []byte(strconv.FormatInt(rec.Offset, 10))},
		kgo.RecordHeader{Key: HeaderError, Value: []byte(text)},
	)
	dl := &kgo.Record{Topic: r.DeadLetterTopic, Key: rec.Key, Value: rec.Value, Headers: headers}
	// The outcome is recorded: produce it even if ctx ended meanwhile.
	pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), commitTimeout)
	defer cancel()
	return r.Client.ProduceSync(pctx, dl).FirstErr()
}

// commit commits the offset past rec, even if ctx ended meanwhile, unless
// the client no longer holds rec's partition or has it committed past rec
// already (see commitDue). A failed commit is kept to be retried
// (retryCommits) until a commit past it succeeds or is no longer due.
func (r *runner) commit(ctx context.Context, rec *kgo.Record) {
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), commitTimeout)
	defer cancel()
	r.commitMu.Lock()
	defer r.commitMu.Unlock()
	if r.crashed.Load() {
		return
	}
	var err error
	if r.commitDue(rec) {
		err = r.Client.CommitRecords(cctx, rec)
		if err != nil {
			r.onError(fmt.Errorf("kafka: commit %s/%d@%d: %w", rec.Topic, rec.Partition, rec.Offset+1, err))
		}
	}
	tp := topicPartition{rec.Topic, rec.Partition}
	r.retryMu.Lock()
	defer r.retryMu.Unlock()
	if err == nil {
		if f, ok := r.retry[tp]; ok && f.Offset <= rec.Offset {
			delete(r.retry, tp)
		}
		return
	}
	if f, ok := r.retry[tp]; !ok || f.Offset <= rec.Offset {
		if r.retry == nil {
			r.retry = map[topicPartition]*kgo.Record{}
		}
		r.retry[tp] = rec
	}
}

// commitDue reports whether a commit past rec is due: the client holds rec's
// partition (franz-go's CommittedOffsets lists the partitions it holds
// and has polled or fetched a commit for) and has not committed past rec.
// A member that lost the partition (removed from the group, or the
// partition reassigned) must not commit it: franz-go commits with the
// client's current generation, which the broker accepts for any
// partition, so a late commit from here could move the new owner's offset
// back. The new owner starts from the last commit and replays what this
// member did past it. (A partition lost between this check and the
// commit is not covered.)
func (r *runner) commitDue(rec *kgo.Record) bool {
	committed, ok := r.Client.CommittedOffsets()[rec.Topic][rec.Partition]
	return ok && committed.Offset <= rec.Offset
}

// retrying reports whether a failed commit waits to be retried.
func (r *runner) retrying() bool {
	r.retryMu.Lock()
	defer r.retryMu.Unlock()
	return len(r.retry) > 0
}

// retryCommits retries the failed commits; commit drops those no longer
// due (see commitDue).
func (r *runner) retryCommits(ctx context.Context) {
	r.retryMu.Lock()
	recs := make([]*kgo.Record, 0, len(r.retry))
	for _, rec := range r.retry {
		recs = append(recs, rec)
	}
	r.retryMu.Unlock()
	for _, rec := range recs {
		r.commit(ctx, rec)
	}
}

func (r *runner) key(rec *kgo.Record) string {
	if r.Key != nil {
		return r.Key(rec)
	}
	for _, h := range rec.Headers {
		if h.Key == r.keyHeader {
			return string(h.Value)
		}
	}
	return rec.Topic + "/" + strconv.FormatInt(int64(rec.Partition), 10) + "/" + strconv.FormatInt(rec.Offset, 10)
}

func (r *runner) onError(err error) {
	if r.OnError != nil {
		r.OnError(err)
		return
	}
	slog.Default().Warn("kafka", "err", err)
}

// backoff is the wait before the n-th retry: min(100ms·n, 5s).
func backoff(n int) time.Duration {
	return min(backoffStep*time.Duration(max(n, 1)), maxBackoff)
}
