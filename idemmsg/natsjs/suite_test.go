package natsjs

import (
	"context"
	"errors"
	"testing"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/idemmsg"
	"github.com/idemkit/idem/idemmsg/adaptertest"
)

// TestAdapterSuite runs the shared adapter scenarios against the private
// nats-server: each topic is a fresh memory stream with its durable
// consumer, and the Deduplicator is on memstore.
//
// The messages are keyed by their payload and published without a
// Nats-Msg-Id: JetStream would drop a repeated id within the stream's
// Duplicates window, and the suite wants duplicates delivered.
// TestDuplicatesDefaultKey covers the default key.
func TestAdapterSuite(t *testing.T) {
	adaptertest.Run(t, adaptertest.Harness{
		NewTopic: func(t *testing.T, cfg adaptertest.Config) adaptertest.Topic {
			return &suiteTopic{env: newEnv(t, envOpts{maxFailures: cfg.MaxFailures})}
		},
		IsCrash:     func(err error) bool { return errors.Is(err, errCrashed) },
		Concurrency: true,
		Batch:       true,
	})
}

type suiteTopic struct{ *env }

func (s *suiteTopic) deadSubject() string { return "dead." + s.stream }

// Publish publishes without Nats-Msg-Id; publish fails the test if the
// stream dropped a message as a duplicate.
func (s *suiteTopic) Publish(t testing.TB, keys ...string) { s.publish(false, keys...) }

func (s *suiteTopic) Start(t testing.TB, ac adaptertest.Consumer) func() error {
	c := s.consumer(ac.Name, payloadKey)
	c.Concurrency = ac.Concurrency
	c.Batch = ac.Batch
	c.MaxMessages = max(DefaultMaxMessages, ac.Concurrency)
	c.DeadLetterSubject = s.deadSubject()
	c.Handler = func(ctx context.Context, msg jetstream.Msg) error { return ac.Handler(ctx, payloadKey(msg)) }
	if ac.BeforeAck != nil {
		c.crashBeforeAck(func(msg jetstream.Msg) bool { return ac.BeforeAck(payloadKey(msg)) })
	}
	if ac.OnResult != nil {
		c.OnResult = func(msg jetstream.Msg, res idemmsg.Result, err error) { ac.OnResult(payloadKey(msg), res, err) }
	}
	return s.start(c)
}

func (s *suiteTopic) Settled(testing.TB) bool { return s.settled() }

// DeadLetters reads the dead-letter subject from the stream, in sequence
// order: the key and error text from the HeaderKey and HeaderError headers.
func (s *suiteTopic) DeadLetters(t testing.TB) []adaptertest.DeadLetter {
	msgs := s.deadLetters(t, s.deadSubject())
	dead := make([]adaptertest.DeadLetter, len(msgs))
	for i, m := range msgs {
		dead[i] = adaptertest.DeadLetter{Key: m.Header.Get(HeaderKey), Error: m.Header.Get(HeaderError)}
	}
	return dead
}
