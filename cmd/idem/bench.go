package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/internal/redistest"
)

func init() {
	commands["bench"] = command{
		summary: "compare naive, WATCH, Lua and idem idempotency layers on Redis",
		run:     runBench,
	}
}

// benchScenario is one workload of idem bench.
type benchScenario struct {
	name, title string
	requests    int           // logical requests in a full run
	quick       int           // ... and with --quick
	clients     int           // closed-loop concurrency
	copies      int           // requests per key, consecutive in the plan (so sent together)
	sleep       time.Duration // the handler's work
	replay      float64       // > 0: warm requests/10 keys first, then this share repeats them
}

var benchScenarios = []benchScenario{
	{name: "a", title: "seed 000: 200 clients, 10 requests per key sent at once, handler sleeps 50 ms",
		requests: 20000, quick: 2000, clients: 200, copies: 10, sleep: 50 * time.Millisecond},
	{name: "b", title: "unique keys, no-op handler (pure overhead)",
		requests: 50000, quick: 5000, clients: 64, copies: 1},
	{name: "c", title: "hot keys: 200 clients on 10 keys at a time (20 requests each), handler sleeps 5 ms",
		requests: 20000, quick: 2000, clients: 200, copies: 20, sleep: 5 * time.Millisecond},
	{name: "d", title: "replay-heavy: keys completed once, then 95% repeats, 5% new keys, no-op handler",
		requests: 50000, quick: 5000, clients: 64, copies: 1, replay: 0.95},
}

// benchResult is one (implementation, scenario) measurement; the JSON
// output is a list of them.
type benchResult struct {
	Impl       string  `json:"impl"`
	Scenario   string  `json:"scenario"`
	Mode       string  `json:"mode"` // closed or open
	Clients    int     `json:"clients,omitempty"`
	Rate       float64 `json:"rate,omitempty"`
	Requests   int     `json:"requests"` // logical requests answered (a 409 retried is one request)
	Attempts   int     `json:"attempts"` // HTTP requests sent, retries included
	Keys       int     `json:"keys"`
	ElapsedS   float64 `json:"elapsed_s"`
	RPS        float64 `json:"rps"`
	P50ms      float64 `json:"p50_ms"`
	P95ms      float64 `json:"p95_ms"`
	P99ms      float64 `json:"p99_ms"`
	MaxMs      float64 `json:"max_ms"`
	Executions int     `json:"executions"` // handler executions during the measurement
	Duplicates int     `json:"duplicates"` // executions beyond the first per key
	// Statuses counts the final answers by status ("0" is a transport
	// error); Errors the non-2xx ones among them.
	Statuses  map[string]int `json:"statuses"`
	Errors    map[string]int `json:"errors"`
	Conflicts int            `json:"conflicts_409"` // 409 answers that were retried
	// Redis INFO deltas over the measurement, per logical request.
	// commandstats also counts the commands a script runs inside Redis,
	// so these are commands executed, not round trips.
	RedisCmdsPerReq  float64            `json:"redis_cmds_per_req"`
	RedisCmds        map[string]float64 `json:"redis_cmds"`
	RedisCPUusPerReq float64            `json:"redis_cpu_us_per_req"`
}

type benchOptions struct {
	redisURL   string
	impls      []string
	scenarios  []benchScenario
	quick      bool
	rate       float64
	duration   time.Duration
	requests   int
	clients    int
	retryPause time.Duration
	limit      float64
	jsonPath   string
	svgPath    string
}

func runBench(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	redisURL := fs.String("redis", "", "Redis `URL` to use (default: start a private redis-server on loopback, which needs redis-server on PATH)")
	impls := fs.String("impls", strings.Join(benchImpls, ","), "comma-separated `implementations` (none runs in scenario b only)")
	scen := fs.String("scenarios", "a,b,c,d", "comma-separated `scenarios`: a (seed 000), b (overhead), c (hot keys), d (replays)")
	quick := fs.Bool("quick", false, "every scenario at reduced size (a smoke check, under a minute)")
	rate := fs.Float64("rate", 0, "open loop: send at this fixed rate (`requests/s`), latency from the scheduled send time; 0: closed loop")
	duration := fs.Duration("duration", 0, "bound on each (implementation, scenario) run (default 60s, 10s with --quick)")
	requests := fs.Int("requests", 0, "logical requests per run (default per scenario: 20000, 50000, 20000, 50000; a tenth with --quick)")
	clients := fs.Int("clients", 0, "closed-loop concurrency for every scenario (default per scenario: 200, 64, 200, 64)")
	retryPause := fs.Duration("retry-pause", 10*time.Millisecond, "a client's pause before retrying a 409")
	limit := fs.Float64("physical-limit", 0, "redis-benchmark's pipelined EVALSHA acquire rate (`acquires/s`, from scripts/bench.sh), to report idem's scenario b against half of it")
	jsonPath := fs.String("json", "", "also write the results as JSON to `FILE`")
	svgPath := fs.String("svg", "", "also write charts as SVG to `FILE`")
	cpuProfile := fs.String("cpuprofile", "", "write a CPU profile of the whole run (load generator, servers and clients; not Redis) to `FILE`, for go tool pprof")
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), "usage: idem bench [--redis URL] [--impls LIST] [--scenarios LIST] [--quick] [--rate R] [--json FILE] [--svg FILE] [--cpuprofile FILE]")
		fs.PrintDefaults()
	}
	if err := parseFlags(fs, args, stderr); err != nil {
		return err
	}
	o := benchOptions{redisURL: *redisURL, quick: *quick, rate: *rate, duration: *duration,
		requests: *requests, clients: *clients, retryPause: *retryPause, limit: *limit,
		jsonPath: *jsonPath, svgPath: *svgPath}
	for _, name := range splitList(*impls) {
		if !slices.Contains(benchImpls, name) {
			return usageError{fmt.Sprintf("--impls: unknown implementation %q (have %s)", name, strings.Join(benchImpls, ", "))}
		}
		o.impls = append(o.impls, name)
	}
	for _, name := range splitList(*scen) {
		i := slices.IndexFunc(benchScenarios, func(s benchScenario) bool { return s.name == name })
		if i < 0 {
			return usageError{fmt.Sprintf("--scenarios: unknown scenario %q (have a, b, c, d)", name)}
		}
		o.scenarios = append(o.scenarios, benchScenarios[i])
	}
	switch {
	case len(o.impls) == 0 || len(o.scenarios) == 0:
		return usageError{"--impls and --scenarios must name at least one each"}
	case o.rate < 0 || o.requests < 0 || o.clients < 0 || o.duration < 0 || o.retryPause < 0 || o.limit < 0:
		return usageError{"--rate, --requests, --clients, --duration, --retry-pause and --physical-limit must not be negative"}
	}
	if o.duration == 0 {
		o.duration = 60 * time.Second
		if o.quick {
			o.duration = 10 * time.Second
		}
	}
	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	results, meta, err := benchAll(ctx, o, stderr)
	if err != nil {
		return err
	}
	writeMarkdown(stdout, results, meta, o)
	if o.jsonPath != "" {
		if err := writeJSONFile(o.jsonPath, results); err != nil {
			return err
		}
	}
	if o.svgPath != "" {
		if err := os.WriteFile(o.svgPath, []byte(renderSVG(results, meta)), 0o644); err != nil {
			return err
		}
	}
	return nil
}

func splitList(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}

// benchMeta describes the run for the report.
type benchMeta struct {
	Date         string
	Redis        string // version and where
	Procs        int
	Quick        bool
	Rate         float64
	RetryPause   time.Duration
	Scenarios    []benchScenario
	PrivateRedis bool
}

// benchAll runs every (scenario, implementation) pair, scenario by
// scenario so that the implementations of one scenario run close in time.
func benchAll(ctx context.Context, o benchOptions, stderr io.Writer) ([]benchResult, benchMeta, error) {
	meta := benchMeta{Date: time.Now().UTC().Format("2006-01-02 15:04 MST"), Procs: runtime.GOMAXPROCS(0),
		Quick: o.quick, Rate: o.rate, RetryPause: o.retryPause, Scenarios: o.scenarios}
	url := o.redisURL
	if url == "" {
		srv, err := redistest.StartServer()
		if err != nil {
			return nil, meta, fmt.Errorf("no --redis URL given, and starting a private redis-server failed: %w", err)
		}
		defer srv.Stop()
		url = "redis://" + srv.Addr()
		meta.PrivateRedis = true
	}
	admin, err := newGoredis(url)
	if err != nil {
		return nil, meta, err
	}
	defer admin.Close()
	info, err := admin.Info(ctx, "server").Result()
	if err != nil {
		return nil, meta, fmt.Errorf("redis at %s: %w", url, err)
	}
	v, _ := redistest.InfoField(info, "redis_version")
	meta.Redis = "redis-server " + v
	if meta.PrivateRedis {
		meta.Redis += " (private, started by idem bench)"
	}
	runID := strconv.FormatUint(rand.Uint64()>>32, 36)
	logger := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	var results []benchResult
	for _, sc := range o.scenarios {
		for _, impl := range o.impls {
			if impl == "none" && sc.name != "b" {
				continue
			}
			if err := ctx.Err(); err != nil {
				return nil, meta, err
			}
			if meta.PrivateRedis {
				if err := admin.FlushAll(ctx).Err(); err != nil {
					return nil, meta, err
				}
			}
			r, err := benchOne(ctx, o, sc, impl, url, runID, admin, logger)
			if err != nil {
				return nil, meta, fmt.Errorf("%s, scenario %s: %w", impl, sc.name, err)
			}
			fmt.Fprintf(stderr, "idem bench: %-12s scenario %s: %7d requests, %8.0f req/s, p99 %7.2f ms, %d duplicates\n",
				impl, sc.name, r.Requests, r.RPS, r.P99ms, r.Duplicates)
			results = append(results, r)
		}
	}
	return results, meta, nil
}

// benchPlan is the key of every logical request, and the keys completed
// before the measurement.
type benchPlan struct {
	keys, warm []string
	distinct   int
}

func makePlan(sc benchScenario, n int, prefix string) benchPlan {
	var p benchPlan
	if sc.replay > 0 {
		rng := rand.New(rand.NewPCG(42, 7)) // the same plan for every implementation
		p.warm = make([]string, max(1, n/10))
		for i := range p.warm {
			p.warm[i] = prefix + "w" + strconv.Itoa(i)
		}
		seen := map[string]bool{}
		for i := range n {
			k := prefix + "n" + strconv.Itoa(i)
			if rng.Float64() < sc.replay {
				k = p.warm[rng.IntN(len(p.warm))]
			}
			p.keys = append(p.keys, k)
			seen[k] = true
		}
		p.distinct = len(seen)
		return p
	}
	copies := max(1, sc.copies)
	for i := range n {
		p.keys = append(p.keys, prefix+strconv.Itoa(i/copies))
	}
	p.distinct = (n + copies - 1) / copies
	return p
}

const warmupKey = "bench-warmup"

func benchOne(ctx context.Context, o benchOptions, sc benchScenario, impl, url, runID string, admin *redis.Client, logger *slog.Logger) (benchResult, error) {
	r := benchResult{Impl: impl, Scenario: sc.name, Mode: "closed"}
	n := sc.requests
	if o.quick {
		n = sc.quick
	}
	if o.requests > 0 {
		n = o.requests
	}
	clients := sc.clients
	if o.clients > 0 {
		clients = o.clients
	}
	plan := makePlan(sc, n, fmt.Sprintf("%s-%s-%s-", runID, impl, sc.name))
	r.Keys = plan.distinct

	app := newBenchApp(sc.sleep)
	layer, err := buildLayer(ctx, impl, url, app, logger)
	if err != nil {
		return r, err
	}
	defer layer.close()
	ln, err := net.Listen("tcp", "127.0.0.1:0") // loopback only
	if err != nil {
		return r, err
	}
	srv := &http.Server{Handler: layer.handler, ReadHeaderTimeout: 10 * time.Second,
		ErrorLog: slog.NewLogLogger(logger.Handler(), slog.LevelWarn)}
	go func() { _ = srv.Serve(ln) }()
	defer srv.Close()
	client := newBenchClient(max(clients, 256))
	defer client.CloseIdleConnections()
	spec := loadSpec{url: "http://" + ln.Addr().String() + "/payments", clients: clients,
		deadline: time.Now().Add(o.duration), retryPause: o.retryPause}

	// Warm up outside the measurement: connections, scripts, and for
	// scenario d the keys to be replayed.
	if st := post(ctx, client, spec.url, runID+warmupKey); st/100 != 2 {
		return r, fmt.Errorf("warm-up request got status %d (is Redis reachable?)", st)
	}
	if len(plan.warm) > 0 {
		w := spec
		w.keys = plan.warm
		runLoad(ctx, client, w)
	}
	before := app.counts()
	sb, err := redisSnapshot(ctx, admin)
	if err != nil {
		return r, err
	}

	spec.keys = plan.keys
	spec.deadline = time.Now().Add(o.duration)
	if o.rate > 0 {
		spec.rate = o.rate
		r.Mode, r.Rate = "open", o.rate
	} else {
		r.Clients = clients
	}
	lr := runLoad(ctx, client, spec)

	sa, err := redisSnapshot(ctx, admin)
	if err != nil {
		return r, err
	}
	after := app.counts()
	summarize(&r, lr)
	for k, c := range after {
		if k == runID+warmupKey {
			continue
		}
		r.Executions += c - before[k]
		r.Duplicates += max(0, c-1)
	}
	if r.Requests > 0 {
		per := 1 / float64(r.Requests)
		r.RedisCmds = map[string]float64{}
		for name, c := range sa.cmds {
			if d := c - sb.cmds[name]; d > 0 {
				r.RedisCmds[name] = float64(d) * per
				r.RedisCmdsPerReq += float64(d) * per
			}
		}
		r.RedisCPUusPerReq = (sa.cpu - sb.cpu) * 1e6 * per
	}
	return r, nil
}

// summarize fills the latency, rate and status fields from a load result.
func summarize(r *benchResult, lr loadResult) {
	var lats []time.Duration
	r.Statuses, r.Errors = map[string]int{}, map[string]int{}
	for _, s := range lr.samples {
		if !s.done {
			continue
		}
		r.Requests++
		r.Attempts += s.tries
		r.Conflicts += s.tries - 1 // every retry followed a 409
		lats = append(lats, s.lat)
		st := strconv.Itoa(s.status)
		r.Statuses[st]++
		if s.status/100 != 2 {
			r.Errors[st]++
		}
	}
	r.ElapsedS = lr.elapsed.Seconds()
	if r.ElapsedS > 0 {
		r.RPS = float64(r.Requests) / r.ElapsedS
	}
	slices.Sort(lats)
	ms := func(q float64) float64 {
		if len(lats) == 0 {
			return 0
		}
		i := int(q*float64(len(lats))+0.999999) - 1 // nearest rank
		return float64(lats[min(max(i, 0), len(lats)-1)]) / float64(time.Millisecond)
	}
	r.P50ms, r.P95ms, r.P99ms, r.MaxMs = ms(0.50), ms(0.95), ms(0.99), ms(1)
}

// redisStats is a snapshot of the server's counters.
type redisStats struct {
	cmds map[string]int64 // calls per command, the bench's own commands left out
	cpu  float64          // used_cpu_sys + used_cpu_user, seconds
}

// harnessCommand reports commands the bench itself or client connection
// set-up sends, which are not the implementations' work.
func harnessCommand(name string) bool {
	switch name {
	case "info", "hello", "ping", "select", "flushall", "flushdb", "auth", "readonly":
		return true
	}
	for _, p := range []string{"client|", "config|", "command|", "script|", "cluster|"} {
		if strings.HasPrefix(name, p) {
			return true
		}
	}
	return false
}

func redisSnapshot(ctx context.Context, admin *redis.Client) (redisStats, error) {
	info, err := admin.Info(ctx, "commandstats", "cpu").Result()
	if err != nil {
		return redisStats{}, fmt.Errorf("INFO: %w", err)
	}
	s := redisStats{cmds: map[string]int64{}}
	for line := range strings.Lines(info) {
		line = strings.TrimSpace(line)
		if rest, ok := strings.CutPrefix(line, "cmdstat_"); ok {
			name, fields, _ := strings.Cut(rest, ":")
			if harnessCommand(name) {
				continue
			}
			for f := range strings.SplitSeq(fields, ",") {
				if v, ok := strings.CutPrefix(f, "calls="); ok {
					n, _ := strconv.ParseInt(v, 10, 64)
					s.cmds[name] = n
				}
			}
			continue
		}
		for _, f := range []string{"used_cpu_sys:", "used_cpu_user:"} {
			if v, ok := strings.CutPrefix(line, f); ok {
				x, _ := strconv.ParseFloat(v, 64)
				s.cpu += x
			}
		}
	}
	return s, nil
}
