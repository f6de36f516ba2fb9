#!/usr/bin/env bash
# Measures the figures in BENCHMARKS.md, side by side in one run:
#   1. the physical limit: redis-benchmark's pipelined EVALSHA rate for
#      idem's own acquire script on a private redis-server, on fresh keys;
#   2. full acquire+complete pairs/s from 64 goroutines with rueidis and
#      go-redis (go test -bench, against the test package's private server);
#   3. the in-memory store and the Guard.
#   4. the consumers, idem bench with its peers, and the consumers beside
#      watermill (see below).
# The Go benchmarks run COUNT times (go test -count, default 3) and report
# each figure's median and spread; idem bench runs ROUNDS alternating
# rounds (default 3) and reports medians and spreads. Bounded: about
# twenty minutes. Loopback only.
#
# One failed measurement does not stop the others: each runs as a step,
# its failure's output (the benchmark's own lines, FAIL and the reason it
# gives) is printed where it happened, and the failed steps are listed at
# the end, with a non-zero exit status.
set -euo pipefail
cd "$(dirname "$0")/.."
benchtime=${BENCHTIME:-5s}
count=${COUNT:-3} # go test -count: each Go benchmark's median and spread over its runs

failed=()
# step NAME FUNCTION: runs FUNCTION; when it fails, records NAME and goes on.
step() {
	local name=$1
	shift
	if ! "$@"; then
		echo "bench.sh: step failed: $name (see its output above)" >&2
		failed+=("$name")
	fi
}
# benchlines: the benchmark lines of go test's output, and the lines that
# say why one failed.
benchlines() { grep -E '^(Benchmark|--- (FAIL|SKIP)|FAIL|panic|ok )|_test\.go:[0-9]+:' || true; }
# medians: go test's output with the runs of each benchmark (-count) made
# one line, in the order first seen: every value the median of its runs,
# followed by their spread, "(lowest–highest)", when there were several;
# other lines pass through. (The awk below reads "VALUE UNIT" pairs, which
# stay in place.)
medians() {
	python3 -c '
import re, statistics, sys
order, runs, rest = [], {}, []
pending = None
for line in sys.stdin:
    # A log line written while a benchmark ran splits its result line in
    # two: "BenchmarkX-2 <log line>", then "   N  V unit ...". Join them.
    m = re.match(r"(Benchmark\S+)\s+\d{4}/\d\d/\d\d \d\d:\d\d:\d\d ", line)
    if m:
        pending = m.group(1); rest.append(("l", line[len(m.group(1)):].strip())); continue
    if pending and re.match(r"\s+\d+\s", line):
        line = pending + " " + line
    pending = None
    f = line.split()
    if f and f[0].startswith("Benchmark") and len(f) >= 4 and re.fullmatch(r"\d+", f[1]):
        if f[0] not in runs:
            order.append(f[0]); runs[f[0]] = []
            rest.append(("b", f[0]))
        runs[f[0]].append(f)
    else:
        rest.append(("l", line.rstrip("\n")))
def fmt(x):
    return "%d" % x if x == int(x) and abs(x) >= 100 else "%.4g" % x
for kind, v in rest:
    if kind == "l":
        print(v); continue
    rs = runs[v]
    out = [v, "%d" % statistics.median(int(r[1]) for r in rs)]
    for i in range(2, len(rs[0]) - 1, 2):
        vals = [float(r[i]) for r in rs if len(r) > i + 1 and r[i + 1] == rs[0][i + 1]]
        cell = fmt(statistics.median(vals)) + " " + rs[0][i + 1]
        if len(vals) > 1:
            cell += " (%s–%s)" % (fmt(min(vals)), fmt(max(vals)))
        out.append(cell)
    print("\t".join(out) + ("\t[%d runs]" % len(rs) if len(rs) > 1 else ""))'
}

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
dir=$(mktemp -d)
redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no --dir "$dir" --daemonize yes --logfile "$dir/log" >/dev/null
trap 'redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true; rm -rf "$dir"' EXIT
for _ in $(seq 50); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done

limit=0
physical_limit() {
	local sha
	sha=$(redis-cli -p "$port" SCRIPT LOAD "$(cat redisstore/scripts/acquire.lua)")
	# 16-byte lease id and fingerprint, a 30 s lease; -r makes nearly every key new.
	limit=$(redis-benchmark -p "$port" -n 1000000 -c 50 -P 16 -r 100000000 --csv \
		EVALSHA "$sha" 1 'idem:{__rand_int__}' LLLLLLLLLLLLLLLL FFFFFFFFFFFFFFFF 30000 |
		awk -F'","' 'NR==2 {print int($2)}')
	echo "redis-benchmark -P 16 EVALSHA acquire.lua: $limit acquires/s  (limit for pairs: $((limit / 2))/s)"
	[ "${limit:-0}" -gt 0 ]
}
step "redis-benchmark (the physical limit)" physical_limit
limit=${limit:-0}
redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true

pairs() {
	local out rc=0
	out=$(go test -run '^$' -bench 'AcquireComplete' -benchtime "$benchtime" -count "$count" ./redisstore/ 2>&1) || rc=$?
	out=$(echo "$out" | medians)
	echo "$out" | benchlines
	[ "$limit" -gt 0 ] && echo "$out" | awk -v half=$((limit / 2)) '/pairs\/s/ {
		for (i = 1; i <= NF; i++) if ($(i+1) == "pairs/s") r = $i
		split($1, n, "/"); printf "%-9s %6.0f pairs/s = %3.0f%% of the limit for pairs\n", n[2], r, 100 * r / half }'
	return $rc
}
step "redisstore AcquireComplete" pairs

gobench() { # gobench ARGS...: go test -bench, its benchmark lines and failures
	local out rc=0
	out=$(go test -run '^$' "$@" 2>&1) || rc=$?
	echo "$out" | medians | benchlines
	return $rc
}
step "memstore and Guard" gobench -bench . -benchtime "$benchtime" -count "$count" ./memstore/ .

# The HTTP middleware (idemhttp): latency one request at a time, and
# throughput from 16 and 128 goroutines, against the test package's private
# redis-server. The targets compare with the Redis round trip as a handler
# pays it (a handler making one PING), measured in the same run.
latency() {
	local lat rc=0
	lat=$(go test -run '^$' -bench 'Latency' -benchtime 10000x -count "$count" ./idemhttp/ 2>&1) || rc=$?
	lat=$(echo "$lat" | medians)
	echo "$lat" | benchlines
	[ $rc -eq 0 ] || return $rc
	echo "$lat" | awk '
	/Benchmark/ { for (i = 1; i <= NF; i++) if ($(i+1) == "p50-µs") v = $i
		n = $1; sub(/^BenchmarkLatency\//, "", n); sub(/-[0-9]+$/, "", n); p[n] = v }
	END {
		rtt = p["no-layer+ping"] - p["no-layer"]
		printf "Redis round trip in a handler: %.1f µs\n", rtt
		printf "first request adds %.1f µs (target <= 2 x RTT + 50 = %.1f)\n", p["first/redis"] - p["no-layer"], 2 * rtt + 50
		printf "replay adds        %.1f µs (target <= RTT + 50 = %.1f)\n", p["replay/redis"] - p["no-layer"], rtt + 50
	}'
}
step "idemhttp Latency" latency
throughput() {
	local thr rc=0
	thr=$(go test -run '^$' -bench 'Throughput' -benchtime "$benchtime" -count "$count" ./idemhttp/ 2>&1) || rc=$?
	thr=$(echo "$thr" | medians)
	echo "$thr" | benchlines
	[ $rc -eq 0 ] || return $rc
	echo "$thr" | awk '
	/Benchmark/ { for (i = 1; i <= NF; i++) if ($(i+1) == "req/s") v = $i
		n = $1; sub(/^BenchmarkThroughput\//, "", n); sub(/-[0-9]+$/, "", n); r[n] = v }
	END { for (g = 16; g <= 128; g *= 8)
		printf "g%d: first/redis %.0f%%, replay/redis %.0f%%, first/memstore %.0f%% of no-layer\n", g,
			100 * r["g" g "/first/redis"] / r["g" g "/no-layer"], 100 * r["g" g "/replay/redis"] / r["g" g "/no-layer"],
			100 * r["g" g "/first/memstore"] / r["g" g "/no-layer"] }'
}
step "idemhttp Throughput" throughput

# Message consumers (idemmsg): messages/s through the Redis Streams and NATS
# JetStream adapters with and without the Deduplicator, per shape (Run
# loops x Concurrency); each idem row reports idem/raw.
step "idemmsg/redisstream Consume" gobench -bench Consume -benchtime 1x -count 1 ./idemmsg/redisstream/
step "idemmsg/natsjs Consume" gobench -bench Consume -benchtime 1x -count 1 ./idemmsg/natsjs/

# idem bench: the source articles' comparison, with the peers (BENCHMARKS.md,
# idem bench section). The same net/http handler behind naive GET-then-SET,
# WATCH/MULTI/EXEC, plain Lua and idem (both clients, and with Config.Wait),
# and behind the Go ecosystem's idempotency libraries (gofiber/fiber v3's
# idempotency middleware on its Redis storage; fiber without a layer; idem
# mounted in fiber), on a private redis-server that the bench starts, in four
# scenarios; idem's scenario b is set against the physical limit measured
# above. This is idem bench (internal/bench) run from internal/benchpeers, a
# module of its own so that the library's users never download the peers:
# the same flags, more implementations. About three minutes; IDEM_QUICK=true
# for the reduced size (every flag can come from IDEM_<FLAG>).
mkdir -p docs
step "idem bench" go run -C internal/benchpeers . bench --rounds "${ROUNDS:-3}" --targets --physical-limit "$limit" --json "$dir/idem-bench.json" --svg "$PWD/docs/bench.svg"

# The same with two server instances per implementation behind the load
# generator, round-robin: a library whose lock lives in one process (fiber's)
# shows its cross-instance duplicates. About two minutes.
step "idem bench --instances 2" go run -C internal/benchpeers . bench --rounds "${ROUNDS:-3}" --instances 2 --impls lua,idem-rueidis,idem-wait,idem-409,fiber --targets \
	--json "$dir/idem-bench-2.json"

# Consumers: watermill's Deduplicator middleware beside idem's Redis Streams
# consumer on one private redis-server, 16 consumers; a speed run, and a
# correctness run (two processes, re-published copies, transient failures)
# that counts duplicate effects and lost messages. About a minute.
step "consume (watermill)" go run -C internal/benchpeers . consume

if [ ${#failed[@]} -gt 0 ]; then
	echo >&2
	echo "bench.sh: ${#failed[@]} step(s) failed; their figures are missing above:" >&2
	printf '  - %s\n' "${failed[@]}" >&2
	exit 1
fi
