package redisstream

import (
	"context"
	"errors"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/idemmsg"
	"github.com/idemkit/idem/idemmsg/adaptertest"
	"github.com/idemkit/idem/idemmsg/internal/msgtest"
	"github.com/idemkit/idem/internal/redisserver"
)

// TestAdapterSuite runs the shared adapter scenarios against the private
// redis-server, with the Deduplicator on redisstore in the same server.
// The consumers run on each client library in turn, the store on the same
// library.
//
// The broker-fault scenarios get their own redis-server each (with an
// append-only file fsynced on every write, so that a restart keeps the
// stream and its group), which the consumers reach through a msgtest.Proxy
// while the test publishes and inspects directly, and a memstore, so that
// only the consumers' connection to the broker is at fault. With
// Config.RedeliverAfter, MinIdle is that long: the second consumer claims
// an entry with XAUTOCLAIM once it has been pending that long, while the
// Deduplicator's lease, twice as long, is renewed as the handler runs.
func TestAdapterSuite(t *testing.T) {
	forEachLib(t, func(t *testing.T, lib string) {
		adaptertest.Run(t, adaptertest.Harness{
			Name:         "redisstream (" + lib + ")",
			NewTopic:     func(t *testing.T, cfg adaptertest.Config) adaptertest.Topic { return newSuiteTopic(t, lib, cfg) },
			IsCrash:      func(err error) bool { return errors.Is(err, errCrashed) },
			Concurrency:  true,
			Batch:        true,
			BrokerFaults: true,
		})
	})
}

func newSuiteTopic(t *testing.T, lib string, cfg adaptertest.Config) adaptertest.Topic {
	o := envOptions{maxFailures: cfg.MaxFailures, store: cfg.Store}
	if cfg.RedeliverAfter > 0 {
		o.minIdle, o.lease, o.memstore = cfg.RedeliverAfter, 2*cfg.RedeliverAfter, true
	}
	if cfg.Lease > 0 {
		o.lease = cfg.Lease
	}
	if !cfg.Faults {
		return &suiteTopic{env: newEnvWith(t, lib, o)}
	}
	server, err := redisserver.StartServer(redisserver.WithArgs("--appendonly", "yes", "--appendfsync", "always"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(server.Stop)
	proxy := msgtest.NewProxy(t, server.Addr())
	o.server, o.consumerAddr, o.memstore = server, proxy.Addr, true
	return &faultTopic{suiteTopic{env: newEnvWith(t, lib, o)}, server, proxy}
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

// faultTopic is a suiteTopic on a redis-server of its own, which the
// consumers reach through proxy.
type faultTopic struct {
	suiteTopic
	server *redisserver.Server
	proxy  *msgtest.Proxy
}

// RestartBroker kills the server (SIGKILL: no shutdown, every connection
// reset) and starts it again on the same port; the append-only file,
// fsynced on every write, brings back the stream, its group, the group's
// pending entries and their delivery counts.
func (f *faultTopic) RestartBroker(t testing.TB) {
	t.Helper()
	f.server.Kill()
	if err := f.server.Restart(); err != nil {
		t.Fatal(err)
	}
}

func (f *faultTopic) Cut(t testing.TB, how adaptertest.Cut) (restore func()) {
	t.Helper()
	return f.proxy.Cut(t, how == adaptertest.Blackhole)
}
