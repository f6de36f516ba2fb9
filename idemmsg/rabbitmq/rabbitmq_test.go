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
	stopNodes()
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
// deduplicator and ledger, on the shared broker's private vhost or on a
// private node (node).
type env struct {
	t      *testing.T
	node   *node // nil: the shared broker
	queue  string
	dlq    string
	dedup  *idemmsg.Deduplicator
	ledger *msgtest.Ledger
	acked  atomic.Int32 // deliveries decided Executed, Replayed or DeadLettered

	// conn and pub, the test's own connection and its publishing channel
	// (with confirms), are dialed again once closed (a broker restart).
	mu   sync.Mutex
	conn *amqp.Connection
	pub  *amqp.Channel
}

type envOpts struct {
	maxFailures int
	quorum      bool
	// node puts the queue on a private node: durable, as its dead-letter
	// exchange and queue, and its messages persistent.
	node *node
	// lease is the Deduplicator's (default testLease); store its store
	// (default a memstore).
	lease time.Duration
	store idem.Store
}

func dial(t *testing.T) *amqp.Connection {
	t.Helper()
	return dialNode(t, nil)
}

// dialNode dials the shared broker's vhost (n nil) or a private node.
func dialNode(t testing.TB, n *node) *amqp.Connection {
	t.Helper()
	url, cfg := amqpURL, amqp.Config{Vhost: vhost, Dial: amqp.DefaultDial(5 * time.Second)}
	if n != nil {
		url, cfg.Vhost = n.url(""), "/"
	}
	conn, err := amqp.DialConfig(url, cfg)
	if err != nil {
		t.Fatalf("dial RabbitMQ %s (vhost %s): %v", url, cfg.Vhost, err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// connection returns the test's connection, dialed again if closed.
func (e *env) connection() *amqp.Connection {
	e.t.Helper()
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.connLocked()
}

func (e *env) connLocked() *amqp.Connection {
	e.t.Helper()
	if e.conn == nil || e.conn.IsClosed() {
		e.conn, e.pub = dialNode(e.t, e.node), nil
	}
	return e.conn
}

// channel opens a channel on the test's connection.
func (e *env) channel() *amqp.Channel {
	e.t.Helper()
	ch, err := e.connection().Channel()
	if err != nil {
		e.t.Fatal(err)
	}
	return ch
}

// publisher returns the publishing channel, opened again if closed.
func (e *env) publisher() *amqp.Channel {
	e.t.Helper()
	e.mu.Lock()
	defer e.mu.Unlock()
	conn := e.connLocked()
	if e.pub == nil || e.pub.IsClosed() {
		pub, err := conn.Channel()
		if err != nil {
			e.t.Fatal(err)
		}
		if err := pub.Confirm(false); err != nil {
			e.t.Fatal(err)
		}
		e.pub = pub
	}
	return e.pub
}

func newEnv(t *testing.T, o envOpts) *env {
	t.Helper()
	e := &env{t: t, node: o.node, ledger: msgtest.NewLedger()}
	pub := e.publisher()
	name := fmt.Sprintf("orders-%d-%d", queueSeq.Add(1), time.Now().UnixNano())
	dlx, dlq := name+".dlx", name+".dlq"
	durable := o.node != nil // to survive the node's restarts
	if err := pub.ExchangeDeclare(dlx, "direct", durable, !durable, false, false, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := pub.QueueDeclare(dlq, durable, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	if err := pub.QueueBind(dlq, dlq, dlx, false, nil); err != nil {
		t.Fatal(err)
	}
	args := amqp.Table{"x-dead-letter-exchange": dlx, "x-dead-letter-routing-key": dlq}
	if o.quorum {
		args["x-queue-type"] = "quorum"
		durable = true
	}
	if _, err := pub.QueueDeclare(name, durable, false, false, false, args); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if ch, err := e.connection().Channel(); err == nil {
			ch.QueueDelete(name, false, false, false)
			ch.QueueDelete(dlq, false, false, false)
			if durable {
				ch.ExchangeDelete(dlx, false, false)
			}
			ch.Close()
		}
	})
	lease, store := o.lease, o.store
	if lease == 0 {
		lease = testLease
	}
	if store == nil {
		store = memstore.New(memstore.Options{})
	}
	d, err := idemmsg.New(store, idemmsg.Config{Namespace: name + "/billing", Lease: lease, MaxFailures: o.maxFailures})
	if err != nil {
		t.Fatal(err)
	}
	e.queue, e.dlq, e.dedup = name, dlq, d
	return e
}

// publish adds one message per key, the key as its body and, when withID
// and not empty, as its MessageId; it waits for the broker's confirms.
// On a private node the messages are persistent.
func (e *env) publish(withID bool, keys ...string) {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	pub := e.publisher()
	for i, k := range keys {
		p := amqp.Publishing{Body: []byte(k), Headers: amqp.Table{"n": int32(i)}}
		if withID {
			p.MessageId = k
		}
		if e.node != nil {
			p.DeliveryMode = amqp.Persistent
		}
		dc, err := pub.PublishWithDeferredConfirmWithContext(ctx, "", e.queue, true, false, p)
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
		conn = e.connection()
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

func (e *env) waitAcked(n int) {
	e.t.Helper()
	waitFor(e.t, fmt.Sprintf("%d deliveries acknowledged or dead-lettered", n), func() bool { return int(e.acked.Load()) >= n })
}

// inspect returns a queue's ready messages and consumers.
func (e *env) inspect(queue string) amqp.Queue {
	e.t.Helper()
	ch := e.channel()
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(queue, false, false, false, false, nil)
	if err != nil {
		// A quorum queue is durable.
		ch2 := e.channel()
		defer ch2.Close()
		var err2 error
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
	ch := e.channel()
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
		case idemmsg.Replayed:
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
		t.Errorf("got %d in-flight and %d replayed outcomes, want 1 and 1", inFlight.Load(), duplicates.Load())
	}
}

// TestCrashConnectionClosed: a consumer dies, on its own connection,
// after the effect of a delivery and before its ack; closing the
// connection returns its unacknowledged deliveries to the queue, and the
// next consumer answers exactly that one Replayed. (The adapter suite
// crashes consumers by closing their channel.)
func TestCrashConnectionClosed(t *testing.T) {
	e := newEnv(t, envOpts{})
	keys := []string{"order-1", "order-2", "order-3", "order-4"}
	e.publish(true, keys...)
	conn := dial(t)
	var handled atomic.Int32
	crashed := e.consumer("c1", conn, nil, nil)
	crashed.crashBeforeAck(func(amqp.Delivery) bool { return handled.Add(1) < 2 })
	stop := e.start(crashed)
	waitFor(t, "c1 to crash", func() bool { return handled.Load() >= 2 })
	if err := stop(); !errors.Is(err, errCrashed) {
		t.Fatalf("crashed Run: got %v, want errCrashed", err)
	}
	conn.Close() // the crash: unacknowledged deliveries return to the queue
	if got := len(e.ledger.Snapshot()); got != 2 {
		t.Fatalf("before the restart the ledger holds %d keys, want 2", got)
	}
	before := e.acked.Load() // c1's two decisions, one of them not acked
	var duplicates atomic.Int32
	c := e.consumer("c2", nil, nil, func(_ amqp.Delivery, res idemmsg.Result, _ error) {
		if res.Outcome == idemmsg.Replayed {
			duplicates.Add(1)
		}
	})
	stop = e.start(c)
	e.waitAcked(int(before) + len(keys) - 1) // the three redelivered
	e.checkLedger(keys, stop)
	if duplicates.Load() != 1 {
		t.Errorf("got %d duplicates after the restart, want 1 (the crashed delivery)", duplicates.Load())
	}
}

// TestDeadLetterFields checks what the adapter suite does not: the dead
// letter RabbitMQ routes keeps the message (body, message-id, headers) and
// gains x-death; the kept error text is Result.Err; a quorum queue's
// x-delivery-count gives the attempts (a classic queue's are counted in
// the process); and Run, holding a delivery for its requeue, stops
// promptly.
func TestDeadLetterFields(t *testing.T) {
	for _, quorum := range []bool{false, true} {
		t.Run(fmt.Sprintf("quorum=%t", quorum), func(t *testing.T) {
			e := newEnv(t, envOpts{maxFailures: 3, quorum: quorum})
			e.publish(true, "poison")
			var runs atomic.Int32
			var mu sync.Mutex
			var attempts []int // the delivery counts, from the broker
			var deadErr error
			c := e.consumer("c1", nil, nil, func(_ amqp.Delivery, res idemmsg.Result, _ error) {
				if res.Outcome == idemmsg.DeadLettered {
					mu.Lock()
					deadErr = res.Err
					mu.Unlock()
				}
			})
			c.Handler = func(ctx context.Context, d amqp.Delivery) error {
				n, _ := deliveryCount(d)
				mu.Lock()
				attempts = append(attempts, n)
				mu.Unlock()
				return fmt.Errorf("cannot parse payload (run %d)", runs.Add(1))
			}
			stop := e.start(c)
			e.waitAcked(1)
			if got := runs.Load(); got != 3 {
				t.Errorf("handler ran %d times, want 3 (MaxFailures)", got)
			}
			mu.Lock()
			if quorum && fmt.Sprint(attempts) != "[1 2 3]" {
				t.Errorf("quorum queue: x-delivery-count attempts %v, want [1 2 3]", attempts)
			}
			if deadErr == nil || deadErr.Error() != "cannot parse payload (run 3)" {
				t.Errorf("Result.Err of the dead-lettered delivery: %v", deadErr)
			}
			mu.Unlock()
			var dead []amqp.Delivery
			waitFor(t, "the dead letter", func() bool { dead = append(dead, e.deadLetters()...); return len(dead) >= 1 })
			if len(dead) != 1 || string(dead[0].Body) != "poison" || dead[0].MessageId != "poison" || dead[0].Headers["n"] != int32(0) {
				t.Fatalf("dead letters: got %d, want the poison message: %+v", len(dead), dead)
			}
			deaths, _ := dead[0].Headers["x-death"].([]any)
			if len(deaths) != 1 {
				t.Fatalf("x-death: got %v, want one entry", dead[0].Headers["x-death"])
			}
			if death, _ := deaths[0].(amqp.Table); death["reason"] != "rejected" || death["queue"] != e.queue {
				t.Errorf("x-death: got %v, want reason rejected, queue %s", death, e.queue)
			}
			t0 := time.Now()
			e.checkLedger(nil, stop)
			if d := time.Since(t0); d > time.Second {
				t.Errorf("Run took %v to stop, want under 1s", d)
			}
		})
	}
}

// TestConcurrencyPanicPassedOn: with Concurrency, a handler's panic still
// comes out of Run, once the other handlers returned.
func TestConcurrencyPanicPassedOn(t *testing.T) {
	e := newEnv(t, envOpts{})
	e.publish(true, "ok-1", "boom", "ok-2")
	c := e.consumer("c1", nil, nil, nil)
	c.Concurrency = 4
	h := c.Handler
	c.Handler = func(ctx context.Context, d amqp.Delivery) error {
		if d.MessageId == "boom" {
			panic("boom")
		}
		return h(ctx, d)
	}
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	got := func() (v any) {
		defer func() { v = recover() }()
		c.Run(ctx)
		return nil
	}()
	if got != "boom" {
		t.Fatalf("Run: got panic %v, want boom", got)
	}
	c.Channel.Close() // unacknowledged deliveries return to the queue
	stop := e.start(e.consumer("c2", nil, nil, nil))
	e.waitAcked(3)
	e.checkLedger([]string{"ok-1", "boom", "ok-2"}, stop)
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
		"no channel": func(c *Consumer) { c.Channel = nil },
		"both channels": func(c *Consumer) {
			c.NewChannel = func(context.Context) (*amqp.Channel, error) { return nil, errors.New("unused") }
		},
		"no queue":      func(c *Consumer) { c.Queue = "" },
		"no dedup":      func(c *Consumer) { c.Dedup = nil },
		"no handler":    func(c *Consumer) { c.Handler = nil },
		"negative":      func(c *Consumer) { c.Prefetch = -1 },
		"negative conc": func(c *Consumer) { c.Concurrency = -1 },
		"prefetch<conc": func(c *Consumer) { c.Prefetch, c.Concurrency = 4, 8 },
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

// start runs c until the test ends, and returns a function that stops it
// and returns Run's error.
func (e *env) start(c *Consumer) (stop func() error) {
	return msgtest.Start(e.t, "consumer", waitLimit, c.Run, func() {
		if c.Channel != nil {
			c.Channel.Close()
		}
	})
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	msgtest.WaitFor(t, what, waitLimit, cond)
}
