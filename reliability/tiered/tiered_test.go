package tiered

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redisserver"
	"github.com/idemkit/idem/internal/reltest"
	"github.com/idemkit/idem/tieredstore"
)

var modes = []mode{tieredTx, tieredVerify, redisPlain}

func newRedis(t *testing.T) *redisserver.Server {
	t.Helper()
	srv, err := redisserver.StartServer()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	return srv
}

// run runs the load, does fault after warmup, lets the load go on for
// after, settles and checks.
func run(h *harness, warmup, after time.Duration, fault func()) tally {
	stop := make(chan struct{})
	wait := h.load(stop)
	time.Sleep(warmup)
	fault()
	time.Sleep(after)
	close(stop)
	wait()
	return h.check(h.settle())
}

func ms(short, long int) time.Duration {
	return time.Duration(reltest.Scale(short, long)) * time.Millisecond
}

// TestFlushAll empties Redis (FLUSHALL) under load, several times.
func TestFlushAll(t *testing.T) {
	for _, m := range modes {
		t.Run(m.String(), func(t *testing.T) {
			srv := newRedis(t)
			h := newHarness(t, m, "redis://"+srv.Addr(), tieredstore.Options{})
			flushes, every := reltest.Scale(2, 10), ms(400, 2000)
			tl := run(h, ms(400, 2000), every, func() {
				for i := range flushes {
					if i > 0 {
						time.Sleep(every)
					}
					if _, err := srv.Do("FLUSHALL"); err != nil {
						t.Fatal(err)
					}
				}
			})
			if m == redisPlain {
				if tl.duplicates == 0 {
					t.Errorf("plain Redis: no duplicate effect after %d FLUSHALLs: the fault did not bite", flushes)
				}
			} else {
				assertTiered(t, tl)
				if m == tieredTx && tl.pgReplays == 0 {
					t.Error("no run after a FLUSHALL found the first commit: the fault did not bite")
				}
			}
			h.report("Redis FLUSHALL under load", fmt.Sprintf("FLUSHALL %d times, %v apart, under load (%d workers; half the requests repeat an earlier key)",
				flushes, every, workers), tl, tl.runs(m))
		})
	}
}

// TestRedisRestart kills Redis under load and restarts it empty (nothing
// persisted).
func TestRedisRestart(t *testing.T) {
	for _, m := range modes {
		t.Run(m.String(), func(t *testing.T) {
			srv := newRedis(t)
			h := newHarness(t, m, "redis://"+srv.Addr(), tieredstore.Options{})
			outage := ms(500, 5000)
			tl := run(h, ms(500, 3000), ms(700, 5000), func() {
				srv.Kill()
				time.Sleep(outage)
				if err := srv.Restart(); err != nil {
					t.Fatal(err)
				}
			})
			if m == redisPlain {
				if tl.duplicates == 0 {
					t.Error("plain Redis: no duplicate effect after the restart: the fault did not bite")
				}
			} else {
				assertTiered(t, tl)
			}
			h.report("Redis restarted under load", fmt.Sprintf("redis-server killed (SIGKILL) for %v under load (%d workers), restarted on the same port, nothing persisted", outage, workers),
				tl, tl.runs(m)+"; requests during the outage failed before the work ran")
		})
	}
}

// TestRedisPaused freezes Redis (SIGSTOP) under load: the store calls in
// flight time out, among them the relays of completions whose commit went
// through. They wait in the outbox, which drains once Redis answers again.
func TestRedisPaused(t *testing.T) {
	for _, m := range modes {
		t.Run(m.String(), func(t *testing.T) {
			srv := newRedis(t)
			h := newHarness(t, m, "redis://"+srv.Addr(), tieredstore.Options{RelayInterval: 100 * time.Millisecond, RelayDelay: 200 * time.Millisecond})
			pause := ms(1000, 5000)
			outbox := 0
			tl := run(h, ms(500, 3000), ms(700, 5000), func() {
				// On a busy machine a short pause may catch no commit
				// between its acquire and its relay: pause again (at most
				// three times) until one waited in the outbox.
				for range 3 {
					if err := srv.Pause(); err != nil {
						t.Fatal(err)
					}
					time.Sleep(pause)
					if m != redisPlain {
						outbox = h.unrelayed()
					}
					if err := srv.Resume(); err != nil {
						t.Fatal(err)
					}
					if m == redisPlain || outbox > 0 {
						return
					}
					time.Sleep(300 * time.Millisecond)
				}
			})
			notes := tl.runs(m)
			if m != redisPlain {
				assertTiered(t, tl)
				if outbox == 0 {
					t.Error("no completion waited in the outbox while Redis was paused: the fault did not bite")
				}
				if n := h.unrelayed(); n != 0 {
					t.Errorf("outbox after the load: %d rows, want 0", n)
				}
				notes += fmt.Sprintf("; %d completions committed while Redis was paused (their relay timed out) waited in the outbox, relayed after the pause", outbox)
			}
			h.report("Redis paused under load (relay down)", fmt.Sprintf("redis-server paused (SIGSTOP) for %v under load (%d workers), store timeout %v", pause, workers, storeTimeout),
				tl, notes)
		})
	}
}

// TestRelayDown turns the relay to Redis off while commits go on: the
// synchronous relay after each commit is skipped, and the background relay
// is off, as when the processes die after their COMMIT. Then a relay
// comes back (a store with its background relay on). Redis keeps working.
func TestRelayDown(t *testing.T) {
	for _, m := range []mode{tieredTx, tieredVerify} {
		t.Run(m.String(), func(t *testing.T) {
			srv := newRedis(t)
			// The load's own store polls nothing (RelayDelay an hour): its
			// only relay is the synchronous one.
			h := newHarness(t, m, "redis://"+srv.Addr(), tieredstore.Options{RelayDelay: time.Hour})
			down := ms(1500, 8000)
			outbox := 0
			var drained time.Duration
			tl := run(h, ms(500, 3000), ms(1000, 5000), func() {
				h.skipRelay.Store(true)
				time.Sleep(down)
				outbox = h.unrelayed()
				h.skipRelay.Store(false)
				start := time.Now()
				// What the relay must drain: the rows committed until now. (Rows
				// committed from now on wait up to 50ms for their mark.)
				var now time.Time
				if err := h.pool.QueryRow(context.Background(), "SELECT statement_timestamp()").Scan(&now); err != nil {
					t.Fatal(err)
				}
				relay, err := tieredstore.New(context.Background(), h.redis, h.pool, tieredstore.Options{Namespace: h.prefix,
					RelayInterval: 100 * time.Millisecond, RelayDelay: time.Millisecond, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { relay.Close() })
				for h.unrelayedBefore(now) > 0 {
					if time.Since(start) > 10*time.Second {
						t.Fatalf("the outbox did not drain in 10s: %d rows left", h.unrelayedBefore(now))
					}
					time.Sleep(20 * time.Millisecond)
				}
				drained = time.Since(start)
			})
			assertTiered(t, tl)
			if outbox == 0 {
				t.Error("nothing in the outbox while the relay was down: the fault did not bite")
			}
			h.report("relay down while commits happen", fmt.Sprintf("no relay to Redis for %v under load (%d workers): the synchronous relay skipped after every COMMIT and no background relay, then a relay started", down, workers),
				tl, fmt.Sprintf("%s; %d completions committed while the relay was down waited in the outbox (their keys answered in flight, then, once the lease had ended, %s); the restarted relay drained the outbox in %v",
					tl.runs(m), outbox, map[mode]string{tieredTx: "ran and were rolled back at CompleteTx with the first commit as the answer",
						tieredVerify: "were replayed from PostgreSQL at Acquire"}[m], drained.Round(time.Millisecond)))
		})
	}
}
