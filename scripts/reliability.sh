#!/usr/bin/env bash
# Runs the reliability suites (reliability/..., and the adapters' broker-fault
# scenarios under idemmsg/...) and prints the table of
# RELIABILITY.md built from the rows they report.
#
#   ./scripts/reliability.sh            the long versions (IDEM_RELIABILITY=long), several minutes
#   ./scripts/reliability.sh --short    the short versions, as the test command runs them
#
# The raw rows (JSON lines) are kept in reliability-rows.jsonl; the table
# goes to stdout. Longer fuzzing: FUZZTIME=10m ./scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=long
[ "${1:-}" = "--short" ] && mode=short
rows=reliability-rows.jsonl
: >"$rows"
export IDEM_RELIABILITY_OUT="$PWD/$rows"
if [ "$mode" = long ]; then
	export IDEM_RELIABILITY=long
fi
go test -race -count=1 -timeout 60m ./reliability/... ./idemmsg/... >&2
go run ./internal/reltest/table <"$rows"
