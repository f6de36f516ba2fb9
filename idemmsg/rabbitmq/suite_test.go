package rabbitmq

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemmsg"
	"github.com/idemkit/idem/idemmsg/adaptertest"
	"github.com/idemkit/idem/idemmsg/internal/msgtest"
)

// TestAdapterSuite runs the shared adapter scenarios against the local
// RabbitMQ, in the tests' private vhost: each topic is a fresh classic
// queue with its dead-letter exchange and queue, the messages keyed by
// their message-id (the default Key), and the Deduplicator is on memstore
// (or Config.Store).
//
// The broker-fault scenarios run on private nodes (node_test.go): a topic
// with Config.Faults is a durable queue on a node the test restarts
// (stop_app, start_app), its messages persistent, and its consumers reach
// it through a msgtest.Proxy, with a Dialer per consumer (heartbeat 1s)
// as Consumer.NewChannel; the publisher dials the node itself. A topic
// with Config.RedeliverAfter is on a node whose consumer_timeout is that
// long (checked every quarter of it): the broker closes the channel of a
// consumer whose delivery stays unacknowledged longer, and requeues its
// deliveries for the other consumer, as in production after 30 minutes;
// its Deduplicator's lease is 4 times as long, renewed while the handler
// runs.
func TestAdapterSuite(t *testing.T) {
	adaptertest.Run(t, adaptertest.Harness{
		Name:         "rabbitmq",
		NewTopic:     newSuiteTopic,
		IsCrash:      func(err error) bool { return errors.Is(err, errCrashed) },
		Concurrency:  true,
		Batch:        true,
		BrokerFaults: true,
	})
}

func newSuiteTopic(t *testing.T, cfg adaptertest.Config) adaptertest.Topic {
	o := envOpts{maxFailures: cfg.MaxFailures, store: cfg.Store}
	switch {
	case cfg.Faults:
		o.node = privateNode(t, nodeSpec{})
		// A restart is seen by every topic on the node: a scenario that
		// restarts it has the node to itself, the others share it.
		if strings.Contains(t.Name(), "BrokerRestart") {
			o.node.mu.Lock()
			t.Cleanup(o.node.mu.Unlock)
		} else {
			o.node.mu.RLock()
			t.Cleanup(o.node.mu.RUnlock)
		}
	case cfg.RedeliverAfter > 0:
		o.node = privateNode(t, nodeSpec{consumerTimeout: cfg.RedeliverAfter})
		o.lease = 4 * cfg.RedeliverAfter
	}
	if cfg.Lease > 0 {
		o.lease = cfg.Lease
	}
	s := &suiteTopic{env: newEnv(t, o), deadErrs: map[string][]string{}}
	if o.node != nil {
		s.dialAddr = o.node.addr()
	}
	if cfg.Faults {
		s.proxy = msgtest.NewProxy(t, o.node.addr())
		s.dialAddr = s.proxy.Addr
		return &faultsTopic{s}
	}
	return s
}

// faultsTopic is a suiteTopic on a private node, behind a proxy.
type faultsTopic struct{ *suiteTopic }

func (f *faultsTopic) RestartBroker(t testing.TB) { f.node.restart(t) }

func (f *faultsTopic) Cut(t testing.TB, how adaptertest.Cut) (restore func()) {
	return f.proxy.Cut(t, how == adaptertest.Blackhole)
}

// suiteTopic tracks what AMQP 0-9-1 does not report: a queue's
// unacknowledged deliveries (passive declare counts only the ready ones)
// and the dead letters' error text (RabbitMQ routes the rejected message
// itself to the dead-letter exchange, with x-death but no room for the
// error: the kept text is Result.Err, see the package documentation).
type suiteTopic struct {
	*env
	// dialAddr, for a topic on a private node, is where its consumers
	// dial (the node, or proxy's address) with a Dialer as NewChannel.
	dialAddr string
	proxy    *msgtest.Proxy

	mu        sync.Mutex
	published int
	// settled counts the deliveries settled: decided Executed, Replayed
	// or DeadLettered and past beforeAck, that is, acked or rejected.
	settled int
	// rejected counts the deliveries rejected to the dead-letter exchange.
	rejected int
	// deadErrs is, per key, the error text of each of its deliveries
	// rejected, in order.
	deadErrs map[string][]string
	// dead is what the dead-letter queue held, taken off it so far.
	dead []amqp.Delivery
}

func (s *suiteTopic) Publish(t testing.TB, keys ...string) {
	s.publish(true, keys...) // waits for the broker's confirms
	s.mu.Lock()
	s.published += len(keys)
	s.mu.Unlock()
}

func (s *suiteTopic) Start(t testing.TB, ac adaptertest.Consumer) func() error {
	// decided holds each delivery's outcome, by delivery tag (unique on
	// the consumer's channel), from OnResult until beforeAck.
	var decided sync.Map
	c := s.consumer(ac.Name, nil, nil, func(d amqp.Delivery, res idemmsg.Result, err error) {
		if ac.OnResult != nil {
			ac.OnResult(d.MessageId, res, err)
		}
		if res.Outcome == idemmsg.NoOutcome && (errors.Is(err, ErrNoMessageID) || errors.Is(err, idem.ErrInvalidKey) || errors.Is(err, idem.ErrMismatch)) {
			res.Outcome, res.Err = idemmsg.DeadLettered, err // as process settles it
		}
		decided.Store(d.DeliveryTag, res)
	})
	c.Concurrency = ac.Concurrency
	c.Batch = ac.Batch
	c.Handler = func(ctx context.Context, d amqp.Delivery) error { return ac.Handler(ctx, d.MessageId) }
	if s.dialAddr != "" {
		// Run survives its channel: a Dialer of its own, with 1s
		// heartbeats (a silent connection is closed after 1.5s).
		d := &Dialer{URL: s.node.url(s.dialAddr), Config: amqp.Config{Heartbeat: time.Second}, Timeout: 2 * time.Second}
		t.Cleanup(func() { d.Close() })
		c.Channel.Close()
		c.Channel, c.NewChannel = nil, d.Channel
	}
	c.crashBeforeAck(func(d amqp.Delivery) bool {
		v, _ := decided.LoadAndDelete(d.DeliveryTag)
		if ac.BeforeAck != nil && !ac.BeforeAck(d.MessageId) {
			return false
		}
		res, _ := v.(idemmsg.Result)
		s.mu.Lock()
		defer s.mu.Unlock()
		switch res.Outcome {
		case idemmsg.Executed, idemmsg.Replayed:
			s.settled++
		case idemmsg.DeadLettered:
			s.settled++
			s.rejected++
			text := ""
			if res.Err != nil {
				text = res.Err.Error()
			}
			s.deadErrs[d.MessageId] = append(s.deadErrs[d.MessageId], text)
		}
		return true
	})
	return s.start(c)
}

// Settled wants every published message settled by a consumer, none
// ready in the queue, and every rejected one in the dead-letter queue.
func (s *suiteTopic) Settled(t testing.TB) bool {
	s.takeDead(t)
	s.mu.Lock()
	done := s.settled >= s.published && len(s.dead) >= s.rejected
	s.mu.Unlock()
	if !done || s.inspect(s.queue).Messages != 0 {
		return false
	}
	if s.node != nil {
		// A delivery decided and counted above may have lost its ack
		// with its channel, and be back: wait until the node has nothing
		// ready or unacknowledged.
		ready, unacked := s.node.queueCounts(t, s.queue)
		return ready == 0 && unacked == 0
	}
	return true
}

// DeadLetters returns the dead-letter queue's messages in arrival order:
// the key from the message-id, which the dead letter keeps, and the error
// text from the outcome of the rejected delivery, matched by key in order.
func (s *suiteTopic) DeadLetters(t testing.TB) []adaptertest.DeadLetter {
	s.takeDead(t)
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]adaptertest.DeadLetter, len(s.dead))
	seen := map[string]int{}
	for i, d := range s.dead {
		k := d.MessageId
		dl := adaptertest.DeadLetter{Key: k}
		if errs := s.deadErrs[k]; seen[k] < len(errs) {
			dl.Error = errs[seen[k]]
		}
		seen[k]++
		if d.Headers["x-death"] == nil {
			t.Errorf("dead letter %d (%s) has no x-death header: %v", i, k, d.Headers)
		}
		out[i] = dl
	}
	return out
}

// takeDead moves the dead-letter queue's messages to s.dead.
func (s *suiteTopic) takeDead(t testing.TB) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.dead = append(s.dead, s.deadLetters()...)
}
