#!/usr/bin/env bash
# Mutation check, run before a release (scripts/test.sh runs only --check).
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
#        scripts/mutants.sh --check [NAME-REGEX]
# MUTANTS_GOFLAGS adds go test flags (e.g. -race; the default is none).
#
# --check runs no test (seconds; scripts/test.sh runs it): it fails when a
# mutant's text does not occur exactly once in its file, or when an
# alternative of its -run pattern names no test function (func TestX in a
# _test.go file) of its packages, naming the mutant and what to update.
#
# PACKAGES are go test's package arguments, in the main module; DIR:PKGS
# runs PKGS in the module at DIR (caddyidem:. is caddyidem's module).
#
# Needs what the targeted tests need: redis-server, PostgreSQL, dynalite,
# mariadbd, fauxqs, aws-lambda-rie, Valkey 9.1 and Redis 8.6
# (scripts/build-redis-servers.sh) and Caddy's modules (see scripts/test.sh,
# which installs them all). 95 mutants: about 25 minutes on a quiet 2-core machine
# (twice that shared with other work; the baseline about 2 of them, then 6 to 55 seconds
# per mutant); the first build in the copy compiles the module's packages
# (and Caddy's module's) again.
set -euo pipefail
# The whole script is read before it runs (the braces), so that editing it
# during a run (adding a mutant) leaves the run alone.
{
root="$(cd "$(dirname "$0")/.." && pwd)"
check=""
if [[ "${1:-}" == --check ]]; then
	check=1
	shift
fi
only="${1:-}"
goflags=(${MUTANTS_GOFLAGS:-})
# The tests send traffic to loopback only: the AWS SDK (dynamostore,
# idemmsg/sqs, idemlambda) must never look for credentials at the EC2
# metadata address.
export AWS_EC2_METADATA_DISABLED=true

names=() files=() olds=() news=() pkgs=() runs=()

# mutant NAME FILE PACKAGES RUN-PATTERN OLD NEW
mutant() {
	if [[ -n "$only" && ! "$1" =~ $only ]]; then
		return
	fi
	names+=("$1") files+=("$2") pkgs+=("$3") runs+=("$4") olds+=("$5") news+=("$6")
}

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
# idemgrpc's stored body in the encoded response's own array: capped, so
# that an append to it never writes into that array.
mutant idemgrpc-inline-body-capped idemgrpc/encoding.go ./idemgrpc 'TestEncodeBodyIsMarshal' \
	"return slices.Clip(b), nil" \
	"return b, nil"
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
# The body read by hand (readBody): its limit, and the server told to
# close the connection past it, as http.MaxBytesReader tells it.
mutant idemhttp-body-past-limit idemhttp/middleware.go ./idemhttp 'TestBodyTooLarge' \
	$'\t\t\tpastLimit(w)\n' \
	$'\t\t\t_ = pastLimit\n'
mutant idemhttp-body-limit-counted idemhttp/middleware.go ./idemhttp 'TestReadBodyLimit' \
	$'\t\tleft -= int64(n)\n' \
	$'\t\tleft -= int64(n) / 2\n'
# v1.0's tenant taken from today's only while the header is the one hashed,
# and only when no API key is part of today's.
mutant idemhttp-v1-tenant-shared idemhttp/middleware.go ./idemhttp 'TestV1TenantRecords' \
	'auth != "" && auth == req.v1Authz {' \
	'auth != "" && req.v1Authz != "" {'
mutant ident-tenant-v1-api-key internal/ident/ident.go ./idemhttp 'TestV1TenantRecords' \
	$'\t\tasV1 = false\n' \
	$'\t\t_ = asV1\n'
# capture.WriteString keeps what Write keeps once the client is gone.
mutant idemhttp-writestring-after-client-gone idemhttp/capture.go ./idemhttp 'TestCaptureWriteStringAsWrite' \
	'c.gone, n, err = err, len(s), nil' \
	'c.gone, err = err, nil'
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
	$'\t\t\t\tout.Body = nil\n\t\t\t\tout.Header = sidecar.HideReplayHints(out.Header)\n' \
	$'\t\t\t\tout.Body = nil\n\t\t\t\t_ = sidecar.HideReplayHints\n'

# --- mysqlstore: the conditions of its statements (the lease, the expiry,
# the repeat's token), the takeover's token floor, and the mismatch.
mutant mysql-takeover-token-floor mysqlstore/sql.go ./mysqlstore 'TestOvertakenDraw' \
	'const takeover = `(state = 3 OR expires_at <= UTC_TIMESTAMP(6)) AND ? > token`' \
	'const takeover = `(state = 3 OR expires_at <= UTC_TIMESTAMP(6)) AND ? > 0`'
mutant mysql-takeover-expired mysqlstore/sql.go ./mysqlstore 'TestConformance$' \
	'const takeover = `(state = 3 OR expires_at <= UTC_TIMESTAMP(6)) AND ? > token`' \
	'const takeover = `(state = 3) AND ? > token`'
mutant mysql-get-expiry mysqlstore/sql.go ./mysqlstore 'TestConformance$' \
	$'` + "`key`" + ` = ? AND expires_at > UTC_TIMESTAMP(6)`\n\n// renewSQL' \
	$'` + "`key`" + ` = ?`\n\n// renewSQL'
mutant mysql-renew-lease mysqlstore/sql.go ./mysqlstore 'TestConformance$' \
	$'LAST_INSERT_ID(token), expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND\nWHERE namespace = ? AND ` + "`key`" + ` = ? AND state = 1 AND lease_id = ?' \
	$'LAST_INSERT_ID(token), expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND\nWHERE namespace = ? AND ` + "`key`" + ` = ? AND state = 1 AND (lease_id = ? OR TRUE)'
mutant mysql-complete-lease mysqlstore/sql.go ./mysqlstore 'TestConformance$' \
	'AND lease_id = ? AND (state = 1 OR (state = 2 AND token = ?))`' \
	'AND (lease_id = ? OR TRUE) AND (state = 1 OR (state = 2 AND token = ?))`'
mutant mysql-complete-repeat-token mysqlstore/sql.go ./mysqlstore 'TestConformance$|TestRepeatNeedsLease' \
	'(state = 1 OR (state = 2 AND token = ?))`' \
	'(state = 1 OR (state = 2 AND (token = ? OR TRUE)))`'
mutant mysql-complete-expiry mysqlstore/sql.go ./mysqlstore 'TestConformance$' \
	$'expires_at > UTC_TIMESTAMP(6)\n\tAND lease_id = ? AND (state = 1 OR (state = 2' \
	$'TRUE\n\tAND lease_id = ? AND (state = 1 OR (state = 2'
mutant mysql-completetx-expiry mysqlstore/sql.go ./mysqlstore 'TestCompleteTx$' \
	$'AND state = 1 AND lease_id = ?\n\tAND expires_at > UTC_TIMESTAMP(6)`\n\n// releaseSQL' \
	$'AND state = 1 AND lease_id = ?`\n\n// releaseSQL'
mutant mysql-release-repeat-token mysqlstore/sql.go ./mysqlstore 'TestConformance$|TestRepeatNeedsLease' \
	'(state = 1 OR (state = 3 AND token = ?))`' \
	'(state = 1 OR (state = 3 AND (token = ? OR TRUE)))`'
mutant mysql-acquire-mismatch mysqlstore/mysqlstore.go ./mysqlstore 'TestConformance$' \
	'case rec.Fingerprint != req.Fingerprint:' \
	'case false:'

# --- idemmsg/sqs: a message is held (its visibility extended) while it is
# handled, deleted once acknowledged, and handed back otherwise.
mutant sqs-extend-visibility idemmsg/sqs/sqs.go ./idemmsg/sqs 'TestVisibilityExtended' \
	'failed := r.changeVisibility(ctx, r.vis, chunk, "extend")' \
	'failed := r.changeVisibility(ctx, minVisibility, chunk, "extend")'
mutant sqs-extend-loop idemmsg/sqs/sqs.go ./idemmsg/sqs 'TestVisibilityExtended' \
	$'\tif r.extendEvery > 0 {\n' \
	$'\tif false {\n'
mutant sqs-delete-acked idemmsg/sqs/sqs.go ./idemmsg/sqs 'TestAdapterSuite/Standard/Duplicates$' \
	$'case idemmsg.Executed, idemmsg.Replayed:\n\t\tr.delete(sctx, msg)' \
	$'case idemmsg.Executed, idemmsg.Replayed:\n\t\tr.release(msg)'
mutant sqs-delete-dead-lettered idemmsg/sqs/sqs.go ./idemmsg/sqs 'TestAdapterSuite/Standard/PoisonDeadLettered$' \
	$'\t\tr.delete(sctx, msg)\n\t\treturn true, nil\n\tcase idemmsg.InFlight:' \
	$'\t\tr.release(msg)\n\t\treturn true, nil\n\tcase idemmsg.InFlight:'
mutant sqs-batch-delete idemmsg/sqs/batch.go ./idemmsg/sqs 'TestAdapterSuite/Standard/Batch/Duplicates$' \
	$'\t\t\tr.delete(sctx, del...)\n' \
	$'\t\t\tr.release(del...)\n'
mutant sqs-inflight-comes-back idemmsg/sqs/sqs.go ./idemmsg/sqs 'TestInFlightComesBack' \
	$'\tcase idemmsg.InFlight:\n\t\tr.setVisibility(sctx, res.RetryAfter, msg)' \
	$'\tcase idemmsg.InFlight:\n\t\tr.setVisibility(sctx, maxVisibility, msg)'

# --- idemlambda: the SQS batch's item failures (each failed record, and
# after the first on a FIFO queue), and the lease an invocation gets.
mutant lambda-batch-handler-error idemlambda/sqs.go ./idemlambda 'TestPowertoolsBatchSQS|TestRIESQSPartialBatchResponse' \
	$'\t\t\tfail(i)\n\t\t\tstopped = b.cfg.FIFO\n\t\t\tcontinue\n\t\t}\n\t\tok = true' \
	$'\t\t\tstopped = b.cfg.FIFO\n\t\t\tcontinue\n\t\t}\n\t\tok = true'
mutant lambda-batch-fifo-stop idemlambda/sqs.go ./idemlambda 'TestSQSFIFOStopsAtFirstFailure' \
	$'\t\t\tfail(i)\n\t\t\tstopped = b.cfg.FIFO\n\t\t\tcontinue\n\t\t}\n\t\tok = true' \
	$'\t\t\tfail(i)\n\t\t\tcontinue\n\t\t}\n\t\tok = true'
mutant lambda-batch-in-flight idemlambda/sqs.go ./idemlambda 'TestSQSRecordInFlightElsewhere' \
	$'\t\t\tfail(i)\n\t\t\tstopped = b.cfg.FIFO\n\t\t\tcontinue\n\t\t}\n\t\tatt := bg.Attempt' \
	$'\t\t\tstopped = b.cfg.FIFO\n\t\t\tcontinue\n\t\t}\n\t\tatt := bg.Attempt'
mutant lambda-batch-duplicate idemlambda/sqs.go ./idemlambda 'TestPowertoolsBatchSQS|TestSQSDuplicateSharesFailure' \
	'if !*earlier[reqs[j].Key] {' \
	'if false {'
mutant lambda-lease-renewed idemlambda/lease.go ./idemlambda 'TestLongInvocationRenewsItsLease' \
	$'\tif ttl >= gs.cfg.Lease {\n\t\treturn gs.cfg.Lease, false\n\t}' \
	$'\tif ttl >= gs.cfg.Lease {\n\t\treturn gs.cfg.Lease, true\n\t}'
mutant lambda-lease-deadline idemlambda/lease.go ./idemlambda 'TestRIETimeoutFreesKeyAfterLease|TestWaitStopsAtTheDeadline' \
	'return max(ttl, minLease), true' \
	'return gs.cfg.Lease, false'

# --- internal/waiters: a request waits only for a holder of the same
# fingerprint, and the holder's Wake hands its result to every waiter.
mutant waiters-hold-fingerprint internal/waiters/waiters.go ./internal/waiters 'TestJoinOrAsk|TestHeldKeyWaitsForWake' \
	$'\t\tif h.fp != fp {\n' \
	$'\t\tif false {\n'
mutant waiters-ask-fingerprint internal/waiters/waiters.go ./internal/waiters 'TestJoinOrAsk' \
	$'\tcase a.fp != fp:\n' \
	$'\tcase false:\n'
mutant waiters-answer-result internal/waiters/waiters.go ./internal/waiters 'TestJoinOrAsk' \
	$'\tw.unask(key).answer(res)\n' \
	$'\tw.unask(key).answer(nil)\n'
mutant waiters-answer-replay-result internal/waiters/waiters.go ./internal/waiters 'TestAnswerReplay' \
	'c.answer(&Result{Fingerprint: fp, Response: resp})' \
	'c.answer(nil)'
mutant waiters-wake-result internal/waiters/waiters.go ./internal/waiters 'TestWakeHandsResult' \
	$'\t\tl.result = res\n' \
	$'\t\t_ = res\n'
mutant waiters-wake-hold-count internal/waiters/waiters.go ./internal/waiters 'TestHeldKeyWaitsForWake|TestWakeHandsResult|TestJoinOrAsk' \
	'if h := w.holds[key]; h.n > 1 {' \
	'if h := w.holds[key]; h.n > 0 {'

# --- caddyidem (a module of its own: PACKAGES caddyidem:.): a key is
# scoped by the tenant, the path the upstream sees and the prefix, and a
# leased request without a body goes without the headers that let
# net/http resend it.
mutant caddy-tenant-header caddyidem/handler.go caddyidem:. 'TestScope$' \
	'h.mw, err = s.Middleware(store, sidecar.TenantFunc(s.TenantHeader, s.TenantCookie), nil, env)' \
	'h.mw, err = s.Middleware(store, sidecar.TenantFunc("", s.TenantCookie), nil, env)'
mutant caddy-scope-route caddyidem/handler.go caddyidem:. 'TestScope$' \
	'h.mw, err = s.Middleware(store, sidecar.TenantFunc(s.TenantHeader, s.TenantCookie), nil, env)' \
	'h.mw, err = s.Middleware(store, sidecar.TenantFunc(s.TenantHeader, s.TenantCookie), func(*http.Request) string { return "/" }, env)'
mutant caddy-store-prefix caddyidem/store.go caddyidem:. 'TestScope$' \
	'return fmt.Sprintf("store\x00%s\x00%s\x00%d\x00%d", s.url, s.prefix, s.memLimit, s.reapEvery)' \
	'return fmt.Sprintf("store\x00%s\x00%s\x00%d\x00%d", s.url, "", s.memLimit, s.reapEvery)'
mutant caddy-tenant-header-value internal/sidecar/sidecar.go caddyidem:. 'TestScope$' \
	$'\t\tcase len(vs) == 1 && vs[0] != "":\n\t\t\treturn "hdr:" + vs[0]' \
	$'\t\tcase len(vs) == 1 && vs[0] != "":\n\t\t\treturn "hdr:"'
mutant caddy-bodiless-hide-hints caddyidem/handler.go caddyidem:. 'TestBodilessSentOnce' \
	$'\t\t\tr.Header = sidecar.HideReplayHints(r.Header)\n' \
	$'\t\t\t_ = sidecar.HideReplayHints\n'

# --- redisstore, last: TestConformance matches TestConformanceServers, which
# runs on Valkey 9.1 and Redis 8.6 (scripts/build-redis-servers.sh).

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

# --- redisstore's replay cache: a hint (which lets a cached copy answer)
# only for a completed record of the request's fingerprint, voided by
# this store's Delete and Fill, before and after the change, also for the
# calls in flight when they ran. (A cached copy's bound past the record's
# expiry has no mutant: rueidis bounds it by the PTTL it reads as well.)
mutant redis-cache-fingerprint redisstore/cache.go ./redisstore 'TestCacheKeepsReplayRules' \
	"if len(v) <= fpEnd || v[0] != 'C' || !bytes.Equal(v[tokenEnd:fpEnd], fp[:]) {" \
	"if len(v) <= fpEnd || v[0] != 'C' || !bytes.Equal(v[tokenEnd:fpEnd], v[tokenEnd:fpEnd]) {"
mutant redis-cache-forget-generation redisstore/cache.go ./redisstore 'TestCacheLateHintAfterChange' \
	$'\trc.gens[h%genShards].Add(1)\n' \
	''
mutant redis-cache-completed-generation redisstore/cache.go ./redisstore 'TestCacheLateHintAfterChange' \
	'if rc.gens[h%genShards].Load() != m.gen {' \
	'if false {'
mutant redis-cache-delete-forgets redisstore/store.go ./redisstore 'TestCacheHintDuringChange' \
	$'\ts.cache.forget(s.KeyName(key))\n\tif err != nil {\n\t\treturn false, &idem.StoreError{Op: "delete"' \
	$'\tif err != nil {\n\t\treturn false, &idem.StoreError{Op: "delete"'
mutant redis-cache-fill-forgets redisstore/layered.go ./redisstore 'TestCacheHintDuringChange' \
	$'\ts.cache.forget(s.KeyName(f.Key)) // and any hint a call in flight set, as Delete does\n' \
	''

# --- redisstore's native path (SET IFEQ, no scripts): every write that
# depends on the record compares it; a claim that found a record reads it
# again, and claims again when it changed; the checks of its steps.
mutant redis-native-cas-ifeq redisstore/native.go ./redisstore 'TestNativeCommands' \
	$'\t\tcmd = append(cmd, "IFEQ", string(st.v))\n' \
	$'\t\t_ = st.v\n'
mutant redis-native-fast-complete-ifeq redisstore/native.go ./redisstore 'TestConformanceServers' \
	'return []string{"SET", key, "C" + token + string(m.fp[:]) + args[3], "IFEQ", held, "PX", px}' \
	'return []string{"SET", key, "C" + token + string(m.fp[:]) + args[3], "PX", px}'
mutant redis-native-fast-release-ifeq redisstore/native.go ./redisstore 'TestNativeCommands' \
	'return []string{"SET", key, "R" + token, "IFEQ", held, "PX", px}' \
	'return []string{"SET", key, "R" + token, "PX", px}'
mutant redis-native-claim-reread redisstore/native.go ./redisstore 'TestNativeCommands' \
	$'\t\t\tif !same {\n\t\t\t\treturn reply{}, false, nil // changed since the claim: claim again\n\t\t\t}\n\t\t}\n\t\trep, w := acquireStep' \
	$'\t\t\tif !same && false {\n\t\t\t\treturn reply{}, false, nil // changed since the claim: claim again\n\t\t\t}\n\t\t}\n\t\trep, w := acquireStep'
mutant redis-native-acquire-mismatch redisstore/native.go ./redisstore 'TestConformanceServers' \
	$'\t\tcase string(v[tokenEnd:fpEnd]) != fp:\n\t\t\treturn reply{n: [3]int64{4, held, 0}}, nil' \
	$'\t\tcase false:\n\t\t\treturn reply{n: [3]int64{4, held, 0}}, nil'
mutant redis-native-complete-repeat-token redisstore/native.go ./redisstore 'TestConformanceServers' \
	"case len(v) >= fpEnd && v[0] == 'C' && string(v[1:tokenEnd]) == token && string(v[fpEnd:]) == resp:" \
	"case len(v) >= fpEnd && v[0] == 'C' && (string(v[1:tokenEnd]) == token || true) && string(v[fpEnd:]) == resp:"
mutant redis-native-token-holds redisstore/native.go ./redisstore 'TestNativeTokens' \
	'return cl.low > 0 && cl.t0 >= cl.st.now && cl.t0-cl.low <= maxAhead && cl.t0-cl.st.now <= maxAhead' \
	'return cl.low > 0'

if ((${#names[@]} == 0)); then
	echo "mutants.sh: no mutant matches '$only'" >&2
	exit 2
fi

# pkgdirs PACKAGES: the directories (relative to the module root) of a
# mutant's packages, one a line; ./x/... is x and every directory below.
pkgdirs() {
	local p dir
	# shellcheck disable=SC2086 # PACKAGES is a list
	for p in $(pkglist "$1"); do
		dir="$(pkgmod "$1")/${p#./}"
		if [[ "$dir" == */... ]]; then
			find "$root/${dir%/...}" -type d -not -path '*/testdata*' -printf '%P\n' |
				sed "s|^|${dir%/...}/|; s|/$||"
		else
			echo "$dir"
		fi
	done
}

# pkgmod PACKAGES: the module directory of a mutant's packages ("." for the
# main module; "caddyidem:./..." names caddyidem's module, its go.mod).
pkgmod() {
	if [[ "$1" == *:* ]]; then
		echo "${1%%:*}"
	else
		echo .
	fi
}

# pkglist PACKAGES: the packages, as go test takes them in their module.
pkglist() {
	echo "${1#*:}"
}

# --check: each mutant's text occurs exactly once in its file, and every
# alternative of its -run pattern names a test function of its packages.
# No test runs; scripts/test.sh calls it, so that a change which moves a
# mutant's text, or renames its test, fails the test command at once.
if [[ -n "$check" ]]; then
	bad=0
	for i in "${!names[@]}"; do
		name="${names[$i]}" file="$root/${files[$i]}"
		if [[ ! -f "$file" ]]; then
			echo "mutants.sh --check: mutant $name: its file ${files[$i]} does not exist: update the mutant (scripts/mutants.sh)" >&2
			bad=1
			continue
		fi
		if ! n="$(OLD="${olds[$i]}" perl -0ne 'my $n = () = /\Q$ENV{OLD}\E/g; print $n' "$file")"; then
			n="?"
		fi
		if [[ "$n" != 1 ]]; then
			echo "mutants.sh --check: mutant $name: its text occurs $n times in ${files[$i]}, want once: update the mutant's text (scripts/mutants.sh) to the code that now does what it guards" >&2
			bad=1
		fi
		tests="$(pkgdirs "${pkgs[$i]}" | while read -r d; do
			[[ -d "$root/$d" ]] || { echo "MISSING:$d"; continue; }
			cat /dev/null "$root/$d"/*_test.go 2>/dev/null | grep -oE '^func Test[A-Za-z0-9_]*\(' | sed 's/^func //; s/($//'
		done)"
		if missing="$(grep '^MISSING:' <<<"$tests")"; then
			echo "mutants.sh --check: mutant $name: its package directory ${missing#MISSING:} does not exist: update its PACKAGES (scripts/mutants.sh)" >&2
			bad=1
			continue
		fi
		IFS='|' read -r -a alts <<<"${runs[$i]}"
		for alt in "${alts[@]}"; do
			alt="${alt%%/*}" # a subtest's path: its test function
			if ! grep -qE -- "$alt" <<<"$tests"; then
				echo "mutants.sh --check: mutant $name: '$alt' of its -run pattern '${runs[$i]}' names no test function in ${pkgs[$i]}: update its pattern (scripts/mutants.sh) to the tests that kill it" >&2
				bad=1
			fi
		done
	done
	if ((bad)); then
		exit 1
	fi
	echo "mutants.sh --check: ${#names[@]} mutants: each text occurs once in its file, each -run pattern names tests of its packages"
	exit 0
fi

tmp="$(mktemp -d "${TMPDIR:-/tmp}/idem-mutants.XXXXXX")"
trap 'chmod -R u+w "$tmp" 2>/dev/null; rm -rf "$tmp"' EXIT
tree="$tmp/tree"
mkdir "$tree"
tar -C "$root" --exclude=./.git -cf - . | tar -C "$tree" -xf -

# gotest LOG PACKAGES PATTERN: runs the tests in the copy; 0 pass, 1 fail,
# 2 build failure.
gotest() {
	local log="$1" pkgs="$2" run="$3"
	# shellcheck disable=SC2086 # PACKAGES is a list
	if (cd "$tree/$(pkgmod "$pkgs")" && go test -count=1 -timeout 10m "${goflags[@]}" -run "$run" $(pkglist "$pkgs")) >"$log" 2>&1; then
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
exit
}
