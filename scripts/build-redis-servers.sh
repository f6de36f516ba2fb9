#!/usr/bin/env bash
# Builds the Redis-protocol servers the redisstore tests run besides the
# system's redis-server (Redis 7.0 on Debian 12): Valkey 9.1 and Redis 8.6,
# from Debian's own source packages (sid and experimental), when they are
# missing. The binaries are cached under $(go env GOPATH)/idem-servers:
#
#	idem-servers/valkey/valkey-server   (Valkey 9.1, Lua as a module)
#	idem-servers/redis8/redis-server    (Redis 8.6)
#
# where internal/redisserver looks for them. The system's apt configuration
# is never changed: a private sources list and private lists directory under
# the cache folder add the sid and experimental deb-src entries for
# `apt-get source --download-only` only. Building takes about 4 minutes for
# Valkey and 1.5 for Redis on 2 cores (make -j2 MALLOC=libc BUILD_TLS=no).
set -euo pipefail

root="$(go env GOPATH | cut -d: -f1)/idem-servers"
mkdir -p "$root"

want=()
[ -x "$root/valkey/valkey-server" ] || want+=(valkey/sid)
[ -x "$root/redis8/redis-server" ] || want+=(redis/experimental)
((${#want[@]})) || exit 0

sudo=""
[ "$(id -u)" = 0 ] || sudo="sudo"
# The build needs a C toolchain, pkg-config and dpkg-dev (dpkg-source, to
# unpack the source package).
need=()
command -v cc >/dev/null 2>&1 || need+=(build-essential)
command -v make >/dev/null 2>&1 || need+=(make)
command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)
command -v dpkg-source >/dev/null 2>&1 || need+=(dpkg-dev)
if ((${#need[@]})); then
	echo "build-redis-servers: installing ${need[*]}" >&2
	$sudo apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi

apt="$root/apt"
mkdir -p "$apt/lists/partial" "$apt/archives/partial" "$apt/src"
cat >"$apt/sources.list" <<'LIST'
deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian sid main
deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian experimental main
LIST
aptopts=(-o "Dir::Etc::sourcelist=$apt/sources.list" -o "Dir::Etc::sourceparts=-"
	-o "Dir::State::Lists=$apt/lists" -o "Dir::Cache::archives=$apt/archives"
	-o "APT::Get::List-Cleanup=0" -o "APT::Sandbox::User=root")
echo "build-redis-servers: fetching ${want[*]} source (private apt lists in $apt)" >&2
apt-get -qq "${aptopts[@]}" update
(cd "$apt/src" && apt-get -qq "${aptopts[@]}" source --download-only "${want[@]}")

build() { # name dsc-glob binary-name destination
	local name=$1 glob=$2 bin=$3 dest=$4 dsc dir
	dsc=$(ls "$apt/src"/$glob | sort -V | tail -n 1)
	dir="$apt/src/build-$name"
	rm -rf "$dir"
	dpkg-source --no-check -x "$dsc" "$dir" >/dev/null
	echo "build-redis-servers: building $name ($(basename "$dsc"))" >&2
	make -C "$dir" -j2 MALLOC=libc BUILD_TLS=no >"$dir.log" 2>&1 || {
		tail -n 40 "$dir.log" >&2
		echo "build-redis-servers: building $name failed (log: $dir.log)" >&2
		return 1
	}
	mkdir -p "$dest.tmp"
	cp "$dir/src/$bin" "$dest.tmp/"
	rm -rf "$dest" && mv "$dest.tmp" "$dest"
	# (Valkey's Lua is a module built into valkey-server; the tests unload
	# it with MODULE UNLOAD lua for a server without scripting.)
	rm -rf "$dir" "$dir.log"
}
for w in "${want[@]}"; do
	case $w in
	valkey/sid) build valkey 'valkey_*.dsc' valkey-server "$root/valkey" ;;
	redis/experimental) build redis8 'redis_*.dsc' redis-server "$root/redis8" ;;
	esac
done
