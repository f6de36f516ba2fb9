package natsjs

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemmsg"
	"github.com/idemkit/idem/idemmsg/internal/msgtest"
	"github.com/idemkit/idem/memstore"
)

var srv *natsServer

func TestMain(m *testing.M) {
	var err error
	srv, err = startNATS()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	code := m.Run()
	srv.Stop()
	os.Exit(code)
}

// Short enough that redeliveries of crashed or failed messages happen
// within the test's bounds; the lease is below AckWait.
const (
	testLease   = 500 * time.Millisecond
	testAckWait = time.Second
	testBackoff = 20 * time.Millisecond
	waitLimit   = 10 * time.Second
	durable     = "billing"
	// dupWindow is the smallest Duplicates window the server accepts.
	dupWindow = 100 * time.Millisecond
)

var streamSeq atomic.Int64

// env is one test's stream, durable consumer, deduplicator and ledger.
type env struct {
	t       *testing.T
	srv     *natsServer
	nc      *nats.Conn
	js      jetstream.JetStream
	stream  string
	subject string
	cons    jetstream.Consumer
	dedup   *idemmsg.Deduplicator
	ledger  *msgtest.Ledger
	lastSeq uint64
}

type envOpts struct {
	maxFailures int
	duplicates  time.Duration // the stream's Duplicates window; 0: the default
	ackPolicy   jetstream.AckPolicy
	maxDeliver  int
	// For the broker-fault scenarios (suite_test.go):
	server  *natsServer   // default srv
	file    bool          // a file-storage stream (default memory)
	ackWait time.Duration // default testAckWait
	lease   time.Duration // default testLease
	store   idem.Store    // default a fresh memstore
}

func newEnv(t *testing.T, o envOpts) *env {
	t.Helper()
	if o.server == nil {
		o.server = srv
	}
	storage := jetstream.MemoryStorage
	if o.file {
		storage = jetstream.FileStorage
	}
	if o.ackWait == 0 {
		o.ackWait = testAckWait
	}
	if o.lease == 0 {
		o.lease = testLease
	}
	if o.store == nil {
		o.store = memstore.New(memstore.Options{})
	}
	nc, err := nats.Connect(o.server.url, nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	// Unique per run, so that -count=N starts from empty streams and keys.
	name := fmt.Sprintf("S%d_%d", streamSeq.Add(1), time.Now().UnixNano())
	subject := "orders." + name
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{
		Name: name, Subjects: []string{subject, "dead." + name}, Duplicates: o.duplicates, Storage: storage,
	}); err != nil {
		t.Fatal(err)
	}
	if o.ackPolicy == 0 {
		o.ackPolicy = jetstream.AckExplicitPolicy
	}
	if o.maxDeliver == 0 {
		o.maxDeliver = 20
	}
	cons, err := js.CreateOrUpdateConsumer(ctx, name, jetstream.ConsumerConfig{
		Durable: durable, AckPolicy: o.ackPolicy, AckWait: o.ackWait, MaxDeliver: o.maxDeliver,
		FilterSubject: subject,
	})
	if err != nil {
		t.Fatal(err)
	}
	d, err := idemmsg.New(o.store, idemmsg.Config{Namespace: name + "/" + durable, Lease: o.lease, MaxFailures: o.maxFailures})
	if err != nil {
		t.Fatal(err)
	}
	return &env{t: t, srv: o.server, nc: nc, js: js, stream: name, subject: subject, cons: cons, dedup: d, ledger: msgtest.NewLedger()}
}

// publish adds one message per key, the key as its payload and, when
// withID, as its Nats-Msg-Id.
func (e *env) publish(withID bool, keys ...string) {
	e.t.Helper()
	for i, k := range keys {
		m := nats.NewMsg(e.subject)
		m.Data = []byte(k)
		m.Header.Set("n", fmt.Sprint(i))
		if withID && k != "" {
			m.Header.Set(jetstream.MsgIDHeader, k)
		}
		ack, err := e.js.PublishMsg(context.Background(), m)
		if err != nil {
			e.t.Fatal(err)
		}
		if ack.Duplicate {
			e.t.Fatalf("publish %s: dropped by the stream's duplicate window", k)
		}
		e.lastSeq = ack.Sequence
	}
}

func payloadKey(msg jetstream.Msg) string { return string(msg.Data()) }

// consumer returns a Run loop keyed by the payload (Key == nil for the
// default, Nats-Msg-Id).
func (e *env) consumer(name string, key func(jetstream.Msg) string) *Consumer {
	return &Consumer{
		Consumer: e.cons, JetStream: e.js, Dedup: e.dedup, Key: key,
		Backoff: func(int) time.Duration { return testBackoff },
		Handler: func(ctx context.Context, msg jetstream.Msg) error {
			return e.ledger.Apply(ctx, string(msg.Data()))
		},
		OnError: func(err error) { e.t.Logf("%s: %v", name, err) },
	}
}

// settled reports whether every published message was delivered to the
// consumer and settled: nothing pending, nothing awaiting an ack.
func (e *env) settled() bool {
	info, err := e.cons.Info(context.Background())
	if err != nil {
		return false
	}
	return info.Delivered.Stream >= e.lastSeq && info.NumAckPending == 0 && info.NumPending == 0
}

// checkLedger wants exactly one effect per distinct key and nothing
// pending or awaiting an ack.
func (e *env) checkLedger(keys []string) {
	e.t.Helper()
	e.ledger.WantOneEach(e.t, keys)
	info, err := e.cons.Info(context.Background())
	if err != nil || info.NumAckPending != 0 || info.NumPending != 0 {
		e.t.Errorf("consumer info: got %+v, %v; want nothing pending", info, err)
	}
}

// keysWithDuplicates returns n keys over distinct values, each repeated.
func keysWithDuplicates(n, distinct int) []string {
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("order-%d", i%distinct)
	}
	return keys
}

func countOutcomes(m *sync.Map) map[idemmsg.Outcome]int {
	counts := map[idemmsg.Outcome]int{}
	m.Range(func(_, v any) bool { counts[v.(idemmsg.Outcome)]++; return true })
	return counts
}

func seqOf(msg jetstream.Msg) uint64 {
	meta, err := msg.Metadata()
	if err != nil {
		return 0
	}
	return meta.Sequence.Stream
}

// TestDuplicatesDefaultKey: with the default key, Nats-Msg-Id, copies
// republished after the stream's duplicate window are answered Replayed.
// (The adapter suite keys by payload.) Run also stops promptly.
func TestDuplicatesDefaultKey(t *testing.T) {
	// Each round of republications waits out the stream's duplicate
	// window, so that the stream keeps them.
	e := newEnv(t, envOpts{duplicates: dupWindow})
	keys := keysWithDuplicates(10, 10)
	for range 3 {
		e.publish(true, keys...)
		time.Sleep(dupWindow + 150*time.Millisecond)
	}
	var outcomes sync.Map
	c := e.consumer("c1", nil)
	c.OnResult = func(msg jetstream.Msg, res idemmsg.Result, err error) { outcomes.Store(seqOf(msg), res.Outcome) }
	stop := e.start(c)
	waitFor(t, "all messages acknowledged", e.settled)
	t0 := time.Now()
	if err := stop(); err != nil {
		t.Fatalf("Run: got %v, want nil after cancel", err)
	}
	if d := time.Since(t0); d > time.Second {
		t.Errorf("Run took %v to stop, want under 1s", d)
	}
	e.checkLedger(keys)
	if counts := countOutcomes(&outcomes); counts[idemmsg.Executed] != 10 || counts[idemmsg.Replayed] != 20 {
		t.Errorf("outcomes: got %v, want 10 executed, 20 replayed", counts)
	}
}

func TestInFlightNaked(t *testing.T) {
	e := newEnv(t, envOpts{})
	// Another holder (as another consumer would) takes the key first and
	// keeps it until the message was found InFlight.
	entered, release := make(chan struct{}), make(chan struct{})
	held := make(chan error, 1)
	go func() {
		_, err := e.dedup.Handle(context.Background(), idemmsg.Delivery{Key: "same", Attempt: 1}, func(ctx context.Context) error {
			close(entered)
			select {
			case <-release:
			case <-time.After(waitLimit):
			}
			return e.ledger.Apply(ctx, "same")
		})
		held <- err
	}()
	<-entered
	e.publish(false, "same")
	var inFlight, duplicates atomic.Int32
	c := e.consumer("c1", payloadKey)
	c.OnResult = func(msg jetstream.Msg, res idemmsg.Result, err error) {
		switch res.Outcome {
		case idemmsg.InFlight:
			if res.RetryAfter <= 0 {
				t.Errorf("InFlight with RetryAfter %v", res.RetryAfter)
			}
			if inFlight.Add(1) == 1 {
				close(release)
			}
		case idemmsg.Replayed:
			duplicates.Add(1)
		}
	}
	e.start(c)
	waitFor(t, "the message acknowledged", e.settled)
	if err := <-held; err != nil {
		t.Fatal(err)
	}
	e.checkLedger([]string{"same"})
	if inFlight.Load() != 1 || duplicates.Load() != 1 {
		t.Errorf("got %d in-flight and %d replayed outcomes, want 1 and 1", inFlight.Load(), duplicates.Load())
	}
}

// deadLetters returns the messages of the stream on subject, in sequence
// order.
func (e *env) deadLetters(t testing.TB, subject string) []*nats.Msg {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	s, err := e.js.Stream(ctx, e.stream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx, jetstream.WithSubjectFilter(subject))
	if err != nil {
		t.Fatal(err)
	}
	var out []*nats.Msg
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		if m.Subject == subject {
			out = append(out, &nats.Msg{Subject: m.Subject, Header: m.Header, Data: m.Data})
		}
	}
	return out
}

// TestDeadLetterFields checks what the adapter suite does not: the
// dead letter's headers and payload, the Nats-* headers dropped, and that
// a consumer whose MaxDeliver equals MaxFailures still dead-letters (the
// last delivery JetStream makes is the one that records the failure).
func TestDeadLetterFields(t *testing.T) {
	e := newEnv(t, envOpts{maxFailures: 3, maxDeliver: 3})
	e.publish(true, "poison")
	var runs atomic.Int32
	c := e.consumer("c1", nil)
	c.DeadLetterSubject = "dead." + e.stream
	c.Handler = func(context.Context, jetstream.Msg) error {
		return fmt.Errorf("cannot parse payload (run %d)", runs.Add(1))
	}
	e.start(c)
	waitFor(t, "the message settled", e.settled)
	if got := runs.Load(); got != 3 {
		t.Errorf("handler ran %d times, want 3 (MaxFailures)", got)
	}
	dead := e.deadLetters(t, c.DeadLetterSubject)
	if len(dead) != 1 {
		t.Fatalf("dead letters: got %d, want 1", len(dead))
	}
	h := dead[0].Header
	if string(dead[0].Data) != "poison" || h.Get("n") != "0" || h.Get(HeaderStream) != e.stream ||
		h.Get(HeaderConsumer) != durable || h.Get(HeaderSubject) != e.subject || h.Get(HeaderKey) != "poison" ||
		h.Get(HeaderSequence) != fmt.Sprint(e.lastSeq) || h.Get(HeaderError) != "cannot parse payload (run 3)" ||
		h.Get(jetstream.MsgIDHeader) != "" {
		t.Errorf("dead letter: got %q %v", dead[0].Data, h)
	}
}

func TestNoMsgIDDeadLettered(t *testing.T) {
	e := newEnv(t, envOpts{})
	e.publish(true, "ok", "") // the second has no Nats-Msg-Id
	c := e.consumer("c1", nil)
	c.DeadLetterSubject = "dead." + e.stream
	var results sync.Map
	c.OnResult = func(msg jetstream.Msg, res idemmsg.Result, err error) { results.Store(string(msg.Data()), err) }
	c.OnError = func(error) {}
	e.start(c)
	waitFor(t, "all messages settled", e.settled)
	e.checkLedger([]string{"ok"})
	if err, _ := results.Load(""); !errors.Is(err.(error), ErrNoMsgID) {
		t.Errorf("message without id: got error %v, want ErrNoMsgID", err)
	}
	dead := e.deadLetters(t, c.DeadLetterSubject)
	if len(dead) != 1 || !strings.Contains(dead[0].Header.Get(HeaderError), jetstream.MsgIDHeader) {
		t.Fatalf("dead letters: got %v, want one with the missing-id error", dead)
	}
}

func TestInvalidKeyDeadLettered(t *testing.T) {
	e := newEnv(t, envOpts{})
	e.publish(false, "ok", "bad key\x01")
	c := e.consumer("c1", payloadKey)
	c.OnError = func(error) {}
	e.start(c) // no DeadLetterSubject: only Termed
	waitFor(t, "all messages settled", e.settled)
	e.checkLedger([]string{"ok"})
}

func TestRunValidates(t *testing.T) {
	e := newEnv(t, envOpts{maxFailures: 5})
	low := newEnv(t, envOpts{maxFailures: 5, maxDeliver: 4})
	none := newEnv(t, envOpts{ackPolicy: jetstream.AckNonePolicy})
	for name, mutate := range map[string]func(c *Consumer){
		"no consumer":            func(c *Consumer) { c.Consumer = nil },
		"no dedup":               func(c *Consumer) { c.Dedup = nil },
		"no handler":             func(c *Consumer) { c.Handler = nil },
		"dead letter, no js":     func(c *Consumer) { c.DeadLetterSubject = "dead.x"; c.JetStream = nil },
		"negative":               func(c *Consumer) { c.MaxMessages = -1 },
		"MaxDeliver too low":     func(c *Consumer) { c.Consumer = low.cons },
		"AckPolicy not explicit": func(c *Consumer) { c.Consumer = none.cons },
	} {
		c := e.consumer("c1", nil)
		mutate(c)
		if err := c.Run(context.Background()); err == nil {
			t.Errorf("%s: got nil error", name)
		}
	}
}

// With Concurrency > 1 a handler's panic is passed on at once, even when no
// further message arrives to wake the pull loop.
func TestConcurrencyPanicPassedOn(t *testing.T) {
	e := newEnv(t, envOpts{})
	e.publish(true, "boom") // and nothing after it
	c := e.consumer("c1", nil)
	c.Concurrency = 4
	c.Handler = func(context.Context, jetstream.Msg) error { panic("boom") }
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	start := time.Now()
	got := func() (v any) {
		defer func() { v = recover() }()
		c.Run(ctx)
		return nil
	}()
	if got != "boom" {
		t.Fatalf("Run: got panic %v, want boom", got)
	}
	// Before the fix the loop sat in Next until the message came back
	// after AckWait (or ctx ended).
	if took := time.Since(start); took >= testAckWait/2 {
		t.Errorf("the panic came out after %v: Run waited for another message", took)
	}
}

// start runs c until the test ends, and returns a function that stops it
// and returns Run's error.
func (e *env) start(c *Consumer) (stop func() error) {
	return msgtest.Start(e.t, "consumer", waitLimit, c.Run, nil)
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	msgtest.WaitFor(t, what, waitLimit, cond)
}

// downStore is a store whose Acquire fails while down is set, as a store
// that cannot be reached.
type downStore struct {
	idem.Store
	down atomic.Bool
}

func (s *downStore) Acquire(ctx context.Context, req idem.AcquireRequest) (idem.Acquisition, error) {
	if s.down.Load() {
		return idem.Acquisition{}, errors.New("store unreachable")
	}
	return s.Store.Acquire(ctx, req)
}

// TestStoreDownSpendsNoDelivery: while the store cannot decide a message,
// the message is held (InProgress) and decided again, rather than naked:
// a store outage spends no JetStream delivery, so a consumer with a small
// MaxDeliver still handles the message once the store is back, on its
// first delivery. Before, each try was a Nak, and JetStream gave the
// message up after MaxDeliver tries.
func TestStoreDownSpendsNoDelivery(t *testing.T) {
	for _, batch := range []bool{false, true} {
		t.Run(fmt.Sprintf("batch=%v", batch), func(t *testing.T) {
			store := &downStore{Store: memstore.New(memstore.Options{})}
			store.down.Store(true)
			e := newEnv(t, envOpts{store: store, maxFailures: 3, maxDeliver: 3})
			e.publish(false, "a", "b")
			var attempts sync.Map
			c := e.consumer("c1", payloadKey)
			c.Batch = batch
			c.Backoff = func(int) time.Duration { return 5 * time.Millisecond }
			c.OnError = func(error) {}
			c.OnResult = func(msg jetstream.Msg, res idemmsg.Result, err error) {
				meta, _ := msg.Metadata()
				attempts.Store(string(msg.Data()), fmt.Sprintf("%v %d", res.Outcome, meta.NumDelivered))
			}
			stop := e.start(c)
			time.Sleep(300 * time.Millisecond) // dozens of tries, far beyond MaxDeliver
			store.down.Store(false)
			waitFor(t, "all messages settled", e.settled)
			if err := stop(); err != nil {
				t.Fatal(err)
			}
			e.checkLedger([]string{"a", "b"})
			for _, k := range []string{"a", "b"} {
				if got, _ := attempts.Load(k); got != "executed 1" {
					t.Errorf("%s: got %v, want executed on delivery 1", k, got)
				}
			}
		})
	}
}

// TestRunReturnsWhenConnectionClosed: a connection closed for good (it
// gave up reconnecting, or was closed) never comes back, so Run returns
// ErrConnectionClosed instead of retrying for ever.
func TestRunReturnsWhenConnectionClosed(t *testing.T) {
	for _, batch := range []bool{false, true} {
		t.Run(fmt.Sprintf("batch=%v", batch), func(t *testing.T) {
			e := newEnv(t, envOpts{})
			nc, err := nats.Connect(srv.url)
			if err != nil {
				t.Fatal(err)
			}
			defer nc.Close()
			js, err := jetstream.New(nc)
			if err != nil {
				t.Fatal(err)
			}
			cons, err := js.Consumer(context.Background(), e.stream, durable)
			if err != nil {
				t.Fatal(err)
			}
			c := e.consumer("c1", payloadKey)
			c.Consumer, c.JetStream, c.Batch = cons, js, batch
			c.OnError = func(error) {}
			done := make(chan error, 1)
			go func() { done <- c.Run(context.Background()) }()
			e.publish(false, "a")
			waitFor(t, "the message settled", e.settled)
			nc.Close()
			select {
			case err := <-done:
				if !errors.Is(err, ErrConnectionClosed) {
					t.Fatalf("Run: got %v, want ErrConnectionClosed", err)
				}
			case <-time.After(5 * time.Second):
				t.Fatal("Run did not return within 5s of the connection's close")
			}
		})
	}
}
