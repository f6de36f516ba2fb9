package redisstream

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

	"github.com/redis/go-redis/v9"
	"github.com/redis/rueidis"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemmsg"
	"github.com/idemkit/idem/idemmsg/internal/msgtest"
	"github.com/idemkit/idem/internal/redisserver"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/redisstore"
)

var srv *redisserver.Server

func TestMain(m *testing.M) { os.Exit(redistest.Run(m, &srv)) }

// Short enough that claims of crashed or failed entries happen within the
// test's bounds.
const (
	testLease = 300 * time.Millisecond
	testBlock = 50 * time.Millisecond
	waitLimit = 10 * time.Second
)

// The client libraries a Consumer runs on, as subtest names.
const (
	goredisLib = "go-redis"
	rueidisLib = "rueidis"
)

var clientLibs = []string{goredisLib, rueidisLib}

// forEachLib runs test as one subtest per client library.
func forEachLib(t *testing.T, test func(t *testing.T, lib string)) {
	for _, lib := range clientLibs {
		t.Run(lib, func(t *testing.T) { test(t, lib) })
	}
}

// env is one test's stream, group, clients, deduplicator and ledger.
type env struct {
	t *testing.T
	// client publishes and inspects the stream, whatever lib is. It
	// connects to the server directly, never through a proxy.
	client *redis.Client
	// lib is the library of the consumers' client (and of the store's,
	// unless envOptions.store or a memstore replaced it).
	lib string
	// goredis and ru are the consumers' client: goredis for go-redis
	// (client itself unless the consumers go through a proxy), ru for
	// rueidis.
	goredis *redis.Client
	ru      rueidis.Client
	stream  string
	group   string
	dedup   *idemmsg.Deduplicator
	ledger  *msgtest.Ledger
	lastID  string
	minIdle time.Duration // the consumers' MinIdle; 0: the lease
}

// envOptions is how an env departs from the defaults: the package's
// server, reached directly, a redisstore on the consumers' client library
// in the same server, and a lease of testLease.
type envOptions struct {
	maxFailures int
	// server, when set, is where the stream lives instead of srv.
	server *redisserver.Server
	// consumerAddr, when set, is the address the consumers' client
	// connects to (a proxy in front of the server).
	consumerAddr string
	// store, when set, is the Deduplicator's store; memstore, when set,
	// asks for a fresh memstore.
	store    idem.Store
	memstore bool
	lease    time.Duration
	minIdle  time.Duration
}

func newEnv(t *testing.T, lib string, maxFailures int) *env {
	t.Helper()
	return newEnvWith(t, lib, envOptions{maxFailures: maxFailures})
}

func newEnvWith(t *testing.T, lib string, o envOptions) *env {
	t.Helper()
	server := srv
	if o.server != nil {
		server = o.server
	}
	consumerAddr := server.Addr()
	if o.consumerAddr != "" {
		consumerAddr = o.consumerAddr
	}
	if o.lease == 0 {
		o.lease = testLease
	}
	c := redis.NewClient(&redis.Options{Addr: server.Addr()})
	t.Cleanup(func() { c.Close() })
	// Unique per run, so that -count=N starts from empty streams and keys.
	name := fmt.Sprintf("%s-%d", strings.ReplaceAll(t.Name(), "/", "-"), time.Now().UnixNano())
	opts := redisstore.Options{Prefix: "idem:" + name + ":"}
	e := &env{t: t, client: c, lib: lib, ledger: msgtest.NewLedger(), minIdle: o.minIdle}
	switch lib {
	case goredisLib:
		e.goredis = c
		if consumerAddr != server.Addr() {
			e.goredis = redis.NewClient(&redis.Options{Addr: consumerAddr})
			t.Cleanup(func() { e.goredis.Close() })
		}
	case rueidisLib:
		ru, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: []string{consumerAddr}, DisableCache: true})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(ru.Close)
		e.ru = ru
	default:
		t.Fatalf("unknown client library %q", lib)
	}
	store := o.store
	switch {
	case store != nil:
	case o.memstore:
		store = memstore.New(memstore.Options{})
	case e.ru != nil:
		rs, err := redisstore.NewRueidis(e.ru, opts)
		if err != nil {
			t.Fatal(err)
		}
		store = rs
	default:
		rs, err := redisstore.New(e.goredis, opts)
		if err != nil {
			t.Fatal(err)
		}
		store = rs
	}
	e.stream, e.group = "stream:"+name, "g"
	d, err := idemmsg.New(store, idemmsg.Config{Namespace: e.stream + "/" + e.group, Lease: o.lease, MaxFailures: o.maxFailures})
	if err != nil {
		t.Fatal(err)
	}
	e.dedup = d
	return e
}

// publish adds one entry per key.
func (e *env) publish(keys ...string) {
	e.t.Helper()
	for i, k := range keys {
		id, err := e.client.XAdd(context.Background(), &redis.XAddArgs{Stream: e.stream, Values: []any{"k", k, "n", i}}).Result()
		if err != nil {
			e.t.Fatal(err)
		}
		e.lastID = id
	}
}

func (e *env) consumer(name string) *Consumer {
	c := &Consumer{
		Stream: e.stream, Group: e.group, Consumer: name,
		Dedup: e.dedup, KeyField: "k", Block: testBlock, MinIdle: e.minIdle,
		Handler: func(ctx context.Context, msg redis.XMessage) error {
			return e.ledger.Apply(ctx, msg.Values["k"].(string))
		},
		OnError: func(err error) { e.t.Logf("%s: %v", name, err) },
	}
	if e.ru != nil {
		c.Rueidis = e.ru
	} else {
		c.Client = e.goredis
	}
	return c
}

// settled reports whether every published entry was delivered to the
// group and acknowledged.
func (e *env) settled() bool {
	groups, err := e.client.XInfoGroups(context.Background(), e.stream).Result()
	if err != nil {
		return false
	}
	for _, g := range groups {
		if g.Name == e.group {
			return g.LastDeliveredID == e.lastID && g.Pending == 0
		}
	}
	return false
}

// checkLedger wants exactly one effect per distinct key and nothing
// pending.
func (e *env) checkLedger(keys []string) {
	e.t.Helper()
	e.ledger.WantOneEach(e.t, keys)
	p, err := e.client.XPending(context.Background(), e.stream, e.group).Result()
	if err != nil || p.Count != 0 {
		e.t.Errorf("XPENDING: got %+v, %v; want count 0", p, err)
	}
}

func TestDeadLetterFields(t *testing.T) {
	forEachLib(t, func(t *testing.T, lib string) {
		e := newEnv(t, lib, 1)
		e.publish("poison")
		c := e.consumer("c1")
		c.DeadLetterStream = e.stream + ":dead"
		c.Handler = func(context.Context, redis.XMessage) error { return errors.New("cannot parse payload") }
		e.start(c)
		waitFor(t, "the entry acknowledged", e.settled)
		dead, err := e.client.XRange(context.Background(), c.DeadLetterStream, "-", "+").Result()
		if err != nil || len(dead) != 1 {
			t.Fatalf("dead-letter stream: got %d entries (%v), want 1", len(dead), err)
		}
		v := dead[0].Values
		if v["k"] != "poison" || v["n"] != "0" || v[FieldStream] != e.stream || v[FieldGroup] != e.group ||
			v[FieldError] != "cannot parse payload" || v[FieldID] != e.lastID {
			t.Errorf("dead letter: got %v", v)
		}
	})
}

func TestInvalidKeyDeadLettered(t *testing.T) {
	forEachLib(t, func(t *testing.T, lib string) {
		e := newEnv(t, lib, 0)
		e.publish("ok", "") // an empty key field is invalid
		c := e.consumer("c1")
		c.DeadLetterStream = e.stream + ":dead"
		c.OnError = func(error) {}
		e.start(c)
		waitFor(t, "all entries acknowledged", e.settled)
		e.checkLedger([]string{"ok"})
		dead, err := e.client.XRange(context.Background(), c.DeadLetterStream, "-", "+").Result()
		if err != nil || len(dead) != 1 || !strings.Contains(dead[0].Values[FieldError].(string), "invalid") {
			t.Fatalf("dead-letter stream: got %v (%v), want one entry with the key error", dead, err)
		}
	})
}

func TestDefaultKeyIsEntryID(t *testing.T) {
	forEachLib(t, func(t *testing.T, lib string) {
		e := newEnv(t, lib, 0)
		e.publish("same", "same") // two entries, two ids: both processed
		var seen sync.Map
		c := e.consumer("c1")
		c.KeyField = ""
		c.Handler = func(ctx context.Context, msg redis.XMessage) error {
			seen.Store(msg.ID, true)
			return e.ledger.Apply(ctx, msg.ID)
		}
		e.start(c)
		waitFor(t, "all entries acknowledged", e.settled)
		if got := len(e.ledger.Snapshot()); got != 2 {
			t.Errorf("ledger holds %d keys, want 2 (one per entry id)", got)
		}
	})
}

func TestGroupRecreated(t *testing.T) {
	forEachLib(t, func(t *testing.T, lib string) {
		e := newEnv(t, lib, 0)
		e.publish("a")
		c := e.consumer("c1")
		c.OnError = func(error) {}
		e.start(c)
		waitFor(t, "the first entry acknowledged", e.settled)
		if err := e.client.Del(context.Background(), e.stream).Err(); err != nil {
			t.Fatal(err)
		}
		time.Sleep(3 * testBlock) // let a read fail with NOGROUP
		e.publish("b")
		waitFor(t, "the entry after the deletion acknowledged", e.settled)
		e.checkLedger([]string{"a", "b"})
	})
}

func TestRunValidates(t *testing.T) {
	e := newEnv(t, rueidisLib, 0) // e.client is a go-redis client too
	for name, mutate := range map[string]func(c *Consumer){
		"no client":    func(c *Consumer) { c.Client, c.Rueidis = nil, nil },
		"both clients": func(c *Consumer) { c.Client, c.Rueidis = e.client, e.ru },
		"no stream":    func(c *Consumer) { c.Stream = "" },
		"no dedup":     func(c *Consumer) { c.Dedup = nil },
		"no handler":   func(c *Consumer) { c.Handler = nil },
		"negative":     func(c *Consumer) { c.Block = -1 },
	} {
		c := e.consumer("c1")
		mutate(c)
		if err := c.Run(context.Background()); err == nil {
			t.Errorf("%s: got nil error", name)
		}
	}
}

// TestIdleNoErrors: reads that find nothing (redis.Nil with go-redis, a
// nil reply with rueidis) are not errors.
func TestIdleNoErrors(t *testing.T) {
	forEachLib(t, func(t *testing.T, lib string) {
		e := newEnv(t, lib, 0)
		var errs atomic.Int64
		c := e.consumer("c1")
		c.OnError = func(err error) { errs.Add(1); t.Log(err) }
		e.start(c)
		time.Sleep(6 * testBlock) // several empty reads
		e.publish("a")
		waitFor(t, "the entry acknowledged", e.settled)
		e.checkLedger([]string{"a"})
		if n := errs.Load(); n != 0 {
			t.Errorf("OnError called %d times, want 0", n)
		}
	})
}

// TestRueidisBlockingRead: with rueidis, XREADGROUP BLOCK waits on a
// connection of its own, so that commands on the client's auto-pipelined
// connection (the store's, here a PING) are not held up behind it, and
// Run's end interrupts it.
func TestRueidisBlockingRead(t *testing.T) {
	e := newEnv(t, rueidisLib, 0)
	const block = 3 * time.Second
	c := e.consumer("c1")
	c.Block, c.MinIdle = block, time.Minute // one long read after the first claim
	stop := e.start(c)
	waitFor(t, "XREADGROUP blocked", func() bool {
		list, err := e.client.ClientList(context.Background()).Result()
		if err != nil {
			return false
		}
		for line := range strings.Lines(list) {
			if strings.Contains(line, " cmd=xreadgroup") && strings.Contains(line, " flags=b ") {
				return true
			}
		}
		return false
	})
	start := time.Now()
	if err := e.ru.Do(context.Background(), e.ru.B().Ping().Build()).Error(); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d > block/3 {
		t.Errorf("PING took %v while XREADGROUP was blocked, want well under the block of %v", d, block)
	}
	start = time.Now()
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d > block/3 {
		t.Errorf("Run returned %v after its context ended, want well under the block of %v", d, block)
	}
}

// start runs c until the test ends, and returns a function that stops it
// and returns Run's error.
func (e *env) start(c *Consumer) (stop func() error) {
	return msgtest.Start(e.t, c.Consumer, waitLimit, c.Run, nil)
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	msgtest.WaitFor(t, what, waitLimit, cond)
}

// TestBlackholedReadEnds: once the connection goes silent (a proxy drops
// every byte, without a reset), a blocking XREADGROUP fails within
// Block+10s on either library (go-redis's read deadline for blocking
// commands; readMargin for rueidis, which has none), Run reports it and
// goes on, and once the network is back the consumer reads again.
func TestBlackholedReadEnds(t *testing.T) {
	for _, lib := range clientLibs {
		t.Run(lib, func(t *testing.T) {
			t.Parallel()
			p := msgtest.NewProxy(t, srv.Addr())
			e := newEnvWith(t, lib, envOptions{consumerAddr: p.Addr, memstore: true, minIdle: time.Minute})
			readErrs := make(chan error, 100)
			c := e.consumer("c1")
			c.OnError = func(err error) {
				t.Logf("c1: %v", err)
				if strings.Contains(err.Error(), "XREADGROUP") {
					select {
					case readErrs <- err:
					default:
					}
				}
			}
			e.publish("a")
			e.start(c)
			waitFor(t, "the first entry acknowledged", e.settled)
			time.Sleep(3 * testBlock) // a few reads, then one blocked in the hole

			p.Blackhole(t)
			start := time.Now()
			bound := testBlock + readMargin
			select {
			case <-readErrs:
				if d := time.Since(start); d > bound+2*time.Second {
					t.Errorf("XREADGROUP failed %v after the connection went silent, want at most about Block+%v", d, readMargin)
				}
			case <-time.After(bound + 5*time.Second):
				t.Fatalf("no XREADGROUP error within %v of the connection going silent", bound+5*time.Second)
			}
			p.Restore(t)
			e.publish("b")
			waitFor(t, "the entry published after the restore acknowledged", e.settled)
			e.checkLedger([]string{"a", "b"})
		})
	}
}
