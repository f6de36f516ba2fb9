# The prologue the scripts/proxybench*.sh scripts share; each sources it
# (`. "$(dirname "$0")/proxybench-lib.sh"`) after `set -euo pipefail` and
# `cd` to the repository. Not a script of its own.
#
# It gives:
#   bench_need CMD...  installs, with apt-get, the Debian packages named as
#                      the commands that are missing (nginx is looked for in
#                      /usr/sbin too); nginx_bin is nginx's path after it
#   dir                a temporary directory, removed at exit
#   pids, pidfiles     processes started in the background (and pid files of
#                      daemons), killed at exit: append to them
#   port               prints a free loopback port
#   wait_port PORT     waits up to 10s for 127.0.0.1:PORT to accept
#   nginx_http_head    prints the start of an nginx http block under $dir:
#                      no access log, temp paths in $dir/nginx, connections
#                      never closed for their number of requests
#   summary_row NAME "RATES" "RATIOS"
#                      prints a markdown row: NAME, the median of the
#                      space-separated RATES and their spread, the median
#                      of the RATIOS and their spread
#   run_rounds         runs the rows: names[] and cmds[] (a command each,
#                      eval'ed, printing one line of space-separated
#                      figures) in $rounds rounds, every row once a round,
#                      in the opposite order from the round before, so that
#                      drift and a noisy moment touch all rows alike; the
#                      output of row I in round R is results[I,R]
#   summary_rows FIELD one summary_row per row of field FIELD (1-based) of
#                      results[], with its ratios, round by round, to the
#                      row base[I] (default 0); rows whose field is "-"
#                      (not measured) are left out
#   cpu_ticks PID      the CPU time (user and system) PID has used, in
#                      clock ticks (tick a second), from /proc/PID/stat

bench_need() {
	local sudo="" need=() c
	[ "$(id -u)" -eq 0 ] || sudo=sudo
	for c in "$@"; do
		if [ "$c" = nginx ]; then
			command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || need+=(nginx)
		else
			command -v "$c" >/dev/null || need+=("$c")
		fi
	done
	if [ ${#need[@]} -gt 0 ]; then
		$sudo apt-get update -qq
		DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
	fi
	nginx_bin=$(command -v nginx || echo /usr/sbin/nginx)
}

dir=$(mktemp -d)
pids=()
pidfiles=()
cleanup() {
	local p f
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
	for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
	for f in "${pidfiles[@]}"; do
		[ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null || true
	done
	rm -rf "$dir"
}
trap cleanup EXIT

port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() {
	for _ in $(seq 100); do
		(exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
		sleep 0.1
	done
	echo "nothing answers on 127.0.0.1:$1" >&2
	return 1
}

nginx_http_head() {
	mkdir -p "$dir/nginx"
	cat <<EOF
worker_processes 1;
pid $dir/nginx.pid;
error_log $dir/nginx-error.log warn;
daemon off;
events { worker_connections 4096; }
http {
	access_log off;
	client_body_temp_path $dir/nginx/body;
	proxy_temp_path $dir/nginx/proxy;
	fastcgi_temp_path $dir/nginx/fastcgi;
	uwsgi_temp_path $dir/nginx/uwsgi;
	scgi_temp_path $dir/nginx/scgi;
	keepalive_requests 1000000;
EOF
}

summary_row() {
	python3 -c '
import statistics, sys
v = [float(x) for x in sys.argv[2].split()]
q = [float(x) for x in sys.argv[3].split()]
print("| %s | %d | %d–%d | %.3f (%.3f–%.3f) |" % (sys.argv[1], statistics.median(v), min(v), max(v), statistics.median(q), min(q), max(q)))' \
		"$1" "$2" "$3"
}

declare -A results
run_rounds() {
	local r i n=${#cmds[@]} order
	for r in $(seq "$rounds"); do
		order=()
		for ((i = 0; i < n; i++)); do
			if ((r % 2)); then order+=("$i"); else order+=("$((n - 1 - i))"); fi
		done
		for i in "${order[@]}"; do
			results[$i,$r]=$(eval "${cmds[$i]}")
			echo "round $r: ${names[$i]}: ${results[$i,$r]}" >&2
		done
	done
}

summary_rows() {
	local field=$1 i r b v w vals ratios
	for i in "${!cmds[@]}"; do
		vals="" ratios=""
		b=${base[$i]:-0}
		for r in $(seq "$rounds"); do
			v=$(cut -d' ' -f"$field" <<<"${results[$i,$r]}")
			w=$(cut -d' ' -f"$field" <<<"${results[$b,$r]}")
			[ "$v" = - ] && continue 2
			vals+=" $v"
			ratios+=" $(awk -v a="$v" -v b="$w" 'BEGIN {printf "%.4f", a / b}')"
		done
		summary_row "${names[$i]}" "$vals" "$ratios"
	done
}

tick=$(getconf CLK_TCK)
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
