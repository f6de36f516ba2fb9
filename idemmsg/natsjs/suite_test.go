package natsjs

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/idemmsg"
	"github.com/idemkit/idem/idemmsg/adaptertest"
	"github.com/idemkit/idem/idemmsg/internal/msgtest"
)

// TestAdapterSuite runs the shared adapter scenarios against the private
// nats-server: each topic is a fresh memory stream with its durable
// consumer, and the Deduplicator is on memstore (or Config.Store).
//
// The messages are keyed by their payload and published without a
// Nats-Msg-Id: JetStream would drop a repeated id within the stream's
// Duplicates window, and the suite wants duplicates delivered.
// TestDuplicatesDefaultKey covers the default key.
//
// The broker-fault scenarios' topics (Config.Faults) live on a server of
// their own, with file storage, which RestartBroker kills and starts again
// on its port and store directory; their consumers connect through a
// msgtest.Proxy, with the connection options the package documentation
// recommends (consumerOptions), while the test publishes and checks the
// consumer's state directly. Config.RedeliverAfter is the consumer's
// AckWait, with a lease twice as long.
func TestAdapterSuite(t *testing.T) {
	adaptertest.Run(t, adaptertest.Harness{
		Name: "natsjs",
		NewTopic: func(t *testing.T, cfg adaptertest.Config) adaptertest.Topic {
			o := envOpts{maxFailures: cfg.MaxFailures, store: cfg.Store}
			if cfg.RedeliverAfter > 0 {
				o.ackWait, o.lease = cfg.RedeliverAfter, 2*cfg.RedeliverAfter
			}
			if cfg.Lease > 0 {
				o.lease = cfg.Lease
			}
			if !cfg.Faults {
				return &suiteTopic{env: newEnv(t, o)}
			}
			s, err := startNATS()
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(s.Stop)
			o.server, o.file = s, true
			return &faultTopic{suiteTopic: suiteTopic{env: newEnv(t, o)}, proxy: msgtest.NewProxy(t, s.addr)}
		},
		IsCrash:      func(err error) bool { return errors.Is(err, errCrashed) },
		Concurrency:  true,
		Batch:        true,
		BrokerFaults: true,
	})
}

type suiteTopic struct{ *env }

func (s *suiteTopic) deadSubject() string { return "dead." + s.stream }

// Publish publishes without Nats-Msg-Id; publish fails the test if the
// stream dropped a message as a duplicate.
func (s *suiteTopic) Publish(t testing.TB, keys ...string) { s.publish(false, keys...) }

func (s *suiteTopic) Start(t testing.TB, ac adaptertest.Consumer) func() error {
	return s.startOn(ac, s.js, s.cons)
}

// startOn runs ac as a Run loop on the durable consumer cons, publishing
// dead letters with js.
func (s *suiteTopic) startOn(ac adaptertest.Consumer, js jetstream.JetStream, cons jetstream.Consumer) func() error {
	c := s.consumer(ac.Name, payloadKey)
	c.Consumer, c.JetStream = cons, js
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

// faultTopic is a suiteTopic on a server of its own (env.srv), with file
// storage, whose consumers connect through proxy.
type faultTopic struct {
	suiteTopic
	proxy *msgtest.Proxy
	pubs  atomic.Int64 // Nats-Msg-Ids of Publish
}

// consumerOptions are the connection options of the fault scenarios'
// consumers, as the package documentation recommends them (shorter, to
// fit the scenarios): reconnect for ever, and ping often enough that a
// silent connection is noticed within seconds.
func consumerOptions() []nats.Option {
	return []nats.Option{
		nats.MaxReconnects(-1),
		nats.ReconnectWait(100 * time.Millisecond),
		nats.PingInterval(500 * time.Millisecond),
		nats.MaxPingsOutstanding(2),
		nats.Timeout(time.Second),
	}
}

// Start runs ac on a connection of its own through the proxy.
func (f *faultTopic) Start(t testing.TB, ac adaptertest.Consumer) func() error {
	t.Helper()
	// The client's callbacks run on a goroutine of its own: log only
	// until the connection is closed.
	var mu sync.Mutex
	closed := false
	logf := func(format string, args ...any) {
		mu.Lock()
		defer mu.Unlock()
		if !closed {
			t.Logf(ac.Name+": "+format, args...)
		}
	}
	nc, err := nats.Connect("nats://"+f.proxy.Addr, append(consumerOptions(),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) { logf("disconnected: %v", err) }),
		nats.ReconnectHandler(func(*nats.Conn) { logf("reconnected") }),
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) { logf("nats: %v", err) }))...)
	if err != nil {
		t.Fatal(err)
	}
	// After the Run loop stopped (cleanups run last first).
	t.Cleanup(nc.Close)
	t.Cleanup(func() { mu.Lock(); closed = true; mu.Unlock() })
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	cons, err := js.Consumer(ctx, f.stream, durable)
	if err != nil {
		t.Fatal(err)
	}
	return f.startOn(ac, js, cons)
}

// Publish publishes directly to the server, never through the proxy, each
// message with a Nats-Msg-Id of its own so that a publication retried
// (the server restarting) is stored once.
func (f *faultTopic) Publish(t testing.TB, keys ...string) {
	t.Helper()
	for _, k := range keys {
		m := nats.NewMsg(f.subject)
		m.Data = []byte(k)
		m.Header.Set(jetstream.MsgIDHeader, fmt.Sprintf("pub-%d", f.pubs.Add(1)))
		deadline := time.Now().Add(waitLimit)
		for {
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			ack, err := f.js.PublishMsg(ctx, m)
			cancel()
			if err == nil {
				f.lastSeq = max(f.lastSeq, ack.Sequence)
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("publish %s: %v", k, err)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
}

// RestartBroker kills the server and starts it again on its port and
// store directory, and waits until the test's own connection reaches the
// stream again.
func (f *faultTopic) RestartBroker(t testing.TB) {
	t.Helper()
	if err := f.srv.Restart(); err != nil {
		t.Fatal(err)
	}
	msgtest.WaitFor(t, "the stream after the restart", waitLimit, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_, err := f.js.Stream(ctx, f.stream)
		return err == nil
	})
}

// Cut resets or black-holes the consumers' connections at the proxy.
func (f *faultTopic) Cut(t testing.TB, how adaptertest.Cut) (restore func()) {
	t.Helper()
	return f.proxy.Cut(t, how == adaptertest.Blackhole)
}
