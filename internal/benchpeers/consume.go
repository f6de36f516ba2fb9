package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmredis "github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/redis/go-redis/v9"
	"github.com/redis/rueidis"

	"github.com/idemkit/idem/idemmsg"
	"github.com/idemkit/idem/idemmsg/redisstream"
	"github.com/idemkit/idem/internal/bench"
	"github.com/idemkit/idem/internal/redisserver"
	"github.com/idemkit/idem/redisstore"
)

// consume puts watermill's Deduplicator middleware beside idem's Redis
// Streams consumer, on one private redis-server, over the same entries
// (BENCHMARKS.md, "Message consumers"):
//
//   - watermill: watermill's router with watermill-redisstream's
//     subscriber, no deduplication: the raw rate of that stack;
//   - watermill-dedup: the same with middleware.Deduplicator as router
//     middleware, keyed by the message UUID (its default key is an
//     Adler-32 of the payload) and its default repository, an in-memory
//     map per process with a one-minute window;
//   - idem: idemmsg/redisstream.Consumer loops on a go-redis client, over
//     one idemmsg.Deduplicator on redisstore.Open (rueidis), keyed by the
//     same UUID (field _watermill_message_uuid);
//   - idem-rueidis: the same with the consumers on one rueidis client
//     shared with the store (Consumer.Rueidis, redisstore.NewRueidis).
//
// Each consumer (one per watermill subscriber, one per idem Run loop)
// handles one message at a time; 16 consumers in all. Entries are
// published in watermill's format (its marshaller), pipelined, before the
// clock starts. Two runs:
//
//   - speed: one process, N unique messages, nothing fails;
//   - correctness: the consumers split over two processes (two routers,
//     two Deduplicators with their own clients; 8 consumers each), every
//     tenth message published again 50 entries later (a producer's retry),
//     and the handler failing once, before its effect, for 1 message in
//     100 (a transient error: the broker redelivers it).
//
// The clock runs until the group has read every entry and none is
// pending. Then the ledger of effects gives duplicates (effects beyond the
// first per message) and lost messages (no effect at all).
func runConsume(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("consume", flag.ContinueOnError)
	fs.SetOutput(stderr)
	redisURL := fs.String("redis", "", "Redis `URL` (default: a private redis-server on loopback)")
	n := fs.Int("messages", 20000, "unique messages per run")
	quick := fs.Bool("quick", false, "2,000 messages per run")
	impls := fs.String("impls", strings.Join(consumerNames(), ","), "comma-separated `implementations`")
	runs := fs.String("runs", "speed,correctness", "comma-separated `runs`: speed, correctness")
	limit := fs.Duration("limit", 2*time.Minute, "bound on one run's consumption")
	if err := parse(fs, args); err != nil {
		return err
	}
	if *quick {
		*n = 2000
	}
	if *n < 100 {
		return bench.UsageError{Msg: "--messages must be at least 100"}
	}
	var sel []consumerImpl
	for _, name := range strings.Split(*impls, ",") {
		i := indexConsumer(strings.TrimSpace(name))
		if i < 0 {
			return bench.UsageError{Msg: fmt.Sprintf("--impls: unknown implementation %q (have %s)", name, strings.Join(consumerNames(), ", "))}
		}
		sel = append(sel, consumerImpls[i])
	}
	var shapes []consumeRun
	for _, name := range strings.Split(*runs, ",") {
		switch strings.TrimSpace(name) {
		case "speed":
			shapes = append(shapes, speedRun)
		case "correctness":
			shapes = append(shapes, correctnessRun)
		default:
			return bench.UsageError{Msg: fmt.Sprintf("--runs: unknown run %q (have speed, correctness)", name)}
		}
	}

	results, version, err := consumeAll(ctx, *redisURL, sel, shapes, *n, *limit, stderr)
	if err != nil {
		return err
	}
	writeConsume(stdout, results, version, *n)
	return nil
}

// consumeAll runs every (run, implementation) pair on Redis at url, or on
// a private redis-server when url is empty; it returns the results and
// the server's version.
func consumeAll(ctx context.Context, url string, sel []consumerImpl, shapes []consumeRun, n int, limit time.Duration, stderr io.Writer) ([]consumeResult, string, error) {
	if url == "" {
		srv, err := redisserver.StartServer()
		if err != nil {
			return nil, "", fmt.Errorf("no --redis URL given, and starting a private redis-server failed: %w", err)
		}
		defer srv.Stop()
		url = "redis://" + srv.Addr()
	}
	admin, err := bench.NewGoredis(url)
	if err != nil {
		return nil, "", err
	}
	defer admin.Close()
	info, err := admin.Info(ctx, "server").Result()
	if err != nil {
		return nil, "", fmt.Errorf("redis at %s: %w", url, err)
	}
	version, _ := redisserver.InfoField(info, "redis_version")
	var results []consumeResult
	for _, run := range shapes {
		for _, impl := range sel {
			r, err := consumeOne(ctx, url, admin, run, impl, n, limit)
			if err != nil {
				return nil, version, fmt.Errorf("%s, %s: %w", impl.name, run.name, err)
			}
			fmt.Fprintf(stderr, "consume: %-16s %-11s %6d entries, %7.0f msgs/s, %d duplicates, %d lost\n",
				impl.name, run.name, r.Entries, r.Rate, r.Duplicates, r.Lost)
			results = append(results, r)
		}
	}
	return results, version, nil
}

// consumeRun is one of the two runs.
type consumeRun struct {
	name      string
	procs     int // processes: each its own router / Deduplicator and clients
	dupEvery  int // > 0: every dupEvery-th message is published again ...
	dupLag    int // ... this many entries after the original
	failEvery int // > 0: every failEvery-th message fails on its first attempt
}

var (
	speedRun       = consumeRun{name: "speed", procs: 1}
	correctnessRun = consumeRun{name: "correctness", procs: 2, dupEvery: 10, dupLag: 50, failEvery: 100}
)

// consumers is how many consumers (subscribers, Run loops) run in all.
const consumers = 16

type consumeResult struct {
	Impl, Run       string
	Procs, Entries  int
	Messages        int
	ElapsedS, Rate  float64
	Effects         int
	Duplicates      int
	Lost            int
	Pending         int64
	RedisCPUusPerEn float64
}

// ledger counts each message's effects and attempts.
type ledger struct {
	mu        sync.Mutex
	attempts  map[string]int
	effects   map[string]int
	failEvery int
}

var errTransient = errors.New("transient failure (simulated)")

// handle is the message handler: the first attempt of every failEvery-th
// message fails before its effect; otherwise the effect is recorded.
func (l *ledger) handle(key string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.attempts[key]++
	if l.failEvery > 0 && l.attempts[key] == 1 && msgIndex(key)%l.failEvery == 0 {
		return errTransient
	}
	l.effects[key]++
	return nil
}

// msgIndex is the message's number, the last part of its key.
func msgIndex(key string) int {
	i, _ := strconv.Atoi(key[strings.LastIndexByte(key, '-')+1:])
	return i
}

// consumerImpl starts one process's consumers of t: n of them, until ctx
// ends; stop waits for them and releases their clients.
type consumerImpl struct {
	name  string
	start func(ctx context.Context, t *consumeTarget, proc, n int) (stop func() error, err error)
}

var consumerImpls = []consumerImpl{
	{"watermill", func(ctx context.Context, t *consumeTarget, proc, n int) (func() error, error) {
		return startWatermill(ctx, t, proc, n, false)
	}},
	{"watermill-dedup", func(ctx context.Context, t *consumeTarget, proc, n int) (func() error, error) {
		return startWatermill(ctx, t, proc, n, true)
	}},
	{"idem", func(ctx context.Context, t *consumeTarget, proc, n int) (func() error, error) {
		return startIdem(ctx, t, proc, n, false)
	}},
	{"idem-rueidis", func(ctx context.Context, t *consumeTarget, proc, n int) (func() error, error) {
		return startIdem(ctx, t, proc, n, true)
	}},
}

func consumerNames() []string {
	var out []string
	for _, c := range consumerImpls {
		out = append(out, c.name)
	}
	return out
}

func indexConsumer(name string) int {
	for i, c := range consumerImpls {
		if c.name == name {
			return i
		}
	}
	return -1
}

// consumeTarget is one run's stream, already filled.
type consumeTarget struct {
	url, stream, group string
	ledger             *ledger
	errs               chan error // consumer errors, reported after the run
}

func (t *consumeTarget) report(err error) {
	select {
	case t.errs <- err:
	default:
	}
}

func consumeOne(ctx context.Context, url string, admin *redis.Client, run consumeRun, impl consumerImpl, n int, limit time.Duration) (consumeResult, error) {
	r := consumeResult{Impl: impl.name, Run: run.name, Procs: run.procs, Messages: n}
	t := &consumeTarget{url: url, group: "g", errs: make(chan error, 16),
		stream: fmt.Sprintf("consume:%s:%s:%x", impl.name, run.name, rand.Uint32()),
		ledger: &ledger{attempts: map[string]int{}, effects: map[string]int{}, failEvery: run.failEvery}}
	entries, err := publish(ctx, admin, t, n, run)
	if err != nil {
		return r, err
	}
	r.Entries = entries
	defer admin.Del(context.WithoutCancel(ctx), t.stream)

	cpu0, err := redisCPU(ctx, admin)
	if err != nil {
		return r, err
	}
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var stops []func() error
	start := time.Now()
	for p := range run.procs {
		stop, err := impl.start(cctx, t, p, consumers/run.procs)
		if err != nil {
			cancel()
			for _, s := range stops {
				_ = s()
			}
			return r, err
		}
		stops = append(stops, stop)
	}
	// Done when the group has read every entry and none is pending.
	deadline := start.Add(limit)
	for {
		done, pending, err := settled(ctx, admin, t)
		if err != nil {
			return r, err
		}
		if done {
			break
		}
		if time.Now().After(deadline) {
			r.Pending = pending
			break
		}
		time.Sleep(2 * time.Millisecond)
	}
	elapsed := time.Since(start)
	cpu1, err := redisCPU(ctx, admin)
	if err != nil {
		return r, err
	}
	cancel()
	stopped := make(chan error, 1)
	go func() {
		var errs []error
		for _, s := range stops {
			errs = append(errs, s())
		}
		stopped <- errors.Join(errs...)
	}()
	select {
	case err := <-stopped:
		if err != nil {
			return r, fmt.Errorf("stopping the consumers: %w", err)
		}
	case <-time.After(15 * time.Second):
		return r, errors.New("the consumers did not stop within 15s")
	}
	select {
	case err := <-t.errs:
		return r, fmt.Errorf("a consumer reported: %w", err)
	default:
	}
	if r.Pending > 0 {
		return r, fmt.Errorf("%d entries still pending or unread after %v", r.Pending, limit)
	}

	r.ElapsedS = elapsed.Seconds()
	r.Rate = float64(entries) / r.ElapsedS
	r.RedisCPUusPerEn = (cpu1 - cpu0) * 1e6 / float64(entries)
	t.ledger.mu.Lock()
	defer t.ledger.mu.Unlock()
	for i := range n {
		c := t.ledger.effects[msgKey(t, i)]
		r.Effects += c
		r.Duplicates += max(0, c-1)
		if c == 0 {
			r.Lost++
		}
	}
	return r, nil
}

func msgKey(t *consumeTarget, i int) string { return t.stream + "-" + strconv.Itoa(i) }

// publish adds the run's entries in watermill's format: message i with
// UUID msgKey(i), and its copy dupLag entries later for every dupEvery-th
// message. It creates the group at the start of the stream and returns the
// number of entries.
func publish(ctx context.Context, rdb *redis.Client, t *consumeTarget, n int, run consumeRun) (int, error) {
	var order []int
	for i := range n {
		order = append(order, i)
		if run.dupEvery > 0 && i >= run.dupLag && (i-run.dupLag)%run.dupEvery == 0 {
			order = append(order, i-run.dupLag)
		}
	}
	var m wmredis.DefaultMarshallerUnmarshaller
	const batch = 1000
	for lo := 0; lo < len(order); lo += batch {
		_, err := rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			for _, i := range order[lo:min(lo+batch, len(order))] {
				msg := message.NewMessage(msgKey(t, i), []byte(`{"amount":1000,"currency":"EUR","order":`+strconv.Itoa(i)+`}`))
				values, err := m.Marshal(t.stream, msg)
				if err != nil {
					return err
				}
				p.XAdd(ctx, &redis.XAddArgs{Stream: t.stream, Values: values})
			}
			return nil
		})
		if err != nil {
			return 0, err
		}
	}
	if err := rdb.XGroupCreate(ctx, t.stream, t.group, "0").Err(); err != nil {
		return 0, err
	}
	return len(order), nil
}

// settled reports whether the group has read every entry and has none
// pending, and how many are pending or unread.
func settled(ctx context.Context, rdb *redis.Client, t *consumeTarget) (bool, int64, error) {
	groups, err := rdb.XInfoGroups(ctx, t.stream).Result()
	if err != nil {
		return false, 0, err
	}
	for _, g := range groups {
		if g.Name == t.group {
			return g.Pending == 0 && g.Lag == 0, g.Pending + max(g.Lag, 0), nil
		}
	}
	return false, 0, fmt.Errorf("group %s not found", t.group)
}

func redisCPU(ctx context.Context, rdb *redis.Client) (float64, error) {
	info, err := rdb.Info(ctx, "cpu").Result()
	if err != nil {
		return 0, err
	}
	var s float64
	for _, f := range []string{"used_cpu_sys", "used_cpu_user"} {
		v, _ := redisserver.InfoField(info, f)
		x, _ := strconv.ParseFloat(v, 64)
		s += x
	}
	return s, nil
}

// startWatermill runs one process's watermill router: n subscribers of the
// group, each with its own handler, on one go-redis client; with dedup,
// the Deduplicator as router middleware.
func startWatermill(ctx context.Context, t *consumeTarget, proc, n int, dedup bool) (func() error, error) {
	rdb, err := bench.NewGoredis(t.url)
	if err != nil {
		return nil, err
	}
	logger := watermill.NopLogger{}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		rdb.Close()
		return nil, err
	}
	if dedup {
		// Every field set: with one left nil, Middleware fills it in for
		// each handler as the router starts them concurrently, a data
		// race in watermill 1.5.1 (found by -race here), and with
		// Repository nil two handlers may each get their own map.
		repo, err := middleware.NewMapExpiringKeyRepository(time.Minute) // its default
		if err != nil {
			rdb.Close()
			return nil, err
		}
		d := &middleware.Deduplicator{
			KeyFactory: func(m *message.Message) (string, error) { return m.UUID, nil },
			Repository: repo,
			Timeout:    time.Minute, // its default
		}
		router.AddMiddleware(d.Middleware)
	}
	for i := range n {
		sub, err := wmredis.NewSubscriber(wmredis.SubscriberConfig{
			Client: rdb, ConsumerGroup: t.group, Consumer: fmt.Sprintf("wm-%d-%d", proc, i),
			DisableIndefiniteInitialBlock: true,
		}, logger)
		if err != nil {
			rdb.Close()
			return nil, err
		}
		router.AddConsumerHandler(fmt.Sprintf("h-%d", i), t.stream, sub, func(msg *message.Message) error {
			return t.ledger.handle(msg.UUID)
		})
	}
	runErr := make(chan error, 1)
	go func() { runErr <- router.Run(ctx) }()
	select {
	case <-router.Running():
	case err := <-runErr:
		rdb.Close()
		return nil, fmt.Errorf("watermill router: %w", err)
	case <-time.After(10 * time.Second):
		_ = router.Close()
		rdb.Close()
		return nil, errors.New("watermill router did not start within 10s")
	}
	return func() error {
		err := router.Close()
		if e := <-runErr; err == nil {
			err = e
		}
		rdb.Close()
		return err
	}, nil
}

// idemMinIdle is how long a failed (or in-flight) entry stays pending
// before XAUTOCLAIM hands it out again, for idem's consumers: short, so
// that the correctness run's redeliveries come within a second (the
// default is the lease, 30s).
const idemMinIdle = time.Second

// startIdem runs one process's idem consumers: n Run loops over one
// Deduplicator on its own store.
func startIdem(ctx context.Context, t *consumeTarget, proc, n int, onRueidis bool) (func() error, error) {
	var (
		store   *redisstore.Store
		ru      rueidis.Client
		rdb     *redis.Client
		release func()
		err     error
	)
	opts := redisstore.Options{Prefix: "idem:" + t.stream + ":"}
	if onRueidis {
		addr := strings.TrimPrefix(t.url, "redis://")
		ru, err = rueidis.NewClient(rueidis.ClientOption{InitAddress: []string{addr}, DisableCache: true, MaxFlushDelay: 20 * time.Microsecond})
		if err != nil {
			return nil, err
		}
		opts.Timeout = -1
		store, err = redisstore.NewRueidis(ru, opts)
		release = ru.Close
	} else {
		store, err = redisstore.Open(t.url, opts)
		if err == nil {
			rdb, err = bench.NewGoredis(t.url)
		}
		release = func() {
			if rdb != nil {
				rdb.Close()
			}
			if store != nil {
				store.Close()
			}
		}
	}
	if err != nil {
		release()
		return nil, err
	}
	d, err := idemmsg.New(store, idemmsg.Config{Namespace: t.stream + "/" + t.group})
	if err != nil {
		release()
		return nil, err
	}
	var wg sync.WaitGroup
	for i := range n {
		c := &redisstream.Consumer{
			Stream: t.stream, Group: t.group, Consumer: fmt.Sprintf("idem-%d-%d", proc, i),
			Dedup: d, KeyField: wmredis.UUIDHeaderKey, MinIdle: idemMinIdle,
			Handler: func(_ context.Context, msg redis.XMessage) error {
				key, _ := msg.Values[wmredis.UUIDHeaderKey].(string)
				return t.ledger.handle(key)
			},
			OnError: func(err error) {
				if ctx.Err() == nil {
					t.report(err)
				}
			},
		}
		if onRueidis {
			c.Rueidis = ru
		} else {
			c.Client = rdb
		}
		wg.Go(func() {
			if err := c.Run(ctx); err != nil {
				t.report(err)
			}
		})
	}
	return func() error { wg.Wait(); release(); return nil }, nil
}

func writeConsume(w io.Writer, rs []consumeResult, version string, n int) {
	fmt.Fprintf(w, "## Consumers: watermill's Deduplicator beside idem, %s\n\n", time.Now().UTC().Format("2006-01-02 15:04 MST"))
	fmt.Fprintf(w, "redis-server %s; Redis Streams, one consumer group, %d consumers each handling one message at a time; %s unique messages per run.\n\n",
		version, consumers, thousandsInt(n))
	fmt.Fprintln(w, "| run | implementation | processes | entries | msgs/s | effects | duplicates | lost | Redis CPU µs/entry |")
	fmt.Fprintln(w, "|---|---|---:|---:|---:|---:|---:|---:|---:|")
	for _, r := range rs {
		fmt.Fprintf(w, "| %s | %s | %d | %s | %s | %s | %s | %s | %.1f |\n", r.Run, r.Impl, r.Procs, thousandsInt(r.Entries),
			thousandsInt(int(r.Rate+0.5)), thousandsInt(r.Effects), thousandsInt(r.Duplicates), thousandsInt(r.Lost), r.RedisCPUusPerEn)
	}
	fmt.Fprintln(w, "\nspeed: one process, unique messages, no failure. correctness: two processes (8 consumers each), every tenth")
	fmt.Fprintln(w, "message published again 50 entries later, and 1 message in 100 failing once before its effect. msgs/s counts")
	fmt.Fprintln(w, "entries until the group has read all and has none pending; for idem that includes waiting out the redelivery of")
	fmt.Fprintln(w, "the failed ones (MinIdle 1s). Effects: handler runs that succeeded; duplicates: effects beyond the first per")
	fmt.Fprintln(w, "message; lost: messages with no effect.")
}

func thousandsInt(n int) string {
	s := strconv.Itoa(n)
	var b strings.Builder
	for i, c := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(c)
	}
	return b.String()
}
