package sqs

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/idemkit/idem/idemmsg"
	"github.com/idemkit/idem/idemmsg/internal/msgtest"
	"github.com/idemkit/idem/idemmsg/internal/workpool"
	"github.com/idemkit/idem/internal/redisserver"
	"github.com/idemkit/idem/redisstore"
)

// Consumer throughput, BENCHMARKS.md "Message consumers (idemmsg)".
const (
	benchMsgs  = 5_000 // messages consumed per b.N iteration (fauxqs is slower than the other brokers)
	benchLimit = 2 * time.Minute
	benchStop  = 30 * time.Second
)

// benchShape is how a benchmark consumes: loops Run loops on the queue,
// each handling conc messages of a receive at once.
type benchShape struct{ loops, conc int }

func (s benchShape) String() string { return fmt.Sprintf("loops=%d,conc=%d", s.loops, s.conc) }

// benchShapes are the other adapters': 16 handlers at a time in two ways
// (16 loops of one; one loop of 16), then 16 loops of 16.
var benchShapes = []benchShape{{16, 1}, {1, 16}, {16, 16}}

// BenchmarkConsume measures messages per second through one standard
// queue of the private fauxqs, for each shape, side by side in one
// process:
//
//	raw   loops goroutines, each receiving (ReceiveMessage, 10 at most,
//	      long polling) and deleting each message (a DeleteMessageBatch
//	      of one, as Run does; fauxqs answers DeleteMessage about twice as
//	      slowly under concurrent calls), conc at a time, then receiving
//	      again: Run's loop with no Deduplicator
//	raw-batch  raw with one DeleteMessageBatch per receive, once its
//	      handlers returned
//	idem  loops Consumer.Run loops (Concurrency conc) with a
//	      Deduplicator over redisstore.Open (the production store) on a
//	      private redis-server started by the benchmark
//	idem-batch  idem with Consumer.Batch: one HandleBatch and one
//	      DeleteMessageBatch per group of a receive
//
// All run the trivial handler (count the message) over benchMsgs
// messages sent (SendMessageBatch), each with a unique Idempotency-Key,
// to a fresh queue before the timer starts. b.N counts iterations; run
// with -benchtime 1x. The clock stops when the handler has run for every
// message; that the queue is then empty (nothing visible, in flight or
// delayed) is checked outside the timing. idem reports idem/raw, the
// ratio of its rate to raw's from the same process, and idem-batch also
// idem/raw-batch.
func BenchmarkConsume(b *testing.B) {
	rs, err := redisserver.StartServer()
	if err != nil {
		b.Fatal(err)
	}
	defer rs.Stop()
	for _, shape := range benchShapes {
		b.Run(shape.String(), func(b *testing.B) {
			var rawRate, rawBatchRate float64
			b.Run("raw", func(b *testing.B) {
				rawRate = benchConsume(b, shape, "raw", func(*testing.B, *benchTarget) (func(context.Context, *benchTarget), func()) {
					return consumeRaw(b, false), func() {}
				})
			})
			b.Run("raw-batch", func(b *testing.B) {
				rawBatchRate = benchConsume(b, shape, "raw-batch", func(*testing.B, *benchTarget) (func(context.Context, *benchTarget), func()) {
					return consumeRaw(b, true), func() {}
				})
			})
			for _, batch := range []bool{false, true} {
				mode := "idem"
				if batch {
					mode = "idem-batch"
				}
				b.Run(mode, func(b *testing.B) {
					rate := benchConsume(b, shape, mode, func(b *testing.B, t *benchTarget) (func(context.Context, *benchTarget), func()) {
						store, err := redisstore.Open("redis://"+rs.Addr(), redisstore.Options{Prefix: "idem:" + t.name + ":"})
						if err != nil {
							b.Fatal(err)
						}
						d, err := idemmsg.New(store, idemmsg.Config{Namespace: t.name})
						if err != nil {
							store.Close()
							b.Fatal(err)
						}
						return consumeIdem(b, d, batch), func() { store.Close() }
					})
					if rawRate > 0 {
						b.ReportMetric(rate/rawRate, "idem/raw")
					}
					if batch && rawBatchRate > 0 {
						b.ReportMetric(rate/rawBatchRate, "idem/raw-batch")
					}
				})
			}
		})
	}
}

// benchTarget is one iteration's queue, already filled.
type benchTarget struct {
	shape   benchShape
	name    string
	queue   string
	client  *awssqs.Client
	handled atomic.Int64
	done    chan struct{} // closed when handled reaches benchMsgs
}

func (t *benchTarget) handle() {
	if t.handled.Add(1) == benchMsgs {
		close(t.done)
	}
}

type prepareFunc func(b *testing.B, t *benchTarget) (run func(ctx context.Context, t *benchTarget), release func())

func benchConsume(b *testing.B, shape benchShape, mode string, prepare prepareFunc) (rate float64) {
	var elapsed time.Duration
	b.ResetTimer()
	b.StopTimer()
	for i := range b.N {
		t := benchPublish(b, fmt.Sprintf("b%s-%d-%d", mode, time.Now().UnixNano(), i))
		t.shape = shape
		run, release := prepare(b, t)
		ctx, cancel := context.WithCancel(context.Background())
		stopped := make(chan struct{})
		start := time.Now()
		b.StartTimer()
		go func() { defer close(stopped); run(ctx, t) }()
		select {
		case <-t.done:
		case <-time.After(benchLimit):
			cancel()
			b.Fatalf("%s: handled %d of %d messages within %v", mode, t.handled.Load(), benchMsgs, benchLimit)
		}
		b.StopTimer()
		elapsed += time.Since(start)
		msgtest.WaitFor(b, "every message deleted", benchStop, func() bool {
			return (&topic{client: t.client, queue: t.queue}).Settled(b)
		})
		cancel()
		select {
		case <-stopped:
		case <-time.After(benchStop):
			b.Fatalf("%s: consumers did not stop within %v", mode, benchStop)
		}
		release()
		if n := t.handled.Load(); n != benchMsgs {
			b.Fatalf("%s: handled %d messages, want %d", mode, n, benchMsgs)
		}
		dctx, dcancel := context.WithTimeout(context.Background(), benchStop)
		if _, err := t.client.DeleteQueue(dctx, &awssqs.DeleteQueueInput{QueueUrl: &t.queue}); err != nil {
			b.Logf("delete queue %s: %v", t.queue, err)
		}
		dcancel()
	}
	rate = float64(b.N*benchMsgs) / elapsed.Seconds()
	b.ReportMetric(rate, "msgs/s")
	return rate
}

// benchPublish creates a standard queue and sends benchMsgs messages to
// it, 10 per SendMessageBatch, 16 batches at a time, each message with a
// unique Idempotency-Key.
func benchPublish(b *testing.B, name string) *benchTarget {
	ctx, cancel := context.WithTimeout(context.Background(), benchLimit)
	defer cancel()
	q, err := shared.CreateQueue(ctx, name, nil)
	if err != nil {
		b.Fatal(err)
	}
	c := shared.Client()
	pool := workpool.New(16)
	for i := 0; i < benchMsgs; i += 10 {
		pool.Go(func() {
			entries := make([]types.SendMessageBatchRequestEntry, 0, 10)
			for j := i; j < min(i+10, benchMsgs); j++ {
				entries = append(entries, types.SendMessageBatchRequestEntry{Id: aws.String(strconv.Itoa(j)), MessageBody: aws.String("payload"),
					MessageAttributes: map[string]types.MessageAttributeValue{
						DefaultKeyAttribute: {DataType: aws.String("String"), StringValue: aws.String(name + "-" + strconv.Itoa(j))}}})
			}
			out, err := c.SendMessageBatch(ctx, &awssqs.SendMessageBatchInput{QueueUrl: &q, Entries: entries})
			if err != nil || len(out.Failed) > 0 {
				b.Errorf("send to %s: %v (%d failed)", name, err, len(out.Failed))
			}
		})
	}
	pool.Wait()
	if b.Failed() {
		b.FailNow()
	}
	return &benchTarget{name: name, queue: q, client: c, done: make(chan struct{})}
}

// consumeRaw is Run's loop without the Deduplicator.
func consumeRaw(b *testing.B, batch bool) func(context.Context, *benchTarget) {
	return func(ctx context.Context, t *benchTarget) {
		var wg sync.WaitGroup
		for n := range t.shape.loops {
			wg.Go(func() {
				for ctx.Err() == nil {
					out, err := t.client.ReceiveMessage(ctx, &awssqs.ReceiveMessageInput{QueueUrl: &t.queue, MaxNumberOfMessages: 10,
						WaitTimeSeconds: 1, MessageAttributeNames: []string{"All"},
						MessageSystemAttributeNames: []types.MessageSystemAttributeName{types.MessageSystemAttributeNameApproximateReceiveCount}})
					if err != nil {
						if ctx.Err() == nil {
							b.Errorf("raw %d: receive: %v", n, err)
						}
						return
					}
					pool := workpool.New(t.shape.conc)
					for _, msg := range out.Messages {
						pool.Go(func() {
							t.handle()
							if batch {
								return
							}
							// DeleteMessageBatch of one, as Run's per-message
							// path: fauxqs answers DeleteMessage about twice as
							// slowly under concurrent calls.
							if _, err := t.client.DeleteMessageBatch(context.WithoutCancel(ctx), &awssqs.DeleteMessageBatchInput{QueueUrl: &t.queue,
								Entries: []types.DeleteMessageBatchRequestEntry{{Id: aws.String("0"), ReceiptHandle: msg.ReceiptHandle}}}); err != nil {
								b.Errorf("raw %d: delete: %v", n, err)
							}
						})
					}
					pool.Wait()
					if batch && len(out.Messages) > 0 {
						entries := make([]types.DeleteMessageBatchRequestEntry, len(out.Messages))
						for i, msg := range out.Messages {
							entries[i] = types.DeleteMessageBatchRequestEntry{Id: aws.String(strconv.Itoa(i)), ReceiptHandle: msg.ReceiptHandle}
						}
						if _, err := t.client.DeleteMessageBatch(context.WithoutCancel(ctx), &awssqs.DeleteMessageBatchInput{QueueUrl: &t.queue,
							Entries: entries}); err != nil {
							b.Errorf("raw %d: delete: %v", n, err)
						}
					}
				}
			})
		}
		wg.Wait()
	}
}

// consumeIdem runs t.shape.loops Consumer.Run loops over d.
func consumeIdem(b *testing.B, d *idemmsg.Deduplicator, batch bool) func(context.Context, *benchTarget) {
	return func(ctx context.Context, t *benchTarget) {
		var wg sync.WaitGroup
		for n := range t.shape.loops {
			c := &Consumer{
				Client: t.client, QueueURL: t.queue, Dedup: d, Concurrency: t.shape.conc, Batch: batch, WaitTime: time.Second,
				Handler: func(context.Context, types.Message) error { t.handle(); return nil },
				// Run retries what fails (a connection fauxqs closed as it
				// was reused, say: the clients make one try per call);
				// the handled count and the empty queue are checked.
				OnError: func(err error) {
					if ctx.Err() == nil {
						b.Logf("consumer %d: %v", n, err)
					}
				},
			}
			wg.Go(func() {
				if err := c.Run(ctx); err != nil {
					b.Errorf("consumer %d: Run: %v", n, err)
				}
			})
		}
		wg.Wait()
	}
}
