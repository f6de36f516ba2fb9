package adaptertest

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/idemmsg"
	"github.com/idemkit/idem/idemmsg/internal/msgtest"
	"github.com/idemkit/idem/internal/reltest"
)

// Faults is what a Topic made with Config.Faults does to its broker, for
// the broker-fault scenarios. Such a topic lives on a broker the test owns
// (a private server, or one the harness controls), and its consumers reach
// the broker through a proxy the harness can cut (msgtest.Proxy, for
// adapters of this module).
type Faults interface {
	// RestartBroker stops the broker, so that every connection to it
	// closes, and starts it again with the messages it had; it returns
	// once the broker accepts connections again. Publish works after it.
	RestartBroker(t testing.TB)
	// Cut breaks the connections between the topic's consumers and the
	// broker until restore is called: ResetConnections resets them and
	// refuses new ones; Blackhole drops every byte silently (no reset),
	// so that a consumer notices only by its own timeouts or heartbeats.
	// Publish must not go through the cut.
	Cut(t testing.TB, how Cut) (restore func())
}

// Cut is how Faults.Cut breaks the connections.
type Cut int

const (
	// ResetConnections resets every connection and refuses new ones.
	ResetConnections Cut = iota + 1
	// Blackhole drops every byte in both directions, without a reset.
	Blackhole
)

func (c Cut) String() string {
	switch c {
	case ResetConnections:
		return "reset"
	case Blackhole:
		return "blackhole"
	}
	return fmt.Sprintf("cut(%d)", int(c))
}

// faultScenarios are the broker-fault scenarios, run for every adapter (in
// both modes when it has a batch mode). Each requires exactly one effect
// per key (or a stale fencing token refused by the ledger), nothing lost,
// nothing left pending or dead-lettered, and the same consumers, never
// restarted by the test, handling the messages published after the fault.
func (s *suite) faultScenarios() map[string]func(t *testing.T) {
	return map[string]func(t *testing.T){
		"BrokerRestart": func(t *testing.T) {
			s.brokerFault(t, "restart", "broker restart mid-consume", func(f Faults) func() { f.RestartBroker(t); return nil })
		},
		"ConnectionReset": func(t *testing.T) {
			s.brokerFault(t, "reset", "connections reset for "+faultPause.String(), func(f Faults) func() { return f.Cut(t, ResetConnections) })
		},
		"ConnectionBlackhole": func(t *testing.T) {
			s.brokerFault(t, "blackhole", "connections black-holed for "+faultPause.String(), func(f Faults) func() { return f.Cut(t, Blackhole) })
		},
		"RedeliveredWhileWorking": s.redeliveredWhileWorking,
		"StoreDown":               s.storeDown,
	}
}

// faultPause is how long a cut lasts, and how long the store is down.
const faultPause = 3 * time.Second

// brokerFault: two consumers work through messages with duplicates; in
// the middle, the broker restarts, or the connections are cut for
// faultPause (fault returns the restore); then more messages are
// published. Every key must have its one effect, every message must
// settle, and Run must not return. desc is the fault in the report.
func (s *suite) brokerFault(t *testing.T, name, desc string, fault func(Faults) (restore func())) {
	e := s.env(t, Config{Faults: true})
	f, ok := e.topic.(Faults)
	if !ok {
		t.Fatalf("the harness's topic made with Config.Faults does not implement adaptertest.Faults")
	}
	n := reltest.Scale(30, 1000) // distinct keys before the fault
	before := keysWithDuplicates(name+"-before", 2*n, n)
	after := keysWithDuplicates(name+"-after", 2*n/3, n/3)
	e.topic.Publish(t, before...)

	var stops []func() error
	for _, n := range []string{"c1", "c2"} {
		c := e.consumer(n)
		c.Handler = slow(e.ledger.Apply, 5*time.Millisecond)
		stops = append(stops, e.topic.Start(t, c))
	}
	e.waitFor("the first effects", func() bool { return len(e.ledger.Snapshot()) >= 5 })
	if restore := fault(f); restore != nil {
		time.Sleep(faultPause)
		restore()
	}
	e.topic.Publish(t, after...)
	e.waitSettledLong("every message settled after the fault")
	e.stopAll(stops...)
	e.ledger.WantOneEach(t, append(before, after...))
	e.wantNoDeadLetters()
	e.report(desc, "memstore", append(before, after...))
}

// redeliveredWhileWorking: the broker hands a message to a second consumer
// while the first still works on it (Config.RedeliverAfter). The lease
// keeps the second from running it; the first's completion is
// acknowledged, or the message comes back and is replayed.
func (s *suite) redeliveredWhileWorking(t *testing.T) {
	const after = time.Second
	e := s.env(t, Config{RedeliverAfter: after})
	keys := keysWithDuplicates("slow", 6, 3)
	e.topic.Publish(t, keys...)

	var mu sync.Mutex
	decisions := map[string]int{}
	var stops []func() error
	for _, n := range []string{"c1", "c2"} {
		c := e.consumer(n)
		c.Handler = slow(e.ledger.Apply, 3*after)
		c.OnResult = func(key string, res idemmsg.Result, err error) {
			mu.Lock()
			decisions[key]++
			mu.Unlock()
		}
		stops = append(stops, e.topic.Start(t, c))
	}
	e.waitSettledLong("every message settled")
	e.stopAll(stops...)
	e.ledger.WantOneEach(t, keys)
	e.wantNoDeadLetters()
	e.report(fmt.Sprintf("redelivered to a second consumer after %v while the first works for %v", after, 3*after), "memstore", keys)
	// The scenario tests something only if a message was handed out
	// again while its first handler ran: more decisions than messages.
	mu.Lock()
	defer mu.Unlock()
	n := 0
	for _, d := range decisions {
		n += d
	}
	if n <= len(keys) {
		t.Errorf("%d decisions for %d messages: the broker redelivered none while its handler ran %v (Config.RedeliverAfter %v not honoured by the harness)",
			n, len(keys), 3*after, after)
	}
}

// storeDown: the Deduplicator's store (a private Redis, reached through a
// proxy) goes away while messages arrive, for faultPause, then comes back.
// Nothing may be acknowledged that was not completed, so every key must
// still get its one effect once the store is back, including the keys
// whose handler ran just before the store went; nothing dead-lettered.
func (s *suite) storeDown(t *testing.T) {
	store, p := msgtest.RedisStore(t)
	// The lease outlives the outage, as the default (30s) outlives most:
	// a handler cut between its effect and the record of its result
	// still holds its key when the store is back, and the Deduplicator
	// records the result then (idemmsg.Config.CompleteRetry).
	e := s.env(t, Config{Store: store, Lease: 10 * time.Second})
	n := reltest.Scale(10, 300)
	before := keysWithDuplicates("store-before", 2*n, n)
	during := keysWithDuplicates("store-during", 2*n, n)
	e.topic.Publish(t, before...)

	var stops []func() error
	for _, n := range []string{"c1", "c2"} {
		stops = append(stops, e.topic.Start(t, e.consumer(n)))
	}
	e.waitFor("the first effects", func() bool { return len(e.ledger.Snapshot()) >= 1 })
	p.Reset(t)
	e.topic.Publish(t, during...)
	time.Sleep(faultPause)
	p.Restore(t)
	e.waitSettledLong("every message settled after the store came back")
	e.stopAll(stops...)
	e.ledger.WantOneEach(t, append(before, during...))
	e.wantNoDeadLetters()
	e.report("idempotency store down for "+faultPause.String()+" while messages arrive", "redis (single)", append(before, during...))
}

// slow wraps a handler so that it takes at least d.
func slow(h func(ctx context.Context, key string) error, d time.Duration) func(ctx context.Context, key string) error {
	return func(ctx context.Context, key string) error {
		select {
		case <-time.After(d):
		case <-ctx.Done():
			return ctx.Err()
		}
		return h(ctx, key)
	}
}

// waitSettledLong is waitSettled with room for a reconnection: twice
// Harness.Wait.
func (e *env) waitSettledLong(what string) {
	e.t.Helper()
	e.waitSettledWithin(what, 2*e.h.Wait)
}

func (e *env) wantNoDeadLetters() {
	e.t.Helper()
	if dl := e.topic.DeadLetters(e.t); len(dl) > 0 {
		e.t.Errorf("%d dead letters after a fault, want none (a fault is not the message's failure): %v", len(dl), dl)
	}
}

// report reports the scenario's row for RELIABILITY.md (reltest.Report):
// effects beyond one per key as duplicates, keys without an effect as
// lost.
func (e *env) report(fault, store string, keys []string) {
	e.t.Helper()
	got := e.ledger.Snapshot()
	distinct := map[string]bool{}
	for _, k := range keys {
		distinct[k] = true
	}
	dup, lost := 0, 0
	for k := range distinct {
		if got[k] == 0 {
			lost++
		} else {
			dup += got[k] - 1
		}
	}
	mode := "per message"
	if e.batch {
		mode = "batch"
	}
	reltest.Report(e.t, reltest.Row{
		Scenario: "consumer: " + e.h.Name + " (" + mode + ")", Store: store, Fault: fault,
		Requests: len(keys), Keys: len(distinct), Duplicates: dup, Lost: lost,
	})
}
