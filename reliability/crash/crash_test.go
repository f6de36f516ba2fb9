//go:build unix

package crash

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"net/url"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/internal/reltest"
	"github.com/idemkit/idem/pgstore"
	"github.com/idemkit/idem/redisstore"
	"github.com/idemkit/idem/tieredstore"
)

// Timing of the crash scenarios: a short lease so that a crashed holder's
// key is taken over quickly, and a middleware Wait longer than the lease
// so that a duplicate waiting on a crashed holder takes the key over
// itself instead of answering 409.
const (
	crashLease = time.Second
	crashWait  = 1500 * time.Millisecond
	grace      = 500 * time.Millisecond
	servers    = 3
)

// crashCase is one kill point.
type crashCase struct {
	name  string // subtest name
	phase string // kill the handler of each designated key when it reports this phase; "" for random kills
	fault string
}

// TestCrashRedis runs three processes serving idemhttp.Middleware over one
// Redis; the handler writes its effect to the fencing ledger with the
// lease's token. Each subtest SIGKILLs processes at one kill point and
// restarts them; clients retry until every key has an answer. Redis is
// at-least-once with fencing: a kill after the effect and before the
// completion makes the retry run the handler again after the lease, with
// a larger token. The test asserts exactly that and no more.
func TestCrashRedis(t *testing.T) {
	t.Parallel()
	cases := []crashCase{
		{"before-effect", "before", "SIGKILL when the handler reports it holds the lease, before its effect"},
		{"after-effect", "after", "SIGKILL after the effect, before the handler returns (so before Complete)"},
		{"random", "", "SIGKILL of a random server at random moments"},
	}
	for _, cc := range cases {
		t.Run(cc.name, func(t *testing.T) {
			t.Parallel()
			runCrash(t, "redis", cc)
		})
	}
}

// TestCrashPostgres is TestCrashRedis on pgstore, with the effect row and
// CompleteTx in one transaction: exactly one effect per key whatever the
// kill point, including between the effect and the commit, and between
// the commit and the answer.
func TestCrashPostgres(t *testing.T) {
	t.Parallel()
	cases := []crashCase{
		{"before-effect", "before", "SIGKILL when the handler holds the lease, before its transaction"},
		{"before-commit", "after", "SIGKILL after the effect row and CompleteTx, before COMMIT"},
		{"after-commit", "committed", "SIGKILL after COMMIT, before the answer is written"},
		{"random", "", "SIGKILL of a random server at random moments"},
	}
	for _, cc := range cases {
		t.Run(cc.name, func(t *testing.T) {
			t.Parallel()
			runCrash(t, "pg", cc)
		})
	}
}

// TestCrashTiered is TestCrashPostgres on the tiered store: leases and
// replays on Redis, the effect row and the completion in one PostgreSQL
// transaction, the completion relayed to Redis after the commit. A kill
// after COMMIT also skips the synchronous relay: another process's
// background relay copies the completion from the outbox, and until then
// a retry that runs the work again is rolled back at CompleteTx and
// answered with the first commit. Exactly one effect per key.
func TestCrashTiered(t *testing.T) {
	t.Parallel()
	cases := []crashCase{
		{"before-effect", "before", "SIGKILL when the handler holds the lease, before its transaction"},
		{"before-commit", "after", "SIGKILL after the effect row and CompleteTx, before COMMIT"},
		{"after-commit", "committed", "SIGKILL after COMMIT, before the relay to Redis and the answer"},
		{"random", "", "SIGKILL of a random server at random moments"},
	}
	for _, cc := range cases {
		t.Run(cc.name, func(t *testing.T) {
			t.Parallel()
			runCrash(t, "tiered", cc)
		})
	}
}

// storeEnv is a store for one test: the URL children use, the parent's
// view of the store, and for pg the pool and the effect rows reader.
type storeEnv struct {
	url     string
	store   idem.Store
	pool    *pgxpool.Pool
	effects func(context.Context) (map[string][]pgEffect, error)
}

// setupStore returns a store for one test.
func setupStore(t *testing.T, kind string) storeEnv {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	switch kind {
	case "redis":
		s, err := redisstore.Open(redisURL(), redisstore.Options{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		return storeEnv{url: redisURL(), store: s}
	case "pg", "tiered":
		pool := pgtest.New(t)
		var s idem.Store
		var err error
		if kind == "pg" {
			s, err = pgstore.New(ctx, pool, pgstore.Options{Migrate: true})
		} else {
			var rs *redisstore.Store
			if rs, err = redisstore.Open(redisURL(), redisstore.Options{}); err == nil {
				t.Cleanup(func() { rs.Close() })
				var ts *tieredstore.Store
				ts, err = tieredstore.New(ctx, rs, pool, tieredstore.Options{Migrate: true, RelayInterval: -1})
				if err == nil {
					t.Cleanup(func() { ts.Close() })
				}
				s = ts
			}
		}
		if err != nil {
			t.Fatal(err)
		}
		if _, err := pool.Exec(ctx, pgSchema); err != nil {
			t.Fatal(err)
		}
		u, err := url.Parse(pgtest.URL())
		if err != nil {
			t.Fatal(err)
		}
		u.Path = "/" + pool.Config().ConnConfig.Database
		storeURL := u.String()
		if kind == "tiered" {
			storeURL = redisURL() + " " + storeURL
		}
		effects := func(ctx context.Context) (map[string][]pgEffect, error) {
			rows, err := pool.Query(ctx, `SELECT key, token, inc FROM crash_effects ORDER BY id`)
			if err != nil {
				return nil, err
			}
			defer rows.Close()
			out := map[string][]pgEffect{}
			for rows.Next() {
				var e pgEffect
				var tok int64
				if err := rows.Scan(&e.key, &tok, &e.inc); err != nil {
					return nil, err
				}
				e.token = uint64(tok)
				out[e.key] = append(out[e.key], e)
			}
			return out, rows.Err()
		}
		return storeEnv{url: storeURL, store: s, pool: pool, effects: effects}
	case "mysql":
		return setupMySQL(t)
	}
	t.Fatalf("unknown store %q", kind)
	return storeEnv{}
}

type pgEffect struct {
	key   string
	token uint64
	inc   int
}

func runCrash(t *testing.T, kind string, cc crashCase) {
	start := time.Now()
	env := setupStore(t, kind)
	storeURL, store, pgEffects := env.url, env.store, env.effects
	led := newLedger(t)
	cl := startCluster(t, kind, storeURL, led, servers, crashLease, crashWait)
	clients := newClients(t, cl)

	prefix := fmt.Sprintf("%s-%s-%x-", kind, cc.name, rand.Uint32())
	// The random case keeps sending new keys until its kills are done.
	minKeys := reltest.Scale(16, 300)
	keys := make([]string, minKeys)
	if cc.phase == "" {
		keys = make([]string, 20*minKeys)
	}
	for i := range keys {
		keys[i] = fmt.Sprintf("%s%03d", prefix, i)
	}
	// Keys whose client sends once and gives up when its server dies: they
	// must not stay in flight past the lease.
	var abandoned []string
	if cc.phase == "before" {
		for i := range reltest.Scale(10, 20) { // several: kills of other keys take some of them down first
			abandoned = append(abandoned, fmt.Sprintf("%sabandoned-%03d", prefix, i))
		}
	}

	designated := map[string]bool{}
	for _, i := range rand.Perm(minKeys)[:reltest.Scale(4, 40)] {
		designated[keys[i]] = true
	}
	for _, k := range abandoned {
		designated[k] = true
	}
	var (
		fmu   sync.Mutex
		fired = map[string]bool{}
	)
	if cc.phase != "" {
		led.setHook(func(r report) {
			if r.Phase != cc.phase || !designated[r.Key] {
				return
			}
			fmu.Lock()
			defer fmu.Unlock()
			if fired[r.Key] {
				return
			}
			if cl.crash(r.Inc) {
				fired[r.Key] = true
				led.markKilled(r.Key, r.Token, r.Inc, r.Phase)
			}
		})
	}

	ctx, cancel := context.WithTimeout(context.Background(), time.Duration(reltest.Scale(40, 300))*time.Second)
	defer cancel()

	// Random kills, for the random case, while the clients run.
	randomDone := make(chan struct{})
	stopRandom := make(chan struct{})
	go func() {
		defer close(randomDone)
		if cc.phase != "" {
			return
		}
		for range reltest.Scale(5, 60) {
			select {
			case <-stopRandom:
				return
			case <-ctx.Done():
				return
			case <-time.After(100*time.Millisecond + rand.N(300*time.Millisecond)):
			}
			cl.crashRandom()
		}
	}()

	var awg sync.WaitGroup
	for _, k := range abandoned {
		awg.Add(1)
		go func() {
			defer awg.Done()
			if err := clients.sendOnce(ctx, k); err == nil {
				t.Errorf("abandoned key %s: got an answer though its server was to be killed", k)
			}
		}()
	}
	answers, fed := clients.run(t, ctx, keys, minKeys, randomDone, 2, reltest.Scale(6, 8))
	awg.Wait()
	if len(abandoned) > 0 {
		// An abandoned key whose send found no live server was never held:
		// at least one must really have been killed mid-handler.
		fmu.Lock()
		held := 0
		for _, k := range abandoned {
			if fired[k] {
				held++
			}
		}
		fmu.Unlock()
		if held == 0 {
			t.Errorf("none of the %d abandoned keys was killed while held: their checks test nothing", len(abandoned))
		}
	}
	close(stopRandom)
	<-randomDone
	clientsDone := time.Now()
	keys = keys[:fed]

	// Every lease taken before now has ended after lease + grace.
	time.Sleep(crashLease + grace)

	var pgRows map[string][]pgEffect
	if pgEffects != nil {
		var err error
		if pgRows, err = pgEffects(ctx); err != nil {
			t.Fatal(err)
		}
	}

	var (
		dups, lost, stuck         int
		killedAfterEffect         int // runs killed after their effect, which was not the final one
		designatedKills           int
		designatedReexec          int
		designatedDups            int // duplicates left by the designated kills; the rest by runs killed with them
		killedRuns, replayedFinal int
	)
	for _, k := range append(slices.Clone(keys), abandoned...) {
		isAbandoned := slices.Contains(abandoned, k)
		key, _ := scope.Key(k)
		rec, found, err := store.Get(ctx, key)
		if err != nil {
			t.Fatalf("get %s: %v", k, err)
		}
		if found && rec.State == idem.StateInFlight {
			stuck++
			t.Errorf("key %s stuck in flight %v after its lease: %+v", k, crashLease+grace, rec)
		}
		runs := led.runs(k)
		for _, r := range runs {
			if r.killedAt == cc.phase && cc.phase != "" {
				designatedKills++
			}
			if cl.killed(r.inc) {
				killedRuns++
			}
		}
		if isAbandoned {
			n := len(led.acceptedTokens(k))
			if kind != "redis" {
				n = len(pgRows[k])
			}
			if n != 0 {
				t.Errorf("abandoned key %s (killed before its effect): %d effects, want 0", k, n)
			}
			continue
		}
		ans, ok := answers[k]
		if !ok {
			continue // the client reported its error
		}
		if ans.replayed {
			replayedFinal++
		}
		final := ans.ans.Token
		if !found || rec.State != idem.StateCompleted || rec.Token != final || rec.Response == nil || !bytes.Equal(rec.Response.Body, ans.body) {
			lost++
			t.Errorf("key %s: client got %s (token %d) but the store holds %+v", k, ans.body, final, rec)
		}

		// Effects.
		var effTokens []uint64
		if kind != "redis" {
			for _, e := range pgRows[k] {
				effTokens = append(effTokens, e.token)
			}
		} else {
			effTokens = led.acceptedTokens(k)
		}
		if len(effTokens) == 0 {
			t.Errorf("key %s answered (token %d) without any effect", k, final)
			continue
		}
		if !slices.IsSorted(effTokens) || len(slices.Compact(slices.Clone(effTokens))) != len(effTokens) {
			t.Errorf("key %s: effects not in strictly increasing token order: %v", k, effTokens)
		}
		if last := effTokens[len(effTokens)-1]; last != final {
			t.Errorf("key %s: the answer's token %d is not the last effect's %d (effects %v)", k, final, last, effTokens)
		}
		dups += len(effTokens) - 1
		if kind != "redis" && len(effTokens) != 1 {
			t.Errorf("key %s: %d effect rows (tokens %v), want exactly 1: the effect commits with CompleteTx", k, len(effTokens), effTokens)
		}
		effectsOf := func(tok uint64) int {
			return len(slices.DeleteFunc(slices.Clone(effTokens), func(x uint64) bool { return x != tok }))
		}
		for _, r := range runs {
			n := effectsOf(r.token)
			switch {
			case r.token == final:
				if n != 1 {
					t.Errorf("key %s: the completed run (token %d) has %d effects, want 1", k, final, n)
				}
			case n > 0:
				// A duplicate: only a run whose process died after its
				// effect and before its completion may leave one.
				if !cl.killed(r.inc) {
					t.Errorf("key %s: run with token %d (server %d, phases %v) left an effect without completing, and its server was not killed",
						k, r.token, r.inc, r.phases)
				} else {
					killedAfterEffect++
					if r.killedAt != "" {
						designatedDups++
					}
				}
			}
			if r.refused > 0 {
				t.Errorf("key %s: run with token %d wrote with a stale token (%d refused): two holders overlapped", k, r.token, r.refused)
			}
			switch r.killedAt {
			case "":
			case "before":
				if n != 0 {
					t.Errorf("key %s: run killed before its effect has %d effects", k, n)
				}
			case "after":
				if kind == "redis" && (n != 1 || r.token >= final) {
					t.Errorf("key %s: run killed after its effect: %d effects, token %d, final %d; want 1 effect and a later run with a larger token", k, n, r.token, final)
				}
				if kind != "redis" && n != 0 {
					t.Errorf("key %s: run killed before COMMIT left %d effect rows", k, n)
				}
				if r.token < final {
					designatedReexec++
				}
			case "committed":
				if r.token != final || n != 1 {
					t.Errorf("key %s: run killed after COMMIT (token %d, %d effects) is not the answer (token %d)", k, r.token, n, final)
				}
			}
		}
	}
	if dups != killedAfterEffect {
		t.Errorf("%d duplicate effects, but %d runs were killed after their effect", dups, killedAfterEffect)
	}
	if cc.phase != "" && designatedKills == 0 {
		t.Errorf("no kill at phase %q happened: the scenario tested nothing", cc.phase)
	}
	if cc.phase == "" && cl.killCount() == 0 {
		t.Errorf("no random kill happened")
	}
	if cc.phase == "after" && designatedReexec != designatedKills {
		t.Errorf("%d kills after the effect, %d re-executions; want equal", designatedKills, designatedReexec)
	}
	if s := led.staleRefused(); s != 0 && kind == "redis" {
		t.Errorf("%d stale-token writes reached the ledger (refused): holders overlapped", s)
	}

	storeName := map[string]string{"redis": "redis (single)", "pg": "postgres (CompleteTx)", "mysql": "mysql (MariaDB 10.11, CompleteTx)", "tiered": "tiered: redis (single) + postgres (CompleteTx)"}[kind]
	expect := "≤1 extra effect per kill after the effect"
	if kind != "redis" {
		expect = "exactly 1 effect per key"
	}
	reltest.Report(t, reltest.Row{
		Scenario:     "crash: SIGKILL mid-handler (" + cc.name + ")",
		Store:        storeName,
		Fault:        fmt.Sprintf("%s; %d processes, lease %v, %d kills + restarts", cc.fault, servers, crashLease, cl.killCount()),
		Requests:     int(clients.stats.attempts.Load()),
		Keys:         len(keys) + len(abandoned),
		Duplicates:   dups,
		Lost:         lost,
		Stuck:        stuck,
		ClientErrors: clients.stats.snapshot(),
		Notes: fmt.Sprintf("%s: %d kills at the kill point, %d duplicates from them; %d runs in killed processes, %d killed after their effect and re-run with a larger token (all duplicates); %d abandoned keys; clients done in %v, scenario %v",
			expect, designatedKills, designatedDups, killedRuns, killedAfterEffect, len(abandoned), clientsDone.Sub(start).Round(time.Millisecond), time.Since(start).Round(time.Millisecond)),
	})
}
