#!/usr/bin/env bash
# Mutation check, run before a release (not part of scripts/test.sh).
#
# Each mutant is one deliberate bug: a literal text in one file replaced by
# another (the text must occur exactly once). The script copies the tree
# (the working tree, .git left out) to a temporary directory, first runs
# every mutant's targeted tests there unmutated (a mutant only counts as
# killed if its tests pass without it), then, one mutant at a time, applies
# it to the copy, runs its targeted tests (go test -count=1 -run PATTERN),
# and puts the file back. The tree it was started from is never changed;
# the copy is removed on exit, also on failure or Ctrl-C.
#
# It fails (exit 1) if any mutant SURVIVES (its tests pass with the bug),
# if a mutant no longer applies (its text is gone or not unique: update the
# mutant), if a mutated tree does not build, or if the baseline fails.
#
# Usage: scripts/mutants.sh [NAME-REGEX]   (only the mutants whose names match)
# MUTANTS_GOFLAGS adds go test flags (e.g. -race; the default is none).
#
# Needs what the targeted tests need: redis-server, PostgreSQL and dynalite (see
# scripts/test.sh, which installs them). It takes about 10 minutes on a
# 2-core machine shared with other work (the baseline about 2.5 of them,
# then 3 to 35 seconds per mutant); the first build in the copy compiles
# the module's packages again.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
only="${1:-}"
goflags=(${MUTANTS_GOFLAGS:-})

tmp="$(mktemp -d "${TMPDIR:-/tmp}/idem-mutants.XXXXXX")"
trap 'chmod -R u+w "$tmp" 2>/dev/null; rm -rf "$tmp"' EXIT
tree="$tmp/tree"
mkdir "$tree"
tar -C "$root" --exclude=./.git -cf - . | tar -C "$tree" -xf -

names=() files=() olds=() news=() pkgs=() runs=()

# mutant NAME FILE PACKAGES RUN-PATTERN OLD NEW
mutant() {
	if [[ -n "$only" && ! "$1" =~ $only ]]; then
		return
	fi
	names+=("$1") files+=("$2") pkgs+=("$3") runs+=("$4") olds+=("$5") news+=("$6")
}

# --- redisstore: the lease and token checks of every Lua script, and the mismatch.
mutant redis-complete-repeat-token redisstore/scripts/complete.lua ./redisstore 'TestConformance' \
	"string.sub(rec, 2, 7) == ARGV[2] and string.sub(rec, 24) == ARGV[4]" \
	"string.sub(rec, 24) == ARGV[4]"
mutant redis-complete-lease redisstore/scripts/complete.lua ./redisstore 'TestConformance' \
	"if kind == 70 and #rec == 39 and string.sub(rec, 24) == ARGV[1] then" \
	"if kind == 70 and #rec == 39 then"
mutant redis-acquire-repeat-lease redisstore/scripts/acquire.lua ./redisstore 'TestConformance' \
	"if string.sub(rec, 24) == ARGV[1] then" \
	"if true then"
mutant redis-acquire-mismatch-in-flight redisstore/scripts/acquire.lua ./redisstore 'TestConformance' \
	$'if string.sub(rec, 8, 23) ~= ARGV[2] then\n      return {4, held, 0}' \
	$'if false then\n      return {4, held, 0}'
mutant redis-acquire-mismatch-completed redisstore/scripts/acquire.lua ./redisstore 'TestConformance' \
	$'if string.sub(rec, 8, 23) ~= ARGV[2] then\n      return {4, done, 0}' \
	$'if false then\n      return {4, done, 0}'
mutant redis-acquire-token-after-release redisstore/scripts/acquire.lua ./redisstore 'TestConformance' \
	"if last >= token then" \
	"if false then"
mutant redis-renew-lease redisstore/scripts/renew.lua ./redisstore 'TestConformance' \
	"or string.sub(rec, 24) ~= ARGV[1] then" \
	"then"
mutant redis-release-lease redisstore/scripts/release.lua ./redisstore 'TestConformance' \
	"if kind == 70 and #rec == 39 and string.sub(rec, 24) == ARGV[1] then" \
	"if kind == 70 and #rec == 39 then"
mutant redis-release-repeat-token redisstore/scripts/release.lua ./redisstore 'TestConformance' \
	"and string.sub(rec, 2, 7) == ARGV[2] then" \
	"then"
mutant redis-hold-lease redisstore/scripts/hold.lua './redisstore ./tieredstore' 'TestLayered|TestTwoHoldersOneCommit|TestCompleteTxExpiredLease' \
	"or string.sub(rec, 24) ~= ARGV[1] then" \
	"then"
mutant redis-raise-lease redisstore/scripts/raise.lua './redisstore ./tieredstore' 'TestLayered|TestStaleToken' \
	"or string.sub(rec, 24) ~= ARGV[1] then" \
	"then"
mutant redis-fill-token redisstore/scripts/fill.lua './redisstore ./tieredstore' 'TestLayered|TestFlushAll|TestRelay|TestTwoHoldersOneCommit' \
	$'elseif had > token then\n        return {0}' \
	$'elseif false then\n        return {0}'

# --- memstore and the waiters: the fingerprint checks, seen through idemhttp.
mutant memstore-mismatch memstore/memstore.go ./idemhttp 'TestMismatch' \
	"case r.fp != req.Fingerprint:" \
	"case false:"
mutant memstore-mismatch-in-flight memstore/memstore.go ./idemhttp 'TestMismatchWhileInFlight' \
	"case r.fp != req.Fingerprint:" \
	"case r.fp != req.Fingerprint && r.state != idem.StateInFlight:"
mutant waiters-handoff-fingerprint internal/waiters/waiters.go ./idemhttp 'TestWaiter' \
	"if r == nil || r.Response == nil || r.Fingerprint != fp {" \
	"if r == nil || r.Response == nil {"

# --- dynamostore: the conditions of its writes, the token counter, the
# read path's expiry, the repeat checks, and the item of a failed condition.
mutant dynamo-acquire-expired dynamostore/store.go ./dynamostore 'TestConformance$' \
	'OR #s = :rel OR #e <= :now"' \
	'OR #s = :rel"'
mutant dynamo-acquire-token dynamostore/store.go ./dynamostore 'TestConformance$' \
	'#t = if_not_exists(#t, :now) + :one,' \
	'#t = if_not_exists(#t, :now),'
mutant dynamo-acquire-mismatch dynamostore/store.go ./dynamostore 'TestConformance$' \
	'case it.fp != req.Fingerprint:' \
	'case false:'
mutant dynamo-held-expiry dynamostore/store.go ./dynamostore 'TestConformance$' \
	'const held = "#s = :fl AND #l = :lid AND #e > :now"' \
	'const held = "#s = :fl AND #l = :lid"'
mutant dynamo-held-lease dynamostore/store.go ./dynamostore 'TestConformance$' \
	'const held = "#s = :fl AND #l = :lid AND #e > :now"' \
	'const held = "#s = :fl AND #e > :now"'
mutant dynamo-repeat-token dynamostore/store.go ./dynamostore 'TestConformance$' \
	'it.state == state && it.token == l.Token:' \
	'it.state == state:'
mutant dynamo-get-expired dynamostore/store.go ./dynamostore 'TestConformance$' \
	'if !it.live(now.UnixMilli()) {' \
	'if it == nil {'
mutant dynamo-all-old dynamostore/store.go ./dynamostore 'TestConditionFailureAllOld' \
	'av := ccf.Item' \
	'var av map[string]types.AttributeValue'
mutant dynamo-ttl-push dynamostore/store.go ./dynamostore 'TestTTLAttribute' \
	'if int64(tok) > nowMS+s.skew.Milliseconds()/2 {' \
	'if false {'
mutant dynamo-omit-large dynamostore/store.go ./dynamostore 'TestItemTooLarge' \
	'if len(enc) <= room || resp.Blob != nil' \
	'if len(enc) <= room+MaxItemSize || resp.Blob != nil'
mutant dynamo-lost-resend dynamostore/store.go ./dynamostore 'TestLostAnswers' \
	'if err == nil || i >= sendAttempts || !again(err) || ctx.Err() != nil {' \
	'if true {'
mutant dynamo-lost-acquire-lease dynamostore/store.go ./dynamostore 'TestLostAnswers' \
	'case it.state == idem.StateInFlight && it.lease == req.LeaseID:' \
	'case false:'
mutant dynamo-lost-delete-unsent dynamostore/store.go ./dynamostore 'TestLostAnswers' \
	'resend(ctx, unsent, func()' \
	'resend(ctx, unanswered, func()'
# The resends through a proxy that cuts connections (TestCutConnections):
# none at all; a half-read answer not taken for a lost one; a Complete
# that never arrived taken for done; a whole answer sent again.
mutant dynamo-cut-resend-once dynamostore/store.go ./dynamostore 'TestCutConnections' \
	'const sendAttempts = 3' \
	'const sendAttempts = 1'
mutant dynamo-cut-half-answer dynamostore/store.go ./dynamostore 'TestCutConnections' \
	'return errors.As(err, &de) && cutShort(de.Err)' \
	'return errors.As(err, &de) && false'
mutant dynamo-cut-unanswered-done dynamostore/store.go ./dynamostore 'TestCutConnections' \
	$'state idem.State, err error) error {\n\tif err == nil {' \
	$'state idem.State, err error) error {\n\tif err == nil || unanswered(err) {'
mutant dynamo-cut-answer-resent dynamostore/store.go ./dynamostore 'TestCutConnections' \
	$'if errors.As(err, &rse) {\n\t\treturn true' \
	$'if errors.As(err, &rse) || true {\n\t\treturn true'

# --- CompleteTx of an expired lease.
mutant pgstore-completetx-expiry pgstore/sql.go ./pgstore 'TestCompleteTx$' \
	$'AND lease_id = $3\n\tAND expires_at > statement_timestamp()`\n\n// completeSQL' \
	$'AND lease_id = $3`\n\n// completeSQL'
mutant tieredstore-completetx-expiry tieredstore/tx.go ./tieredstore 'TestCompleteTxExpiredLease' \
	$'fp, err := s.redis.Hold(ctx, l, max(l.TTL, time.Millisecond))\n\tif err != nil {' \
	$'fp, err := s.redis.Hold(ctx, l, max(l.TTL, time.Millisecond))\n\tif err != nil && !errors.Is(err, idem.ErrLeaseLost) {'

# --- the engine under idemhttp and idemgrpc: the work context (its bounds),
# and idemgrpc's detachment from the caller, seen through idemgrpc.
mutant engine-work-context-max-execution internal/engine/engine.go ./idemgrpc 'TestMaxExecutionAndStop' \
	"context.WithTimeoutCause(ctx, e.cfg.MaxExecution, idem.ErrMaxExecution)" \
	"context.WithTimeoutCause(ctx, e.cfg.MaxExecution, nil)"
mutant idemgrpc-work-context idemgrpc/server.go ./idemgrpc 'TestClientTimeoutThenRetry' \
	"d := s.eng.Acquire(ctx, context.WithoutCancel(ctx), key, fp, method)" \
	"d := s.eng.Acquire(ctx, ctx, key, fp, method)"

# The engine's panic handling: a key neither completed nor released is
# released at End; the outcome is reported once.
mutant engine-end-releases internal/engine/engine.go ./idemgrpc 'TestPanic' \
	$'\tif !w.settled {' \
	$'\tif false {'
mutant engine-report-once internal/engine/engine.go ./idemgrpc 'TestPanicInOnOutcomeReleases' \
	"if w.reported || w.report == nil {" \
	"if w.report == nil {"

# --- idemhttp: the work context, the capture after a client leaves, the
# Transport's key.
mutant idemhttp-work-context idemhttp/middleware.go ./idemhttp 'TestClientTimeoutWorkRunsToEnd|TestClientLeavesMidBody' \
	$'\t\tparent = context.WithoutCancel(parent)\n' \
	$'\t\t_ = context.WithoutCancel\n'
mutant idemhttp-capture-after-client-gone idemhttp/capture.go ./idemhttp 'TestClientLeavesMidBody|TestClientStopsReading' \
	$'\tc.keep(p[:n])\n\treturn n, nil\n}' \
	$'\tif c.gone == nil {\n\t\tc.keep(p[:n])\n\t}\n\treturn n, nil\n}'
mutant idemhttp-transport-key-per-attempt idemhttp/transport.go ./idemhttp 'TestTransport' \
	$'\t\t\tareq = out.WithContext(ctx)\n' \
	$'\t\t\tareq = out.WithContext(ctx)\n\t\t\tareq.Header = out.Header.Clone()\n\t\t\tareq.Header.Set(HeaderKey, fmt.Sprint(key, "-", attempt))\n'
mutant idemhttp-transport-key-redirect idemhttp/transport.go ./idemhttp 'TestTransport' \
	"if prev := req.Response; prev != nil && prev.Request != nil {" \
	"if prev := req.Response; false && prev != nil && prev.Request != nil {"

# --- the proxy's upstream transport (sendOnce): no resend.
mutant proxy-sendonce-getbody cmd/idem/proxy_upstream.go ./cmd/idem 'TestSendOnceWithGetBody|TestProxyNeverResendsUpstream' \
	$'\tout.GetBody = nil\n' \
	$'\t_ = out.GetBody\n'
mutant proxy-sendonce-key-header cmd/idem/proxy_upstream.go ./cmd/idem 'TestSendOnceWithGetBody|TestProxyNeverResendsUpstream' \
	$'\t\t\t\tout.Header = sidecar.HideReplayHints(out.Header)\n' \
	$'\t\t\t\t_ = sidecar.HideReplayHints\n'

if ((${#names[@]} == 0)); then
	echo "mutants.sh: no mutant matches '$only'" >&2
	exit 2
fi

# gotest LOG PACKAGES PATTERN: runs the tests in the copy; 0 pass, 1 fail,
# 2 build failure.
gotest() {
	local log="$1" pkgs="$2" run="$3"
	# shellcheck disable=SC2086 # PACKAGES is a list
	if (cd "$tree" && go test -count=1 -timeout 10m "${goflags[@]}" -run "$run" $pkgs) >"$log" 2>&1; then
		return 0
	fi
	if grep -q -e '\[build failed\]' -e '\[setup failed\]' -e '^# ' "$log"; then
		return 2
	fi
	return 1
}

start=$SECONDS
echo "mutants.sh: ${#names[@]} mutants; baseline first (the targeted tests, unmutated)"
declare -A seen=()
for i in "${!names[@]}"; do
	k="${pkgs[$i]}|${runs[$i]}"
	[[ -n "${seen[$k]:-}" ]] && continue
	seen[$k]=1
	if ! gotest "$tmp/log" "${pkgs[$i]}" "${runs[$i]}"; then
		echo "baseline FAILED: go test -run '${runs[$i]}' ${pkgs[$i]} fails without any mutant:"
		tail -40 "$tmp/log"
		exit 1
	fi
done
echo "baseline passed ($((SECONDS - start))s)"

survived=() broken=()
for i in "${!names[@]}"; do
	name="${names[$i]}" file="$tree/${files[$i]}"
	cp "$file" "$tmp/orig"
	if ! OLD="${olds[$i]}" NEW="${news[$i]}" perl -0pi -e '
		my $n = () = /\Q$ENV{OLD}\E/g;
		if ($n != 1) { print STDERR "found $n times, want once\n"; exit 3 }
		s/\Q$ENV{OLD}\E/$ENV{NEW}/;' "$file" 2>"$tmp/log"; then
		echo "BROKEN   $name: its text in ${files[$i]} $(cat "$tmp/log"): update the mutant"
		cp "$tmp/orig" "$file"
		broken+=("$name")
		continue
	fi
	t0=$SECONDS
	rc=0
	gotest "$tmp/log" "${pkgs[$i]}" "${runs[$i]}" || rc=$?
	cp "$tmp/orig" "$file"
	case $rc in
	0)
		echo "SURVIVED $name: go test -run '${runs[$i]}' ${pkgs[$i]} passes with ${files[$i]} mutated ($((SECONDS - t0))s)"
		survived+=("$name")
		;;
	1)
		by="$(grep -o -- '--- FAIL: [^ ]*' "$tmp/log" | awk '{print $3}' | sort -u | awk -F/ 'NF == 1' | head -4 | paste -sd, -)"
		echo "killed   $name by ${by:-a failing test} ($((SECONDS - t0))s)"
		;;
	2)
		echo "BROKEN   $name: the mutated tree does not build:"
		grep -v '^ok\|^FAIL\|^---' "$tmp/log" | head -5
		broken+=("$name")
		;;
	esac
done

echo "mutants.sh: ${#names[@]} mutants, $((${#names[@]} - ${#survived[@]} - ${#broken[@]})) killed, ${#survived[@]} survived, ${#broken[@]} broken, in $((SECONDS - start))s"
if ((${#survived[@]} + ${#broken[@]})); then
	exit 1
fi
