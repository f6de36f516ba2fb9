package rabbitmq

import (
	"context"
	"errors"
	"sync"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemmsg"
	"github.com/idemkit/idem/idemmsg/adaptertest"
)

// TestAdapterSuite runs the shared adapter scenarios against the local
// RabbitMQ, in the tests' private vhost: each topic is a fresh classic
// queue with its dead-letter exchange and queue, the messages keyed by
// their message-id (the default Key), and the Deduplicator is on memstore.
func TestAdapterSuite(t *testing.T) {
	adaptertest.Run(t, adaptertest.Harness{
		NewTopic: func(t *testing.T, cfg adaptertest.Config) adaptertest.Topic {
			return &suiteTopic{env: newEnv(t, envOpts{maxFailures: cfg.MaxFailures}), deadErrs: map[string][]string{}}
		},
		IsCrash:     func(err error) bool { return errors.Is(err, errCrashed) },
		Concurrency: true,
		Batch:       true,
	})
}

// suiteTopic tracks what AMQP 0-9-1 does not report: a queue's
// unacknowledged deliveries (passive declare counts only the ready ones)
// and the dead letters' error text (RabbitMQ routes the rejected message
// itself to the dead-letter exchange, with x-death but no room for the
// error: the kept text is Result.Err, see the package documentation).
type suiteTopic struct {
	*env

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
	return done && s.inspect(s.queue).Messages == 0
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
