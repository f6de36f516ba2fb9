#!/usr/bin/env bash
# Measures the figures in BENCHMARKS.md, side by side in one run:
#   1. the physical limit: redis-benchmark's pipelined EVALSHA rate for
#      idem's own acquire script on a private redis-server, on fresh keys;
#   2. full acquire+complete pairs/s from 64 goroutines with rueidis and
#      go-redis (go test -bench, against the test package's private server);
#   3. the in-memory store and the Guard.
# Bounded: about two minutes. Loopback only.
set -euo pipefail
cd "$(dirname "$0")/.."
benchtime=${BENCHTIME:-5s}

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
dir=$(mktemp -d)
redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no --dir "$dir" --daemonize yes --logfile "$dir/log" >/dev/null
trap 'redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true; rm -rf "$dir"' EXIT
for _ in $(seq 50); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done

sha=$(redis-cli -p "$port" SCRIPT LOAD "$(cat redisstore/scripts/acquire.lua)")
# 16-byte lease id and fingerprint, a 30 s lease; -r makes nearly every key new.
limit=$(redis-benchmark -p "$port" -n 1000000 -c 50 -P 16 -r 100000000 --csv \
	EVALSHA "$sha" 1 'idem:{__rand_int__}' LLLLLLLLLLLLLLLL FFFFFFFFFFFFFFFF 30000 |
	awk -F'","' 'NR==2 {print int($2)}')
echo "redis-benchmark -P 16 EVALSHA acquire.lua: $limit acquires/s  (limit for pairs: $((limit / 2))/s)"
redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true

out=$(go test -run '^$' -bench 'AcquireComplete' -benchtime "$benchtime" -count 1 ./redisstore/)
echo "$out" | grep Benchmark
echo "$out" | awk -v half=$((limit / 2)) '/pairs\/s/ {
	for (i = 1; i <= NF; i++) if ($(i+1) == "pairs/s") r = $i
	split($1, n, "/"); printf "%-9s %6.0f pairs/s = %3.0f%% of the limit for pairs\n", n[2], r, 100 * r / half }'

go test -run '^$' -bench . -benchtime "$benchtime" -count 1 ./memstore/ . | grep Benchmark
