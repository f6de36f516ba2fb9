package kafka

import (
	"context"
	"errors"
	"testing"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemkit/idem/idemmsg"
	"github.com/idemkit/idem/idemmsg/adaptertest"
)

// TestAdapterSuite runs the shared adapter scenarios against kfake: each
// topic is a fresh in-process cluster with a 3-partition topic, its
// dead-letter topic and one consumer group, the records keyed by their
// Idempotency-Key header (the default Key), and the Deduplicator is on
// memstore. Every scenario also wants each partition's effects in offset
// order.
//
// Kafka keeps each partition's order and has no Concurrency. Its
// beforeCommit hook is the suite's BeforeAck.
func TestAdapterSuite(t *testing.T) {
	adaptertest.Run(t, adaptertest.Harness{
		NewTopic: func(t *testing.T, cfg adaptertest.Config) adaptertest.Topic {
			e := newEnv(t, cfg.MaxFailures)
			t.Cleanup(func() { e.ledger.checkOrder(t) })
			return &suiteTopic{env: e}
		},
		IsCrash: func(err error) bool { return errors.Is(err, errCrashed) },
		Batch:   true,
	})
}

type suiteTopic struct{ *env }

func (s *suiteTopic) Publish(t testing.TB, keys ...string) { s.publish(keys...) }

func recordKey(rec *kgo.Record) string { return headerValue(rec, DefaultKeyHeader) }

// Start runs a new group member on its own client; stopping it closes the
// client, so that it leaves the group (after a crash too).
func (s *suiteTopic) Start(t testing.TB, ac adaptertest.Consumer) func() error {
	c := s.consumer(ac.Name)
	c.DeadLetterTopic = s.dead
	c.Batch = ac.Batch
	c.Handler = func(ctx context.Context, rec *kgo.Record) error {
		if err := ac.Handler(ctx, recordKey(rec)); err != nil {
			return err
		}
		s.ledger.record(rec) // the effect is done: check its partition's order
		return nil
	}
	if ac.BeforeAck != nil {
		// The partitions of a batch are handled in parallel, so a crash in
		// one would not stop another's handler at the same point: poll one
		// record at a time, for the crash to come after exactly the
		// effects the scenario counted.
		c.MaxPollRecords = 1
		c.crashBeforeCommit(func(rec *kgo.Record) bool { return ac.BeforeAck(recordKey(rec)) })
	}
	if ac.OnResult != nil {
		c.OnResult = func(rec *kgo.Record, res idemmsg.Result, err error) { ac.OnResult(recordKey(rec), res, err) }
	}
	stop := s.start(c)
	return func() error {
		err := stop()
		c.Client.Close()
		return err
	}
}

func (s *suiteTopic) Settled(testing.TB) bool { return s.settled() }

// DeadLetters reads the dead-letter topic (one partition, so in arrival
// order) up to its end: the key and error text from the Idempotency-Key
// and idem-error headers.
func (s *suiteTopic) DeadLetters(t testing.TB) []adaptertest.DeadLetter {
	var end int64
	for _, p := range s.cluster.PartitionInfos(s.dead) {
		end += p.HighWatermark
	}
	var dead []adaptertest.DeadLetter
	for _, rec := range s.readDead(t, int(end)) {
		dead = append(dead, adaptertest.DeadLetter{Key: recordKey(rec), Error: headerValue(rec, HeaderError)})
	}
	return dead
}
