package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"encoding/xml"
	"errors"
	"flag"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redisserver"
)

// parse parses idem bench's command line as the idem command does.
func parse(t *testing.T, catalog []Impl, args ...string) Options {
	t.Helper()
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	f := NewFlags(fs, catalog)
	if err := fs.Parse(args); err != nil {
		t.Fatal(err)
	}
	o, err := f.Options()
	if err != nil {
		t.Fatal(err)
	}
	return o
}

// TestBench runs idem bench --quick in-process at a tiny size against a
// private redis-server and checks the JSON, the markdown and the SVG.
func TestBench(t *testing.T) {
	srv, err := redisserver.StartServer()
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Stop()
	dir := t.TempDir()
	jsonPath, svgPath := filepath.Join(dir, "bench.json"), filepath.Join(dir, "bench.svg")
	var stdout, stderr bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	// 200 requests: in (a) 20 keys of 10 copies sent at once to a handler
	// sleeping 50 ms, in (c) 10 keys of 20 copies (5 ms): the copies of a
	// key reach naive's GET long before its SET, so it runs them all.
	o := parse(t, Builtin(), "--quick", "--requests", "200", "--redis", "redis://"+srv.Addr(),
		"--targets", "--json", jsonPath, "--svg", svgPath)
	if err := Execute(ctx, o, &stdout, &stderr); err != nil {
		t.Fatalf("%v\nstderr:\n%s", err, stderr.String())
	}

	raw, err := os.ReadFile(jsonPath)
	if err != nil {
		t.Fatal(err)
	}
	var rs []Result
	if err := json.Unmarshal(raw, &rs); err != nil {
		t.Fatalf("JSON: %v", err)
	}
	got := map[string]Result{}
	for _, r := range rs {
		got[r.Impl+"/"+r.Scenario] = r
	}
	for _, sc := range []string{"a", "b", "c", "d"} {
		for _, im := range Builtin() {
			impl := im.Name
			r, ok := got[impl+"/"+sc]
			if im.Extra {
				if ok {
					t.Errorf("%s ran in scenario %s without --impls naming it", impl, sc)
				}
				continue
			}
			if impl == "none" && sc != "b" {
				if ok {
					t.Errorf("none ran in scenario %s", sc)
				}
				continue
			}
			if !ok {
				t.Errorf("no result for %s in scenario %s", impl, sc)
				continue
			}
			if r.Requests != 200 || r.RPS <= 0 || r.P50ms <= 0 || r.P99ms < r.P50ms || len(r.Errors) != 0 {
				t.Errorf("%s/%s: implausible result %+v", impl, sc, r)
			}
			if impl != "none" && r.RedisCmdsPerReq <= 0 {
				t.Errorf("%s/%s: no Redis commands counted", impl, sc)
			}
			if strings.HasPrefix(impl, "idem-") && r.Duplicates != 0 {
				t.Errorf("%s/%s: %d duplicate executions", impl, sc, r.Duplicates)
			}
		}
	}
	if got["naive/a"].Duplicates == 0 && got["naive/c"].Duplicates == 0 {
		t.Errorf("naive shows no duplicates in (a) nor (c)")
	}
	if got["lua/a"].Executions != got["lua/a"].Keys || got["watch/c"].Duplicates != 0 {
		t.Errorf("a locking baseline ran a key twice: lua/a %+v, watch/c %+v", got["lua/a"], got["watch/c"])
	}

	md := stdout.String()
	for _, want := range []string{"| scenario | implementation |", "| a | idem-rueidis |", "| b | none |", "### Targets"} {
		if !strings.Contains(md, want) {
			t.Errorf("markdown lacks %q:\n%s", want, md)
		}
	}

	svg, err := os.ReadFile(svgPath)
	if err != nil {
		t.Fatal(err)
	}
	dec := xml.NewDecoder(bytes.NewReader(svg))
	for {
		_, err := dec.Token()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("SVG is not well-formed XML: %v", err)
		}
	}
	if !bytes.Contains(svg, []byte("<svg")) || !bytes.Contains(svg, []byte("idem-goredis")) {
		t.Errorf("SVG lacks the chart")
	}
}

func TestFlagErrors(t *testing.T) {
	for _, args := range [][]string{
		{"--impls", "bogus"},
		{"--scenarios", "z"},
		{"--rate", "-1"},
		{"--instances", "0"},
		{"--rounds", "0"},
		{"--impls", ""},
	} {
		fs := flag.NewFlagSet("bench", flag.ContinueOnError)
		f := NewFlags(fs, Builtin())
		if err := fs.Parse(args); err != nil {
			t.Fatal(err)
		}
		if _, err := f.Options(); !errors.As(err, new(UsageError)) {
			t.Errorf("%v: error %v, want a UsageError", args, err)
		}
	}
}

func TestMakePlan(t *testing.T) {
	p := makePlan(Scenario{Copies: 10}, 25, "k")
	if len(p.keys) != 25 || p.distinct != 3 || p.keys[9] != "k0" || p.keys[10] != "k1" {
		t.Errorf("copies plan: %+v", p)
	}
	p = makePlan(Scenario{Replay: 0.95}, 1000, "k")
	if len(p.warm) != 100 || len(p.keys) != 1000 {
		t.Errorf("replay plan: %d warm, %d keys", len(p.warm), len(p.keys))
	}
	var fresh int
	for _, k := range p.keys {
		if strings.HasPrefix(k, "kn") {
			fresh++
		}
	}
	if fresh < 20 || fresh > 90 {
		t.Errorf("replay plan: %d new keys of 1000, want about 50", fresh)
	}
}

// TestInstancesAndPeers runs two instances of each implementation, with a
// stand-in peer (the lua baseline, marked Peer) and a stand-in peer whose
// lock lives in one process (naive behind a process-local mutex per key):
// across two instances the latter runs keys twice, and the report checks
// idem against both.
func TestInstancesAndPeers(t *testing.T) {
	srv, err := redisserver.StartServer()
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Stop()
	builtin := Builtin()
	lua := builtin[slices.IndexFunc(builtin, func(im Impl) bool { return im.Name == "lua" })]
	catalog := append(builtin,
		Impl{Name: "peer-lua", Peer: true, Color: "#000000", Build: lua.Build},
		Impl{Name: "peer-local", Peer: true, Build: func(ctx context.Context, env Env) (Server, error) {
			// A lock per key in this process, in front of the store-less
			// handler: correct in one process, not across two.
			return NetHTTP(&localLock{next: env.App, done: map[string]bool{}}, env.Logger, nil), nil
		}},
	)
	var stdout, stderr bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	o := parse(t, catalog, "--quick", "--requests", "100", "--redis", "redis://"+srv.Addr(), "--instances", "2",
		"--impls", "idem-rueidis,idem-wait,peer-lua,peer-local", "--scenarios", "a,b", "--targets")
	results, meta, err := Run(ctx, o, &stderr)
	if err != nil {
		t.Fatalf("%v\nstderr:\n%s", err, stderr.String())
	}
	WriteMarkdown(&stdout, results, meta, o)
	for _, r := range results {
		if r.Instances != 2 || r.Requests != 100 || len(r.Errors) != 0 {
			t.Errorf("%s/%s: implausible result %+v", r.Impl, r.Scenario, r)
		}
		if r.Impl != "peer-local" && r.Duplicates != 0 {
			t.Errorf("%s/%s: %d duplicates", r.Impl, r.Scenario, r.Duplicates)
		}
		if r.Impl == "peer-local" && r.Scenario == "a" && r.Duplicates == 0 {
			t.Errorf("peer-local/a: no duplicates across two instances")
		}
	}
	md := stdout.String()
	for _, want := range []string{"2 server instances per implementation", "vs peer-lua: throughput",
		"idem-rueidis, (a): throughput ≥ every peer's", "peer-local duplicates as measured: (a) "} {
		if !strings.Contains(md, want) {
			t.Errorf("markdown lacks %q:\n%s", want, md)
		}
	}
	svg := RenderSVG(results, meta)
	if !strings.Contains(svg, "its peers") || !strings.Contains(svg, "#000000") {
		t.Errorf("SVG lacks the peers")
	}
}

// TestBenchSealed runs idem-sealed (idem-rueidis with sealed records)
// beside idem-rueidis, and checks that it ran each key once and that the
// records it left in Redis are sealed: no value holds the handler's
// answer in clear, while idem-rueidis's records (the control) do.
func TestBenchSealed(t *testing.T) {
	for _, c := range []struct {
		impl   string
		sealed bool
	}{{"idem-sealed", true}, {"idem-rueidis", false}} {
		t.Run(c.impl, func(t *testing.T) {
			srv, err := redisserver.StartServer()
			if err != nil {
				t.Fatal(err)
			}
			defer srv.Stop()
			var stderr bytes.Buffer
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			o := parse(t, Builtin(), "--quick", "--requests", "200", "--redis", "redis://"+srv.Addr(),
				"--impls", c.impl, "--scenarios", "d")
			results, _, err := Run(ctx, o, &stderr)
			if err != nil {
				t.Fatalf("%v\nstderr:\n%s", err, stderr.String())
			}
			if len(results) != 1 || results[0].Duplicates != 0 || len(results[0].Errors) != 0 || results[0].Requests != 200 {
				t.Fatalf("implausible results %+v", results)
			}
			rdb, err := NewGoredis("redis://" + srv.Addr())
			if err != nil {
				t.Fatal(err)
			}
			defer rdb.Close()
			var values, clear int
			iter := rdb.Scan(ctx, 0, "*", 1000).Iterator()
			for iter.Next(ctx) {
				typ, err := rdb.Type(ctx, iter.Val()).Result()
				if err != nil || typ != "string" {
					continue
				}
				v, err := rdb.Get(ctx, iter.Val()).Bytes()
				if err != nil {
					t.Fatal(err)
				}
				values++
				if bytes.Contains(v, []byte(`"status":"captured"`)) {
					clear++
				}
			}
			if err := iter.Err(); err != nil {
				t.Fatal(err)
			}
			if values == 0 {
				t.Fatal("no records left in Redis")
			}
			if c.sealed && clear != 0 {
				t.Errorf("%d of %d values hold the answer in clear", clear, values)
			}
			if !c.sealed && clear == 0 {
				t.Errorf("control: none of %d values holds the answer in clear (the check finds nothing)", values)
			}
		})
	}
}

// localLock runs each key once per process: a completed key answers 201
// again without running the handler, a key in flight gets 409. It stands
// for a library whose lock and records live in one process.
type localLock struct {
	next http.Handler
	mu   sync.Mutex
	done map[string]bool // key -> completed (false: in flight)
}

func (l *localLock) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	key := r.Header.Get("Idempotency-Key")
	l.mu.Lock()
	completed, seen := l.done[key]
	if !seen {
		l.done[key] = false
	}
	l.mu.Unlock()
	switch {
	case seen && completed:
		w.WriteHeader(http.StatusCreated)
		return
	case seen:
		w.WriteHeader(http.StatusConflict)
		return
	}
	l.next.ServeHTTP(w, r)
	l.mu.Lock()
	l.done[key] = true
	l.mu.Unlock()
}

// TestCombine checks the medians, the spreads and the sums of three rounds.
func TestCombine(t *testing.T) {
	rounds := []Result{
		{Impl: "x", Scenario: "a", Requests: 100, RPS: 300, P99ms: 9, Duplicates: 0, Conflicts: 1, Statuses: map[string]int{"201": 100}},
		{Impl: "x", Scenario: "a", Requests: 100, RPS: 100, P99ms: 30, Duplicates: 2, Conflicts: 2, Statuses: map[string]int{"201": 99, "503": 1}, Errors: map[string]int{"503": 1}},
		{Impl: "x", Scenario: "a", Requests: 100, RPS: 200, P99ms: 10, Duplicates: 0, Statuses: map[string]int{"201": 100}},
	}
	r := Combine(rounds)
	if r.Rounds != 3 || r.RPS != 200 || r.RPSMin != 100 || r.RPSMax != 300 || r.P99ms != 10 || r.P99MinMs != 9 || r.P99MaxMs != 30 ||
		r.Requests != 100 || r.Duplicates != 0 || r.DuplicatesMax != 2 || worstDuplicates(r) != 2 || r.Conflicts != 3 ||
		r.Statuses["201"] != 299 || r.Errors["503"] != 1 || len(r.PerRound) != 3 {
		t.Errorf("Combine: %+v", r)
	}
	if one := Combine(rounds[:1]); one.Rounds != 0 || one.PerRound != nil || one.RPS != 300 {
		t.Errorf("Combine of one round: %+v", one)
	}
	if m := median([]float64{4, 1, 3, 2}); m != 2.5 {
		t.Errorf("median of 4 values: %v", m)
	}
}
