package natsjs

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/idemmsg"
	"github.com/idemkit/idem/idemmsg/internal/loop"
	"github.com/idemkit/idem/idemmsg/internal/msgtest"
	"github.com/idemkit/idem/idemmsg/internal/workpool"
	"github.com/idemkit/idem/internal/redisserver"
	"github.com/idemkit/idem/redisstore"
)

// Consumer throughput, BENCHMARKS.md "Message consumers (idemmsg)".
const (
	benchMsgs    = 20_000 // messages consumed per b.N iteration
	benchAckWait = 30 * time.Second
	benchLimit   = 2 * time.Minute // bound on one iteration's consumption
	// benchQuiet is how long the consumption may make no progress before
	// the benchmark notes the durable's state (logged after the run).
	benchQuiet = 5 * time.Second
	benchStop  = 10 * time.Second
)

// benchShape is how a benchmark consumes: loops Run loops on the
// durable, each handling conc messages at once.
type benchShape struct{ loops, conc int }

func (s benchShape) String() string { return fmt.Sprintf("loops=%d,conc=%d", s.loops, s.conc) }

// pull is the iterator's buffer: DefaultMaxMessages, or conc if more.
func (s benchShape) pull() int { return max(DefaultMaxMessages, s.conc) }

// benchShapes: 16 handlers at a time in two ways (16 in-order loops; one
// loop with Concurrency 16), then 16 loops with Concurrency 16.
var benchShapes = []benchShape{{16, 1}, {1, 16}, {16, 16}}

// BenchmarkConsume measures messages per second through one durable pull
// consumer of the private nats-server, for each shape, side by side in
// one process:
//
//	raw   loops goroutines, each with its own Messages iterator
//	      (PullMaxMessages 16) on the durable, acking each message, conc
//	      at a time: Run's loop with no Deduplicator
//	idem  loops Consumer.Run loops (Concurrency conc) on the durable with
//	      a Deduplicator over redisstore.Open (the production store) on a
//	      private redis-server started by the benchmark
//	idem-batch  idem with Consumer.Batch: one HandleBatch per batch taken
//	      from the iterator
//
// Both run the trivial handler (count the message) over benchMsgs
// messages published, each with a unique Nats-Msg-Id, to a fresh
// file-storage stream before the timer starts. b.N counts iterations of
// benchMsgs messages; run with -benchtime 1x. The clock stops when the
// handler has run for every message; that the consumer then has nothing
// pending or unacknowledged is checked outside the timing. idem reports
// idem/raw, the ratio of its rate to raw's from the same process, and the
// store's redis-server CPU time per message (INFO cpu, user + sys, over
// the timed part); every mode reports the test process's CPU time per
// message (consumers and client libraries, getrusage; the nats-server is
// a process of its own).
//
// The store's server is the system's redis-server (Redis 7.0: the
// store's Lua path). $IDEM_BENCH_SERVERS (redisserver.BenchKinds) runs the
// whole benchmark with the store on each server kind it lists instead,
// one sub-benchmark per kind, each on a private server of that kind
// started for it; the store's path is PathAuto, and the benchmark fails
// if the store did not take the path the kind calls for (native on
// Valkey 9.1 and Redis 8.6). The broker is the private nats-server
// either way:
//
//	IDEM_BENCH_SERVERS=valkey-9.1,redis-8.6 go test -run '^$' -bench Consume -benchtime 1x ./idemmsg/natsjs/
func BenchmarkConsume(b *testing.B) {
	kinds, err := redisserver.BenchKinds()
	if err != nil {
		b.Fatal(err)
	}
	if kinds == nil {
		benchConsumeOn(b, "", redisstore.PathLua)
		return
	}
	for _, kind := range kinds {
		b.Run(string(kind), func(b *testing.B) { benchConsumeOn(b, kind, benchPath[kind]) })
	}
}

// benchPath is the path redisstore's PathAuto takes on each server kind.
var benchPath = map[redisserver.Kind]redisstore.Path{
	redisserver.Redis7:       redisstore.PathLua,
	redisserver.Valkey9:      redisstore.PathNative,
	redisserver.Redis8:       redisstore.PathNative,
	redisserver.Valkey9NoLua: redisstore.PathNative,
}

// benchConsumeOn runs every mode in every shape with the store on a
// private server of kind ("": the system's redis-server), where it must
// take path.
func benchConsumeOn(b *testing.B, kind redisserver.Kind, path redisstore.Path) {
	rs, err := redisserver.StartServer(redisserver.WithKind(kind))
	if err != nil {
		b.Fatal(err)
	}
	defer rs.Stop()
	nc, err := nats.Connect(srv.url)
	if err != nil {
		b.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		b.Fatal(err)
	}
	rc := redis.NewClient(&redis.Options{Addr: rs.Addr()})
	defer rc.Close()

	for _, shape := range benchShapes {
		b.Run(shape.String(), func(b *testing.B) {
			var rawRate float64
			b.Run("raw", func(b *testing.B) {
				rawRate = benchConsume(b, js, shape, "raw", func(b *testing.B, _ *benchTarget) (func(context.Context, *benchTarget), func()) {
					return consumeRaw(), func() {}
				})
			})
			for _, batch := range []bool{false, true} {
				mode := "idem"
				if batch {
					mode = "idem-batch"
				}
				b.Run(mode, func(b *testing.B) {
					rate := benchConsume(b, js, shape, mode, func(b *testing.B, t *benchTarget) (func(context.Context, *benchTarget), func()) {
						store, err := redisstore.Open("redis://"+rs.Addr(), redisstore.Options{Prefix: "idem:" + t.stream + ":"})
						if err != nil {
							b.Fatal(err)
						}
						d, err := idemmsg.New(store, idemmsg.Config{Namespace: t.stream + "/" + durable})
						if err != nil {
							store.Close()
							b.Fatal(err)
						}
						t.redis = rc
						return consumeIdem(b, d, batch), func() {
							if p := store.Path(); p != path {
								b.Errorf("the store took the %v path on %s, want %v", p, rs.Addr(), path)
							}
							store.Close()
						}
					})
					if rawRate > 0 {
						b.ReportMetric(rate/rawRate, "idem/raw")
					}
				})
			}
		})
	}
}

// benchTarget is one iteration's stream and durable, already filled.
type benchTarget struct {
	shape   benchShape
	stream  string
	cons    jetstream.Consumer
	redis   *redis.Client // the store's server, for its CPU time (idem only)
	handled atomic.Int64
	done    chan struct{} // closed when handled reaches benchMsgs

	mu     sync.Mutex
	errs   []string // the first errors the consumers reported (pull, ack, OnError)
	nerrs  int
	failed bool     // an error that invalidates the run (not a pull error retried)
	quiet  []string // the durable's state when the consumption made no progress for benchQuiet
}

// waitHandled waits until every message was handled, failing the
// benchmark (after cancel) when that takes longer than benchLimit. When
// nothing is handled for benchQuiet, it notes the durable's state, for
// the log: a pull iterator that went silent shows as messages pending
// with no pull request waiting at the server.
func (t *benchTarget) waitHandled(b *testing.B, mode string, cancel func()) {
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	limit := time.After(benchLimit)
	last, lastAt, noted := t.handled.Load(), time.Now(), false
	for {
		select {
		case <-t.done:
			return
		case <-limit:
			cancel()
			b.Fatalf("%s: handled %d of %d messages within %v (%s)", mode, t.handled.Load(), benchMsgs, benchLimit, t.why())
		case now := <-tick.C:
			n := t.handled.Load()
			if n != last {
				last, lastAt, noted = n, now, false
				continue
			}
			if noted || now.Sub(lastAt) < benchQuiet {
				continue
			}
			noted = true
			note := fmt.Sprintf("nothing handled for %v at %d of %d", benchQuiet, n, benchMsgs)
			ctx, icancel := context.WithTimeout(context.Background(), time.Second)
			if info, err := t.cons.Info(ctx); err != nil {
				note += fmt.Sprintf(": consumer info: %v", err)
			} else {
				note += fmt.Sprintf(": pending %d, waiting pull requests %d, unacknowledged %d", info.NumPending, info.NumWaiting, info.NumAckPending)
			}
			icancel()
			t.mu.Lock()
			t.quiet = append(t.quiet, note)
			t.mu.Unlock()
		}
	}
}

// failure records an error of the consumers. A pull error is retried, as
// Run retries it; the run stays valid if every message is still handled
// once and acknowledged (the checks after the timing), and the error is
// printed with any failure. Others fail the run once it is timed.
func (t *benchTarget) failure(retried bool, format string, args ...any) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.nerrs++
	if len(t.errs) < 5 {
		t.errs = append(t.errs, fmt.Sprintf(format, args...))
	}
	t.failed = t.failed || !retried
}

// why describes the errors the consumers reported, for a failure message.
func (t *benchTarget) why() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.nerrs == 0 {
		return "no error reported by the consumers"
	}
	return fmt.Sprintf("%d errors reported by the consumers, the first: %s", t.nerrs, strings.Join(t.errs, "; "))
}

func (t *benchTarget) handle() {
	if t.handled.Add(1) == benchMsgs {
		close(t.done)
	}
}

// prepareFunc readies the consumers of t (untimed) and returns run, which
// consumes until ctx ends and returns once every loop returned, and
// release, called after run returned.
type prepareFunc func(b *testing.B, t *benchTarget) (run func(ctx context.Context, t *benchTarget), release func())

func benchConsume(b *testing.B, js jetstream.JetStream, shape benchShape, mode string, prepare prepareFunc) (rate float64) {
	var elapsed, cpu, ccpu time.Duration
	cpuOK := true
	b.ResetTimer()
	b.StopTimer()
	for i := range b.N {
		t := benchPublish(b, js, fmt.Sprintf("B%s_%d_%d", mode, time.Now().UnixNano(), i))
		t.shape = shape
		run, release := prepare(b, t)

		ctx, cancel := context.WithCancel(context.Background())
		stopped := make(chan struct{})
		var cpu0 time.Duration
		if t.redis != nil {
			var err error
			if cpu0, err = redisserver.CPUTime(ctx, t.redis); err != nil {
				b.Fatal(err)
			}
		}
		ccpu0, ok := msgtest.ProcessCPU()
		cpuOK = cpuOK && ok
		start := time.Now()
		b.StartTimer()
		go func() { defer close(stopped); run(ctx, t) }()
		t.waitHandled(b, mode, cancel)
		b.StopTimer()
		elapsed += time.Since(start)
		ccpu1, _ := msgtest.ProcessCPU()
		ccpu += ccpu1 - ccpu0
		if t.redis != nil {
			cpu1, err := redisserver.CPUTime(ctx, t.redis)
			if err != nil {
				b.Fatal(err)
			}
			cpu += cpu1 - cpu0
		}

		var info *jetstream.ConsumerInfo
		acked := func() bool {
			ictx, icancel := context.WithTimeout(context.Background(), time.Second)
			defer icancel()
			var err error
			info, err = t.cons.Info(ictx)
			return err == nil && info.NumPending == 0 && info.NumAckPending == 0 && info.NumRedelivered == 0
		}
		for deadline := time.Now().Add(benchStop); !acked(); time.Sleep(10 * time.Millisecond) {
			if time.Now().After(deadline) {
				cancel()
				state := "no consumer info"
				if info != nil {
					state = fmt.Sprintf("pending %d, unacknowledged %d, redelivered %d", info.NumPending, info.NumAckPending, info.NumRedelivered)
				}
				b.Fatalf("%s: not every message acknowledged once within %v after the last was handled: %s (%s)", mode, benchStop, state, t.why())
			}
		}
		cancel()
		select {
		case <-stopped:
		case <-time.After(benchStop):
			b.Fatalf("%s: consumers did not stop within %v (%s)", mode, benchStop, t.why())
		}
		release()
		if n := t.handled.Load(); n != benchMsgs {
			b.Fatalf("%s: handled %d messages, want %d (%s)", mode, n, benchMsgs, t.why())
		}
		if t.failed {
			b.Fatalf("%s: %s", mode, t.why())
		}
		if t.nerrs > 0 {
			b.Logf("%s: the run recovered from %s", mode, t.why())
		}
		for _, note := range t.quiet {
			b.Logf("%s: %s", mode, note)
		}
		dctx, dcancel := context.WithTimeout(context.Background(), benchStop)
		if err := js.DeleteStream(dctx, t.stream); err != nil {
			b.Logf("delete stream %s: %v", t.stream, err)
		}
		dcancel()
	}
	rate = float64(b.N*benchMsgs) / elapsed.Seconds()
	b.ReportMetric(rate, "msgs/s")
	if cpu > 0 {
		b.ReportMetric(float64(cpu.Microseconds())/float64(b.N*benchMsgs), "redis-cpu-µs/msg")
	}
	if cpuOK {
		b.ReportMetric(float64(ccpu.Microseconds())/float64(b.N*benchMsgs), "client-cpu-µs/msg")
	}
	return rate
}

// benchPublish creates a file-storage stream and its durable (explicit
// acks, as Run requires) and publishes benchMsgs messages to it, each
// with a unique Nats-Msg-Id.
func benchPublish(b *testing.B, js jetstream.JetStream, name string) *benchTarget {
	ctx, cancel := context.WithTimeout(context.Background(), benchLimit)
	defer cancel()
	subject := "orders." + name
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{subject}}); err != nil {
		b.Fatal(err)
	}
	cons, err := js.CreateOrUpdateConsumer(ctx, name, jetstream.ConsumerConfig{
		Durable: durable, AckPolicy: jetstream.AckExplicitPolicy, AckWait: benchAckWait,
		MaxDeliver: 20, FilterSubject: subject,
	})
	if err != nil {
		b.Fatal(err)
	}
	const window = 1000 // async publications in flight
	for i := 0; i < benchMsgs; i += window {
		for j := i; j < min(i+window, benchMsgs); j++ {
			m := nats.NewMsg(subject)
			m.Data = []byte("payload")
			m.Header.Set(jetstream.MsgIDHeader, fmt.Sprintf("%s-%d", name, j))
			if _, err := js.PublishMsgAsync(m); err != nil {
				b.Fatal(err)
			}
		}
		select {
		case <-js.PublishAsyncComplete():
		case <-ctx.Done():
			b.Fatalf("publishing to %s: %v", name, ctx.Err())
		}
	}
	info, err := js.Stream(ctx, name)
	if err != nil {
		b.Fatal(err)
	}
	if n := info.CachedInfo().State.Msgs; n != benchMsgs {
		b.Fatalf("stream %s holds %d messages, want %d", name, n, benchMsgs)
	}
	return &benchTarget{stream: name, cons: cons, done: make(chan struct{})}
}

// consumeRaw is Run's pull loop without the Deduplicator: each loop
// pulls with a Messages iterator and, like Run, takes a new one after a
// pull error (a missed heartbeat when the machine is busy, for one),
// after a pause. Before, a pull error ended the loop: with one loop
// (loops=1), nothing consumed the rest and the run failed after
// benchLimit, with the error printed only by an Errorf that
// scripts/bench.sh filtered out.
func consumeRaw() func(context.Context, *benchTarget) {
	return func(ctx context.Context, t *benchTarget) {
		var wg sync.WaitGroup
		for n := range t.shape.loops {
			wg.Go(func() {
				for failures := 0; ctx.Err() == nil; failures++ {
					if failures > 0 {
						loop.Sleep(ctx, loop.Backoff(failures))
					}
					if err := pullRaw(ctx, t); err != nil && ctx.Err() == nil {
						t.failure(true, "raw %d: pull: %v", n, err)
					}
				}
			})
		}
		wg.Wait()
	}
}

// pullRaw runs one Messages iterator until ctx ends (nil) or a pull
// error, handling and acking each message, t.shape.conc at a time.
func pullRaw(ctx context.Context, t *benchTarget) error {
	it, err := t.cons.Messages(jetstream.PullMaxMessages(t.shape.pull()))
	if err != nil {
		return err
	}
	defer it.Stop()
	pool := workpool.New(t.shape.conc)
	defer pool.Wait()
	for {
		msg, err := it.Next(jetstream.NextContext(ctx))
		if ctx.Err() != nil {
			if msg != nil {
				msg.Nak()
			}
			return nil
		}
		if err != nil {
			return err
		}
		pool.Go(func() {
			t.handle()
			if err := msg.Ack(); err != nil {
				t.failure(false, "raw: ack: %v", err)
			}
		})
	}
}

// consumeIdem runs t.shape.loops Consumer.Run loops over d.
func consumeIdem(b *testing.B, d *idemmsg.Deduplicator, batch bool) func(context.Context, *benchTarget) {
	return func(ctx context.Context, t *benchTarget) {
		var wg sync.WaitGroup
		for n := range t.shape.loops {
			c := &Consumer{
				Consumer: t.cons, Dedup: d, Concurrency: t.shape.conc, MaxMessages: t.shape.pull(), Batch: batch,
				Handler: func(context.Context, jetstream.Msg) error { t.handle(); return nil },
				OnError: func(err error) {
					if ctx.Err() == nil {
						// Run retries what it reports here: the checks
						// after the timing tell whether the run is valid.
						t.failure(true, "consumer %d: %v", n, err)
					}
				},
			}
			wg.Go(func() {
				if err := c.Run(ctx); err != nil {
					t.failure(false, "consumer %d: Run: %v", n, err)
				}
			})
		}
		wg.Wait()
	}
}
