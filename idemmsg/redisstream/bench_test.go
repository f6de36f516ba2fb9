package redisstream

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/rueidis"

	"github.com/idemkit/idem/idemmsg"
	"github.com/idemkit/idem/idemmsg/internal/msgtest"
	"github.com/idemkit/idem/idemmsg/internal/workpool"
	"github.com/idemkit/idem/internal/redisserver"
	"github.com/idemkit/idem/redisstore"
)

// Consumer throughput, BENCHMARKS.md "Message consumers (idemmsg)".
const (
	benchMsgs  = 20_000 // messages consumed per b.N iteration
	benchBlock = 100 * time.Millisecond
	benchLimit = 2 * time.Minute // bound on one iteration's consumption
	// benchIdle bounds how long the consumption may make no progress (no
	// entry handled) before the benchmark fails, saying why: longer than
	// the idem modes take to claim entries whose read was lost (MinIdle,
	// the 30s lease, plus a claim interval), which the raw modes never do.
	benchIdle = time.Minute
	benchStop = 10 * time.Second
)

// benchShape is how a benchmark consumes: loops Run loops (consumers of
// the group), each handling conc entries of its batch at once.
type benchShape struct{ loops, conc int }

func (s benchShape) String() string { return fmt.Sprintf("loops=%d,conc=%d", s.loops, s.conc) }

// benchShapes: 16 handlers at a time in two ways (16 in-order consumers;
// one consumer with Concurrency 16), then 16 consumers with Concurrency 16.
var benchShapes = []benchShape{{16, 1}, {1, 16}, {16, 16}}

// BenchmarkConsume measures messages per second through a consumer group
// on the private redis-server, for each shape, side by side in one
// process:
//
//	raw   loops goroutines, each its own consumer of the group, in the
//	      loop Run uses (XREADGROUP ">" COUNT 16, then one XACK per entry,
//	      conc entries at a time) with no Deduplicator
//	idem  loops Consumer.Run loops (Concurrency conc) with a Deduplicator
//	      over redisstore.Open (the production store) on the same
//	      redis-server
//	idem-batch  idem with Consumer.Batch: one HandleBatch per read
//	raw-rueidis, idem-rueidis, idem-rueidis-batch: raw, idem and
//	      idem-batch with the consumers on rueidis (Consumer.Rueidis):
//	      one rueidis client set up as Open sets up its own, shared by the
//	      store (redisstore.NewRueidis) and the consumers
//
// Both run the trivial handler (count the message) over benchMsgs entries
// published, before the timer starts, to a fresh stream per iteration.
// b.N counts iterations of benchMsgs messages; run with -benchtime 1x.
// The clock stops when the handler has run for every entry; that every
// entry was then acknowledged is checked outside the timing. The idem
// modes report idem/raw, the ratio of their rate to raw's (the rueidis
// ones to raw-rueidis's) from the same process; every mode reports the
// redis-server's CPU time per message (INFO cpu, user + sys, over the
// timed part), and the test process's (consumers and client libraries,
// getrusage), so that a ratio can be read against the work each message
// costs on a machine whose cores they share. Every wait is bounded: a
// consumption that handles nothing for benchIdle or does not finish
// within benchLimit, or an acknowledgement or shutdown not done within
// benchStop, fails the benchmark, saying why (benchTarget.why).
//
// The server, broker and store at once, is the system's redis-server
// (Redis 7.0: the store's Lua path). $IDEM_BENCH_SERVERS
// (redisserver.BenchKinds) runs the whole benchmark on each server kind it
// lists instead, one sub-benchmark per kind, each on a private server of
// that kind started for it; the store's path is PathAuto, and the
// benchmark fails if the store did not take the path the kind calls for
// (native on Valkey 9.1 and Redis 8.6):
//
//	IDEM_BENCH_SERVERS=valkey-9.1,redis-8.6 go test -run '^$' -bench Consume -benchtime 1x ./idemmsg/redisstream/
func BenchmarkConsume(b *testing.B) {
	kinds, err := redisserver.BenchKinds()
	if err != nil {
		b.Fatal(err)
	}
	if kinds == nil {
		benchConsumeShapes(b, srv.Addr(), redisstore.PathLua)
		return
	}
	for _, kind := range kinds {
		b.Run(string(kind), func(b *testing.B) {
			s := srv
			if kind != redisserver.Redis7 {
				var err error
				if s, err = redisserver.StartServer(redisserver.WithKind(kind)); err != nil {
					b.Fatal(err)
				}
				defer s.Stop()
			}
			benchConsumeShapes(b, s.Addr(), benchPath[kind])
		})
	}
}

// benchPath is the path redisstore's PathAuto takes on each server kind.
var benchPath = map[redisserver.Kind]redisstore.Path{
	redisserver.Redis7:       redisstore.PathLua,
	redisserver.Valkey9:      redisstore.PathNative,
	redisserver.Redis8:       redisstore.PathNative,
	redisserver.Valkey9NoLua: redisstore.PathNative,
}

// benchConsumeShapes runs every mode in every shape on the server at
// addr, where the store must take path.
func benchConsumeShapes(b *testing.B, addr string, path redisstore.Path) {
	for _, shape := range benchShapes {
		b.Run(shape.String(), func(b *testing.B) {
			var rawRate float64
			for _, m := range []struct {
				name    string
				consume consumeFunc
			}{
				{"raw", consumeRaw},
				{"idem", consumeIdem(false)},
				{"idem-batch", consumeIdem(true)},
				{"raw-rueidis", consumeRawRueidis},
				{"idem-rueidis", consumeIdemRueidis(false)},
				{"idem-rueidis-batch", consumeIdemRueidis(true)},
			} {
				b.Run(m.name, func(b *testing.B) {
					rate := benchConsume(b, addr, path, shape, m.name, m.consume)
					if strings.HasPrefix(m.name, "raw") {
						rawRate = rate
					} else if rawRate > 0 {
						b.ReportMetric(rate/rawRate, "idem/raw")
					}
				})
			}
		})
	}
}

// benchTarget is one iteration's stream and group, already filled.
type benchTarget struct {
	shape         benchShape
	addr          string          // the server's address
	path          redisstore.Path // the path the store must take there
	client        *redis.Client
	stream, group string
	handled       atomic.Int64
	done          chan struct{} // closed when handled reaches benchMsgs

	mu     sync.Mutex
	errs   []string // the first errors the consumers reported
	nerrs  int
	failed bool // an error that invalidates the run (Run's own)
}

func (t *benchTarget) handle() {
	if t.handled.Add(1) == benchMsgs {
		close(t.done)
	}
}

// failure records an error of the consumers, for the failure message
// (an Errorf from a consumer's goroutine could come after the benchmark
// ended, and would say nothing of why it failed). Unless fatal, whether
// the run is still valid is for the checks after the timing to tell:
// every entry handled once and acknowledged.
func (t *benchTarget) failure(fatal bool, format string, args ...any) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.nerrs++
	t.failed = t.failed || fatal
	if len(t.errs) < 5 {
		t.errs = append(t.errs, fmt.Sprintf(format, args...))
	}
}

// why describes the consumers' errors and the group's state, for a
// failure message: handled entries, the group's pending entries (total
// and per consumer: entries read but never acknowledged, a read whose
// reply was lost among them), its lag (entries not yet read), and the
// first errors the consumers reported.
func (t *benchTarget) why() string {
	var b strings.Builder
	fmt.Fprintf(&b, "handled %d of %d", t.handled.Load(), benchMsgs)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if p, err := t.client.XPending(ctx, t.stream, t.group).Result(); err != nil {
		fmt.Fprintf(&b, "; XPENDING: %v", err)
	} else {
		fmt.Fprintf(&b, "; pending %d %v", p.Count, p.Consumers)
	}
	if groups, err := t.client.XInfoGroups(ctx, t.stream).Result(); err != nil {
		fmt.Fprintf(&b, "; XINFO GROUPS: %v", err)
	} else {
		for _, g := range groups {
			if g.Name == t.group {
				fmt.Fprintf(&b, "; lag %d, last delivered %s", g.Lag, g.LastDeliveredID)
			}
		}
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.nerrs == 0 {
		b.WriteString("; no error reported by the consumers")
	} else {
		fmt.Fprintf(&b, "; %d errors reported by the consumers, the first: %s", t.nerrs, strings.Join(t.errs, "; "))
	}
	return b.String()
}

// waitHandled waits until every entry was handled, and fails the
// benchmark, saying why, when that takes longer than benchLimit or the
// consumers handle nothing for benchIdle.
func (t *benchTarget) waitHandled(b *testing.B, mode string) {
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	limit := time.After(benchLimit)
	last, lastAt := t.handled.Load(), time.Now()
	for {
		select {
		case <-t.done:
			return
		case <-limit:
			b.Fatalf("%s: not every entry handled within %v: %s", mode, benchLimit, t.why())
		case now := <-tick.C:
			if n := t.handled.Load(); n != last {
				last, lastAt = n, now
			} else if now.Sub(lastAt) >= benchIdle {
				b.Fatalf("%s: no entry handled for %v: %s", mode, benchIdle, t.why())
			}
		}
	}
}

// consumeFunc prepares the consumers of t (untimed) and returns run,
// which consumes until ctx ends and returns once they all returned, and
// release, called after run returned.
type consumeFunc func(b *testing.B, t *benchTarget) (run func(ctx context.Context), release func())

func benchConsume(b *testing.B, addr string, path redisstore.Path, shape benchShape, mode string, consume consumeFunc) (rate float64) {
	c := redis.NewClient(&redis.Options{Addr: addr, PoolSize: shape.loops * (1 + shape.conc)})
	defer c.Close()
	var elapsed, cpu, ccpu time.Duration
	cpuOK := true
	// A failure stops the iteration's consumers (Fatalf does not wait
	// for them: they may be stuck); they report to t, not to b.
	stop := func() {}
	defer func() { stop() }()
	b.ResetTimer()
	b.StopTimer()
	for i := range b.N {
		t := &benchTarget{
			shape: shape, addr: addr, path: path, client: c, group: "g", done: make(chan struct{}),
			stream: fmt.Sprintf("bench:%s:%d:%d", mode, time.Now().UnixNano(), i),
		}
		benchPublish(b, t)
		run, release := consume(b, t)

		ctx, cancel := context.WithCancel(context.Background())
		stop = cancel
		stopped := make(chan struct{})
		cpu0, err := redisserver.CPUTime(ctx, c)
		if err != nil {
			b.Fatal(err)
		}
		ccpu0, ok := msgtest.ProcessCPU()
		cpuOK = cpuOK && ok
		start := time.Now()
		b.StartTimer()
		go func() { defer close(stopped); run(ctx) }()
		t.waitHandled(b, mode)
		b.StopTimer()
		elapsed += time.Since(start)
		ccpu1, _ := msgtest.ProcessCPU()
		ccpu += ccpu1 - ccpu0
		cpu1, err := redisserver.CPUTime(ctx, c)
		if err != nil {
			b.Fatal(err)
		}
		cpu += cpu1 - cpu0

		for deadline := time.Now().Add(benchStop); ; time.Sleep(10 * time.Millisecond) {
			p, err := c.XPending(context.Background(), t.stream, t.group).Result()
			if err == nil && p.Count == 0 {
				break
			}
			if time.Now().After(deadline) {
				b.Fatalf("%s: not every entry acknowledged within %v after the last was handled: %s", mode, benchStop, t.why())
			}
		}
		cancel()
		select {
		case <-stopped:
		case <-time.After(benchStop):
			b.Fatalf("%s: consumers did not stop within %v: %s", mode, benchStop, t.why())
		}
		release()
		if n := t.handled.Load(); n != benchMsgs {
			b.Fatalf("%s: handled %d entries, want %d: %s", mode, n, benchMsgs, t.why())
		}
		if t.failed {
			b.Fatalf("%s: %s", mode, t.why())
		}
		if t.nerrs > 0 {
			b.Logf("%s: the run recovered: %s", mode, t.why())
		}
		c.Del(context.Background(), t.stream)
	}
	rate = float64(b.N*benchMsgs) / elapsed.Seconds()
	b.ReportMetric(rate, "msgs/s")
	b.ReportMetric(float64(cpu.Microseconds())/float64(b.N*benchMsgs), "redis-cpu-µs/msg")
	if cpuOK {
		b.ReportMetric(float64(ccpu.Microseconds())/float64(b.N*benchMsgs), "client-cpu-µs/msg")
	}
	return rate
}

// benchPublish adds benchMsgs entries, field k holding a unique key, and
// creates the group at the start of the stream.
func benchPublish(b *testing.B, t *benchTarget) {
	ctx := context.Background()
	const batch = 1000
	for i := 0; i < benchMsgs; i += batch {
		_, err := t.client.Pipelined(ctx, func(p redis.Pipeliner) error {
			for j := i; j < min(i+batch, benchMsgs); j++ {
				p.XAdd(ctx, &redis.XAddArgs{Stream: t.stream, Values: []any{"k", fmt.Sprintf("%s-%d", t.stream, j)}})
			}
			return nil
		})
		if err != nil {
			b.Fatal(err)
		}
	}
	if err := t.client.XGroupCreate(ctx, t.stream, t.group, "0").Err(); err != nil {
		b.Fatal(err)
	}
}

// consumeRaw is Run's read loop without the Deduplicator.
func consumeRaw(b *testing.B, t *benchTarget) (run func(context.Context), release func()) {
	return func(ctx context.Context) { consumeRawRun(b, ctx, t) }, func() {}
}

func consumeRawRun(b *testing.B, ctx context.Context, t *benchTarget) {
	var wg sync.WaitGroup
	for n := range t.shape.loops {
		name := fmt.Sprintf("raw-%d", n)
		wg.Go(func() {
			for ctx.Err() == nil {
				res, err := t.client.XReadGroup(ctx, &redis.XReadGroupArgs{
					Group: t.group, Consumer: name, Streams: []string{t.stream, ">"},
					Count: DefaultCount, Block: benchBlock,
				}).Result()
				if errors.Is(err, redis.Nil) {
					continue
				}
				if err != nil {
					if ctx.Err() == nil {
						t.failure(false, "%s: XREADGROUP: %v", name, err)
						time.Sleep(benchBlock) // a pause before the next read, as Run's backoff
					}
					continue
				}
				pool := workpool.New(t.shape.conc)
				for _, s := range res {
					for _, msg := range s.Messages {
						pool.Go(func() {
							t.handle()
							actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), ackTimeout)
							if err := t.client.XAck(actx, t.stream, t.group, msg.ID).Err(); err != nil {
								t.failure(false, "%s: XACK: %v", name, err)
							}
							cancel()
						})
					}
				}
				pool.Wait()
			}
		})
	}
	wg.Wait()
}

// consumeIdem runs t.shape.loops Consumer.Run loops over one
// Deduplicator on redisstore.Open, with Consumer.Batch set to batch.
func consumeIdem(batch bool) consumeFunc {
	return func(b *testing.B, t *benchTarget) (func(context.Context), func()) {
		return consumeIdemGoredis(b, t, batch)
	}
}

func consumeIdemGoredis(b *testing.B, t *benchTarget, batch bool) (run func(context.Context), release func()) {
	store, err := redisstore.Open("redis://"+t.addr, redisstore.Options{Prefix: "idem:" + t.stream + ":"})
	if err != nil {
		b.Fatal(err)
	}
	d, err := idemmsg.New(store, idemmsg.Config{Namespace: t.stream + "/" + t.group})
	if err != nil {
		store.Close()
		b.Fatal(err)
	}
	return func(ctx context.Context) { consumeIdemRun(b, ctx, t, d, nil, batch) }, func() {
		checkPath(b, t, store)
		store.Close()
	}
}

// checkPath fails the benchmark if store did not take t.path.
func checkPath(b *testing.B, t *benchTarget, store *redisstore.Store) {
	if p := store.Path(); p != t.path {
		b.Errorf("the store took the %v path on %s, want %v", p, t.addr, t.path)
	}
}

// newBenchRueidis returns a rueidis client configured as redisstore.Open
// configures its own (20µs flush delay).
func newBenchRueidis(b *testing.B, addr string) rueidis.Client {
	ru, err := rueidis.NewClient(rueidis.ClientOption{
		InitAddress: []string{addr}, DisableCache: true, MaxFlushDelay: 20 * time.Microsecond,
	})
	if err != nil {
		b.Fatal(err)
	}
	return ru
}

// consumeRawRueidis is consumeRaw on rueidis.
func consumeRawRueidis(b *testing.B, t *benchTarget) (run func(context.Context), release func()) {
	ru := newBenchRueidis(b, t.addr)
	return func(ctx context.Context) {
		var wg sync.WaitGroup
		for n := range t.shape.loops {
			name := fmt.Sprintf("raw-%d", n)
			wg.Go(func() {
				for ctx.Err() == nil {
					cmd := ru.B().Xreadgroup().Group(t.group, name).Count(DefaultCount).Block(benchBlock.Milliseconds()).
						Streams().Key(t.stream).Id(">").Build()
					res, err := ru.Do(ctx, cmd).AsXRead()
					if rueidis.IsRedisNil(err) {
						continue
					}
					if err != nil {
						if ctx.Err() == nil {
							t.failure(false, "%s: XREADGROUP: %v", name, err)
							time.Sleep(benchBlock) // a pause before the next read, as Run's backoff
						}
						continue
					}
					pool := workpool.New(t.shape.conc)
					for _, entries := range res {
						for _, e := range entries {
							pool.Go(func() {
								t.handle()
								actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), ackTimeout)
								if err := ru.Do(actx, ru.B().Xack().Key(t.stream).Group(t.group).Id(e.ID).Build()).Error(); err != nil {
									t.failure(false, "%s: XACK: %v", name, err)
								}
								cancel()
							})
						}
					}
					pool.Wait()
				}
			})
		}
		wg.Wait()
	}, ru.Close
}

// consumeIdemRueidis is consumeIdem with the consumers on the store's
// rueidis client (no timeout per store call, as Open).
func consumeIdemRueidis(batch bool) consumeFunc {
	return func(b *testing.B, t *benchTarget) (func(context.Context), func()) {
		return consumeIdemOnRueidis(b, t, batch)
	}
}

func consumeIdemOnRueidis(b *testing.B, t *benchTarget, batch bool) (run func(context.Context), release func()) {
	ru := newBenchRueidis(b, t.addr)
	store, err := redisstore.NewRueidis(ru, redisstore.Options{Prefix: "idem:" + t.stream + ":", Timeout: -1})
	if err != nil {
		ru.Close()
		b.Fatal(err)
	}
	d, err := idemmsg.New(store, idemmsg.Config{Namespace: t.stream + "/" + t.group})
	if err != nil {
		ru.Close()
		b.Fatal(err)
	}
	return func(ctx context.Context) { consumeIdemRun(b, ctx, t, d, ru, batch) }, func() {
		checkPath(b, t, store)
		ru.Close()
	}
}

// consumeIdemRun runs the consumers on ru when set, else on t.client.
func consumeIdemRun(b *testing.B, ctx context.Context, t *benchTarget, d *idemmsg.Deduplicator, ru rueidis.Client, batch bool) {
	var wg sync.WaitGroup
	for n := range t.shape.loops {
		c := &Consumer{
			Stream: t.stream, Group: t.group, Consumer: fmt.Sprintf("idem-%d", n),
			Dedup: d, KeyField: "k", Block: benchBlock, Concurrency: t.shape.conc, Batch: batch,
			Handler: func(context.Context, redis.XMessage) error { t.handle(); return nil },
			OnError: func(err error) {
				if ctx.Err() == nil {
					t.failure(false, "consumer %d: %v", n, err)
				}
			},
		}
		if ru != nil {
			c.Rueidis = ru
		} else {
			c.Client = t.client
		}
		wg.Go(func() {
			if err := c.Run(ctx); err != nil {
				t.failure(true, "consumer %d: Run: %v", n, err)
			}
		})
	}
	wg.Wait()
}
