package redisstream

import (
	"context"
	"errors"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/idemmsg"
	"github.com/idemkit/idem/idemmsg/adaptertest"
)

// TestAdapterSuite runs the shared adapter scenarios against the private
// redis-server, with the Deduplicator on redisstore in the same server.
// The consumers run on each client library in turn, the store on the same
// library.
func TestAdapterSuite(t *testing.T) {
	forEachLib(t, func(t *testing.T, lib string) {
		adaptertest.Run(t, adaptertest.Harness{
			NewTopic: func(t *testing.T, cfg adaptertest.Config) adaptertest.Topic {
				return &suiteTopic{env: newEnv(t, lib, cfg.MaxFailures)}
			},
			IsCrash:     func(err error) bool { return errors.Is(err, errCrashed) },
			Concurrency: true,
			Batch:       true,
		})
	})
}

type suiteTopic struct{ *env }

func (s *suiteTopic) Publish(t testing.TB, keys ...string) { s.publish(keys...) }

func (s *suiteTopic) Start(t testing.TB, ac adaptertest.Consumer) func() error {
	c := s.consumer(ac.Name)
	c.Concurrency = ac.Concurrency
	c.Batch = ac.Batch
	c.DeadLetterStream = s.stream + ":dead"
	key := func(msg redis.XMessage) string { k, _ := msg.Values["k"].(string); return k }
	c.Handler = func(ctx context.Context, msg redis.XMessage) error { return ac.Handler(ctx, key(msg)) }
	if ac.BeforeAck != nil {
		c.crashBeforeAck(func(msg redis.XMessage) bool { return ac.BeforeAck(key(msg)) })
	}
	if ac.OnResult != nil {
		c.OnResult = func(msg redis.XMessage, res idemmsg.Result, err error) { ac.OnResult(key(msg), res, err) }
	}
	return s.start(c)
}

func (s *suiteTopic) Settled(testing.TB) bool { return s.settled() }

func (s *suiteTopic) DeadLetters(t testing.TB) []adaptertest.DeadLetter {
	entries, err := s.client.XRange(context.Background(), s.stream+":dead", "-", "+").Result()
	if err != nil {
		t.Fatal(err)
	}
	dead := make([]adaptertest.DeadLetter, len(entries))
	for i, e := range entries {
		k, _ := e.Values["k"].(string)
		text, _ := e.Values[FieldError].(string)
		dead[i] = adaptertest.DeadLetter{Key: k, Error: text}
	}
	return dead
}
