//go:build unix

package crash

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/reltest"
	"github.com/idemkit/idem/pgstore"
)

const zombieLease = time.Second

// httpAnswer is one plain (non-retrying) HTTP exchange.
type httpAnswer struct {
	status   int
	body     []byte
	replayed bool
	err      error
}

func post(ctx context.Context, hc *http.Client, addr, key, mode string) httpAnswer {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+addr+route, strings.NewReader(key))
	if err != nil {
		return httpAnswer{err: err}
	}
	req.Header.Set(idemhttp.HeaderKey, key)
	req.Header.Set("Content-Type", "text/plain")
	if mode != "" {
		req.Header.Set(headerMode, mode)
	}
	resp, err := hc.Do(req)
	if err != nil {
		return httpAnswer{err: err}
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return httpAnswer{status: resp.StatusCode, body: body, replayed: resp.Header.Get(idemhttp.HeaderReplayed) == "true", err: err}
}

// TestZombieSIGSTOP pauses a server process (SIGSTOP) while its handlers
// hold two keys, past their lease; another process takes both keys over
// and completes them; then the paused process resumes. The zombie's
// handlers must see their context cancelled with cause idem.ErrLeaseLost;
// the effect they write anyway with their old token is refused by the
// fencing ledger; the middleware's Complete (handler answered 200) and
// Release (handler answered 503) are rejected and change nothing: both
// records still hold the new holder's result.
func TestZombieSIGSTOP(t *testing.T) {
	t.Parallel()
	env := setupStore(t, "redis")
	storeURL, store := env.url, env.store
	led := newLedger(t)
	cl := startCluster(t, "redis", storeURL, led, 2, zombieLease, 1500*time.Millisecond)
	incA, addrA := cl.slotChild(0)
	incB, addrB := cl.slotChild(1)
	prefix := fmt.Sprintf("zombie-%x-", rand.Uint32())
	kc, kr := prefix+"complete", prefix+"release"
	modes := map[string]string{kc: modeZombieComplete, kr: modeZombieRelease}

	// Pause A once both its handlers hold their keys and report "before":
	// the first report waits for the second, so neither writes its effect
	// before the pause.
	var (
		arrived  atomic.Int32
		paused   = make(chan struct{})
		pausedAt time.Time
	)
	led.setHook(func(r report) {
		if r.Inc != incA || r.Phase != "before" || modes[r.Key] == "" {
			return
		}
		if arrived.Add(1) == 2 {
			if err := cl.pause(incA); err != nil {
				t.Errorf("SIGSTOP: %v", err)
			}
			pausedAt = time.Now()
			close(paused)
			return
		}
		select {
		case <-paused:
		case <-time.After(10 * time.Second):
		}
	})

	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Second)
	defer cancel()
	hc := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{}}
	requests := 0
	zombieAns := map[string]httpAnswer{}
	var zmu sync.Mutex
	var zwg sync.WaitGroup
	for k, mode := range modes {
		requests++
		zwg.Add(1)
		go func() {
			defer zwg.Done()
			a := post(ctx, hc, addrA, k, mode)
			zmu.Lock()
			zombieAns[k] = a
			zmu.Unlock()
		}()
	}
	select {
	case <-paused:
	case <-time.After(15 * time.Second):
		cl.resume(incA)
		t.Fatalf("the zombie's handlers did not both report: %d of 2", arrived.Load())
	}

	// Take both keys over on B. B's middleware waits (Config.Wait) for the
	// paused holder's lease to end, then runs the handler itself.
	takeover := map[string]httpAnswer{}
	for k := range modes {
		for {
			requests++
			a := post(ctx, hc, addrB, k, "")
			if a.err == nil && a.status == http.StatusOK {
				takeover[k] = a
				break
			}
			if ctx.Err() != nil {
				cl.resume(incA)
				t.Fatalf("takeover of %s: no answer: %v %d %s", k, a.err, a.status, a.body)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	pausedFor := time.Since(pausedAt)
	if err := cl.resume(incA); err != nil {
		t.Fatalf("SIGCONT: %v", err)
	}
	zwg.Wait()

	// The zombie's own clients: what they got back is recorded, not
	// asserted (see the report).
	clientErrs := map[string]int{}
	var notes []string
	for k, a := range zombieAns {
		switch {
		case a.err != nil:
			clientErrs["zombie: "+classify(a.err)]++
		default:
			clientErrs[fmt.Sprintf("zombie: %d", a.status)]++
			notes = append(notes, fmt.Sprintf("zombie %s client got %d %s", modes[k], a.status, bytes.TrimSpace(a.body)))
		}
	}

	for k, mode := range modes {
		var won answer
		if err := json.Unmarshal(takeover[k].body, &won); err != nil {
			t.Fatalf("%s: takeover answer %q: %v", k, takeover[k].body, err)
		}
		if won.Inc != incB || !won.Applied {
			t.Errorf("%s: takeover answer %+v: want server %d with its effect applied", k, won, incB)
		}
		runs := led.runs(k)
		if len(runs) != 2 {
			t.Fatalf("%s: %d runs, want the zombie's and the takeover: %+v", k, len(runs), runs)
		}
		z, n := runs[0], runs[1]
		if z.inc != incA || n.inc != incB || n.token != won.Token || z.token >= n.token {
			t.Errorf("%s: runs %+v and %+v: want the zombie on %d with the smaller token, then %d with token %d", k, z, n, incA, incB, won.Token)
		}
		if z.cause != "ErrLeaseLost" {
			t.Errorf("%s (%s): the zombie's context cause was %q, want idem.ErrLeaseLost", k, mode, z.cause)
		}
		if z.effects != 0 || z.refused != 1 {
			t.Errorf("%s: zombie wrote with its stale token: %d accepted, %d refused; want 0 and 1", k, z.effects, z.refused)
		}
		if n.effects != 1 || n.refused != 0 {
			t.Errorf("%s: takeover: %d effects, %d refused; want 1 and 0", k, n.effects, n.refused)
		}
		key, _ := scope.Key(k)
		rec, found, err := store.Get(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		if !found || rec.State != idem.StateCompleted || rec.Token != n.token || rec.Response == nil || !bytes.Equal(rec.Response.Body, takeover[k].body) {
			t.Errorf("%s: after the zombie finished the record is %+v, want completed with token %d and body %s", k, rec, n.token, takeover[k].body)
		}
		// A repeat, now to the resumed zombie process, replays the new
		// holder's result.
		requests++
		rep := post(ctx, hc, addrA, k, "")
		if rep.err != nil || rep.status != http.StatusOK || !rep.replayed || !bytes.Equal(rep.body, takeover[k].body) {
			t.Errorf("%s: repeat on the resumed process: %v %d replayed=%v %s; want the replay of %s", k, rep.err, rep.status, rep.replayed, rep.body, takeover[k].body)
		}
	}
	if s := led.staleRefused(); s != 2 {
		t.Errorf("ledger refused %d stale writes, want 2 (one per zombie)", s)
	}
	logs := cl.logs(incA)
	for _, want := range []string{
		"handler ran but its response was not stored", // Complete rejected
		"lease lost before the release",               // Release rejected
		idem.ErrLeaseLost.Error(),
	} {
		if !strings.Contains(logs, want) {
			t.Errorf("zombie process log lacks %q:\n%s", want, logs)
		}
	}

	reltest.Report(t, reltest.Row{
		Scenario:     "zombie: SIGSTOP holder past its lease",
		Store:        "redis (single)",
		Fault:        fmt.Sprintf("SIGSTOP of a server holding 2 keys mid-handler for %v (lease %v); another process takes over and completes; SIGCONT", pausedFor.Round(10*time.Millisecond), zombieLease),
		Requests:     requests,
		Keys:         2,
		Duplicates:   0,
		Lost:         0,
		Stuck:        0,
		ClientErrors: clientErrs,
		Notes: "zombie context cancelled with cause ErrLeaseLost; its stale-token effects refused by the ledger (2); its Complete and Release rejected, records keep the new holder's result; " +
			strings.Join(notes, "; "),
	})
}

// TestZombieStoreCalls drives the store directly: a holder whose lease
// expired, and whose key was taken over, calls Renew, Complete and
// Release with its old lease (and, on PostgreSQL, CompleteTx) while the
// new holder is in flight and again after it completed. Every call must
// return idem.ErrLeaseLost and change nothing.
func TestZombieStoreCalls(t *testing.T) {
	t.Parallel()
	for _, kind := range []string{"redis", "pg"} {
		t.Run(kind, func(t *testing.T) {
			env := setupStore(t, kind)
			store := env.store
			led := newLedger(t)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			name := fmt.Sprintf("zombie-store-%x", rand.Uint32())
			key, _ := scope.Key(name)
			fp := idem.SumFingerprint([]byte(name))
			// The zombie's lease is short, to expire; the new holder's is
			// long, so that it outlives the checks on a loaded machine.
			const ttl, holderTTL = 300 * time.Millisecond, time.Minute
			calls := 0
			lease := ttl
			acquire := func() idem.Acquisition {
				calls++
				acq, err := store.Acquire(ctx, idem.AcquireRequest{Key: key, Fingerprint: fp, LeaseID: idem.NewLeaseID(), TTL: lease})
				if err != nil {
					t.Fatal(err)
				}
				return acq
			}
			a1 := acquire()
			if a1.Outcome != idem.Acquired {
				t.Fatalf("first acquire: %v", a1.Outcome)
			}
			zombie := a1.Lease
			lease = holderTTL
			var a2 idem.Acquisition
			for deadline := time.Now().Add(10 * time.Second); ; {
				if a2 = acquire(); a2.Outcome == idem.Acquired {
					break
				}
				if a2.Outcome != idem.InFlight || time.Now().After(deadline) {
					t.Fatalf("takeover: %v", a2.Outcome)
				}
				time.Sleep(min(a2.RetryAfter+time.Millisecond, 50*time.Millisecond))
			}
			holder := a2.Lease
			if holder.Token <= zombie.Token {
				t.Fatalf("takeover token %d not above the zombie's %d", holder.Token, zombie.Token)
			}
			if !led.apply(name, holder.Token, 2) || led.apply(name, zombie.Token, 1) {
				t.Errorf("fencing ledger: the new holder's token must be accepted and the zombie's refused")
			}
			zombieResp := &idem.Response{Status: 200, Body: []byte("zombie")}
			rejected := 0
			zombieCalls := func(when string, want idem.Record) {
				t.Helper()
				for op, err := range map[string]error{
					"renew":    store.Renew(ctx, zombie, ttl),
					"complete": store.Complete(ctx, zombie, zombieResp, time.Hour),
					"release":  store.Release(ctx, zombie),
				} {
					calls++
					if !errors.Is(err, idem.ErrLeaseLost) {
						t.Errorf("%s: zombie %s: %v, want ErrLeaseLost", when, op, err)
					} else {
						rejected++
					}
				}
				if ps, ok := store.(*pgstore.Store); ok {
					calls++
					err := pgCompleteTx(ctx, t, env.pool, ps, zombie, zombieResp)
					if !errors.Is(err, idem.ErrLeaseLost) {
						t.Errorf("%s: zombie CompleteTx: %v, want ErrLeaseLost", when, err)
					} else {
						rejected++
					}
				}
				calls++
				rec, found, err := store.Get(ctx, key)
				if err != nil || !found || rec.State != want.State || rec.Token != want.Token || rec.LeaseID != want.LeaseID ||
					(want.Response != nil && (rec.Response == nil || !bytes.Equal(rec.Response.Body, want.Response.Body))) {
					t.Errorf("%s: record after the zombie's calls: %+v (found %v, err %v); want %+v", when, rec, found, err, want)
				}
			}
			zombieCalls("new holder in flight", idem.Record{State: idem.StateInFlight, Token: holder.Token, LeaseID: holder.ID})
			won := &idem.Response{Status: 200, Body: []byte("new holder")}
			calls++
			if err := store.Complete(ctx, holder, won, time.Hour); err != nil {
				t.Fatal(err)
			}
			zombieCalls("new holder completed", idem.Record{State: idem.StateCompleted, Token: holder.Token, Response: won})
			if a := acquire(); a.Outcome != idem.Replay || !bytes.Equal(a.Response.Body, won.Body) {
				t.Errorf("repeat after the zombie's calls: %v, want the new holder's replay", a.Outcome)
			}
			reltest.Report(t, reltest.Row{
				Scenario: "zombie: stale lease calls after takeover",
				Store:    map[string]string{"redis": "redis (single)", "pg": "postgres"}[kind],
				Fault:    fmt.Sprintf("lease %v expired and taken over; the old holder calls Renew, Complete, Release%s with its lease, before and after the new holder completes", ttl, map[string]string{"pg": ", CompleteTx"}[kind]),
				Requests: calls, Keys: 1,
				Notes: fmt.Sprintf("%d zombie calls, all ErrLeaseLost, record unchanged; zombie token %d refused by the ledger, new holder's %d accepted", rejected, zombie.Token, holder.Token),
			})
		})
	}
}

// pgCompleteTx runs CompleteTx for l in a transaction of its own and
// rolls it back.
func pgCompleteTx(ctx context.Context, t *testing.T, pool *pgxpool.Pool, s *pgstore.Store, l idem.Lease, resp *idem.Response) error {
	t.Helper()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	return s.CompleteTx(ctx, tx, l, resp, time.Hour)
}

// renewSpy wraps a store: it counts the answers Renew gets and, while cut
// is set, makes Renew hang until its context ends, as for a holder cut off
// from the store.
type renewSpy struct {
	idem.Store
	cut      atomic.Bool
	mu       sync.Mutex
	answers  []error
	timedOut int
}

func (s *renewSpy) Renew(ctx context.Context, l idem.Lease, ttl time.Duration) error {
	if s.cut.Load() {
		<-ctx.Done()
		s.mu.Lock()
		s.timedOut++
		s.mu.Unlock()
		return &idem.StoreError{Op: "renew", Key: l.Key, Err: ctx.Err()}
	}
	err := s.Store.Renew(ctx, l, ttl)
	s.mu.Lock()
	s.answers = append(s.answers, err)
	s.mu.Unlock()
	return err
}

// TestZombieGuard runs a blocked handler in-process with idem.Guard.Do on
// redisstore, in two ways of losing the lease:
//
//   - cut off: the zombie's renewals hang (it cannot reach the store) until
//     its lease has ended locally; another guard takes the key over.
//   - purged: an operator deletes the record and another guard acquires
//     the key and completes it; the zombie's next renewal gets
//     ErrLeaseLost from the store.
//
// Either way the zombie's context must be cancelled with cause
// idem.ErrLeaseLost (and OnRenew told), its effect with the old token
// refused by the fencing ledger, Do must return ErrLeaseLost, and the
// record must keep the new holder's result.
func TestZombieGuard(t *testing.T) {
	t.Parallel()
	for _, how := range []string{"cut-off", "purged"} {
		t.Run(how, func(t *testing.T) {
			store := setupStore(t, "redis").store
			led := newLedger(t)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			const lease = 1500 * time.Millisecond
			spy := &renewSpy{Store: store}
			var onRenew []error
			var omu sync.Mutex
			zg, err := idem.New(spy, idem.Config{Lease: lease, OnRenew: func(_ idem.Key, err error) {
				omu.Lock()
				onRenew = append(onRenew, err)
				omu.Unlock()
			}})
			if err != nil {
				t.Fatal(err)
			}
			ng, err := idem.New(store, idem.Config{Lease: lease})
			if err != nil {
				t.Fatal(err)
			}
			name := fmt.Sprintf("zombie-guard-%s-%x", how, rand.Uint32())
			key, _ := scope.Key(name)
			fp := idem.SumFingerprint([]byte(name))
			if how == "cut-off" {
				spy.cut.Store(true)
			}

			started := make(chan uint64, 1)
			takenOver := make(chan struct{})
			type zombieResult struct {
				cause    error
				accepted bool
				res      idem.Result
				err      error
			}
			zdone := make(chan zombieResult, 1)
			go func() {
				var z zombieResult
				z.res, z.err = zg.Do(ctx, key, fp, func(ctx context.Context) (*idem.Response, error) {
					l, _ := idem.LeaseFromContext(ctx)
					started <- l.Token
					select { // blocked: lease lost, and the new holder done
					case <-ctx.Done():
						z.cause = context.Cause(ctx)
					case <-time.After(10 * time.Second):
					}
					select {
					case <-takenOver:
					case <-time.After(10 * time.Second):
					}
					z.accepted = led.apply(name, l.Token, 1) // a handler that ignores its context
					return &idem.Response{Status: 200, Body: []byte("zombie")}, nil
				})
				zdone <- z
			}()
			var zt uint64
			select {
			case zt = <-started:
			case <-ctx.Done():
				t.Fatal("zombie never started")
			}

			if how == "purged" {
				time.Sleep(20 * time.Millisecond) // a later clock millisecond: a larger token after Delete
				if ok, err := store.Delete(ctx, key); err != nil || !ok {
					t.Fatalf("purge: %v %v", ok, err)
				}
			}
			var nt uint64
			won := &idem.Response{Status: 200, Body: []byte("new holder")}
			for {
				_, err := ng.Do(ctx, key, fp, func(ctx context.Context) (*idem.Response, error) {
					l, _ := idem.LeaseFromContext(ctx)
					nt = l.Token
					if !led.apply(name, l.Token, 2) {
						t.Errorf("the new holder's token %d was refused", l.Token)
					}
					return won, nil
				})
				if err == nil {
					break
				}
				var inFlight *idem.InFlightError
				if !errors.As(err, &inFlight) || ctx.Err() != nil {
					t.Fatalf("takeover: %v", err)
				}
				time.Sleep(min(inFlight.RetryAfter+time.Millisecond, 50*time.Millisecond))
			}
			close(takenOver)
			var z zombieResult
			select {
			case z = <-zdone:
			case <-ctx.Done():
				t.Fatal("zombie never finished")
			}

			if nt <= zt {
				t.Errorf("new holder's token %d not above the zombie's %d", nt, zt)
			}
			if !errors.Is(z.cause, idem.ErrLeaseLost) {
				t.Errorf("zombie's context cause %v, want ErrLeaseLost", z.cause)
			}
			if z.accepted {
				t.Errorf("the ledger accepted the zombie's stale token %d (new holder's %d)", zt, nt)
			}
			if !errors.Is(z.err, idem.ErrLeaseLost) || z.res.Replayed || z.res.Response == nil {
				t.Errorf("zombie's Do: %+v, %v; want its own response with ErrLeaseLost", z.res, z.err)
			}
			omu.Lock()
			sawLost := len(onRenew) > 0 && errors.Is(onRenew[len(onRenew)-1], idem.ErrLeaseLost)
			omu.Unlock()
			if !sawLost {
				t.Errorf("OnRenew was not told the lease was lost: %v", onRenew)
			}
			spy.mu.Lock()
			answers, timedOut := append([]error(nil), spy.answers...), spy.timedOut
			spy.mu.Unlock()
			if how == "purged" && (len(answers) == 0 || !errors.Is(answers[len(answers)-1], idem.ErrLeaseLost)) {
				t.Errorf("purged: the store's renew answers %v; want the last to be ErrLeaseLost (loss found by the store)", answers)
			}
			if how == "cut-off" && timedOut == 0 {
				t.Errorf("cut-off: no renewal was attempted while cut off")
			}
			rec, found, err := store.Get(ctx, key)
			if err != nil || !found || rec.State != idem.StateCompleted || rec.Token != nt || !bytes.Equal(rec.Response.Body, won.Body) {
				t.Errorf("record after the zombie: %+v (found %v, err %v); want completed with token %d", rec, found, err, nt)
			}
			fault := map[string]string{
				"cut-off": "handler blocked while its renewals hang (cut off from the store) until the lease ends; another guard takes over and completes",
				"purged":  "handler blocked; operator Delete and another guard acquires and completes; the zombie's next renewal",
			}[how]
			reltest.Report(t, reltest.Row{
				Scenario: "zombie: blocked handler (Guard.Do, " + how + ")",
				Store:    "redis (single)",
				Fault:    fault,
				Requests: 2, Keys: 1,
				Notes: fmt.Sprintf("zombie ctx cause %v; stale token %d refused, new token %d accepted; zombie Do: %v; store renew answers %v, %d renewals timed out while cut off",
					z.cause, zt, nt, z.err, answers, timedOut),
			})
		})
	}
}
