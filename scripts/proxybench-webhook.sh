#!/usr/bin/env bash
# What verifying a webhook's signature costs in idem proxy (BENCHMARKS.md,
# "Webhook signatures in idem proxy"): wrk (32 connections, 2 threads)
# against three idem proxies on the memory store, in front of one nginx
# upstream that answers a static 201 on keepalive connections
# (as scripts/proxybench.sh):
#   1. unsigned keyed POSTs: a unique Idempotency-Key per request;
#   2. GitHub webhooks: one body of BODY_BYTES (default 1024) signed once
#      here with openssl (X-Hub-Signature-256, HMAC-SHA256 under a
#      secret in a file), a unique X-GitHub-Delivery per request, on a
#      --config route with webhook: github (the route verifies each
#      request's signature over the body before it claims the key);
#   3. the same requests as 2 (signature header and all) to a proxy whose
#      route takes X-GitHub-Delivery as the key without verifying anything
#      (key: header:X-GitHub-Delivery), which tells the signature's cost
#      from the headers'.
# Each proxy has one --config route, POST /hook, with require_key.
# The unsigned rows send the same body. Every request is a first
# execution (outcome executed) in every row. Before measuring, the script
# checks that the webhook route refuses a bad signature (401), runs a good
# one, and replays its redelivery; every measured answer must be a 201.
# ROUNDS rounds (default 3), each running every row, in the opposite order
# from the round before; each row reports the median of its rounds, their
# spread (lowest-highest), and the median of its per-round ratios to the
# unsigned row; and the same of the CPU time its proxy took per request.
# Then go test's BenchmarkVerify (internal/webhook: the verification
# alone, per preset) and BenchmarkRouteFirstRequest (internal/sidecar: the
# three rows' middleware in process, with its CPU time per request);
# BENCH_VERIFY=0 skips them.
# idem proxy runs with its defaults (a JSON log line per request, to
# /dev/null), with no quota and a memory limit far above what the rounds
# store; nginx logs nothing and runs one worker (2 cores).
#
# Installs wrk, nginx and openssl with apt-get when missing. Starts
# everything on free loopback ports and stops it at the end. About
# ROUNDS x 3 x DURATION plus a minute (DURATION per row and round, default
# 10s; CONNECTIONS, default 32).
set -euo pipefail
cd "$(dirname "$0")/.."
duration=${DURATION:-10s}
conns=${CONNECTIONS:-32}
rounds=${ROUNDS:-3}
body_bytes=${BODY_BYTES:-1024}
[[ $body_bytes =~ ^[0-9]+$ ]] && ((body_bytes >= 64)) || { echo "BODY_BYTES=$body_bytes: want a number of bytes, at least 64" >&2; exit 2; }

. scripts/proxybench-lib.sh
bench_need wrk nginx openssl

up=$(port)
pkeyed=$(port)
phook=$(port)
pheader=$(port)

{
	nginx_http_head
	cat <<EOF
	server {
		listen 127.0.0.1:$up;
		location / { default_type application/json; return 201 '{"ok":true}\n'; }
	}
}
EOF
} >"$dir/nginx.conf"
"$nginx_bin" -c "$dir/nginx.conf" -p "$dir/nginx" &
pids+=($!)

go build -o "$dir/idem" ./cmd/idem

# The secret (made up here, never printed), its file, and the routes.
secret=$(openssl rand -hex 20)
printf '# the benchmark webhook'"'"'s secret\n%s\n' "$secret" >"$dir/github.secrets"
chmod 0400 "$dir/github.secrets"
# Each proxy's --config: one route, POST /hook, the three alike but for
# where the key comes from.
route() { # file, then the route's fields
	local f=$1
	shift
	{
		echo "routes:"
		echo "  - match: \"POST /hook\""
		echo "    require_key: true"
		for field in "$@"; do echo "    $field"; done
	} >"$dir/$f"
}
route keyed.yaml
route hook.yaml "webhook: github" "webhook_secret_file: $dir/github.secrets"
route header.yaml "key: header:X-GitHub-Delivery"

# A GitHub-like body of exactly body_bytes bytes, and its signature, once.
head='{"action":"opened","number":1042,"repository":{"full_name":"idemkit/idem"},"pad":"'
tail='"}'
pad=$((body_bytes - ${#head} - ${#tail}))
body="$head$(head -c "$pad" /dev/zero | tr '\0' x)$tail"
[ ${#body} -eq "$body_bytes" ] || { echo "body is ${#body} bytes; want $body_bytes" >&2; exit 1; }
sig=$(printf '%s' "$body" | openssl dgst -sha256 -hmac "$secret" -r | cut -d' ' -f1)

# idem proxy flags common to all: the memory store, unbounded for the
# rounds (no quota: every request is one tenant's, anonymous or
# webhook:github; a limit far above what they store); --v1-scopes off,
# else each new Idempotency-Key (row 1 only: v1.0 knew no other source)
# costs one more store read, for records of idem v1.0.
common=(--upstream "http://127.0.0.1:$up" --store memory --memory-limit 8GiB
	--quota-in-flight 0 --quota-records 0 --quota-bytes 0 --v1-scopes off)
declare -A pid_of # the proxy's pid, by port
# idem PORT [flags]: starts a proxy on PORT, its log (a line per request)
# to /dev/null; one that does not come up is run again for 3s to show why.
idem() {
	local p=$1
	shift
	"$dir/idem" proxy --listen "127.0.0.1:$p" "${common[@]}" "$@" 2>/dev/null &
	pids+=($!)
	pid_of[$p]=$!
	wait_port "$p" || { timeout 3 "$dir/idem" proxy --listen "127.0.0.1:$p" "${common[@]}" "$@" 2>&1 | head -5 >&2; exit 1; }
}
wait_port "$up"
idem "$pkeyed" --config "$dir/keyed.yaml"
idem "$phook" --config "$dir/hook.yaml"
idem "$pheader" --config "$dir/header.yaml"

# The webhook route does what is measured: a bad signature is refused, a
# good one runs, its redelivery (same X-GitHub-Delivery) is replayed.
hook() { # delivery signature [curl flags]: the answer's status line and headers
	curl -s -X POST --data-binary "$body" -H 'Content-Type: application/json' \
		-H "X-GitHub-Delivery: $1" -H "X-Hub-Signature-256: sha256=$2" -H 'X-GitHub-Event: pull_request' \
		"${@:3}" "http://127.0.0.1:$phook/hook"
}
bad=$(printf '%064d' 0)
check() { # delivery signature want what: want is "STATUS REPLAYED"
	local got
	got=$(hook "$1" "$2" -o /dev/null -D - | tr -d '\r' |
		awk 'NR == 1 {s = $2} tolower($1) == "idempotent-replayed:" {r = $2} END {print s, r}')
	if [ "$got" != "$3" ]; then
		echo "error: the webhook route answered \"$got\" to $4; want \"$3\". Its answer:" >&2
		hook "$1" "$2" -i >&2 || true
		exit 1
	fi
}
check check-1 "$bad" "401 " "a delivery with a wrong signature"
check check-2 "$sig" "201 " "a genuine delivery"
check check-2 "$sig" "201 true" "its redelivery"

# wrk scripts: the same body, a key unique to the request (the run, the
# thread's id, a counter) in Idempotency-Key or in X-GitHub-Delivery.
lua() { # header [extra headers, Lua table fields]
	cat <<EOF
local n, id = 0, 0
local run = "$(date +%s%N)"
local body = [[$body]]
setup = function(thread) thread:set("id", tostring(math.random(1, 1e9))) end
init = function() id = wrk.thread:get("id") end
request = function()
	n = n + 1
	return wrk.format("POST", "${3:-/}", {["Content-Type"] = "application/json", ["$1"] = run .. "-" .. id .. "-" .. n$2}, body)
end
EOF
}
lua Idempotency-Key "" /hook >"$dir/keyed.lua"
lua X-GitHub-Delivery ", [\"X-Hub-Signature-256\"] = \"sha256=$sig\", [\"X-GitHub-Event\"] = \"pull_request\"" /hook >"$dir/hook.lua"

# rate PORT PATH SCRIPT: the req/s over DURATION of the proxy on PORT, and
# the CPU time it took per request, in microseconds (user and system,
# from /proc/PID/stat, in clock ticks: 10 ms, under 0.1% of a 10 s run at
# the rates here), after checking that every answer was a 2xx and no
# socket failed. The CPU per request is the proxy's own: it moves less
# with the load of other processes than the rate does.
rate() {
	local out d=$duration pid=${pid_of[$1]} before after
	[ -n "${warm:-}" ] && d=3s
	before=$(cpu_ticks "$pid")
	out=$(wrk -t2 -c"$conns" -d"$d" -s "$3" "http://127.0.0.1:$1$2")
	after=$(cpu_ticks "$pid")
	if grep -q 'Non-2xx\|Socket errors' <<<"$out"; then
		echo "$out" >&2
		echo "error: answers other than 2xx, or socket errors, at 127.0.0.1:$1$2" >&2
		return 1
	fi
	awk -v t="$tick" -v c=$((after - before)) '/^Requests\/sec:/ {r = $2} / requests in / {n = $1} END {printf "%.0f %.1f\n", r, c / t * 1e6 / n}' <<<"$out"
}

names=("idem proxy, unsigned keyed POST (unique Idempotency-Key)"
	"idem proxy, GitHub webhook verified (unique X-GitHub-Delivery)"
	"idem proxy, the same requests, key: header:X-GitHub-Delivery (nothing verified)")
cmds=("rate $pkeyed /hook $dir/keyed.lua" "rate $phook /hook $dir/hook.lua" "rate $pheader /hook $dir/hook.lua")

# Warm every path (connections, caches), unmeasured.
warm=1
for i in "${!cmds[@]}"; do ${cmds[$i]} >/dev/null; done
warm=

load_before=$(cut -d' ' -f1-3 /proc/loadavg)
run_rounds
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

echo "wrk -t2 -c$conns -d$duration, $rounds rounds, body $body_bytes bytes; $(nproc) cores, load average $load_before before, $load_after after; $("$nginx_bin" -v 2>&1); $(openssl version | cut -d' ' -f1-2)"
echo
echo "| path | req/s, median | spread (lowest–highest) | vs unsigned keyed, median of rounds |"
echo "|---|---:|---:|---:|"
summary_rows 1
echo
echo "| path | the proxy's CPU a request, µs, median | spread | vs unsigned keyed, median of rounds |"
echo "|---|---:|---:|---:|"
summary_rows 2

if [ "${BENCH_VERIFY:-1}" != 0 ]; then
	echo
	echo "go test -run '^\$' -bench BenchmarkVerify -benchtime 2s ./internal/webhook/ (each preset's fixture, two secrets, the right one second)"
	echo
	go test -run '^$' -bench BenchmarkVerify -benchtime 2s ./internal/webhook/ | grep '^Benchmark'
	echo
	echo "go test -run '^\$' -bench BenchmarkRouteFirstRequest -benchtime 30000x -count 3 ./internal/sidecar/ (in process, 1 KiB body)"
	echo
	go test -run '^$' -bench BenchmarkRouteFirstRequest -benchtime 30000x -count 3 ./internal/sidecar/ | grep '^Benchmark'
fi
