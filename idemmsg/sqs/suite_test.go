package sqs

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemmsg"
	"github.com/idemkit/idem/idemmsg/adaptertest"
	"github.com/idemkit/idem/idemmsg/internal/msgtest"
	"github.com/idemkit/idem/internal/reltest"
	"github.com/idemkit/idem/internal/sqstest"
	"github.com/idemkit/idem/memstore"
)

// shared is the fauxqs of the tests whose topics need no server of their
// own.
var shared *sqstest.Server

func TestMain(m *testing.M) {
	os.Setenv("AWS_EC2_METADATA_DISABLED", "true") // never look for credentials
	s, err := sqstest.Start(sqstest.Options{})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	shared = s
	code := m.Run()
	s.Stop()
	os.Exit(code)
}

const (
	// testLease is the Deduplicator's lease in the tests, and so the
	// visibility a received message gets (and gets again every third of
	// it while held): a crashed consumer's messages come back after it.
	testLease = 2 * time.Second
	// testWait is the long poll: short, so that a poll left behind by a
	// stopped consumer (fauxqs still hands it messages, which then come
	// back after their visibility) ends soon.
	testWait   = time.Second
	waitLimit  = 30 * time.Second
	fifoGroups = 8
)

var queues atomic.Int64

// suiteWait is Harness.Wait: the default, or 60s for the long versions of
// the broker-fault scenarios (reltest.Long), whose thousands of messages
// fauxqs, a single Node process, takes longer than 40s to pass through
// one at a time under -race on a shared machine.
func suiteWait() time.Duration {
	if reltest.Long() {
		return 60 * time.Second
	}
	return 0
}

// TestAdapterSuite runs the shared adapter scenarios against fauxqs: each
// topic is a fresh queue with a dead-letter queue, and the Deduplicator is
// on memstore (or Config.Store). Messages carry their key in the
// Idempotency-Key message attribute (the default Key). Standard/ runs
// them on standard queues, FIFO/ on FIFO queues, whose messages spread
// over 8 message groups, each with a MessageDeduplicationId of its own
// (the suite wants its duplicates delivered).
//
// The broker-fault scenarios' topics (Config.Faults) live on a fauxqs of
// their own with a data directory, which RestartBroker kills and starts
// again on its port (the queue, its messages, the in-flight ones and
// their receipt handles come back); their consumers reach it through a
// msgtest.Proxy, while the test publishes and checks the queue directly.
// Config.RedeliverAfter is the VisibilityTimeout, never extended
// (ExtendEvery negative), with a lease twice as long.
func TestAdapterSuite(t *testing.T) {
	for _, fifo := range []bool{false, true} {
		name, kind := "Standard", "standard"
		if fifo {
			name, kind = "FIFO", "FIFO"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			adaptertest.Run(t, adaptertest.Harness{
				Name:         "sqs (" + kind + ")",
				NewTopic:     func(t *testing.T, cfg adaptertest.Config) adaptertest.Topic { return newTopic(t, cfg, fifo) },
				IsCrash:      func(err error) bool { return errors.Is(err, errCrashed) },
				Concurrency:  true,
				Batch:        true,
				BrokerFaults: true,
				Wait:         suiteWait(),
			})
		})
	}
}

// topic is one scenario's queue and dead-letter queue.
type topic struct {
	srv        *sqstest.Server
	client     *awssqs.Client // the test's, straight to srv
	consumers  *awssqs.Client // the consumers', through proxy when there is one
	proxy      *msgtest.Proxy
	queue, dlq string
	fifo       bool
	dedup      *idemmsg.Deduplicator
	cfg        adaptertest.Config
	pubs       atomic.Int64

	mu   sync.Mutex
	dead []adaptertest.DeadLetter
}

func newTopic(t *testing.T, cfg adaptertest.Config, fifo bool) adaptertest.Topic {
	t.Helper()
	tp := &topic{srv: shared, fifo: fifo, cfg: cfg}
	if cfg.Faults {
		s, err := sqstest.Start(sqstest.Options{Persist: true})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(s.Stop)
		tp.srv, tp.proxy = s, msgtest.NewProxy(t, s.Addr())
	}
	tp.client = tp.srv.Client()
	tp.consumers = tp.client
	if tp.proxy != nil {
		tp.consumers = sqstest.NewClient(tp.proxy.Addr)
	}
	n := queues.Add(1)
	suffix := ""
	if fifo {
		suffix = ".fifo"
	}
	ctx := context.Background()
	var err error
	if tp.queue, err = tp.srv.CreateQueue(ctx, fmt.Sprintf("q%d%s", n, suffix), nil); err != nil {
		t.Fatal(err)
	}
	if tp.dlq, err = tp.srv.CreateQueue(ctx, fmt.Sprintf("q%d-dead%s", n, suffix), nil); err != nil {
		t.Fatal(err)
	}
	lease := testLease
	if cfg.RedeliverAfter > 0 {
		lease = 2 * cfg.RedeliverAfter
	}
	if cfg.Lease > 0 {
		lease = cfg.Lease
	}
	var store idem.Store = memstore.New(memstore.Options{})
	if cfg.Store != nil {
		store = cfg.Store
	}
	if tp.dedup, err = idemmsg.New(store, idemmsg.Config{Namespace: tp.queue, Lease: lease, MaxFailures: cfg.MaxFailures}); err != nil {
		t.Fatal(err)
	}
	if cfg.Faults {
		return &faultTopic{tp}
	}
	return tp
}

// Publish sends one message per key, with the key in the Idempotency-Key
// attribute (and, on a FIFO queue, in one of 8 groups, with a
// MessageDeduplicationId of its own). A send that fails (the server
// restarting) is tried again.
func (tp *topic) Publish(t testing.TB, keys ...string) {
	t.Helper()
	for _, k := range keys {
		n := tp.pubs.Add(1)
		in := &awssqs.SendMessageInput{QueueUrl: &tp.queue, MessageBody: aws.String("body of " + k),
			MessageAttributes: map[string]types.MessageAttributeValue{
				DefaultKeyAttribute: {DataType: aws.String("String"), StringValue: aws.String(k)}}}
		if tp.fifo {
			in.MessageGroupId = aws.String("g" + strconv.Itoa(int(n%fifoGroups)))
			in.MessageDeduplicationId = aws.String("pub-" + strconv.FormatInt(n, 10))
		}
		deadline := time.Now().Add(waitLimit)
		for {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			_, err := tp.client.SendMessage(ctx, in)
			cancel()
			if err == nil {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("publish %s: %v", k, err)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
}

func keyOf(msg types.Message) string {
	if a, ok := msg.MessageAttributes[DefaultKeyAttribute]; ok {
		return aws.ToString(a.StringValue)
	}
	return ""
}

// consumer returns a Consumer of the topic for ac.
func (tp *topic) consumer(ac adaptertest.Consumer) *Consumer {
	c := &Consumer{
		Client: tp.consumers, QueueURL: tp.queue, Dedup: tp.dedup, DeadLetterQueueURL: tp.dlq,
		WaitTime: testWait, Concurrency: ac.Concurrency, Batch: ac.Batch,
		Handler: func(ctx context.Context, msg types.Message) error { return ac.Handler(ctx, keyOf(msg)) },
		OnError: func(err error) {},
	}
	if tp.cfg.RedeliverAfter > 0 {
		c.VisibilityTimeout, c.ExtendEvery = tp.cfg.RedeliverAfter, -1
	}
	if ac.BeforeAck != nil {
		c.crashBeforeAck(func(msg types.Message) bool { return ac.BeforeAck(keyOf(msg)) })
	}
	if ac.OnResult != nil {
		c.OnResult = func(msg types.Message, res idemmsg.Result, err error) { ac.OnResult(keyOf(msg), res, err) }
	}
	return c
}

func (tp *topic) Start(t testing.TB, ac adaptertest.Consumer) func() error {
	c := tp.consumer(ac)
	return msgtest.Start(t, ac.Name, waitLimit, c.Run, nil)
}

// Settled reports whether the queue has no message visible, in flight or
// delayed.
func (tp *topic) Settled(t testing.TB) bool {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	out, err := tp.client.GetQueueAttributes(ctx, &awssqs.GetQueueAttributesInput{QueueUrl: &tp.queue,
		AttributeNames: []types.QueueAttributeName{types.QueueAttributeNameAll}})
	if err != nil {
		return false // the server restarting
	}
	for _, a := range []string{"ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible", "ApproximateNumberOfMessagesDelayed"} {
		if out.Attributes[a] != "0" {
			return false
		}
	}
	return true
}

// DeadLetters receives (and deletes) what reached the dead-letter queue
// since the last call, and returns every dead letter so far, in the order
// they were received: the key and error text from the AttrKey and
// AttrError attributes.
func (tp *topic) DeadLetters(t testing.TB) []adaptertest.DeadLetter {
	t.Helper()
	tp.mu.Lock()
	defer tp.mu.Unlock()
	ctx := context.Background()
	for {
		out, err := tp.client.ReceiveMessage(ctx, &awssqs.ReceiveMessageInput{QueueUrl: &tp.dlq, MaxNumberOfMessages: 10,
			VisibilityTimeout: 30, MessageAttributeNames: []string{"All"}})
		if err != nil {
			t.Fatal(err)
		}
		if len(out.Messages) == 0 {
			return append([]adaptertest.DeadLetter(nil), tp.dead...)
		}
		for _, m := range out.Messages {
			tp.dead = append(tp.dead, adaptertest.DeadLetter{
				Key: aws.ToString(m.MessageAttributes[AttrKey].StringValue), Error: aws.ToString(m.MessageAttributes[AttrError].StringValue)})
			if _, err := tp.client.DeleteMessage(ctx, &awssqs.DeleteMessageInput{QueueUrl: &tp.dlq, ReceiptHandle: m.ReceiptHandle}); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// faultTopic is a topic on a fauxqs of its own, with a data directory,
// which the consumers reach through proxy.
type faultTopic struct{ *topic }

// RestartBroker kills fauxqs and starts it again on its port and data
// directory.
func (f *faultTopic) RestartBroker(t testing.TB) {
	t.Helper()
	if err := f.srv.Restart(); err != nil {
		t.Fatal(err)
	}
}

// Cut resets or black-holes the consumers' connections at the proxy.
func (f *faultTopic) Cut(t testing.TB, how adaptertest.Cut) (restore func()) {
	t.Helper()
	return f.proxy.Cut(t, how == adaptertest.Blackhole)
}
