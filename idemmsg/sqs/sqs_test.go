package sqs

import (
	"context"
	"errors"
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
	"github.com/idemkit/idem/idemmsg/adaptertest"
	"github.com/idemkit/idem/idemmsg/internal/msgtest"
	"github.com/idemkit/idem/memstore"
)

// TestVisibilityExtended: a handler that runs twice the
// VisibilityTimeout (2s) keeps its message: the visibility is extended
// to VisibilityTimeout while it runs (every 1.5s: an extension to
// anything shorter, such as SQS's 1s minimum, would let the message
// reappear before the next), so a second consumer never receives it, and
// it is received once (ApproximateReceiveCount 1). Without the extension
// (ExtendEvery negative, the control case) the second consumer receives
// it meanwhile.
func TestVisibilityExtended(t *testing.T) {
	for _, extend := range []bool{true, false} {
		t.Run(fmt.Sprintf("extend=%t", extend), func(t *testing.T) {
			t.Parallel()
			tp := newTopic(t, adaptertest.Config{}, false).(*topic)
			tp.Publish(t, "slow")
			var decisions, maxAttempt atomic.Int32
			var stops []func() error
			for _, name := range []string{"c1", "c2"} {
				c := tp.consumer(adaptertest.Consumer{Name: name, Handler: func(ctx context.Context, key string) error {
					select {
					case <-time.After(4 * time.Second):
					case <-ctx.Done():
					}
					return nil
				}})
				c.VisibilityTimeout = 2 * time.Second
				c.ExtendEvery = 1500 * time.Millisecond
				if !extend {
					c.ExtendEvery = -1
				}
				c.OnResult = func(msg types.Message, res idemmsg.Result, err error) {
					decisions.Add(1)
					if a := int32(attemptOf(msg)); a > maxAttempt.Load() {
						maxAttempt.Store(a)
					}
				}
				stops = append(stops, msgtest.Start(t, name, waitLimit, c.Run, nil))
			}
			msgtest.WaitFor(t, "the message settled", waitLimit, func() bool { return decisions.Load() >= 1 && tp.Settled(t) })
			for _, stop := range stops {
				if err := stop(); err != nil {
					t.Fatal(err)
				}
			}
			if extend && (decisions.Load() != 1 || maxAttempt.Load() != 1) {
				t.Errorf("with the extension: %d decisions, highest receive count %d; want 1 and 1", decisions.Load(), maxAttempt.Load())
			}
			if !extend && decisions.Load() < 2 {
				t.Errorf("without the extension: %d decisions, want the message received again while its handler ran", decisions.Load())
			}
		})
	}
}

// TestRedrivePolicyRefused: a queue whose redrive policy moves a message
// to its dead-letter queue before MaxFailures receives is refused; one
// with room is not.
func TestRedrivePolicyRefused(t *testing.T) {
	ctx := context.Background()
	dead, err := shared.CreateQueue(ctx, "redrive-dead", nil)
	if err != nil {
		t.Fatal(err)
	}
	arn, err := shared.Client().GetQueueAttributes(ctx, &awssqs.GetQueueAttributesInput{QueueUrl: &dead,
		AttributeNames: []types.QueueAttributeName{types.QueueAttributeNameQueueArn}})
	if err != nil {
		t.Fatal(err)
	}
	d, err := idemmsg.New(memstore.New(memstore.Options{}), idemmsg.Config{MaxFailures: 5})
	if err != nil {
		t.Fatal(err)
	}
	for n, want := range map[int]bool{3: true, 5: false} {
		q, err := shared.CreateQueue(ctx, "redrive-"+strconv.Itoa(n), map[string]string{"RedrivePolicy": fmt.Sprintf(
			`{"deadLetterTargetArn":%q,"maxReceiveCount":%d}`, arn.Attributes["QueueArn"], n)})
		if err != nil {
			t.Fatal(err)
		}
		c := &Consumer{Client: shared.Client(), QueueURL: q, Dedup: d, WaitTime: -1,
			Handler: func(context.Context, types.Message) error { return nil }}
		rctx, cancel := context.WithTimeout(ctx, time.Second)
		err = c.Run(rctx)
		cancel()
		if got := errors.Is(err, ErrRedrivePolicy); got != want {
			t.Errorf("maxReceiveCount %d, MaxFailures 5: Run returned %v; want ErrRedrivePolicy: %t", n, err, want)
		}
	}
}

// TestDefaultKey: the Idempotency-Key attribute is the key when present,
// else the MessageId: two messages with one attribute value run once,
// two without run twice.
func TestDefaultKey(t *testing.T) {
	tp := newTopic(t, adaptertest.Config{}, false).(*topic)
	tp.Publish(t, "same", "same")
	ctx := context.Background()
	for range 2 {
		if _, err := tp.client.SendMessage(ctx, &awssqs.SendMessageInput{QueueUrl: &tp.queue, MessageBody: aws.String("no key")}); err != nil {
			t.Fatal(err)
		}
	}
	var mu sync.Mutex
	runs := map[string]int{}
	c := tp.consumer(adaptertest.Consumer{Name: "c1"})
	c.Handler = func(ctx context.Context, msg types.Message) error {
		mu.Lock()
		defer mu.Unlock()
		runs[aws.ToString(msg.Body)]++
		return nil
	}
	stop := msgtest.Start(t, "c1", waitLimit, c.Run, nil)
	msgtest.WaitFor(t, "the messages settled", waitLimit, func() bool { return tp.Settled(t) })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if runs["body of same"] != 1 || runs["no key"] != 2 {
		t.Errorf("handler runs by body: %v; want 1 for the keyed pair, 2 for the two without a key", runs)
	}
}

// fakeFIFO is an API whose one ReceiveMessage returns msgs (of a FIFO
// queue), as SQS may, several of one message group in one receive; later
// receives return nothing. It records the visibility changes and deletes.
type fakeFIFO struct {
	msgs []types.Message

	mu       sync.Mutex
	received bool
	deleted  []string
	visible  map[string]int32 // body: the last visibility set
}

func newFakeFIFO(bodies ...string) *fakeFIFO {
	f := &fakeFIFO{visible: map[string]int32{}}
	for i, b := range bodies {
		f.msgs = append(f.msgs, types.Message{MessageId: aws.String("id-" + b), ReceiptHandle: aws.String(b), Body: aws.String(b),
			Attributes: map[string]string{"MessageGroupId": b[:1], "ApproximateReceiveCount": "1"},
			MessageAttributes: map[string]types.MessageAttributeValue{
				DefaultKeyAttribute: {DataType: aws.String("String"), StringValue: aws.String(b + strconv.Itoa(i))}}})
	}
	return f
}

func (f *fakeFIFO) ReceiveMessage(ctx context.Context, in *awssqs.ReceiveMessageInput, _ ...func(*awssqs.Options)) (*awssqs.ReceiveMessageOutput, error) {
	f.mu.Lock()
	first := !f.received
	f.received = true
	f.mu.Unlock()
	if first {
		return &awssqs.ReceiveMessageOutput{Messages: f.msgs}, nil
	}
	select {
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-time.After(50 * time.Millisecond):
		return &awssqs.ReceiveMessageOutput{}, nil
	}
}

func (f *fakeFIFO) DeleteMessageBatch(_ context.Context, in *awssqs.DeleteMessageBatchInput, _ ...func(*awssqs.Options)) (*awssqs.DeleteMessageBatchOutput, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, e := range in.Entries {
		f.deleted = append(f.deleted, aws.ToString(e.ReceiptHandle))
	}
	return &awssqs.DeleteMessageBatchOutput{}, nil
}

func (f *fakeFIFO) ChangeMessageVisibilityBatch(_ context.Context, in *awssqs.ChangeMessageVisibilityBatchInput, _ ...func(*awssqs.Options)) (*awssqs.ChangeMessageVisibilityBatchOutput, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, e := range in.Entries {
		f.visible[aws.ToString(e.ReceiptHandle)] = e.VisibilityTimeout
	}
	return &awssqs.ChangeMessageVisibilityBatchOutput{}, nil
}

func (f *fakeFIFO) SendMessage(context.Context, *awssqs.SendMessageInput, ...func(*awssqs.Options)) (*awssqs.SendMessageOutput, error) {
	return &awssqs.SendMessageOutput{}, nil
}

func (f *fakeFIFO) GetQueueAttributes(context.Context, *awssqs.GetQueueAttributesInput, ...func(*awssqs.Options)) (*awssqs.GetQueueAttributesOutput, error) {
	return &awssqs.GetQueueAttributesOutput{}, nil
}

// TestFIFOGroupOrder: a receive holds three messages of group a and one
// of group b; the handler of a's second fails. a's third must not run
// before it (it is handed back, behind the failed one, which gets its
// backoff), while group b runs; in both modes, with and without
// concurrency.
func TestFIFOGroupOrder(t *testing.T) {
	for _, batch := range []bool{false, true} {
		for _, conc := range []int{1, 4} {
			t.Run(fmt.Sprintf("batch=%t/concurrency=%d", batch, conc), func(t *testing.T) {
				t.Parallel()
				f := newFakeFIFO("a1", "b1", "a2", "a3")
				d, err := idemmsg.New(memstore.New(memstore.Options{}), idemmsg.Config{Lease: 10 * time.Second})
				if err != nil {
					t.Fatal(err)
				}
				var mu sync.Mutex
				var ran []string
				c := &Consumer{Client: f, QueueURL: "http://127.0.0.1/000000000000/q.fifo", Dedup: d, Batch: batch, Concurrency: conc,
					Backoff: func(int) time.Duration { return 7 * time.Second },
					Handler: func(_ context.Context, msg types.Message) error {
						mu.Lock()
						defer mu.Unlock()
						ran = append(ran, aws.ToString(msg.Body))
						if aws.ToString(msg.Body) == "a2" {
							return errors.New("a2 fails")
						}
						return nil
					}}
				stop := msgtest.Start(t, "c", waitLimit, c.Run, nil)
				msgtest.WaitFor(t, "a2's backoff", waitLimit, func() bool {
					f.mu.Lock()
					defer f.mu.Unlock()
					return f.visible["a2"] != 0 && f.visible["a3"] != 0 && len(f.deleted) == 2
				})
				if err := stop(); err != nil {
					t.Fatal(err)
				}
				mu.Lock()
				defer mu.Unlock()
				f.mu.Lock()
				defer f.mu.Unlock()
				for _, b := range ran {
					if b == "a3" {
						t.Errorf("a3 ran after a2 failed (ran: %v)", ran)
					}
				}
				if f.visible["a2"] != 7 || f.visible["a3"] != 1 {
					t.Errorf("visibility set: %v; want a2 7 (its backoff), a3 1 (handed back)", f.visible)
				}
				if len(f.deleted) != 2 || !contains(f.deleted, "a1") || !contains(f.deleted, "b1") {
					t.Errorf("deleted %v, want a1 and b1", f.deleted)
				}
			})
		}
	}
}

func contains(s []string, v string) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}

// TestInFlightComesBack: a message whose key another message holds (two
// deliveries of one key, handled at once) is made visible again when the
// holder's lease would end (Result.RetryAfter, 2s at most here), not kept
// away longer: once the holder completed, it comes back and replays.
func TestInFlightComesBack(t *testing.T) {
	tp := newTopic(t, adaptertest.Config{Lease: 2 * time.Second}, false).(*topic)
	tp.Publish(t, "k", "k")
	release := make(chan struct{})
	var runs, inFlight, replays atomic.Int32
	c := tp.consumer(adaptertest.Consumer{Name: "c1", Concurrency: 2, Handler: func(ctx context.Context, key string) error {
		runs.Add(1)
		select {
		case <-release: // the other message was found in flight
		case <-ctx.Done():
		}
		return nil
	}})
	c.OnResult = func(msg types.Message, res idemmsg.Result, err error) {
		switch res.Outcome {
		case idemmsg.InFlight:
			if inFlight.Add(1) == 1 {
				close(release)
			}
		case idemmsg.Replayed:
			replays.Add(1)
		}
	}
	stop := msgtest.Start(t, "c1", waitLimit, c.Run, nil)
	msgtest.WaitFor(t, "the message found in flight came back and replayed", waitLimit, func() bool { return replays.Load() >= 1 && tp.Settled(t) })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if runs.Load() != 1 || inFlight.Load() < 1 {
		t.Errorf("%d runs and %d in-flight answers, want 1 and at least 1", runs.Load(), inFlight.Load())
	}
}
