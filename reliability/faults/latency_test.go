package faults

import (
	"fmt"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/reltest"
)

// delayAttrs is a latency toxic's attributes: every reply arrives
// injectedDelay late, far beyond the store's timeout.
var delayAttrs = map[string]int64{"latency": injectedDelay.Milliseconds()}

// TestAcquireReplyLate delays every reply from Redis beyond the store's
// timeout while a batch of first requests arrives. The acquire scripts run
// (the commands reach Redis on time), but their replies come too late: every
// request must get 503 and no handler may run. Once the latency is gone,
// each key is retried until it is replayed: it must run exactly once. The
// acquired-but-unanswered leases are released by the Guard in the
// background, or end with the lease; until then a retry gets 409, never a
// second execution.
func TestAcquireReplyLate(t *testing.T) {
	t.Parallel()
	for _, client := range clients {
		t.Run(client, func(t *testing.T) {
			h := newHarness(t, client, harnessOpts{})
			warm := h.warm(4)
			n := reltest.Scale(24, 200)
			keys := keyNames("acq", n)

			toxic := h.proxy.add(t, "latency", "downstream", delayAttrs)
			start := time.Now()
			parallel(n, n, func(i int) {
				ctx, cancel := ctxTimeout(10 * time.Second)
				defer cancel()
				if res := h.post(ctx, keys[i]); res.status != http.StatusServiceUnavailable {
					t.Errorf("%s: status %d during the late replies, want 503", keys[i], res.status)
				}
			})
			took := time.Since(start)
			h.proxy.remove(t, toxic)
			if got := h.totalExecutions(); got != len(warm) {
				t.Errorf("%d handler executions while every acquire timed out, want 0", got-len(warm))
			}

			h.settle(keys)
			tl := h.check(nil)
			assertInvariants(t, tl)
			// Once the replies are on time again, nothing fails, and each
			// key runs once. (Should a Complete fail on a loaded machine
			// nonetheless, its key may run again: check says whether that
			// was explained.)
			if h.store.failureCount("complete") == 0 {
				for _, k := range keys {
					if got := h.executions(k); got != 1 {
						t.Errorf("%s: %d executions, want 1", k, got)
					}
				}
			}
			h.report("late reply to acquire", lateReplies+", during the first request of each key",
				tl, fmt.Sprintf("all %d first requests got 503 (all answered within %v) and ran nothing, although their acquire scripts ran; the Guard released those unanswered leases in the background (at most 64 at once), "+
					"so %d retries got 409 while one was still held; then each key ran once", n, took.Round(time.Millisecond), h.errorCount("409 recovery")))
		})
	}
}

// TestCompleteReplyLate lets every handler run, then, from inside the
// handlers (all of them waiting at a gate), delays Redis's replies beyond
// the store's timeout, so that every Complete script runs but its reply is
// lost to the timeout. The middleware logs the failure and still sends the
// handler's 201. Once the latency is gone, every key must replay exactly the
// body its client got: the record was written although the caller saw an
// error, and nothing runs twice.
//
// go-redis runs it twice: with a warm pool (as many connections as
// requests), and with a cold one, where some Complete calls must first open
// a connection, whose handshake (HELLO) is delayed as well, so that the
// script never reaches Redis. Those completions are really lost: the key
// stays in flight until its lease ends (the Guard's release fails the same
// way), retries get 409, and then the handler runs again although its
// first client got 201. That is idemhttp's documented behaviour when
// storing fails; the test asserts that every such re-execution follows a
// Complete that was not written, and nothing else.
func TestCompleteReplyLate(t *testing.T) {
	t.Parallel()
	t.Run("rueidis", func(t *testing.T) { completeReplyLate(t, "rueidis", false) })
	t.Run("go-redis", func(t *testing.T) { completeReplyLate(t, "go-redis", false) })
	t.Run("go-redis-cold-pool", func(t *testing.T) { completeReplyLate(t, "go-redis", true) })
}

func completeReplyLate(t *testing.T, client string, coldPool bool) {
	n := reltest.Scale(24, 200)
	o := harnessOpts{}
	if client == "go-redis" && !coldPool {
		o.warmPool = n + 8
	}
	h := newHarness(t, client, o)
	warm := h.warm(4)
	if client == "rueidis" {
		h.burst(64, 2) // pipelining on every connection (see TestRetryAfterLostReply)
	}
	keys := keyNames("cmp", n)

	// arrived counts the handlers waiting at the gate, missed the requests
	// answered without running the handler (a store call that was slow on
	// a loaded machine: 503).
	var arrived, missed atomic.Int32
	gate := make(chan struct{})
	var toxic string
	go func() { // close the gate once every handler waits at it (or after 5s)
		deadline := time.Now().Add(5 * time.Second)
		for int(arrived.Load()+missed.Load()) < n && time.Now().Before(deadline) {
			time.Sleep(2 * time.Millisecond)
		}
		toxic = h.proxy.add(t, "latency", "downstream", delayAttrs)
		close(gate)
	}()
	hook := func(key string, exec int) {
		if exec == 1 {
			arrived.Add(1)
			<-gate // the toxic is in place: this handler's Complete reply will be late
		}
	}
	h.onExec.Store(&hook)
	parallel(n, n, func(i int) {
		ctx, cancel := ctxTimeout(10 * time.Second)
		defer cancel()
		switch res := h.post(ctx, keys[i]); {
		case res.status == http.StatusServiceUnavailable && h.executions(keys[i]) == 0:
			missed.Add(1)
		case res.status != http.StatusCreated || res.replayed:
			t.Errorf("%s: status %d replayed=%v, want an original 201", keys[i], res.status, res.replayed)
		}
	})
	<-gate
	h.onExec.Store(nil)
	h.proxy.remove(t, toxic)
	failed, gated := h.store.failureCount("complete"), int(arrived.Load())
	if failed < gated || gated < n/2 {
		t.Errorf("%d Complete calls failed under the late replies, want all %d of the handlers that ran (of %d requests)", failed, gated, n)
	}
	// Which of the failed Complete calls were written anyway?
	notWritten := 0
	for _, k := range keys {
		if h.executions(k) == 0 {
			continue
		}
		ctx, cancel := ctxTimeout(5 * time.Second)
		rec, ok, err := h.get(ctx, idemKey(k))
		cancel()
		if err != nil {
			t.Fatalf("Get %s: %v", k, err)
		}
		if !ok || rec.State != idem.StateCompleted {
			notWritten++
		}
	}

	h.settle(keys)
	tl := h.check(nil)
	if tl.stuck != 0 || tl.unexplDups != 0 || tl.unexplLost != 0 {
		t.Errorf("stuck %d, unexplained duplicates %d, unexplained lost %d; want 0", tl.stuck, tl.unexplDups, tl.unexplLost)
	}
	fault := lateReplies + ", the toxic added from inside the handlers"
	scenario := "late reply to complete"
	var notes string
	if coldPool {
		scenario += " (cold pool)"
		if tl.duplicates != notWritten || tl.lost != notWritten {
			t.Errorf("duplicates %d, lost %d; want %d each (the keys whose Complete never reached Redis)", tl.duplicates, tl.lost, notWritten)
		}
		for _, k := range warm {
			if got := h.executions(k); got != 1 {
				t.Errorf("%s: %d executions, want 1", k, got)
			}
		}
		notes = fmt.Sprintf("%d of %d Complete calls failed; %d of them never reached Redis (they had to open a connection first, whose handshake was as late as every reply): "+
			"the key stayed in flight for its lease (409s), then ran again although its client had got 201 (documented: idemhttp sends the response when storing fails); "+
			"the other %d were written and replayed", failed, n, notWritten, failed-notWritten)
	} else {
		if notWritten != 0 {
			t.Errorf("%d failed Complete calls were not written, want 0", notWritten)
		}
		for _, k := range append(keys, warm...) {
			if got := h.executions(k); got != 1 {
				t.Errorf("%s: %d executions, want 1", k, got)
			}
		}
		if tl.duplicates != 0 || tl.lost != 0 {
			t.Errorf("duplicates %d, lost %d; want 0", tl.duplicates, tl.lost)
		}
		notes = fmt.Sprintf("all %d Complete calls failed at the caller (logged; the client still got its 201) yet were written: every retry replayed the body first sent, 0 re-executions", failed)
		if m := missed.Load(); m > 0 {
			notes += fmt.Sprintf("; %d first requests got 503 before the fault (a store call slower than the timeout on the loaded test machine)", m)
		}
		if client == "go-redis" {
			notes += "; go-redis pool warmed beforehand"
		}
	}
	h.report(scenario, fault, tl, notes)
}
