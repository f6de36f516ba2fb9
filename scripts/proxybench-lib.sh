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
