// Package adaptertest is the shared test suite of the idemmsg broker
// adapters, in the style of watermill's pub/sub tests: one set of
// scenarios, run by every adapter's tests against its real broker through
// a small harness. An adapter written outside this module can run it too.
//
// Every scenario publishes messages with duplicate keys to a fresh topic,
// consumes them with one or more Run loops whose handler applies an effect
// to a ledger that checks fencing tokens, and then requires, of the broker
// and the ledger:
//
//   - exactly one effect per distinct key, and no stale fencing token;
//   - nothing left pending, unacknowledged or awaiting redelivery;
//   - poison messages in the dead-letter destination, once MaxFailures
//     deliveries failed, and never handled again.
//
// The scenarios: duplicates with one consumer; two consumers at once; a
// consumer that crashes after the effect but before the ack, then restarts
// beside another; a poison message; a restart over already-consumed keys;
// and, for adapters with a Concurrency setting, handlers running in
// parallel. Adapters with a batch mode (Harness.Batch) run them all again
// in it.
//
// The broker-fault scenarios (Harness.BrokerFaults) do to the consumers
// what a broker and a network do in production: the broker restarts
// mid-consume; the connections are reset, or black-holed for a few
// seconds; a message is handed to a second consumer while the first still
// works on it; the idempotency store is down while messages arrive. Each
// requires the same: one effect per key, nothing lost, nothing pending or
// dead-lettered, and the consumers running again on their own.
package adaptertest

import (
	"context"
	"fmt"
	"maps"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemmsg"
	"github.com/idemkit/idem/idemmsg/internal/msgtest"
)

// Harness connects the suite to one adapter and its broker.
type Harness struct {
	// Name names the adapter in the rows the broker-fault scenarios
	// report for RELIABILITY.md ("rabbitmq", "kafka", ...).
	Name string
	// NewTopic returns a fresh, empty topic (stream, queue, subject or
	// topic, with its consumer group or durable consumer) and a
	// Deduplicator scoped to it, configured by cfg. It is called once per
	// scenario; scenarios run in parallel.
	NewTopic func(t *testing.T, cfg Config) Topic
	// IsCrash reports whether err is what Run returns after
	// Consumer.BeforeAck asked for a simulated crash.
	IsCrash func(err error) bool
	// Concurrency reports that the adapter honours Consumer.Concurrency.
	Concurrency bool
	// Batch reports that the adapter honours Consumer.Batch: every
	// scenario then runs twice, the second time (under "Batch/") with
	// Batch set on every consumer.
	Batch bool
	// Wait bounds every wait for the broker to settle, including
	// redeliveries after a crash or a failure. Default 20s; the
	// broker-fault scenarios wait twice as long.
	Wait time.Duration
	// BrokerFaults reports that the harness honours Config.Faults,
	// Config.RedeliverAfter and Config.Store: the broker-fault scenarios
	// (BrokerRestart, ConnectionReset, ConnectionBlackhole,
	// RedeliveredWhileWorking, StoreDown) then run too. Every adapter of
	// this module sets it.
	BrokerFaults bool
}

// Config is what a scenario asks of a topic.
type Config struct {
	// MaxFailures is the Deduplicator's (0: its default).
	MaxFailures int
	// Faults asks for a topic whose Topic also implements Faults: on a
	// broker the test owns, reached by the consumers through a proxy the
	// harness can cut.
	Faults bool
	// RedeliverAfter, when positive, asks the broker to hand an
	// unacknowledged message to another consumer once it has been out
	// this long (RabbitMQ's consumer timeout, JetStream's AckWait, a Redis
	// Streams consumer's MinIdle, a Kafka rebalance), and the Deduplicator
	// to keep its lease meanwhile (renewed while the handler runs).
	RedeliverAfter time.Duration
	// Store, when set, is the store the topic's Deduplicator must use
	// instead of its own.
	Store idem.Store
	// Lease, when positive, is the Deduplicator's lease (the harness's
	// own otherwise, which may be short to keep the suite fast).
	Lease time.Duration
}

// Topic is one scenario's destination on the broker.
type Topic interface {
	// Publish sends one message per key, in order. Equal keys are
	// distinct messages, as a producer's retries would publish them.
	Publish(t testing.TB, keys ...string)
	// Start runs one consumer (a Run loop of the adapter) until the test
	// ends, and returns a function that stops it and returns Run's error.
	Start(t testing.TB, c Consumer) (stop func() error)
	// Settled reports whether every published message was delivered and
	// settled: nothing pending, unacknowledged or awaiting redelivery.
	Settled(t testing.TB) bool
	// DeadLetters returns the messages in the dead-letter destination, in
	// the order they arrived.
	DeadLetters(t testing.TB) []DeadLetter
}

// Consumer is what a scenario runs as one Run loop.
type Consumer struct {
	// Name names the consumer, for brokers that name their consumers.
	// A restarted consumer may reuse its name.
	Name string
	// Handler is the message's effect, given its key and the handler's
	// context (which carries the lease).
	Handler func(ctx context.Context, key string) error
	// BeforeAck, when set, is called before a decided message is settled;
	// false simulates a crash: Run returns at once (see Harness.IsCrash)
	// and leaves the message and the rest of its batch unsettled.
	BeforeAck func(key string) bool
	// OnResult, when set, receives each decision.
	OnResult func(key string, res idemmsg.Result, err error)
	// Concurrency is the adapter's Concurrency (0: its default).
	Concurrency int
	// Batch asks the adapter to decide each fetched batch with one
	// idemmsg.Deduplicator.HandleBatch call (see Harness.Batch).
	Batch bool
}

// DeadLetter is one message in the dead-letter destination.
type DeadLetter struct {
	Key   string // the original message's key
	Error string // the kept error text
}

// Run runs every scenario as a parallel subtest of t.
func Run(t *testing.T, h Harness) {
	if h.Wait == 0 {
		h.Wait = 20 * time.Second
	}
	run := func(t *testing.T, s *suite) {
		for name, run := range s.scenarios() {
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				run(t)
			})
		}
	}
	run(t, &suite{h: h})
	if h.Batch {
		t.Run("Batch", func(t *testing.T) {
			t.Parallel()
			run(t, &suite{h: h, batch: true})
		})
	}
}

func (s *suite) scenarios() map[string]func(t *testing.T) {
	h := s.h
	scenarios := map[string]func(t *testing.T){
		"Duplicates":         s.duplicates,
		"TwoConsumers":       s.twoConsumers,
		"CrashBeforeAck":     func(t *testing.T) { s.crashBeforeAck(t, 0) },
		"PoisonDeadLettered": s.poison,
		"Restart":            s.restart,
	}
	if h.Concurrency {
		scenarios["Concurrency"] = s.concurrency
		scenarios["CrashBeforeAckConcurrent"] = func(t *testing.T) { s.crashBeforeAck(t, 4) }
	}
	if h.BrokerFaults {
		maps.Copy(scenarios, s.faultScenarios())
	}
	return scenarios
}

type suite struct {
	h     Harness
	batch bool // every consumer with Batch set
}

// env is one scenario's topic and ledger.
type env struct {
	t      *testing.T
	h      Harness
	topic  Topic
	ledger *msgtest.Ledger
	batch  bool
}

func (s *suite) env(t *testing.T, cfg Config) *env {
	return &env{t: t, h: s.h, batch: s.batch, topic: s.h.NewTopic(t, cfg), ledger: msgtest.NewLedger()}
}

// consumer returns a consumer whose handler applies the key's effect.
func (e *env) consumer(name string) Consumer {
	return Consumer{Name: name, Handler: e.ledger.Apply, Batch: e.batch}
}

func (e *env) waitSettled(what string) {
	e.t.Helper()
	e.waitSettledWithin(what, e.h.Wait)
}

// waitSettledWithin polls Topic.Settled until it holds, failing the test
// after limit.
func (e *env) waitSettledWithin(what string, limit time.Duration) {
	e.t.Helper()
	deadline := time.Now().Add(limit)
	for !e.topic.Settled(e.t) {
		if time.Now().After(deadline) {
			e.t.Fatalf("timed out after %v waiting for %s (ledger: %v)", limit, what, e.ledger.Snapshot())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (e *env) waitFor(what string, cond func() bool) {
	e.t.Helper()
	deadline := time.Now().Add(e.h.Wait)
	for !cond() {
		if time.Now().After(deadline) {
			e.t.Fatalf("timed out after %v waiting for %s", e.h.Wait, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// stopAll stops consumers, each wanting a nil error.
func (e *env) stopAll(stops ...func() error) {
	e.t.Helper()
	for i, stop := range stops {
		if err := stop(); err != nil {
			e.t.Errorf("consumer %d: Run returned %v, want nil after its context ended", i, err)
		}
	}
}

// keysWithDuplicates returns n keys over distinct values, each repeated.
func keysWithDuplicates(prefix string, n, distinct int) []string {
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("%s-%d", prefix, i%distinct)
	}
	return keys
}

// outcomes counts decisions by outcome.
type outcomes struct {
	mu sync.Mutex
	n  map[idemmsg.Outcome]int
}

func (o *outcomes) record(_ string, res idemmsg.Result, _ error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.n == nil {
		o.n = map[idemmsg.Outcome]int{}
	}
	o.n[res.Outcome]++
}

func (o *outcomes) get(k idemmsg.Outcome) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.n[k]
}

// duplicates: one consumer, 30 messages over 10 keys: 10 executed, the 20
// copies (and any redelivery) replayed and acknowledged without running
// the handler.
func (s *suite) duplicates(t *testing.T) {
	e := s.env(t, Config{})
	keys := keysWithDuplicates("order", 30, 10)
	e.topic.Publish(t, keys...)
	var got outcomes
	c := e.consumer("c1")
	c.OnResult = got.record
	stop := e.topic.Start(t, c)
	e.waitSettled("every message settled")
	e.stopAll(stop)
	e.ledger.WantOneEach(t, keys)
	// At least 20 replayed: an at-least-once broker may deliver a message
	// again (a Kafka consumer group that rebalances before its offsets are
	// committed does), and the copy is replayed like any other.
	if p, d := got.get(idemmsg.Executed), got.get(idemmsg.Replayed); p != 10 || d < 20 {
		t.Errorf("outcomes: %d executed, %d replayed; want 10 and at least 20", p, d)
	}
}

// twoConsumers: two Run loops share the topic; duplicates of a key may
// reach both at once.
func (s *suite) twoConsumers(t *testing.T) {
	e := s.env(t, Config{})
	keys := keysWithDuplicates("order", 60, 25)
	e.topic.Publish(t, keys...)
	var stops []func() error
	for _, name := range []string{"c1", "c2"} {
		c := e.consumer(name)
		c.Handler = func(ctx context.Context, key string) error {
			time.Sleep(2 * time.Millisecond) // let the two interleave
			return e.ledger.Apply(ctx, key)
		}
		stops = append(stops, e.topic.Start(t, c))
	}
	e.waitSettled("every message settled")
	e.stopAll(stops...)
	e.ledger.WantOneEach(t, keys)
}

// crashBeforeAck: a consumer applies and records the effect of its third
// message, then dies before the ack; restarted beside a second consumer,
// the message comes back and is answered Replayed. With concurrency > 1
// (CrashBeforeAckConcurrent) the handlers running beside the third may
// record their effects too before the crash; none of them acks.
func (s *suite) crashBeforeAck(t *testing.T, concurrency int) {
	e := s.env(t, Config{})
	keys := keysWithDuplicates("order", 12, 12)
	e.topic.Publish(t, keys...)

	var decided atomic.Int32
	var mu sync.Mutex
	recorded := map[string]bool{} // keys whose result c1 reported stored
	c := e.consumer("c1")
	c.Concurrency = concurrency
	c.BeforeAck = func(string) bool { return decided.Add(1) < 3 }
	c.OnResult = func(key string, res idemmsg.Result, err error) {
		if res.Outcome == idemmsg.Executed && err == nil {
			mu.Lock()
			recorded[key] = true
			mu.Unlock()
		}
	}
	stop := e.topic.Start(t, c)
	e.waitFor("c1 to crash", func() bool { return decided.Load() >= 3 })
	if err := stop(); !s.h.IsCrash(err) {
		t.Fatalf("crashed Run returned %v, want the simulated crash", err)
	}
	// In batch mode the handlers of a whole fetched batch may have run
	// before the first of them is settled.
	before := e.ledger.Snapshot()
	if got := len(before); e.batch && got < 3 {
		t.Fatalf("before the restart the ledger holds %d keys, want at least 3 (batch mode)", got)
	} else if got != 3 && !e.batch && (concurrency <= 1 || got < 3 || got == len(keys)) {
		t.Fatalf("before the restart the ledger holds %d keys, want 3 (or, with concurrency %d, at least 3 and not all %d)",
			got, concurrency, len(keys))
	}

	var got outcomes
	var stops []func() error
	for _, name := range []string{"c1", "c2"} {
		c := e.consumer(name)
		c.OnResult = got.record
		stops = append(stops, e.topic.Start(t, c))
	}
	e.waitSettled("every message settled after the restart")
	e.stopAll(stops...)
	if e.batch {
		// A batch records its completions in groups: the crash may cut
		// the recording of handlers that had run (their effect is in
		// before), and those run again once their leases end, which is
		// the documented at-least-once of a crash after the effect and
		// before the record. Each runs at most twice; a key whose result
		// c1 reported stored, and every key without an effect before the
		// crash, exactly once.
		mu.Lock()
		for k := range recorded {
			delete(before, k)
		}
		mu.Unlock()
		e.ledger.WantOneEachBut(t, keys, before)
	} else {
		e.ledger.WantOneEach(t, keys)
	}
	if d := got.get(idemmsg.Replayed); d < 1 {
		t.Errorf("%d duplicates after the restart, want at least 1 (the message whose ack was lost)", d)
	}
}

// poison: a message whose handler always fails runs MaxFailures times, is
// dead-lettered with its error, and a later delivery of its key is
// dead-lettered again without running.
func (s *suite) poison(t *testing.T) {
	const maxFailures = 3
	e := s.env(t, Config{MaxFailures: maxFailures})
	e.topic.Publish(t, "good-1", "poison", "good-2")
	var runs atomic.Int32
	c := e.consumer("c1")
	c.Handler = func(ctx context.Context, key string) error {
		if key == "poison" {
			return fmt.Errorf("cannot parse payload (run %d)", runs.Add(1))
		}
		return e.ledger.Apply(ctx, key)
	}
	stop := e.topic.Start(t, c)
	e.waitSettled("every message settled")
	e.ledger.WantOneEach(t, []string{"good-1", "good-2"})
	if got := runs.Load(); got != maxFailures {
		t.Errorf("the poison handler ran %d times, want %d (MaxFailures)", got, maxFailures)
	}
	want := DeadLetter{Key: "poison", Error: fmt.Sprintf("cannot parse payload (run %d)", maxFailures)}
	if dead := e.topic.DeadLetters(t); len(dead) != 1 || dead[0] != want {
		t.Fatalf("dead letters: got %+v, want [%+v]", dead, want)
	}

	e.topic.Publish(t, "poison")
	e.waitSettled("the second poison message settled")
	e.waitFor("the second dead letter", func() bool { return len(e.topic.DeadLetters(t)) >= 2 })
	e.stopAll(stop)
	if got := runs.Load(); got != maxFailures {
		t.Errorf("the poison handler ran %d times after a later delivery, want %d", got, maxFailures)
	}
	if dead := e.topic.DeadLetters(t); len(dead) != 2 || dead[1] != want {
		t.Errorf("dead letters: got %+v, want two of %+v", dead, want)
	}
}

// restart: after a consumer stopped, the same keys published again (a
// producer replaying its outbox) and new ones reach a fresh consumer:
// only the new keys run.
func (s *suite) restart(t *testing.T) {
	e := s.env(t, Config{})
	first := keysWithDuplicates("order", 10, 10)
	e.topic.Publish(t, first...)
	stop := e.topic.Start(t, e.consumer("c1"))
	e.waitSettled("the first messages settled")
	e.stopAll(stop)

	second := append(keysWithDuplicates("order", 10, 10), keysWithDuplicates("refund", 5, 5)...)
	e.topic.Publish(t, second...)
	var got outcomes
	c := e.consumer("c2")
	c.OnResult = got.record
	stop = e.topic.Start(t, c)
	e.waitSettled("the messages after the restart settled")
	e.stopAll(stop)
	e.ledger.WantOneEach(t, append(first, second...))
	if p, d := got.get(idemmsg.Executed), got.get(idemmsg.Replayed); p != 5 || d != 10 {
		t.Errorf("after the restart: %d executed, %d replayed; want 5 and 10", p, d)
	}
}

// concurrency (for adapters with a Concurrency setting): two consumers with Concurrency 8 over 200 messages and 50
// keys; handlers overlap within a consumer, and each key still has one
// effect.
func (s *suite) concurrency(t *testing.T) {
	e := s.env(t, Config{})
	keys := keysWithDuplicates("order", 200, 50)
	e.topic.Publish(t, keys...)
	var running, peak atomic.Int32
	var stops []func() error
	for _, name := range []string{"c1", "c2"} {
		c := e.consumer(name)
		c.Concurrency = 8
		c.Handler = func(ctx context.Context, key string) error {
			n := running.Add(1)
			defer running.Add(-1)
			for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
			}
			time.Sleep(time.Millisecond)
			return e.ledger.Apply(ctx, key)
		}
		stops = append(stops, e.topic.Start(t, c))
	}
	e.waitSettled("every message settled")
	e.stopAll(stops...)
	e.ledger.WantOneEach(t, keys)
	// Two consumers alone could reach 2; more means handlers overlapped
	// within a consumer.
	if p := peak.Load(); p <= 2 {
		t.Errorf("at most %d handlers ran at once, want more than 2 with Concurrency 8", p)
	}
}
