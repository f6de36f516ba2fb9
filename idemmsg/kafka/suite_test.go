package kafka

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/idemkit/idem/idemmsg"
	"github.com/idemkit/idem/idemmsg/adaptertest"
)

// TestAdapterSuite runs the shared adapter scenarios against kfake: each
// topic is a fresh in-process cluster with a 3-partition topic, its
// dead-letter topic and one consumer group, the records keyed by their
// Idempotency-Key header (the default Key), and the Deduplicator is on
// memstore (or Config.Store). Every scenario also wants each partition's
// effects in offset order.
//
// Kafka keeps each partition's order and has no Concurrency. Its
// beforeCommit hook is the suite's BeforeAck.
//
// The broker faults, on a topic made with Config.Faults (see
// suiteTopic.RestartBroker and Cut):
//
//   - the cluster persists to a private directory (kfake.DataDir) on a
//     fixed port, and a restart closes it (every connection with it;
//     what it holds is written out) and starts a new cluster there,
//     which reloads the records, the commits and the group;
//   - the consumers' clients dial a msgtest.Proxy for the broker, the
//     seed and every address the metadata names alike, while the test's
//     producer connects directly.
//
// Config.RedeliverAfter: Kafka hands a partition's uncommitted records to
// another member when their member leaves the group, and the coordinator
// removes a member whose heartbeats stop for its session timeout (a
// member stuck, cut from the coordinator, or past Java's
// max.poll.interval.ms). The consumers' session timeout is RedeliverAfter,
// and the first member to start a handler goes silent to the coordinator
// while that handler runs (its heartbeats are answered with an error that
// the client retries in place, without renewing the session); the
// coordinator removes it and gives its partitions, the record it works on
// included, to the other member. The Deduplicator's lease is
// 2·RedeliverAfter, renewed while a handler runs.
func TestAdapterSuite(t *testing.T) {
	adaptertest.Run(t, adaptertest.Harness{
		Name: "kafka",
		NewTopic: func(t *testing.T, cfg adaptertest.Config) adaptertest.Topic {
			ec := envConfig{maxFailures: cfg.MaxFailures, faults: cfg.Faults, store: cfg.Store}
			if cfg.Faults || cfg.Store != nil {
				ec.lease = faultLease
			}
			if cfg.RedeliverAfter > 0 {
				ec.lease, ec.sessionTimeout = 2*cfg.RedeliverAfter, cfg.RedeliverAfter
			}
			if cfg.Lease > 0 {
				ec.lease = cfg.Lease
			}
			e := newEnvWith(t, ec)
			t.Cleanup(func() { e.ledger.checkOrder(t) })
			s := &suiteTopic{env: e}
			if cfg.RedeliverAfter > 0 {
				s.stallFirstWorker()
			}
			return s
		},
		IsCrash:      func(err error) bool { return errors.Is(err, errCrashed) },
		Batch:        true,
		BrokerFaults: true,
	})
}

// faultLease is the Deduplicator's lease in the broker-fault scenarios
// (but RedeliveredWhileWorking's), none of which waits for a lease to
// end: under -race on a loaded machine a renewal (due every third of the
// lease) can come late enough to lose testLease's 300ms, and a lost lease
// lets a copy of the key run again, which is not the fault under test.
const faultLease = 2 * time.Second

type suiteTopic struct {
	*env
	// With Config.RedeliverAfter: the member silent to the coordinator
	// while it works, and whether it works now.
	stallMu  sync.Mutex
	stall    bool   // Config.RedeliverAfter
	stalling bool   // a member was chosen
	stalled  string // its member ID
	busy     int    // its handlers running
}

func (s *suiteTopic) Publish(t testing.TB, keys ...string) { s.publish(keys...) }

func recordKey(rec *kgo.Record) string { return headerValue(rec, DefaultKeyHeader) }

// Start runs a new group member on its own client; stopping it closes the
// client, so that it leaves the group (after a crash too).
func (s *suiteTopic) Start(t testing.TB, ac adaptertest.Consumer) func() error {
	c := s.consumer(ac.Name)
	c.DeadLetterTopic = s.dead
	c.Batch = ac.Batch
	cl := c.Client
	c.Handler = func(ctx context.Context, rec *kgo.Record) error {
		defer s.working(cl)()
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
	for _, p := range s.kfake().PartitionInfos(s.dead) {
		end += p.HighWatermark
	}
	var dead []adaptertest.DeadLetter
	for _, rec := range s.readDead(t, int(end)) {
		dead = append(dead, adaptertest.DeadLetter{Key: recordKey(rec), Error: headerValue(rec, HeaderError)})
	}
	return dead
}

// RestartBroker restarts the cluster (see TestAdapterSuite). What it does
// not model: kfake reloads at once on the same port, so the restart is
// short; the producer's and consumers' clients reconnect by themselves.
func (s *suiteTopic) RestartBroker(t testing.TB) { s.restart(t) }

// Cut cuts the consumers' proxy; the producer does not go through it.
func (s *suiteTopic) Cut(t testing.TB, how adaptertest.Cut) (restore func()) {
	return s.proxy.Cut(t, how == adaptertest.Blackhole)
}

// stallFirstWorker makes the first member whose handler starts go silent
// to the coordinator while its handlers run: its heartbeats are answered
// COORDINATOR_LOAD_IN_PROGRESS (retried in place by the client for up to
// its retry timeout, set above the session timeout) and do not renew its
// session, so the coordinator removes it after the session timeout.
func (s *suiteTopic) stallFirstWorker() {
	s.stall = true
	s.kfake().Fault(kfake.Fault{
		Keys: []kmsg.Key{kmsg.Heartbeat}, Group: s.group, TopLevel: true, Count: -1,
		Err: kerr.CoordinatorLoadInProgress,
		When: func(req kmsg.Request) bool {
			hb := req.(*kmsg.HeartbeatRequest)
			s.stallMu.Lock()
			defer s.stallMu.Unlock()
			return s.busy > 0 && hb.MemberID == s.stalled
		},
	})
}

// working notes that cl's member starts a handler, and returns the
// function that notes its end.
func (s *suiteTopic) working(cl *kgo.Client) func() {
	member, _ := cl.GroupMetadata()
	s.stallMu.Lock()
	defer s.stallMu.Unlock()
	if !s.stall {
		return func() {}
	}
	if !s.stalling {
		s.stalling, s.stalled = true, member
	}
	if member != s.stalled {
		return func() {}
	}
	s.busy++
	return func() {
		s.stallMu.Lock()
		s.busy--
		s.stallMu.Unlock()
	}
}
