#!/usr/bin/env bash
# What idem proxy costs beside nginx, side by side in one run (BENCHMARKS.md,
# "idem proxy"): wrk (32 connections, 2 threads) against
#   1. nginx proxy_pass to the upstream (keepalive upstream connections);
#   2. a bare net/http/httputil.ReverseProxy (Go's standard library, with a
#      Transport that keeps 256 idle connections to the upstream);
#   3. idem proxy passing a GET through (not covered), and a POST without
#      an Idempotency-Key (passed_through);
#   4. idem proxy with a unique Idempotency-Key per POST, on the memory
#      store and on a private redis-server;
# all in front of one nginx upstream that answers a static 201 on keepalive
# connections. ROUNDS rounds (default 3), each running every row once, in
# the opposite order from the round before; each row reports the median of
# its rounds' req/s, their spread (lowest–highest), and the median (and
# spread) of its per-round ratios to nginx proxy_pass; then the CPU time
# each proxy process took per request (from /proc/PID/stat; not nginx's,
# whose worker serves the upstream too), beside the bare ReverseProxy's.
# idem proxy runs with its defaults (a JSON log line per request, here to
# /dev/null); nginx logs nothing.
#
# Installs wrk and nginx with apt-get when missing. Starts everything on
# free loopback ports and stops it at the end. About two minutes
# (DURATION per row and round, default 5s; ROUNDS, default 3; CONNECTIONS,
# default 32).
set -euo pipefail
cd "$(dirname "$0")/.."
duration=${DURATION:-5s}
conns=${CONNECTIONS:-32}
rounds=${ROUNDS:-3}

. scripts/proxybench-lib.sh
bench_need wrk nginx redis-server

up=$(port)
front=$(port)
bare=$(port)
pmem=$(port)
predis=$(port)
rport=$(port)

# nginx: the upstream (a static 201) and the front (proxy_pass to it), one
# process, one worker each way (2 cores: one worker), no logs.
{
	nginx_http_head
	cat <<EOF
	upstream app { server 127.0.0.1:$up; keepalive 64; }
	server {
		listen 127.0.0.1:$up;
		location / { default_type application/json; return 201 '{"ok":true}\n'; }
	}
	server {
		listen 127.0.0.1:$front;
		location / {
			proxy_pass http://app;
			proxy_http_version 1.1;
			proxy_set_header Connection "";
		}
	}
}
EOF
} >"$dir/nginx.conf"
"$nginx_bin" -c "$dir/nginx.conf" -p "$dir/nginx" &
pids+=($!)

# The bare ReverseProxy: the standard library only.
mkdir -p "$dir/bare"
cat >"$dir/bare/main.go" <<'EOF'
package main

import (
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
)

func main() {
	target, _ := url.Parse(os.Args[2])
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.MaxIdleConnsPerHost = 256
	rp := &httputil.ReverseProxy{Rewrite: func(pr *httputil.ProxyRequest) { pr.SetURL(target); pr.SetXForwarded() }, Transport: t}
	panic(http.ListenAndServe(os.Args[1], rp))
}
EOF
printf 'module bare\n\ngo 1.22\n' >"$dir/bare/go.mod"
(cd "$dir/bare" && go build -o "$dir/bare-proxy" .)
go build -o "$dir/idem" ./cmd/idem
"$dir/bare-proxy" "127.0.0.1:$bare" "http://127.0.0.1:$up" &
bare_pid=$!
pids+=($!)

redis-server --port "$rport" --bind 127.0.0.1 --save "" --appendonly no --dir "$dir" \
	--daemonize yes --pidfile "$dir/redis.pid" --logfile "$dir/redis.log" >/dev/null
pidfiles+=("$dir/redis.pid")
"$dir/idem" proxy --listen "127.0.0.1:$pmem" --upstream "http://127.0.0.1:$up" --store memory \
	--memory-limit 2GiB 2>/dev/null &
pmem_pid=$!
pids+=($!)
"$dir/idem" proxy --listen "127.0.0.1:$predis" --upstream "http://127.0.0.1:$up" \
	--store "redis://127.0.0.1:$rport/0" 2>/dev/null &
predis_pid=$!
pids+=($!)
for p in "$up" "$front" "$bare" "$rport" "$pmem" "$predis"; do wait_port "$p"; done

# wrk scripts: a POST without a key, and a POST with a key unique to the
# request (the thread's id, a counter, the run).
cat >"$dir/post.lua" <<'EOF'
wrk.method = "POST"
wrk.body = '{"amount":1}'
wrk.headers["Content-Type"] = "application/json"
EOF
cat >"$dir/keyed.lua" <<EOF
local n, id = 0, 0
local run = "$(date +%s%N)"
setup = function(thread) thread:set("id", tostring(math.random(1, 1e9))) end
init = function() id = wrk.thread:get("id") end
request = function()
	n = n + 1
	return wrk.format("POST", "/", {["Content-Type"] = "application/json", ["Idempotency-Key"] = run .. "-" .. id .. "-" .. n}, '{"amount":1}')
end
EOF

# rate PID URL [script]: req/s, and the CPU time the process PID (a proxy)
# took per request in microseconds ("-" for PID -: nginx, whose one worker
# also serves the upstream), after checking that every answer was a 201.
rate() {
	local pid=$1 url=$2 script=${3:-} out before=0 after=0
	[ "$pid" = - ] || before=$(cpu_ticks "$pid")
	if [ -n "$script" ]; then
		out=$(wrk -t2 -c"$conns" -d"$duration" -s "$script" "$url")
	else
		out=$(wrk -t2 -c"$conns" -d"$duration" "$url")
	fi
	[ "$pid" = - ] || after=$(cpu_ticks "$pid")
	if grep -q 'Non-2xx\|Socket errors' <<<"$out"; then
		echo "$out" >&2
		echo "error: answers other than 201, or socket errors, at $url" >&2
		return 1
	fi
	awk -v t="$tick" -v c=$((after - before)) -v cpu="$pid" '/^Requests\/sec:/ {r = $2} / requests in / {n = $1}
		END {if (cpu == "-") printf "%.0f -\n", r; else printf "%.0f %.1f\n", r, c / t * 1e6 / n}' <<<"$out"
}

# Warm every path (connections, caches), untimed.
for u in "$front" "$bare" "$pmem"; do DURATION=2s wrk -t1 -c4 -d2s "http://127.0.0.1:$u/" >/dev/null; done
wrk -t1 -c4 -d2s -s "$dir/keyed.lua" "http://127.0.0.1:$predis/" >/dev/null

# The rows: name, then the command of one round's measurement; every
# row's baseline is row 0, nginx proxy_pass.
names=("nginx proxy_pass (keepalive upstream)" "bare httputil.ReverseProxy" "idem proxy, GET passed through"
	"idem proxy, POST without a key" "idem proxy, keyed, memory store, unique keys" "idem proxy, keyed, Redis, unique keys")
cmds=("rate - http://127.0.0.1:$front/" "rate $bare_pid http://127.0.0.1:$bare/" "rate $pmem_pid http://127.0.0.1:$pmem/"
	"rate $pmem_pid http://127.0.0.1:$pmem/ $dir/post.lua" "rate $pmem_pid http://127.0.0.1:$pmem/ $dir/keyed.lua"
	"rate $predis_pid http://127.0.0.1:$predis/ $dir/keyed.lua")

load_before=$(cut -d' ' -f1-3 /proc/loadavg)
run_rounds
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

echo "wrk -t2 -c$conns -d$duration, $rounds rounds; $(nproc) cores, load average $load_before before, $load_after after; $(redis-server --version | awk '{print $1, $2, $3}'), $("$nginx_bin" -v 2>&1)"
echo
echo "| path | req/s, median | spread (lowest–highest) | vs nginx proxy_pass, median of rounds (spread) |"
echo "|---|---:|---:|---:|"
summary_rows 1
echo
echo "| path | the proxy's CPU a request, µs, median | spread | vs bare ReverseProxy, median of rounds (spread) |"
echo "|---|---:|---:|---:|"
base=(1 1 1 1 1 1)
summary_rows 2
