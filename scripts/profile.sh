#!/usr/bin/env bash
# CPU and allocation profiles of each path a request takes through idem,
# under load (issue 36): the Go benchmarks that drive each path from
# parallel goroutines (idem proxy's handler with a loopback upstream; the
# middleware's ServeHTTP; grpc-go over a loopback listener), one run with
# -cpuprofile, one with -memprofile at -memprofilerate 1 (every
# allocation; that run is slower, so its CPU is not profiled), then the top
# entries of each with go tool pprof: CPU by flat time, idem's own
# functions by cumulative CPU, allocations by count (alloc_objects).
#
# Usage: scripts/profile.sh [PATH-REGEX]   (only the paths whose names match)
#   OUT   keep the profiles and test binaries there (default: a temporary
#         directory, removed at exit); open one with
#         go tool pprof -http :0 OUT/NAME.test OUT/NAME.cpu
#   TOP   entries shown of each profile (default 15)
#   BENCHTIME  of each run (default 2s; the memory runs take a fixed count)
#
# Needs redis-server (the Redis rows start a private one). About 2 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."

match=${1:-.}
top=${TOP:-15}
benchtime=${BENCHTIME:-2s}
if [ -n "${OUT:-}" ]; then
	out=$OUT
	mkdir -p "$out"
else
	out=$(mktemp -d)
	trap 'rm -rf "$out"' EXIT
fi

# The paths: name, package, benchmark (a -bench pattern naming one
# sub-benchmark), and the count of the memory-profiled run.
paths=(
	"proxy-passthrough ./cmd/idem ^BenchmarkProxyHandler$/^passthrough-get$ 20000"
	"proxy-keyed-memory ./cmd/idem ^BenchmarkProxyHandler$/^keyed-memory$ 20000"
	"proxy-replay-memory ./cmd/idem ^BenchmarkProxyHandler$/^replay-memory$ 20000"
	"proxy-keyed-redis ./cmd/idem ^BenchmarkProxyHandler$/^keyed-redis$ 10000"
	"http-first-memory ./idemhttp ^BenchmarkServe$/^first/memstore$ 20000"
	"http-replay-memory ./idemhttp ^BenchmarkServe$/^replay/memstore$ 20000"
	"http-first-redis ./idemhttp ^BenchmarkServe$/^first/redis$ 10000"
	"grpc-first-memory ./idemgrpc ^BenchmarkLatency$/^first/memstore$ 5000"
	"grpc-first-redis ./idemgrpc ^BenchmarkLatency$/^first/redis$ 5000"
)

echo "$(go version); $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg); top $top entries"
for p in "${paths[@]}"; do
	read -r name pkg bench count <<<"$p"
	[[ $name =~ $match ]] || continue
	bin=$out/$(basename "$pkg").test
	[ -x "$bin" ] || go test -c -o "$bin" "$pkg"
	# A test binary runs in its package's directory, as go test runs it.
	(cd "$pkg" && "$bin" -test.run '^$' -test.bench "$bench" -test.benchtime "$benchtime" \
		-test.cpuprofile "$out/$name.cpu" >"$out/$name.cpu.txt")
	(cd "$pkg" && "$bin" -test.run '^$' -test.bench "$bench" -test.benchtime "${count}x" -test.benchmem \
		-test.memprofile "$out/$name.mem" -test.memprofilerate 1 >"$out/$name.mem.txt")
	echo
	echo "## $name ($pkg $bench)"
	echo
	grep '^Benchmark' "$out/$name.cpu.txt" || true
	echo
	echo "CPU, by flat time:"
	go tool pprof -top -nodecount "$top" "$bin" "$out/$name.cpu" 2>/dev/null | sed -n '/flat%/,$p'
	echo
	echo "CPU in idem's own functions, by cumulative time:"
	go tool pprof -top -cum -nodecount "$top" -show 'github.com/idemkit/' "$bin" "$out/$name.cpu" 2>/dev/null | sed -n '/flat%/,$p'
	echo
	echo "Allocations, by count:"
	go tool pprof -top -nodecount "$top" -sample_index=alloc_objects "$bin" "$out/$name.mem" 2>/dev/null | sed -n '/flat%/,$p'
done
