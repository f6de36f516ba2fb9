package bench

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
)

var idemImpls = []string{"idem-rueidis", "idem-goredis", "idem-wait", "idem-fiber"}

func findResult(rs []Result, impl, scenario string) (Result, bool) {
	i := slices.IndexFunc(rs, func(r Result) bool { return r.Impl == impl && r.Scenario == scenario })
	if i < 0 {
		return Result{}, false
	}
	return rs[i], true
}

// thousands formats n with commas: 12,345.
func thousands(n int64) string {
	s := strconv.FormatInt(n, 10)
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	var b strings.Builder
	for i, c := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(c)
	}
	if neg {
		return "-" + b.String()
	}
	return b.String()
}

func fmtMs(v float64) string {
	switch {
	case v >= 100:
		return strconv.FormatFloat(v, 'f', 0, 64)
	case v >= 10:
		return strconv.FormatFloat(v, 'f', 1, 64)
	}
	return strconv.FormatFloat(v, 'f', 2, 64)
}

// statusList is "409:3 503:1", or "–" when empty.
func statusList(m map[string]int) string {
	if len(m) == 0 {
		return "–"
	}
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		name := k
		if k == "0" {
			name = "conn"
		}
		parts[i] = name + ":" + strconv.Itoa(m[k])
	}
	return strings.Join(parts, " ")
}

func WriteMarkdown(w io.Writer, rs []Result, meta Meta, o Options) {
	mode := "closed loop"
	if meta.Rate > 0 {
		mode = fmt.Sprintf("open loop at %s req/s (latency from the scheduled send)", thousands(int64(meta.Rate)))
	}
	size := "full size"
	if meta.Quick {
		size = "--quick (reduced size)"
	}
	fmt.Fprintf(w, "## idem bench, %s\n\n", meta.Date)
	fmt.Fprintf(w, "%s, GOMAXPROCS %d, %s, %s, a 409 retried after %v (±25%%).\n\n", meta.Redis, meta.Procs, mode, size, meta.RetryPause)
	if meta.Instances > 1 {
		fmt.Fprintf(w, "%d server instances per implementation, each with its own clients and in-process state, on the same Redis; every HTTP attempt goes to the next instance, round-robin.\n\n", meta.Instances)
	}
	for _, sc := range meta.Scenarios {
		fmt.Fprintf(w, "- (%s) %s\n", sc.Name, sc.Title)
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "| scenario | implementation | requests | req/s | p50 ms | p95 ms | p99 ms | max ms | executions | duplicates | 409 retries | errors | Redis cmds/req | Redis CPU µs/req |")
	fmt.Fprintln(w, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|")
	for _, r := range rs {
		rps, p99, dups := thousands(int64(math.Round(r.RPS))), fmtMs(r.P99ms), thousands(int64(r.Duplicates))
		if r.Rounds > 1 { // the median, then the spread of the rounds
			rps += fmt.Sprintf(" (%s–%s)", thousands(int64(math.Round(r.RPSMin))), thousands(int64(math.Round(r.RPSMax))))
			p99 += fmt.Sprintf(" (%s–%s)", fmtMs(r.P99MinMs), fmtMs(r.P99MaxMs))
			if r.DuplicatesMax > 0 {
				dups += fmt.Sprintf(" (max %s)", thousands(int64(r.DuplicatesMax)))
			}
		}
		fmt.Fprintf(w, "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %.2f | %.1f |\n",
			r.Scenario, r.Impl, thousands(int64(r.Requests)), rps,
			fmtMs(r.P50ms), fmtMs(r.P95ms), p99, fmtMs(r.MaxMs),
			thousands(int64(r.Executions)), dups, thousands(int64(r.Conflicts)),
			statusList(r.Errors), r.RedisCmdsPerReq, r.RedisCPUusPerReq)
	}
	fmt.Fprintln(w, "\nRequests are logical requests: a 409 retried until the final answer counts once, and its latency runs")
	fmt.Fprintln(w, "from the first send to the final answer. Redis cmds/req is from INFO commandstats, which also counts")
	fmt.Fprintln(w, "the commands a script runs inside Redis: commands executed, not round trips.")
	if meta.Rounds > 1 {
		fmt.Fprintf(w, "\n%d rounds per scenario, every implementation once a round, in the opposite order from the round\n", meta.Rounds)
		fmt.Fprintln(w, "before. Each figure is the median of the rounds; req/s and p99 give the spread (lowest–highest round)")
		fmt.Fprintln(w, "in brackets, duplicates the worst round when one had any; 409 retries and errors are summed over")
		fmt.Fprintln(w, "the rounds. Ratios and targets are judged on the medians; \"0 duplicates\" on every round.")
	}
	if lines := ratioLines(rs, o.Limit, extraBases(meta.Impls)); len(lines) > 0 {
		fmt.Fprintln(w, "\n### Ratios")
		fmt.Fprintln(w)
		for _, l := range lines {
			fmt.Fprintln(w, "- "+l)
		}
	}
	if lines := targetLines(rs, o.Limit, peerNames(meta.Impls)); o.Targets && len(lines) > 0 {
		fmt.Fprintln(w, "\n### Targets")
		fmt.Fprintln(w)
		for _, l := range lines {
			fmt.Fprintln(w, "- "+l)
		}
	}
}

func pct(a, b float64) string {
	if b == 0 {
		return "n/a"
	}
	return fmt.Sprintf("%.1f%%", 100*a/b)
}

func times(a, b float64) string {
	if b == 0 {
		return "n/a"
	}
	return fmt.Sprintf("%.2f×", a/b)
}

// extraBases are the implementations, beyond lua, watch and none, that
// idem is compared with: the peers and their own no-layer baselines.
func extraBases(impls []Impl) []string {
	var out []string
	for _, im := range impls {
		if (im.Peer || im.OnlyB) && im.Name != "none" {
			out = append(out, im.Name)
		}
	}
	return out
}

// peerNames are the peers' names.
func peerNames(impls []Impl) []string {
	var out []string
	for _, im := range impls {
		if im.Peer {
			out = append(out, im.Name)
		}
	}
	return out
}

// ratioLines compares each idem client with the baselines.
func ratioLines(rs []Result, limit float64, extra []string) []string {
	var out []string
	for _, impl := range idemImpls {
		for _, sc := range []string{"a", "b", "c", "d"} {
			me, ok := findResult(rs, impl, sc)
			if !ok {
				continue
			}
			var parts []string
			for _, base := range append([]string{"lua", "watch", "none"}, extra...) {
				b, ok := findResult(rs, base, sc)
				if !ok {
					continue
				}
				parts = append(parts, fmt.Sprintf("vs %s: throughput %s, p99 %s", base, times(me.RPS, b.RPS), times(me.P99ms, b.P99ms)))
			}
			if sc == "b" && limit > 0 {
				parts = append(parts, fmt.Sprintf("%s of the physical limit for pairs (%s/s, half of redis-benchmark's %s EVALSHA/s)",
					pct(me.RPS, limit/2), thousands(int64(limit/2)), thousands(int64(limit))))
			}
			if len(parts) > 0 {
				out = append(out, fmt.Sprintf("%s, scenario %s: %s", impl, sc, strings.Join(parts, "; ")))
			}
		}
	}
	return out
}

func verdict(ok bool) string {
	if ok {
		return "**met**"
	}
	return "**not met**"
}

// targetLines checks the project's own targets (BENCHMARKS.md) on what
// was measured; printed with --targets.
func targetLines(rs []Result, limit float64, peers []string) []string {
	var out []string
	for _, sc := range []string{"a", "c"} {
		if r, ok := findResult(rs, "naive", sc); ok {
			out = append(out, fmt.Sprintf("naive shows duplicates in (%s): %s duplicates: %s", sc, thousands(int64(r.Duplicates)), verdict(r.Duplicates > 0)))
		}
	}
	for _, impl := range idemImpls {
		var n, dups int
		for _, r := range rs {
			if r.Impl == impl {
				n++
				dups += worstDuplicates(r)
			}
		}
		if n > 0 {
			out = append(out, fmt.Sprintf("%s has 0 duplicates in every scenario: %d in %d scenarios: %s", impl, dups, n, verdict(dups == 0)))
		}
	}
	for _, impl := range idemImpls {
		for _, sc := range []string{"a", "c", "d"} {
			me, ok1 := findResult(rs, impl, sc)
			lua, ok2 := findResult(rs, "lua", sc)
			if !ok1 || !ok2 {
				continue
			}
			out = append(out, fmt.Sprintf("%s, (%s): throughput ≥ lua's (%s vs %s req/s): %s; p99 ≤ lua's (%s vs %s ms): %s",
				impl, sc, thousands(int64(math.Round(me.RPS))), thousands(int64(math.Round(lua.RPS))), verdict(me.RPS >= lua.RPS),
				fmtMs(me.P99ms), fmtMs(lua.P99ms), verdict(me.P99ms <= lua.P99ms)))
		}
	}
	for _, impl := range idemImpls {
		me, ok := findResult(rs, impl, "b")
		if !ok {
			continue
		}
		if none, ok := findResult(rs, "none", "b"); ok {
			out = append(out, fmt.Sprintf("%s, (b): ≥ 50%% of no layer: %s: %s", impl, pct(me.RPS, none.RPS), verdict(me.RPS >= none.RPS/2)))
		}
		if limit > 0 {
			out = append(out, fmt.Sprintf("%s, (b): ≥ 25%% of the physical limit for pairs: %s: %s", impl, pct(me.RPS, limit/2), verdict(me.RPS >= limit/2/4)))
		}
	}
	// Against the peers: idem on rueidis (what redisstore.Open creates;
	// also with Config.Wait, and on fiber when run) at least as fast as
	// the fastest peer and at most the lowest peer p99, with 0
	// duplicates; every peer's duplicates as measured.
	for _, idemImpl := range []string{"idem-rueidis", "idem-wait", "idem-fiber"} {
		for _, sc := range []string{"a", "b", "c", "d"} {
			me, ok := findResult(rs, idemImpl, sc)
			if !ok {
				continue
			}
			var best, low Result
			var n int
			for _, p := range peers {
				r, ok := findResult(rs, p, sc)
				if !ok {
					continue
				}
				if n == 0 || r.RPS > best.RPS {
					best = r
				}
				if n == 0 || r.P99ms < low.P99ms {
					low = r
				}
				n++
			}
			if n == 0 {
				continue
			}
			out = append(out, fmt.Sprintf("%s, (%s): throughput ≥ every peer's (%s vs %s req/s, %s): %s; p99 ≤ every peer's (%s vs %s ms, %s): %s; 0 duplicates (%s): %s",
				idemImpl, sc, thousands(int64(math.Round(me.RPS))), thousands(int64(math.Round(best.RPS))), best.Impl, verdict(me.RPS >= best.RPS),
				fmtMs(me.P99ms), fmtMs(low.P99ms), low.Impl, verdict(me.P99ms <= low.P99ms),
				thousands(int64(worstDuplicates(me))), verdict(worstDuplicates(me) == 0)))
		}
	}
	for _, p := range peers {
		var parts []string
		for _, sc := range []string{"a", "b", "c", "d"} {
			if r, ok := findResult(rs, p, sc); ok {
				parts = append(parts, fmt.Sprintf("(%s) %s", sc, thousands(int64(r.Duplicates))))
			}
		}
		if len(parts) > 0 {
			out = append(out, fmt.Sprintf("%s duplicates as measured: %s", p, strings.Join(parts, ", ")))
		}
	}
	return out
}

func WriteJSONFile(path string, rs []Result) error {
	b, err := json.MarshalIndent(rs, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(b, '\n'), 0o644)
}
