package faults

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redisserver"
	"github.com/idemkit/idem/internal/reltest"
)

// TestScriptFlush empties Redis's script cache every few milliseconds under
// load. Every store call runs its script with EVALSHA and, on NOSCRIPT,
// sends it again with EVAL: the flushes must be invisible to clients (no
// 503 at all), and nothing may run twice or be lost. The store timeout is
// 2s here, so that a slow moment of a loaded machine is not mistaken for a
// failure to reload a script.
func TestScriptFlush(t *testing.T) {
	t.Parallel()
	for _, client := range clients {
		t.Run(client, func(t *testing.T) {
			h := newHarness(t, client, harnessOpts{timeout: 2 * time.Second})
			h.warm(4)
			keys := keyNames("flush", reltest.Scale(40, 400))
			dur := time.Duration(reltest.Scale(1200, 30000)) * time.Millisecond

			stop := make(chan struct{})
			flushes := 0
			go func() {
				defer close(stop)
				for end := time.Now().Add(dur); time.Now().Before(end); flushes++ {
					if _, err := h.redis.Do("SCRIPT", "FLUSH"); err != nil {
						t.Errorf("SCRIPT FLUSH: %v", err)
						return
					}
					time.Sleep(3 * time.Millisecond)
				}
			}()
			h.load(keys, loadWorkers, stop)
			h.settle(keys)
			tl := h.check(nil)

			noscript := errorStat(t, h.redis, "NOSCRIPT")
			if noscript == 0 {
				t.Errorf("no NOSCRIPT reply in %d flushes: the fault did not reach the clients", flushes)
			}
			for label, n := range h.errorCounts() {
				if label != "409" { // 409: two workers drew the same key at once
					t.Errorf("%d× %s under SCRIPT FLUSH, want none", n, label)
				}
			}
			if tl.duplicates != 0 || tl.lost != 0 || tl.stuck != 0 {
				t.Errorf("duplicates %d, lost %d, stuck %d; want 0", tl.duplicates, tl.lost, tl.stuck)
			}
			h.report("SCRIPT FLUSH under load", fmt.Sprintf("SCRIPT FLUSH every ~3ms for %v (%d flushes), %d workers", dur, flushes, loadWorkers),
				tl, fmt.Sprintf("%d NOSCRIPT replies, all absorbed by the EVAL fallback; 409s are concurrent requests for one key", noscript))
		})
	}
}

// errorStat returns the count of error replies with the given prefix that
// the server has sent (INFO errorstats).
func errorStat(t testing.TB, s *redisserver.Server, prefix string) int {
	t.Helper()
	info, err := s.Do("INFO", "errorstats")
	if err != nil {
		t.Fatalf("INFO errorstats: %v", err)
	}
	v, ok := redisserver.InfoField(info, "errorstat_"+prefix)
	if !ok {
		return 0
	}
	n, _ := strconv.Atoi(strings.TrimPrefix(v, "count="))
	return n
}

// TestRedisRestart kills Redis under load and starts it again on the same
// port. It persists nothing (--save "" --appendonly no), so every record is
// lost: a key completed before the restart runs again when retried after
// it, with a larger fencing token. During the outage every request gets 503
// and no handler runs; afterwards the service recovers by itself (the
// clients reconnect), and the keys first tried during the outage run once.
func TestRedisRestart(t *testing.T) {
	t.Parallel()
	for _, client := range clients {
		t.Run(client, func(t *testing.T) {
			h := newHarness(t, client, harnessOpts{})
			before := keyNames("pre", reltest.Scale(20, 200))
			during := keyNames("out", reltest.Scale(20, 200))
			outage := time.Duration(reltest.Scale(400, 5000)) * time.Millisecond

			parallel(len(before), loadWorkers, func(i int) {
				ctx, cancel := ctxTimeout(10 * time.Second)
				defer cancel()
				if res := h.post(ctx, before[i]); res.status != http.StatusCreated {
					t.Errorf("%s before the restart: status %d", before[i], res.status)
				}
			})

			h.redis.Kill()
			execs := h.totalExecutions()
			h.setPhase("outage")
			all := slices.Concat(before, during)
			stop := make(chan struct{})
			go func() { time.Sleep(outage); close(stop) }()
			h.load(all, loadWorkers, stop)
			h.setPhase("")
			outageErrs := h.errorCounts()
			if got := h.totalExecutions(); got != execs {
				t.Errorf("%d handler executions while Redis was down, want 0", got-execs)
			}
			for label, n := range outageErrs {
				if strings.HasSuffix(label, " outage") && label != "503 outage" {
					t.Errorf("%d× %s while Redis was down, want only 503", n, label)
				}
			}
			if outageErrs["503 outage"] == 0 {
				t.Error("no 503 while Redis was down")
			}

			if err := h.redis.Restart(); err != nil {
				t.Fatal(err)
			}
			start := time.Now()
			var recovered time.Duration
			for i := 0; ; i++ {
				ctx, cancel := ctxTimeout(5 * time.Second)
				res := h.post(ctx, fmt.Sprintf("restart-probe-%d", i))
				cancel()
				if res.status == http.StatusCreated {
					recovered = time.Since(start)
					break
				}
				if time.Since(start) > 10*time.Second {
					t.Fatalf("not recovered 10s after the restart (last status %d)", res.status)
				}
				time.Sleep(20 * time.Millisecond)
			}

			h.settle(all)
			isBefore := func(k string) bool { return slices.Contains(before, k) }
			tl := h.check(isBefore)
			assertInvariants(t, tl)
			for _, k := range before {
				if got := h.executions(k); got != 2 {
					t.Errorf("%s (completed before the restart): %d executions, want 2 (the record was lost with the restart)", k, got)
				}
				h.ledger.mu.Lock()
				if ex := h.ledger.keys[k].execs; len(ex) == 2 && ex[1].token <= ex[0].token {
					t.Errorf("%s: fencing token went from %d to %d across the restart", k, ex[0].token, ex[1].token)
				}
				h.ledger.mu.Unlock()
			}
			for _, k := range during {
				if got := h.executions(k); got != 1 {
					t.Errorf("%s (first tried during the outage): %d executions, want 1", k, got)
				}
			}
			if tl.duplicates != len(before) || tl.lost != len(before) {
				t.Errorf("duplicates %d, lost %d; want %d each (the records completed before the restart)", tl.duplicates, tl.lost, len(before))
			}
			h.report("Redis restarted", fmt.Sprintf("redis-server killed (SIGKILL) for %v under load, restarted on the same port, nothing persisted", outage),
				tl, fmt.Sprintf("every request during the outage got 503, no handler ran; served again %v after the restart without intervention; "+
					"the %d records completed before the restart were lost with it (no persistence) and ran again on retry, with larger fencing tokens; keys first tried during the outage ran once",
					recovered.Round(time.Millisecond), len(before)))
		})
	}
}

// TestMaxmemoryNoeviction fills Redis to its maxmemory with eviction off.
// Once it is full, acquire scripts fail with OOM: the request gets 503 and
// the handler does not run, so every execution has a record. The test
// checks that the keys the handler ran for are exactly the keys with a
// record in Redis, then lifts the limit and checks that every key
// completes, and that anything run twice follows a Complete that failed
// (Redis can fill up between a key's acquire and its complete).
func TestMaxmemoryNoeviction(t *testing.T) {
	t.Parallel()
	for _, client := range clients {
		t.Run(client, func(t *testing.T) {
			h := newHarness(t, client, harnessOpts{pad: 2048})
			h.warm(1)
			used := memUsed(t, h.redis)
			budget := reltest.Scale(256<<10, 4<<20)
			mustDo(t, h.redis, "CONFIG", "SET", "maxmemory-policy", "noeviction")
			mustDo(t, h.redis, "CONFIG", "SET", "maxmemory", strconv.Itoa(used+budget))

			// Distinct keys, four at a time, until 16 requests in a row got
			// 503 (Redis is full) or a bound.
			maxKeys := 20 * budget / 2048
			var keys []string
			for run, i := 0, 0; run < 16 && i < maxKeys; i += 4 {
				batch := keyNames(fmt.Sprintf("oom%05d", i), 4)
				keys = append(keys, batch...)
				statuses := make([]int, len(batch))
				parallel(len(batch), len(batch), func(j int) {
					ctx, cancel := ctxTimeout(10 * time.Second)
					defer cancel()
					statuses[j] = h.post(ctx, batch[j]).status
				})
				for _, st := range statuses {
					switch st {
					case http.StatusServiceUnavailable:
						run++
					case http.StatusCreated:
						run = 0
					default:
						t.Errorf("status %d while filling Redis", st)
					}
				}
			}
			full := h.errorCount("503")
			if full == 0 {
				t.Fatalf("Redis never filled up: %d keys of %d bytes under maxmemory %d", len(keys), 2048, used+budget)
			}

			// Every execution has a record, and every record an execution,
			// except for an acquire that timed out on the loaded machine
			// after its script ran: its record holds no result.
			names, err := h.redis.Do("KEYS", "idem:*")
			if err != nil {
				t.Fatal(err)
			}
			// The store's id (Prefix+"store-id") is not a record.
			records := slices.DeleteFunc(strings.Fields(names), func(n string) bool { return strings.HasSuffix(n, "store-id") })
			clientKey := map[string]string{}
			executed := 0
			for _, k := range slices.Concat([]string{"warm-0000"}, keys) {
				clientKey[h.store.KeyName(idemKey(k))] = k
				if h.executions(k) > 0 {
					executed++
					if !slices.Contains(records, h.store.KeyName(idemKey(k))) {
						t.Errorf("%s: executed without a record in Redis", k)
					}
				}
			}
			unexecuted := 0
			for _, name := range records {
				k, ok := clientKey[name]
				if !ok {
					t.Errorf("unexpected key %s in Redis", name)
					continue
				}
				if h.executions(k) > 0 {
					continue
				}
				unexecuted++
				if rec, found, err := h.get(context.Background(), idemKey(k)); err != nil || (found && rec.State == idem.StateCompleted) {
					t.Errorf("%s: completed record (%v) without an execution", k, err)
				}
			}
			timedOut := h.store.failureCount("acquire") - h.store.oomCount("acquire")
			if unexecuted > timedOut {
				t.Errorf("%d records without an execution, but only %d acquires failed otherwise than with OOM", unexecuted, timedOut)
			}
			if execs := h.totalExecutions(); execs != executed || h.store.acquiredCount() != execs {
				t.Errorf("%d handler executions over %d keys, %d acquisitions; want all equal", execs, executed, h.store.acquiredCount())
			}
			oomComplete := h.store.oomCount("complete")
			if h.store.oomCount("acquire") == 0 {
				t.Errorf("no acquire failed with OOM (first failure: %q)", h.store.firstError("acquire"))
			}

			mustDo(t, h.redis, "CONFIG", "SET", "maxmemory", "0")
			h.settle(keys)
			tl := h.check(nil)
			assertInvariants(t, tl)
			h.report("maxmemory, noeviction", fmt.Sprintf("maxmemory = used + %d KiB, noeviction; ~2 KiB responses until Redis refused writes, then the limit lifted", budget>>10),
				tl, fmt.Sprintf("full after %d records: %d requests got 503 (%d acquires refused with OOM, %d timed out) and ran nothing; handler executions = keys with a record = %d (+%d records of timed-out acquires, none completed); %d Complete calls failed with OOM (their Release too: the key stayed in flight for its lease); %s",
					len(records), full, h.store.oomCount("acquire"), timedOut, executed, unexecuted, oomComplete, explainDups(tl)))
		})
	}
}

// memUsed returns Redis's used_memory.
func memUsed(t testing.TB, s *redisserver.Server) int {
	t.Helper()
	info := mustDo(t, s, "INFO", "memory")
	v, _ := redisserver.InfoField(info, "used_memory")
	n, err := strconv.Atoi(v)
	if err != nil {
		t.Fatalf("used_memory %q: %v", v, err)
	}
	return n
}

// mustDo runs a command on s and fails the test on an error.
func mustDo(t testing.TB, s *redisserver.Server, args ...string) string {
	t.Helper()
	r, err := s.Do(args...)
	if err != nil {
		t.Fatalf("%s: %v", strings.Join(args, " "), err)
	}
	return r
}
