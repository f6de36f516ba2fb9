#!/usr/bin/env bash
# gRPC and HTTPS through idem proxy beside nginx, side by side in one run
# (BENCHMARKS.md, "gRPC and HTTPS through idem proxy beside nginx"):
#   1. gRPC unary calls: ghz against nginx grpc_pass (keep-alive upstream
#      connections) and against idem proxy (h2c listener, h2c:// upstream),
#      unkeyed (passed through) and keyed (a unique idempotency-key
#      metadata per call, ghz's {{.UUID}}) on the memory store, all in
#      front of one grpc-go server (internal/bench/grpcupstream) whose one
#      method answers at once;
#   2. HTTPS (TLS, keep-alive, HTTP/1.1): wrk against nginx ssl +
#      proxy_pass and against idem proxy --tls-cert/--tls-key, a GET
#      passed through, in front of an nginx upstream answering a static 201
#      (as scripts/proxybench.sh). When the idem binary has no --tls-cert
#      flag yet, these rows are left out and the script says so.
# ROUNDS rounds (default 3), each running every row once, in the opposite
# order from the round before, so that drift and a noisy moment touch all
# rows alike; each row reports the median of its rounds, their spread
# (lowest–highest) and the median of its per-round ratios to nginx. Every
# call must succeed (gRPC status OK, HTTP 2xx), else the script fails.
# idem proxy runs with its defaults (a JSON log line per request, here to
# /dev/null); nginx logs nothing and runs one worker (2 cores).
#
# Installs nginx, wrk and openssl with apt-get and ghz with go install
# (from the Go module proxy, into $(go env GOPATH)/bin) when missing. Starts
# everything on free loopback ports and stops it at the end. About three
# minutes (DURATION per row and round, default 10s; CONNECTIONS, default
# 32: wrk's connections and ghz's concurrent calls, over GRPC_CONNS
# HTTP/2 connections, default 2).
set -euo pipefail
cd "$(dirname "$0")/.."
duration=${DURATION:-10s}
conns=${CONNECTIONS:-32}
grpc_conns=${GRPC_CONNS:-2}
rounds=${ROUNDS:-3}
secs=${duration%s}
[[ $secs =~ ^[0-9]+$ ]] || { echo "DURATION=$duration: want whole seconds, such as 10s" >&2; exit 2; }

. scripts/proxybench-lib.sh
bench_need wrk nginx openssl
gobin="$(go env GOPATH | cut -d: -f1)/bin"
ghz=$(command -v ghz || echo "$gobin/ghz")
if [ ! -x "$ghz" ]; then
	echo "proxybench-h2.sh: installing ghz v0.120.0 (go install, a few minutes)" >&2
	GOBIN="$gobin" go install github.com/bojand/ghz/cmd/ghz@v0.120.0
fi

up=$(port)      # nginx: the static 201 (HTTPS rows' upstream)
gup=$(port)     # grpcupstream
gfront=$(port)  # nginx grpc_pass
tfront=$(port)  # nginx ssl + proxy_pass
gidem=$(port)   # idem proxy, h2c -> h2c://
tidem=$(port)   # idem proxy, TLS -> http://

go build -o "$dir/idem" ./cmd/idem
go build -o "$dir/grpcupstream" ./internal/bench/grpcupstream
tls=true
"$dir/idem" proxy -h 2>&1 | grep -q -- '-tls-cert' || tls=false

# One self-signed P-256 certificate for both TLS listeners (wrk does not
# verify it).
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 -subj /CN=127.0.0.1 \
	-addext subjectAltName=IP:127.0.0.1 -keyout "$dir/key.pem" -out "$dir/cert.pem" 2>/dev/null

"$dir/grpcupstream" "127.0.0.1:$gup" >/dev/null &
pids+=($!)

# nginx: the static upstream, grpc_pass (HTTP/2 cleartext listener) and
# ssl + proxy_pass, one process, one worker (2 cores), no logs. Connections
# are never closed for their number of requests (keepalive_requests, which
# covers HTTP/2 connections too).
{
	nginx_http_head
	cat <<EOF
	upstream app { server 127.0.0.1:$up; keepalive 64; keepalive_requests 1000000; }
	upstream grpcapp { server 127.0.0.1:$gup; keepalive 64; keepalive_requests 1000000; }
	server {
		listen 127.0.0.1:$up;
		location / { default_type application/json; return 201 '{"ok":true}\n'; }
	}
	server {
		listen 127.0.0.1:$gfront http2;
		location / { grpc_pass grpc://grpcapp; }
	}
	server {
		listen 127.0.0.1:$tfront ssl;
		ssl_certificate $dir/cert.pem;
		ssl_certificate_key $dir/key.pem;
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

"$dir/idem" proxy --listen "127.0.0.1:$gidem" --upstream "h2c://127.0.0.1:$gup" --store memory \
	--memory-limit 2GiB 2>/dev/null &
pids+=($!)
ports=("$up" "$gup" "$gfront" "$tfront" "$gidem")
if $tls; then
	"$dir/idem" proxy --listen "127.0.0.1:$tidem" --tls-cert "$dir/cert.pem" --tls-key "$dir/key.pem" \
		--upstream "http://127.0.0.1:$up" --store memory 2>/dev/null &
	pids+=($!)
	ports+=("$tidem")
fi
for p in "${ports[@]}"; do wait_port "$p"; done

# grpc ADDR [keyed]: calls/s, after checking that every call ended OK
# (ghz's JSON report, which lists every call, in a file). A timed ghz run
# (-z) cancels the calls in flight when its time is up, which then count
# as Unavailable: so a measured run makes a number of calls, calls[ADDR
# keyed], which the warm-up (warm=1, timed, not checked) sets to last about
# DURATION.
declare -A calls
grpc() {
	local addr=$1 keyed=${2:-}
	local args=(--insecure --proto internal/bench/grpcupstream/bench.proto --call bench.Bench/Charge
		-d '{"value":1}' -c "$conns" --connections "$grpc_conns" --format json)
	[ -n "$keyed" ] && args+=(--metadata '{"idempotency-key":"{{.UUID}}"}')
	if [ -n "${warm:-}" ]; then
		"$ghz" "${args[@]}" -z 3s "$addr" >"$dir/ghz.json"
		calls[$addr $keyed]=$(python3 -c 'import json, sys; print(int(json.load(open(sys.argv[1]))["rps"] * float(sys.argv[2])))' "$dir/ghz.json" "$secs")
		return
	fi
	"$ghz" "${args[@]}" -n "${calls[$addr $keyed]}" "$addr" >"$dir/ghz.json"
	python3 -c '
import json, sys
r = json.load(open(sys.argv[1]))
codes = r.get("statusCodeDistribution") or {}
bad = {k: v for k, v in codes.items() if k != "OK"}
if bad or r.get("errorDistribution") or not codes.get("OK"):
    sys.exit("error: calls not OK at %s: %s %s" % (sys.argv[2], codes, r.get("errorDistribution")))
print("%.0f" % r["rps"])' "$dir/ghz.json" "$addr"
}

# https URL: req/s over DURATION, after checking that every answer was a
# 2xx and no socket failed.
https() {
	local out d=$duration
	[ -n "${warm:-}" ] && d=3s
	out=$(wrk -t2 -c"$conns" -d"$d" "$1")
	if grep -q 'Non-2xx\|Socket errors' <<<"$out"; then
		echo "$out" >&2
		echo "error: answers other than 2xx, or socket errors, at $1" >&2
		return 1
	fi
	awk '/^Requests\/sec:/ {printf "%.0f", $2}' <<<"$out"
}

# The rows: name, then the command that measures one round. A row's
# baseline is the nginx row named in base[].
names=("nginx grpc_pass (keep-alive upstream)" "idem proxy, gRPC passed through (h2c -> h2c://)"
	"idem proxy, keyed gRPC, memory store, unique keys")
cmds=("grpc 127.0.0.1:$gfront" "grpc 127.0.0.1:$gidem" "grpc 127.0.0.1:$gidem keyed")
base=(0 0 0)
if $tls; then
	names+=("nginx ssl + proxy_pass (keep-alive upstream)" "idem proxy --tls-cert, GET passed through")
	cmds+=("https https://127.0.0.1:$tfront/" "https https://127.0.0.1:$tidem/")
	base+=(3 3)
fi

# Warm every path (connections, TLS sessions, caches), unmeasured, and
# size the gRPC runs. (eval in this shell: calls[] is set here.)
warm=1
for i in "${!cmds[@]}"; do eval "${cmds[$i]}" >/dev/null; done
warm=

load_before=$(cut -d' ' -f1-3 /proc/loadavg)
run_rounds
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

echo "ghz $(go version -m "$ghz" | awk '$1 == "mod" {print $3}') -c$conns --connections $grpc_conns, about $duration a run (-n); wrk -t2 -c$conns -d$duration; $rounds rounds"
echo "$(nproc) cores, load average $load_before before, $load_after after; $("$nginx_bin" -v 2>&1); $(openssl version | cut -d' ' -f1-2)"
$tls || echo "(idem proxy has no --tls-cert: the HTTPS rows were not run)"
echo
echo "| path | calls or req/s, median | spread (lowest–highest) | vs nginx, median of rounds |"
echo "|---|---:|---:|---:|"
summary_rows 1
