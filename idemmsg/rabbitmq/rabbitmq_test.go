package rabbitmq

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemmsg"
	"github.com/idemkit/idem/idemmsg/internal/msgtest"
	"github.com/idemkit/idem/memstore"
)

// The tests run against a real RabbitMQ (IDEM_AMQP_URL, default
// amqp://guest:guest@127.0.0.1:5672/), in a private vhost that TestMain
// creates and deletes with rabbitmqctl.
const defaultURL = "amqp://guest:guest@127.0.0.1:5672/"

var (
	amqpURL string
	vhost   string
)

func TestMain(m *testing.M) {
	cleanup, err := setupVhost()
	if err != nil {
		fmt.Fprintln(os.Stderr, "rabbitmq tests:", err)
		os.Exit(1)
	}
	code := m.Run()
	cleanup()
	os.Exit(code)
}

func setupVhost() (cleanup func(), err error) {
	amqpURL = os.Getenv("IDEM_AMQP_URL")
	if amqpURL == "" {
		amqpURL = defaultURL
	}
	uri, err := amqp.ParseURI(amqpURL)
	if err != nil {
		return nil, fmt.Errorf("IDEM_AMQP_URL %q: %w", amqpURL, err)
	}
	addr := net.JoinHostPort(uri.Host, fmt.Sprint(uri.Port))
	conn, err := net.DialTimeout("tcp", addr, 3*time.Second)
	if err != nil {
		return nil, fmt.Errorf("RabbitMQ is not reachable at %s (%v): start it (rabbitmq-server) or set IDEM_AMQP_URL", addr, err)
	}
	conn.Close()
	ctl, err := exec.LookPath("rabbitmqctl")
	if err != nil {
		ctl = "/usr/sbin/rabbitmqctl"
	}
	b := make([]byte, 6)
	rand.Read(b)
	vhost = "idemtest-" + hex.EncodeToString(b)
	ctlRun := func(args ...string) error {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		out, err := exec.CommandContext(ctx, ctl, args...).CombinedOutput()
		if err != nil {
			return fmt.Errorf("%s %s: %v: %s", ctl, strings.Join(args, " "), err, out)
		}
		return nil
	}
	if err := ctlRun("add_vhost", vhost); err != nil {
		return nil, err
	}
	cleanup = func() {
		if err := ctlRun("delete_vhost", vhost); err != nil {
			fmt.Fprintln(os.Stderr, "rabbitmq tests:", err)
		}
	}
	if err := ctlRun("set_permissions", "-p", vhost, uri.Username, ".*", ".*", ".*"); err != nil {
		cleanup()
		return nil, err
	}
	return cleanup, nil
}

const (
	testLease = 500 * time.Millisecond
	testRetry = 20 * time.Millisecond
	waitLimit = 10 * time.Second
)

var queueSeq atomic.Int64

// env is one test's queue (with a dead-letter exchange and queue),
// deduplicator and ledger.
type env struct {
	t      *testing.T
	conn   *amqp.Connection
	pub    *amqp.Channel
	queue  string
	dlq    string
	dedup  *idemmsg.Deduplicator
	ledger *msgtest.Ledger
	acked  atomic.Int32 // deliveries decided Processed, Duplicate or DeadLettered
}

type envOpts struct {
	maxFailures int
	quorum      bool
}

func dial(t *testing.T) *amqp.Connection {
	t.Helper()
	conn, err := amqp.DialConfig(amqpURL, amqp.Config{Vhost: vhost, Dial: amqp.DefaultDial(5 * time.Second)})
	if err != nil {
		t.Fatalf("dial RabbitMQ vhost %s: %v", vhost, err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

func newEnv(t *testing.T, o envOpts) *env {
	t.Helper()
	conn := dial(t)
	pub, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if err := pub.Confirm(false); err != nil {
		t.Fatal(err)
	}
	name := fmt.Sprintf("orders-%d-%d", queueSeq.Add(1), time.Now().UnixNano())
	dlx, dlq := name+".dlx", name+".dlq"
	if err := pub.ExchangeDeclare(dlx, "direct", false, true, false, false, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := pub.QueueDeclare(dlq, false, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	if err := pub.QueueBind(dlq, dlq, dlx, false, nil); err != nil {
		t.Fatal(err)
	}
	args := amqp.Table{"x-dead-letter-exchange": dlx, "x-dead-letter-routing-key": dlq}
	durable := false
	if o.quorum {
		args["x-queue-type"] = "quorum"
		durable = true
	}
	if _, err := pub.QueueDeclare(name, durable, false, false, false, args); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if ch, err := conn.Channel(); err == nil {
			ch.QueueDelete(name, false, false, false)
			ch.QueueDelete(dlq, false, false, false)
			ch.Close()
		}
	})
	d, err := idemmsg.New(memstore.New(memstore.Options{}), idemmsg.Config{Namespace: name + "/billing", Lease: testLease, MaxFailures: o.maxFailures})
	if err != nil {
		t.Fatal(err)
	}
	return &env{t: t, conn: conn, pub: pub, queue: name, dlq: dlq, dedup: d, ledger: msgtest.NewLedger()}
}

// publish adds one message per key, the key as its body and, when withID
// and not empty, as its MessageId; it waits for the broker's confirms.
func (e *env) publish(withID bool, keys ...string) {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	for i, k := range keys {
		p := amqp.Publishing{Body: []byte(k), Headers: amqp.Table{"n": int32(i)}}
		if withID {
			p.MessageId = k
		}
		dc, err := e.pub.PublishWithDeferredConfirmWithContext(ctx, "", e.queue, true, false, p)
		if err != nil {
			e.t.Fatal(err)
		}
		if ok, err := dc.WaitContext(ctx); !ok || err != nil {
			e.t.Fatalf("publish %s: confirmed %t, %v", k, ok, err)
		}
	}
}

func bodyKey(d amqp.Delivery) string { return string(d.Body) }

// consumer returns a Run loop on a new channel of conn (e.conn when nil),
// keyed by key (nil: MessageId). It counts acknowledged outcomes in
// e.acked, then calls onResult when set.
func (e *env) consumer(name string, conn *amqp.Connection, key func(amqp.Delivery) string, onResult func(amqp.Delivery, idemmsg.Result, error)) *Consumer {
	e.t.Helper()
	if conn == nil {
		conn = e.conn
	}
	ch, err := conn.Channel()
	if err != nil {
		e.t.Fatal(err)
	}
	return &Consumer{
		Channel: ch, Queue: e.queue, Dedup: e.dedup, Key: key,
		RetryDelay: func(int) time.Duration { return testRetry },
		Handler: func(ctx context.Context, d amqp.Delivery) error {
			return e.ledger.Apply(ctx, string(d.Body))
		},
		OnResult: func(d amqp.Delivery, res idemmsg.Result, err error) {
			if res.Outcome.Ack() || errors.Is(err, ErrNoMessageID) || errors.Is(err, idem.ErrInvalidKey) {
				e.acked.Add(1)
			}
			if onResult != nil {
				onResult(d, res, err)
			}
		},
		OnError: func(err error) { e.t.Logf("%s: %v", name, err) },
	}
}

// start runs c until the test ends, and returns a function that stops it,
// closes its channel and returns Run's error.
func (e *env) start(c *Consumer) (stop func() error) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	var once sync.Once
	var err error
	stop = func() error {
		once.Do(func() {
			cancel()
			select {
			case err = <-done:
			case <-time.After(waitLimit):
				e.t.Errorf("consumer did not stop within %v", waitLimit)
			}
			c.Channel.Close()
		})
		return err
	}
	e.t.Cleanup(func() { stop() })
	return stop
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(waitLimit)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", waitLimit, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (e *env) waitAcked(n int) {
	e.t.Helper()
	waitFor(e.t, fmt.Sprintf("%d deliveries acknowledged or dead-lettered", n), func() bool { return int(e.acked.Load()) >= n })
}

// inspect returns a queue's ready messages and consumers.
func (e *env) inspect(queue string) amqp.Queue {
	e.t.Helper()
	ch, err := e.conn.Channel()
	if err != nil {
		e.t.Fatal(err)
	}
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(queue, false, false, false, false, nil)
	if err != nil {
		// A quorum queue is durable.
		ch2, err2 := e.conn.Channel()
		if err2 != nil {
			e.t.Fatal(err)
		}
		defer ch2.Close()
		if q, err2 = ch2.QueueInspect(queue); err2 != nil {
			e.t.Fatal(err)
		}
	}
	return q
}

// checkLedger wants exactly one effect per distinct key. With every
// consumer stopped and its channel closed (stops), it wants the queue
// empty: nothing ready, so nothing was left unacknowledged either.
func (e *env) checkLedger(keys []string, stops ...func() error) {
	e.t.Helper()
	e.ledger.WantOneEach(e.t, keys)
	for _, stop := range stops {
		if err := stop(); err != nil && !errors.Is(err, errCrashed) {
			e.t.Errorf("Run: %v", err)
		}
	}
	if q := e.inspect(e.queue); q.Messages != 0 || q.Consumers != 0 {
		e.t.Errorf("queue %s after the consumers stopped: %d messages, %d consumers; want 0, 0", e.queue, q.Messages, q.Consumers)
	}
}

// deadLetters takes the messages of the dead-letter queue.
func (e *env) deadLetters() []amqp.Delivery {
	e.t.Helper()
	ch, err := e.conn.Channel()
	if err != nil {
		e.t.Fatal(err)
	}
	defer ch.Close()
	var out []amqp.Delivery
	for {
		d, ok, err := ch.Get(e.dlq, true)
		if err != nil {
			e.t.Fatal(err)
		}
		if !ok {
			return out
		}
		out = append(out, d)
	}
}

func keysWithDuplicates(n, distinct int) []string {
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("order-%d", i%distinct)
	}
	return keys
}

func TestDuplicates(t *testing.T) {
	for _, withID := range []bool{true, false} {
		t.Run(fmt.Sprintf("messageID=%t", withID), func(t *testing.T) {
			e := newEnv(t, envOpts{})
			keys := keysWithDuplicates(30, 10)
			e.publish(withID, keys...)
			var key func(amqp.Delivery) string
			if !withID {
				key = bodyKey
			}
			var mu sync.Mutex
			counts := map[idemmsg.Outcome]int{}
			c := e.consumer("c1", nil, key, func(_ amqp.Delivery, res idemmsg.Result, _ error) {
				mu.Lock()
				counts[res.Outcome]++
				mu.Unlock()
			})
			stop := e.start(c)
			e.waitAcked(len(keys))
			t0 := time.Now()
			if err := stop(); err != nil {
				t.Fatalf("Run: got %v, want nil after cancel", err)
			}
			if d := time.Since(t0); d > time.Second {
				t.Errorf("Run took %v to stop, want under 1s", d)
			}
			e.checkLedger(keys)
			mu.Lock()
			defer mu.Unlock()
			if counts[idemmsg.Processed] != 10 || counts[idemmsg.Duplicate] != 20 {
				t.Errorf("outcomes: got %v, want 10 processed, 20 duplicate", counts)
			}
		})
	}
}

func TestTwoConsumers(t *testing.T) {
	e := newEnv(t, envOpts{})
	keys := keysWithDuplicates(60, 25)
	e.publish(true, keys...)
	var handled [2]atomic.Int32
	var stops []func() error
	for i, name := range []string{"c1", "c2"} {
		c := e.consumer(name, nil, nil, func(amqp.Delivery, idemmsg.Result, error) { handled[i].Add(1) })
		c.Prefetch = 4
		h := c.Handler
		c.Handler = func(ctx context.Context, d amqp.Delivery) error {
			time.Sleep(2 * time.Millisecond) // let the two interleave
			return h(ctx, d)
		}
		stops = append(stops, e.start(c))
	}
	e.waitAcked(len(keys))
	e.checkLedger(keys, stops...)
	t.Logf("deliveries handled per Run loop: %d, %d", handled[0].Load(), handled[1].Load())
}

func TestCrashBeforeAck(t *testing.T) {
	e := newEnv(t, envOpts{})
	keys := keysWithDuplicates(12, 12)
	e.publish(true, keys...)

	// c1, on its own connection, performs and records the effect of its
	// third message, then dies before the ack; the rest of its prefetched
	// deliveries are left unacknowledged too.
	conn := dial(t)
	var handled atomic.Int32
	crashed := e.consumer("c1", conn, nil, nil)
	crashed.beforeAck = func(amqp.Delivery) bool { return handled.Add(1) < 3 }
	stop := e.start(crashed)
	waitFor(t, "c1 to crash", func() bool { return handled.Load() >= 3 })
	if err := stop(); !errors.Is(err, errCrashed) {
		t.Fatalf("crashed Run: got %v, want errCrashed", err)
	}
	if got := e.ledger.Snapshot(); len(got) != 3 {
		t.Fatalf("before the restart the ledger holds %d keys, want 3", len(got))
	}
	conn.Close() // the crash: unacknowledged deliveries return to the queue

	var duplicates atomic.Int32
	var stops []func() error
	for _, name := range []string{"c2", "c3"} {
		c := e.consumer(name, nil, nil, func(_ amqp.Delivery, res idemmsg.Result, _ error) {
			if res.Outcome == idemmsg.Duplicate {
				duplicates.Add(1)
			}
		})
		stops = append(stops, e.start(c))
	}
	e.waitAcked(3 + len(keys) - 2) // c1's three (one not acked), then the ten redelivered
	e.checkLedger(keys, stops...)
	if duplicates.Load() != 1 {
		t.Errorf("got %d duplicates after the restart, want 1 (the crashed message)", duplicates.Load())
	}
}

func TestInFlightRequeued(t *testing.T) {
	e := newEnv(t, envOpts{})
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
	e.publish(true, "same")
	var inFlight, duplicates atomic.Int32
	c := e.consumer("c1", nil, nil, func(_ amqp.Delivery, res idemmsg.Result, _ error) {
		switch res.Outcome {
		case idemmsg.InFlight:
			if res.RetryAfter <= 0 {
				t.Errorf("InFlight with RetryAfter %v", res.RetryAfter)
			}
			if inFlight.Add(1) == 1 {
				close(release)
			}
		case idemmsg.Duplicate:
			duplicates.Add(1)
		}
	})
	stop := e.start(c)
	e.waitAcked(1)
	if err := <-held; err != nil {
		t.Fatal(err)
	}
	e.checkLedger([]string{"same"}, stop)
	if inFlight.Load() != 1 || duplicates.Load() != 1 {
		t.Errorf("got %d in-flight and %d duplicate outcomes, want 1 and 1", inFlight.Load(), duplicates.Load())
	}
}

func TestPoisonDeadLettered(t *testing.T) {
	for _, quorum := range []bool{false, true} {
		t.Run(fmt.Sprintf("quorum=%t", quorum), func(t *testing.T) {
			e := newEnv(t, envOpts{maxFailures: 3, quorum: quorum})
			keys := []string{"good-1", "poison", "good-2"}
			e.publish(true, keys...)
			var poisonRuns atomic.Int32
			var mu sync.Mutex
			var attempts []int // the poison message's delivery counts, from the broker
			c := e.consumer("c1", nil, nil, nil)
			h := c.Handler
			c.Handler = func(ctx context.Context, d amqp.Delivery) error {
				if string(d.Body) == "poison" {
					n, _ := deliveryCount(d)
					mu.Lock()
					attempts = append(attempts, n)
					mu.Unlock()
					return fmt.Errorf("cannot parse payload (run %d)", poisonRuns.Add(1))
				}
				return h(ctx, d)
			}
			stop := e.start(c)
			e.waitAcked(len(keys))
			if got := poisonRuns.Load(); got != 3 {
				t.Errorf("poison handler ran %d times, want 3 (MaxFailures)", got)
			}
			mu.Lock()
			if quorum && fmt.Sprint(attempts) != "[1 2 3]" {
				t.Errorf("quorum queue: x-delivery-count attempts %v, want [1 2 3]", attempts)
			}
			mu.Unlock()
			var dead []amqp.Delivery
			waitFor(t, "the dead letter", func() bool { dead = append(dead, e.deadLetters()...); return len(dead) >= 1 })
			if len(dead) != 1 || string(dead[0].Body) != "poison" || dead[0].MessageId != "poison" || dead[0].Headers["x-death"] == nil {
				t.Fatalf("dead letters: got %d, want the poison message with x-death: %+v", len(dead), dead)
			}

			// A later message with the same key is dead-lettered without
			// running.
			e.publish(true, "poison")
			e.waitAcked(len(keys) + 1)
			if got := poisonRuns.Load(); got != 3 {
				t.Errorf("poison handler ran %d times after a republication, want 3", got)
			}
			waitFor(t, "the second dead letter", func() bool { dead = append(dead, e.deadLetters()...); return len(dead) >= 2 })
			e.checkLedger([]string{"good-1", "good-2"}, stop)
		})
	}
}

func TestNoMessageIDDeadLettered(t *testing.T) {
	e := newEnv(t, envOpts{})
	e.publish(true, "ok", "") // the second has no MessageId
	var results sync.Map
	c := e.consumer("c1", nil, nil, func(d amqp.Delivery, _ idemmsg.Result, err error) { results.Store(string(d.Body), err) })
	c.OnError = func(error) {}
	stop := e.start(c)
	e.waitAcked(2)
	if err, _ := results.Load(""); err == nil || !errors.Is(err.(error), ErrNoMessageID) {
		t.Errorf("message without id: got error %v, want ErrNoMessageID", err)
	}
	var dead []amqp.Delivery
	waitFor(t, "the dead letter", func() bool { dead = append(dead, e.deadLetters()...); return len(dead) >= 1 })
	if len(dead) != 1 || dead[0].MessageId != "" {
		t.Errorf("dead letters: got %+v, want the message without id", dead)
	}
	e.checkLedger([]string{"ok"}, stop)
}

func TestInvalidKeyDeadLettered(t *testing.T) {
	e := newEnv(t, envOpts{})
	e.publish(false, "ok", "bad key\x01")
	c := e.consumer("c1", nil, bodyKey, nil)
	c.OnError = func(error) {}
	stop := e.start(c)
	e.waitAcked(2)
	var dead []amqp.Delivery
	waitFor(t, "the dead letter", func() bool { dead = append(dead, e.deadLetters()...); return len(dead) >= 1 })
	e.checkLedger([]string{"ok"}, stop)
}

func TestRunValidates(t *testing.T) {
	e := newEnv(t, envOpts{})
	for name, mutate := range map[string]func(c *Consumer){
		"no channel":    func(c *Consumer) { c.Channel = nil },
		"no queue":      func(c *Consumer) { c.Queue = "" },
		"no dedup":      func(c *Consumer) { c.Dedup = nil },
		"no handler":    func(c *Consumer) { c.Handler = nil },
		"negative":      func(c *Consumer) { c.Prefetch = -1 },
		"missing queue": func(c *Consumer) { c.Queue = "no-such-queue-" + e.queue },
	} {
		c := e.consumer("c1", nil, nil, nil)
		mutate(c)
		if err := c.Run(context.Background()); err == nil {
			t.Errorf("%s: got nil error", name)
		}
		if c.Channel != nil {
			c.Channel.Close()
		}
	}
}

func TestDeliveryCount(t *testing.T) {
	for _, tc := range []struct {
		h       amqp.Table
		n       int
		counted bool
	}{
		{nil, 1, false},
		{amqp.Table{DeliveryCountHeader: int64(0)}, 1, true},
		{amqp.Table{DeliveryCountHeader: int64(2)}, 3, true},
		{amqp.Table{DeliveryCountHeader: int32(4)}, 5, true},
		{amqp.Table{DeliveryCountHeader: "x"}, 1, false},
	} {
		if n, ok := deliveryCount(amqp.Delivery{Headers: tc.h}); n != tc.n || ok != tc.counted {
			t.Errorf("%v: got %d, %t; want %d, %t", tc.h, n, ok, tc.n, tc.counted)
		}
	}
}
