// Package bench is the harness of idem bench: the same net/http handler
// behind several idempotency layers on one Redis, measured side by side in
// four scenarios (BENCHMARKS.md, "idem bench").
//
// cmd/idem wires it as the bench command with the built-in implementations
// ([Builtin]); internal/benchpeers, a module of its own so that the
// library's users never download the peers' dependencies, runs the same
// harness with the Go ecosystem's idempotency libraries added as
// implementations ([Impl]).
package bench

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math"
	"math/rand/v2"
	"net"
	"os"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/internal/redisserver"
)

// Scenario is one workload of idem bench.
type Scenario struct {
	Name, Title string
	Requests    int           // logical requests in a full run
	Quick       int           // ... and with --quick
	Clients     int           // closed-loop concurrency
	Copies      int           // requests per key, consecutive in the plan (so sent together)
	Sleep       time.Duration // the handler's work
	Replay      float64       // > 0: warm requests/10 keys first, then this share repeats them
}

// Scenarios are idem bench's four workloads, (a) to (d).
var Scenarios = []Scenario{
	{Name: "a", Title: "retry storm: 200 clients, 10 copies of each request sent at once, handler sleeps 50 ms",
		Requests: 20000, Quick: 2000, Clients: 200, Copies: 10, Sleep: 50 * time.Millisecond},
	{Name: "b", Title: "unique keys, no-op handler (pure overhead)",
		Requests: 50000, Quick: 5000, Clients: 64, Copies: 1},
	{Name: "c", Title: "hot keys: 200 clients on 10 keys at a time (20 requests each), handler sleeps 5 ms",
		Requests: 20000, Quick: 2000, Clients: 200, Copies: 20, Sleep: 5 * time.Millisecond},
	{Name: "d", Title: "replay-heavy: keys completed once, then 95% repeats, 5% new keys, no-op handler",
		Requests: 50000, Quick: 5000, Clients: 64, Copies: 1, Replay: 0.95},
}

// Result is one (implementation, scenario) measurement; the JSON output is
// a list of them.
type Result struct {
	Impl      string  `json:"impl"`
	Scenario  string  `json:"scenario"`
	Mode      string  `json:"mode"` // closed or open
	Clients   int     `json:"clients,omitempty"`
	Rate      float64 `json:"rate,omitempty"`
	Instances int     `json:"instances,omitempty"` // server instances behind the load generator, when more than one
	Requests  int     `json:"requests"`            // logical requests answered (a 409 retried is one request)
	Attempts  int     `json:"attempts"`            // HTTP requests sent, retries included
	Keys      int     `json:"keys"`
	ElapsedS  float64 `json:"elapsed_s"`
	RPS       float64 `json:"rps"`
	P50ms     float64 `json:"p50_ms"`
	P95ms     float64 `json:"p95_ms"`
	P99ms     float64 `json:"p99_ms"`
	MaxMs     float64 `json:"max_ms"`
	// Executions counts the handler's runs during the measurement;
	// Duplicates the runs beyond the first per key.
	Executions int `json:"executions"`
	Duplicates int `json:"duplicates"`
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

	// With --rounds N > 1, every number above is the median of the N
	// rounds' (per field; the median of an even count is the mean of the
	// two middle ones), except Statuses, Errors and Conflicts, which are
	// summed over the rounds. The spread of the throughput, of the p99 and
	// of the duplicates is the lowest and highest round; PerRound holds
	// each round's own Result, in the order the rounds ran. With one
	// round these fields are left out.
	Rounds        int      `json:"rounds,omitempty"`
	RPSMin        float64  `json:"rps_min,omitempty"`
	RPSMax        float64  `json:"rps_max,omitempty"`
	P99MinMs      float64  `json:"p99_min_ms,omitempty"`
	P99MaxMs      float64  `json:"p99_max_ms,omitempty"`
	DuplicatesMax int      `json:"duplicates_max,omitempty"`
	PerRound      []Result `json:"per_round,omitempty"`
}

// Options is one run of idem bench.
type Options struct {
	RedisURL   string
	Impls      []Impl // in report order
	Scenarios  []Scenario
	Quick      bool
	Rate       float64
	Duration   time.Duration
	Requests   int
	Clients    int
	Instances  int // server instances per implementation (default 1)
	Rounds     int // alternating rounds of every implementation per scenario (0: 1)
	RetryPause time.Duration
	Limit      float64
	Targets    bool // print the project's own targets (scripts/bench.sh, for BENCHMARKS.md)
	JSONPath   string
	SVGPath    string
	CPUProfile string
}

// UsageError is a mistake in the command line.
type UsageError struct{ Msg string }

func (e UsageError) Error() string { return e.Msg }

// Flags are idem bench's command-line flags, defined on a flag set by
// NewFlags and turned into Options after parsing.
type Flags struct {
	catalog                   []Impl
	redisURL, impls, scen     *string
	quick, targets            *bool
	rate, limit               *float64
	duration, retryPause      *time.Duration
	requests, clients, inst   *int
	rounds                    *int
	jsonPath, svgPath, cpuOut *string
}

// NewFlags defines idem bench's flags on fs; --impls chooses among catalog
// and defaults to all of it.
func NewFlags(fs *flag.FlagSet, catalog []Impl) *Flags {
	var names []string
	for _, im := range catalog {
		if !im.Extra {
			names = append(names, im.Name)
		}
	}
	return &Flags{
		catalog:    catalog,
		redisURL:   fs.String("redis", "", "Redis `URL` to use (default: start a private redis-server on loopback, which needs redis-server on PATH)"),
		impls:      fs.String("impls", strings.Join(names, ","), "comma-separated `implementations` (none runs in scenario b only; idem-sealed, idem-rueidis with sealed records, and idem-v1off, idem-rueidis without the look-up of v1.0's keys, only when named)"),
		scen:       fs.String("scenarios", "a,b,c,d", "comma-separated `scenarios`: a (retry storm), b (overhead), c (hot keys), d (replays)"),
		quick:      fs.Bool("quick", false, "every scenario at reduced size (a smoke check, under a minute)"),
		rate:       fs.Float64("rate", 0, "open loop: send at this fixed rate (`requests/s`), latency from the scheduled send time; 0: closed loop"),
		duration:   fs.Duration("duration", 0, "bound on each (implementation, scenario) run (default 60s, 10s with --quick)"),
		requests:   fs.Int("requests", 0, "logical requests per run (default per scenario: 20000, 50000, 20000, 50000; a tenth with --quick)"),
		clients:    fs.Int("clients", 0, "closed-loop concurrency for every scenario (default per scenario: 200, 64, 200, 64)"),
		inst:       fs.Int("instances", 1, "server `instances` per implementation, each with its own clients and in-process state, on the same Redis; the load generator spreads requests over them round-robin"),
		rounds:     fs.Int("rounds", 3, "`rounds` per scenario: every implementation runs once a round, in the opposite order from the round before; the report gives each one's median and spread (lowest–highest) over the rounds, and --targets judges the medians (1: a single run)"),
		retryPause: fs.Duration("retry-pause", 10*time.Millisecond, "a client's pause before retrying a 409"),
		limit:      fs.Float64("physical-limit", 0, "redis-benchmark's pipelined EVALSHA acquire rate (`acquires/s`, from scripts/bench.sh), to report idem's scenario b against half of it"),
		targets:    fs.Bool("targets", false, "also check idem's own performance targets (for the project's BENCHMARKS.md)"),
		jsonPath:   fs.String("json", "", "also write the results as JSON to `FILE`"),
		svgPath:    fs.String("svg", "", "also write charts as SVG to `FILE`"),
		cpuOut:     fs.String("cpuprofile", "", "write a CPU profile of the whole run (load generator, servers and clients; not Redis) to `FILE`, for go tool pprof"),
	}
}

// Options checks the parsed flags; its errors are UsageErrors.
func (f *Flags) Options() (Options, error) {
	o := Options{RedisURL: *f.redisURL, Quick: *f.quick, Rate: *f.rate, Duration: *f.duration,
		Requests: *f.requests, Clients: *f.clients, Instances: *f.inst, Rounds: *f.rounds, RetryPause: *f.retryPause, Limit: *f.limit,
		Targets: *f.targets, JSONPath: *f.jsonPath, SVGPath: *f.svgPath, CPUProfile: *f.cpuOut}
	for _, name := range splitList(*f.impls) {
		i := slices.IndexFunc(f.catalog, func(im Impl) bool { return im.Name == name })
		if i < 0 {
			return o, UsageError{fmt.Sprintf("--impls: unknown implementation %q (have %s)", name, strings.Join(ImplNames(f.catalog), ", "))}
		}
		o.Impls = append(o.Impls, f.catalog[i])
	}
	for _, name := range splitList(*f.scen) {
		i := slices.IndexFunc(Scenarios, func(s Scenario) bool { return s.Name == name })
		if i < 0 {
			return o, UsageError{fmt.Sprintf("--scenarios: unknown scenario %q (have a, b, c, d)", name)}
		}
		o.Scenarios = append(o.Scenarios, Scenarios[i])
	}
	switch {
	case len(o.Impls) == 0 || len(o.Scenarios) == 0:
		return o, UsageError{"--impls and --scenarios must name at least one each"}
	case o.Rate < 0 || o.Requests < 0 || o.Clients < 0 || o.Duration < 0 || o.RetryPause < 0 || o.Limit < 0:
		return o, UsageError{"--rate, --requests, --clients, --duration, --retry-pause and --physical-limit must not be negative"}
	case o.Instances < 1 || o.Instances > 16:
		return o, UsageError{"--instances must be between 1 and 16"}
	case o.Rounds < 1 || o.Rounds > 100:
		return o, UsageError{"--rounds must be between 1 and 100"}
	}
	if o.Duration == 0 {
		o.Duration = 60 * time.Second
		if o.Quick {
			o.Duration = 10 * time.Second
		}
	}
	return o, nil
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

// Execute runs o and writes its report: markdown to stdout, and the JSON
// and SVG files o names; progress goes to stderr.
func Execute(ctx context.Context, o Options, stdout, stderr io.Writer) error {
	if o.CPUProfile != "" {
		f, err := os.Create(o.CPUProfile)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	results, meta, err := Run(ctx, o, stderr)
	if err != nil {
		return err
	}
	WriteMarkdown(stdout, results, meta, o)
	if o.JSONPath != "" {
		if err := WriteJSONFile(o.JSONPath, results); err != nil {
			return err
		}
	}
	if o.SVGPath != "" {
		if err := os.WriteFile(o.SVGPath, []byte(RenderSVG(results, meta)), 0o644); err != nil {
			return err
		}
	}
	return nil
}

// Meta describes the run for the report.
type Meta struct {
	Date         string
	Redis        string // version and where
	Procs        int
	Quick        bool
	Rate         float64
	RetryPause   time.Duration
	Instances    int
	Rounds       int
	Scenarios    []Scenario
	PrivateRedis bool
	Impls        []Impl // the implementations run, for their colors and kinds
}

// Run runs every (scenario, implementation) pair, scenario by scenario so
// that the implementations of one scenario run close in time.
func Run(ctx context.Context, o Options, stderr io.Writer) ([]Result, Meta, error) {
	o.Instances = max(1, o.Instances)
	meta := Meta{Date: time.Now().UTC().Format("2006-01-02 15:04 MST"), Procs: runtime.GOMAXPROCS(0),
		Quick: o.Quick, Rate: o.Rate, RetryPause: o.RetryPause, Instances: o.Instances, Scenarios: o.Scenarios, Impls: o.Impls}
	url := o.RedisURL
	if url == "" {
		srv, err := redisserver.StartServer()
		if err != nil {
			return nil, meta, fmt.Errorf("no --redis URL given, and starting a private redis-server failed: %w", err)
		}
		defer srv.Stop()
		url = "redis://" + srv.Addr()
		meta.PrivateRedis = true
	}
	admin, err := NewGoredis(url)
	if err != nil {
		return nil, meta, err
	}
	defer admin.Close()
	info, err := admin.Info(ctx, "server").Result()
	if err != nil {
		return nil, meta, fmt.Errorf("redis at %s: %w", url, err)
	}
	v, _ := redisserver.InfoField(info, "redis_version")
	meta.Redis = "redis-server " + v
	if meta.PrivateRedis {
		meta.Redis += " (private, started by idem bench)"
	}
	runID := strconv.FormatUint(rand.Uint64()>>32, 36)
	logger := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	rounds := max(1, o.Rounds)
	meta.Rounds = rounds
	var results []Result
	for _, sc := range o.Scenarios {
		var impls []Impl
		for _, impl := range o.Impls {
			if !impl.OnlyB || sc.Name == "b" {
				impls = append(impls, impl)
			}
		}
		// Round by round, every implementation once, in the opposite order
		// from the round before: drift and a noisy moment touch them all
		// alike, and the implementations of one scenario run close in time.
		per := make([][]Result, len(impls))
		for round := 1; round <= rounds; round++ {
			for j := range impls {
				i := j
				if round%2 == 0 {
					i = len(impls) - 1 - j
				}
				impl := impls[i]
				if err := ctx.Err(); err != nil {
					return nil, meta, err
				}
				if meta.PrivateRedis {
					if err := admin.FlushAll(ctx).Err(); err != nil {
						return nil, meta, err
					}
				}
				// Each round has keys of its own (a Redis given with --redis
				// is not flushed).
				id := runID
				if rounds > 1 {
					id += "r" + strconv.Itoa(round)
				}
				r, err := runOne(ctx, o, sc, impl, url, id, admin, logger)
				if err != nil {
					return nil, meta, fmt.Errorf("%s, scenario %s: %w", impl.Name, sc.Name, err)
				}
				at := ""
				if rounds > 1 {
					at = fmt.Sprintf(" round %d/%d", round, rounds)
				}
				fmt.Fprintf(stderr, "idem bench: %-12s scenario %s%s: %7d requests, %8.0f req/s, p99 %7.2f ms, %d duplicates\n",
					impl.Name, sc.Name, at, r.Requests, r.RPS, r.P99ms, r.Duplicates)
				per[i] = append(per[i], r)
			}
		}
		for i := range impls {
			results = append(results, Combine(per[i]))
		}
	}
	return results, meta, nil
}

// Combine is one implementation's Result in one scenario from its rounds'
// (see Result.Rounds): the medians, the spreads and the rounds themselves.
// One round is returned as it is.
func Combine(rounds []Result) Result {
	if len(rounds) == 1 {
		return rounds[0]
	}
	r := rounds[0]
	r.PerRound = slices.Clone(rounds)
	r.Rounds = len(rounds)
	med := func(f func(Result) float64) float64 {
		v := make([]float64, len(rounds))
		for i, x := range rounds {
			v[i] = f(x)
		}
		return median(v)
	}
	medInt := func(f func(Result) int) int {
		return int(math.Round(med(func(x Result) float64 { return float64(f(x)) })))
	}
	r.Requests = medInt(func(x Result) int { return x.Requests })
	r.Attempts = medInt(func(x Result) int { return x.Attempts })
	r.Keys = medInt(func(x Result) int { return x.Keys })
	r.Executions = medInt(func(x Result) int { return x.Executions })
	r.Duplicates = medInt(func(x Result) int { return x.Duplicates })
	r.ElapsedS = med(func(x Result) float64 { return x.ElapsedS })
	r.RPS = med(func(x Result) float64 { return x.RPS })
	r.P50ms = med(func(x Result) float64 { return x.P50ms })
	r.P95ms = med(func(x Result) float64 { return x.P95ms })
	r.P99ms = med(func(x Result) float64 { return x.P99ms })
	r.MaxMs = med(func(x Result) float64 { return x.MaxMs })
	r.RedisCmdsPerReq = med(func(x Result) float64 { return x.RedisCmdsPerReq })
	r.RedisCPUusPerReq = med(func(x Result) float64 { return x.RedisCPUusPerReq })
	r.RedisCmds = map[string]float64{}
	for _, x := range rounds {
		for name := range x.RedisCmds {
			r.RedisCmds[name] = med(func(x Result) float64 { return x.RedisCmds[name] })
		}
	}
	r.Statuses, r.Errors, r.Conflicts = map[string]int{}, map[string]int{}, 0
	r.RPSMin, r.RPSMax = rounds[0].RPS, rounds[0].RPS
	r.P99MinMs, r.P99MaxMs = rounds[0].P99ms, rounds[0].P99ms
	for _, x := range rounds {
		for k, n := range x.Statuses {
			r.Statuses[k] += n
		}
		for k, n := range x.Errors {
			r.Errors[k] += n
		}
		r.Conflicts += x.Conflicts
		r.RPSMin, r.RPSMax = min(r.RPSMin, x.RPS), max(r.RPSMax, x.RPS)
		r.P99MinMs, r.P99MaxMs = min(r.P99MinMs, x.P99ms), max(r.P99MaxMs, x.P99ms)
		r.DuplicatesMax = max(r.DuplicatesMax, x.Duplicates)
	}
	return r
}

func median(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	v = slices.Clone(v)
	slices.Sort(v)
	if n := len(v); n%2 == 1 {
		return v[n/2]
	} else {
		return (v[n/2-1] + v[n/2]) / 2
	}
}

// worstDuplicates is the most duplicates r had in one round.
func worstDuplicates(r Result) int { return max(r.Duplicates, r.DuplicatesMax) }

// plan is the key of every logical request, and the keys completed before
// the measurement.
type plan struct {
	keys, warm []string
	distinct   int
}

func makePlan(sc Scenario, n int, prefix string) plan {
	var p plan
	if sc.Replay > 0 {
		rng := rand.New(rand.NewPCG(42, 7)) // the same plan for every implementation
		p.warm = make([]string, max(1, n/10))
		for i := range p.warm {
			p.warm[i] = prefix + "w" + strconv.Itoa(i)
		}
		seen := map[string]bool{}
		for i := range n {
			k := prefix + "n" + strconv.Itoa(i)
			if rng.Float64() < sc.Replay {
				k = p.warm[rng.IntN(len(p.warm))]
			}
			p.keys = append(p.keys, k)
			seen[k] = true
		}
		p.distinct = len(seen)
		return p
	}
	copies := max(1, sc.Copies)
	for i := range n {
		p.keys = append(p.keys, prefix+strconv.Itoa(i/copies))
	}
	p.distinct = (n + copies - 1) / copies
	return p
}

const warmupKey = "bench-warmup"

func runOne(ctx context.Context, o Options, sc Scenario, impl Impl, url, runID string, admin *redis.Client, logger *slog.Logger) (Result, error) {
	r := Result{Impl: impl.Name, Scenario: sc.Name, Mode: "closed"}
	if o.Instances > 1 {
		r.Instances = o.Instances
	}
	n := sc.Requests
	if o.Quick {
		n = sc.Quick
	}
	if o.Requests > 0 {
		n = o.Requests
	}
	clients := sc.Clients
	if o.Clients > 0 {
		clients = o.Clients
	}
	plan := makePlan(sc, n, fmt.Sprintf("%s-%s-%s-", runID, impl.Name, sc.Name))
	r.Keys = plan.distinct

	// One handler, so one ledger of executions, behind every instance: the
	// instances are copies of one service in front of one database.
	app := NewApp(sc.Sleep)
	env := Env{RedisURL: url, App: app, Logger: logger}
	spec := loadSpec{clients: clients, deadline: time.Now().Add(o.Duration), retryPause: o.RetryPause, next: new(atomic.Uint64)}
	for range max(1, o.Instances) {
		srv, err := impl.Build(ctx, env)
		if err != nil {
			return r, err
		}
		defer srv.Close()
		ln, err := net.Listen("tcp", "127.0.0.1:0") // loopback only
		if err != nil {
			return r, err
		}
		go func() { _ = srv.Serve(ln) }()
		spec.urls = append(spec.urls, "http://"+ln.Addr().String()+"/payments")
	}
	client := newClient(max(clients, 256))
	defer client.CloseIdleConnections()

	// Warm up outside the measurement: connections and scripts on every
	// instance, and for scenario d the keys to be replayed.
	for i, u := range spec.urls {
		if st := post(ctx, client, u, runID+warmupKey+strconv.Itoa(i)); st/100 != 2 {
			return r, fmt.Errorf("warm-up request got status %d (is Redis reachable?)", st)
		}
	}
	if len(plan.warm) > 0 {
		w := spec
		w.keys = plan.warm
		runLoad(ctx, client, w)
	}
	before := app.Counts()
	sb, err := redisSnapshot(ctx, admin)
	if err != nil {
		return r, err
	}

	spec.keys = plan.keys
	spec.deadline = time.Now().Add(o.Duration)
	if o.Rate > 0 {
		spec.rate = o.Rate
		r.Mode, r.Rate = "open", o.Rate
	} else {
		r.Clients = clients
	}
	lr := runLoad(ctx, client, spec)

	sa, err := redisSnapshot(ctx, admin)
	if err != nil {
		return r, err
	}
	after := app.Counts()
	summarize(&r, lr)
	for k, c := range after {
		if strings.HasPrefix(k, runID+warmupKey) {
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
func summarize(r *Result, lr loadResult) {
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
