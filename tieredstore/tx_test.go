package tieredstore_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/rueidis"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/idemmsg"
	"github.com/idemkit/idem/internal/redisserver"
	"github.com/idemkit/idem/redisstore"
	"github.com/idemkit/idem/tieredstore"
)

// env is one test's world: a Redis server (shared, or the test's own when
// it breaks Redis), the package's database with a ledger table of the
// test's own, and a tiered store with a Guard.
type env struct {
	t      *testing.T
	ctx    context.Context
	srv    *redisserver.Server
	client rueidis.Client
	pool   *pgxpool.Pool
	store  *tieredstore.Store
	guard  *idem.Guard
	ledger string // quoted table name: one row per committed effect
	prefix string
}

type envOpts struct {
	ownRedis bool
	ropts    redisstore.Options
	opts     tieredstore.Options
	lease    time.Duration
}

func newEnv(t *testing.T, o envOpts) *env {
	t.Helper()
	e := &env{t: t, ctx: t.Context(), srv: shared, pool: newPool(t, 8), prefix: uniquePrefix(t.Name())}
	if o.ownRedis {
		srv, err := redisserver.StartServer()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(srv.Stop)
		e.srv = srv
	}
	e.client = newRueidis(t, e.srv.Addr())
	e.store = newStore(t, e.client, e.pool, e.prefix, o.ropts, o.opts)
	g, err := idem.New(e.store, idem.Config{Lease: cmpDur(o.lease, 5*time.Second), Retention: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	e.guard = g
	e.ledger = pgx.Identifier{"ledger_" + strings.ToLower(strings.Trim(e.prefix[7:], ":"))}.Sanitize()
	if _, err := e.pool.Exec(e.ctx, "CREATE TABLE "+e.ledger+" (key text NOT NULL, token bigint NOT NULL, run text NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	return e
}

func cmpDur(v, def time.Duration) time.Duration {
	if v == 0 {
		return def
	}
	return v
}

func (e *env) key(name string) idem.Key {
	k, err := idem.Scope{Route: "charges"}.Key(name)
	if err != nil {
		e.t.Fatal(err)
	}
	return k
}

// charge is the business work: one ledger row, in tx, and a response that
// names the run.
func (e *env) charge(name, run string) func(ctx context.Context, tx pgx.Tx) (*idem.Response, error) {
	return func(ctx context.Context, tx pgx.Tx) (*idem.Response, error) {
		l, _ := idem.LeaseFromContext(ctx)
		if _, err := tx.Exec(ctx, "INSERT INTO "+e.ledger+" (key, token, run) VALUES ($1, $2, $3)", name, int64(l.Token), run); err != nil {
			return nil, err
		}
		return &idem.Response{Status: 201, Body: []byte(fmt.Sprintf(`{"key":%q,"run":%q,"token":%d}`, name, run, l.Token))}, nil
	}
}

// run is one request: Guard.Begin, then BeginFunc with charge.
func (e *env) run(name string, fp idem.Fingerprint, run string) (idem.Acquisition, idem.Result, error) {
	e.t.Helper()
	att, acq, err := e.guard.Begin(e.ctx, e.key(name), fp)
	if err != nil || acq.Outcome != idem.Acquired {
		return acq, idem.Result{}, err
	}
	res, err := e.store.BeginFunc(e.ctx, e.pool, att, e.charge(name, run))
	return acq, res, err
}

// effects counts the ledger rows of name: the committed effects.
func (e *env) effects(name string) int {
	e.t.Helper()
	var n int
	if err := e.pool.QueryRow(e.ctx, "SELECT count(*) FROM "+e.ledger+" WHERE key = $1", name).Scan(&n); err != nil {
		e.t.Fatal(err)
	}
	return n
}

// redisRecord reads name's record from Redis alone.
func (e *env) redisRecord(name string) (idem.Record, bool) {
	e.t.Helper()
	rec, ok, err := e.store.Redis().Get(e.ctx, e.key(name))
	if err != nil {
		e.t.Fatal(err)
	}
	return rec, ok
}

func (e *env) flushAll() {
	e.t.Helper()
	if _, err := e.srv.Do("FLUSHALL"); err != nil {
		e.t.Fatal(err)
	}
}

// unrelayed counts the namespace's rows still in the outbox.
func (e *env) unrelayed() int {
	e.t.Helper()
	var n int
	if err := e.pool.QueryRow(e.ctx, "SELECT count(*) FROM idem_completions WHERE namespace = $1 AND NOT relayed", e.prefix).Scan(&n); err != nil {
		e.t.Fatal(err)
	}
	return n
}

// eventually polls cond every 20ms for up to d.
func eventually(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("after %v: %s", d, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

var (
	fpA = idem.Fingerprint{0: 'a'}
	fpB = idem.Fingerprint{0: 'b'}
)

func TestBeginFuncCommitsOnceThenReplays(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOpts{opts: tieredstore.Options{RelayInterval: 50 * time.Millisecond}})
	acq, res, err := e.run("k1", fpA, "first")
	if err != nil || acq.Outcome != idem.Acquired || res.Replayed {
		t.Fatalf("first run: got %v, %+v, %v; want acquired, a fresh result, no error", acq.Outcome, res, err)
	}
	first := res.Response
	rec, ok := e.redisRecord("k1")
	if !ok || rec.State != idem.StateCompleted || rec.Token != acq.Lease.Token || !bytes.Equal(rec.Response.Body, first.Body) {
		t.Fatalf("Redis after the commit: got %v %+v, want the completion relayed with token %d", ok, rec, acq.Lease.Token)
	}
	for i := range 3 {
		acq, _, err := e.run("k1", fpA, fmt.Sprint("repeat ", i))
		if err != nil || acq.Outcome != idem.Replay || !bytes.Equal(acq.Response.Body, first.Body) {
			t.Fatalf("repeat %d: got %v %v, want a replay of %s", i, acq.Outcome, err, first.Body)
		}
	}
	if acq, _, _ := e.run("k1", fpB, "other"); acq.Outcome != idem.Mismatch {
		t.Fatalf("other request: got %v, want mismatch", acq.Outcome)
	}
	if n := e.effects("k1"); n != 1 {
		t.Fatalf("ledger: got %d effects, want 1", n)
	}
	eventually(t, 5*time.Second, "the relayed completion is still in the outbox", func() bool { return e.unrelayed() == 0 })
}

// A Redis that loses a completed key (FLUSHALL): the next run's
// transaction fails at CompleteTx, its ledger row is rolled back, the
// caller gets the first commit's response as a replay, and Redis holds
// the completion again.
func TestFlushAllAfterCommit(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOpts{ownRedis: true})
	first, res, err := e.run("k1", fpA, "first")
	if err != nil || first.Outcome != idem.Acquired {
		t.Fatalf("first run: %v %v", first.Outcome, err)
	}
	want := res.Response.Body
	e.run("k2", fpA, "first")
	e.flushAll()

	second, res, err := e.run("k1", fpA, "second")
	if err != nil || second.Outcome != idem.Acquired {
		t.Fatalf("run after FLUSHALL: got %v %v; want acquired (Redis lost the key)", second.Outcome, err)
	}
	if !res.Replayed || !bytes.Equal(res.Response.Body, want) {
		t.Fatalf("run after FLUSHALL: got %s (replayed %t), want the replay of %s", res.Response.Body, res.Replayed, want)
	}
	if second.Lease.Token <= first.Lease.Token {
		t.Errorf("token after FLUSHALL: got %d, want more than %d", second.Lease.Token, first.Lease.Token)
	}
	if n := e.effects("k1"); n != 1 {
		t.Fatalf("ledger: got %d effects for k1, want 1 (the second run's row rolled back)", n)
	}
	rec, ok := e.redisRecord("k1")
	if !ok || rec.State != idem.StateCompleted || rec.Token != first.Lease.Token || !bytes.Equal(rec.Response.Body, want) {
		t.Fatalf("Redis after the failed run: got %v %+v, want the first completion refilled", ok, rec)
	}
	if acq, _, _ := e.run("k1", fpA, "third"); acq.Outcome != idem.Replay || !bytes.Equal(acq.Response.Body, want) {
		t.Fatalf("third run: got %v, want a replay from Redis", acq.Outcome)
	}

	// Another request under the lost key: a mismatch, rolled back.
	_, _, err = e.run("k2", fpB, "other")
	var ace *tieredstore.AlreadyCompletedError
	if !errors.Is(err, idem.ErrMismatch) || !errors.As(err, &ace) || ace.Response != nil {
		t.Fatalf("other request after FLUSHALL: got %v, want a mismatch without a response", err)
	}
	if n := e.effects("k2"); n != 1 {
		t.Fatalf("ledger: got %d effects for k2, want 1", n)
	}
	if acq, _, _ := e.run("k2", fpA, "again"); acq.Outcome != idem.Replay {
		t.Fatalf("k2 after the mismatch: got %v, want a replay (refilled)", acq.Outcome)
	}
}

// With VerifyAcquire, the run after FLUSHALL does not run at all: Acquire
// answers the replay from PostgreSQL and refills Redis.
func TestFlushAllVerifyAcquire(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOpts{ownRedis: true, opts: tieredstore.Options{VerifyAcquire: true}})
	first, res, err := e.run("k1", fpA, "first")
	if err != nil || first.Outcome != idem.Acquired {
		t.Fatalf("first run: %v %v", first.Outcome, err)
	}
	want := res.Response.Body
	e.flushAll()
	acq, _, err := e.run("k1", fpA, "second")
	if err != nil || acq.Outcome != idem.Replay || !bytes.Equal(acq.Response.Body, want) {
		t.Fatalf("run after FLUSHALL: got %v %v, want a replay from PostgreSQL", acq.Outcome, err)
	}
	if rec, ok := e.redisRecord("k1"); !ok || rec.State != idem.StateCompleted || rec.Token != first.Lease.Token {
		t.Fatalf("Redis after the replay: got %v %+v, want the completion refilled", ok, rec)
	}
	e.flushAll()
	if acq, _, _ := e.run("k1", fpB, "other"); acq.Outcome != idem.Mismatch {
		t.Fatalf("other request after FLUSHALL: got %v, want mismatch", acq.Outcome)
	}
	if n := e.effects("k1"); n != 1 {
		t.Fatalf("ledger: got %d effects, want 1", n)
	}
}

// Guard.Do with the plain Complete after FLUSHALL: the work runs again
// (nothing joins its effects to the completion), and Complete refuses the
// second completion with the first one's response.
func TestPlainCompleteAfterFlushAll(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOpts{ownRedis: true})
	key := e.key("k1")
	runs := 0
	fn := func(context.Context) (*idem.Response, error) {
		runs++
		return &idem.Response{Status: 200, Body: []byte(fmt.Sprint("run ", runs))}, nil
	}
	if _, err := e.guard.Do(e.ctx, key, fpA, fn); err != nil {
		t.Fatal(err)
	}
	e.flushAll()
	res, err := e.guard.Do(e.ctx, key, fpA, fn)
	var ace *tieredstore.AlreadyCompletedError
	if !errors.As(err, &ace) || !errors.Is(err, idem.ErrLeaseLost) || string(ace.Response.Body) != "run 1" {
		t.Fatalf("Do after FLUSHALL: got %+v, %v; want an AlreadyCompletedError carrying run 1", res, err)
	}
	res, err = e.guard.Do(e.ctx, key, fpA, fn)
	if err != nil || !res.Replayed || string(res.Response.Body) != "run 1" || runs != 2 {
		t.Fatalf("third Do: got %+v %v after %d runs; want the replay of run 1 after 2 runs", res, err, runs)
	}
}

// Two holders of one key at once (Redis lost the first one's record while
// its transaction was open): of the two transactions, exactly one commits
// its completion, whichever order they end in.
func TestTwoHoldersOneCommit(t *testing.T) {
	t.Parallel()
	for _, firstCommits := range []bool{true, false} {
		t.Run(fmt.Sprintf("firstCommits=%t", firstCommits), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, envOpts{ownRedis: true})
			name := "k"
			att1, acq, err := e.guard.Begin(e.ctx, e.key(name), fpA)
			if err != nil || acq.Outcome != idem.Acquired {
				t.Fatal(acq.Outcome, err)
			}
			tx1, err := e.pool.Begin(e.ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer tx1.Rollback(e.ctx)
			resp1, _ := e.charge(name, "first")(att1.Context(), tx1)
			att1.StopRenewal()
			if err := e.store.CompleteTx(e.ctx, tx1, att1.Lease(), resp1, time.Hour); err != nil {
				t.Fatal(err)
			}
			e.flushAll()
			att2, acq, err := e.guard.Begin(e.ctx, e.key(name), fpA)
			if err != nil || acq.Outcome != idem.Acquired {
				t.Fatal(acq.Outcome, err)
			}
			type result struct {
				res idem.Result
				err error
			}
			second := make(chan result, 1)
			go func() {
				// On a pgx.Conn-like Beginner other than the pool, too.
				res, err := e.store.BeginFunc(e.ctx, beginner{e.pool}, att2, e.charge(name, "second"))
				second <- result{res, err}
			}()
			time.Sleep(200 * time.Millisecond) // the second waits on the first's row
			select {
			case r := <-second:
				t.Fatalf("the second transaction ended while the first was open: %+v %v", r.res, r.err)
			default:
			}
			if firstCommits {
				if err := tx1.Commit(e.ctx); err != nil {
					t.Fatal(err)
				}
			} else {
				tx1.Rollback(e.ctx)
			}
			r := <-second
			switch {
			case r.err != nil:
				t.Fatalf("second: %v", r.err)
			case firstCommits && (!r.res.Replayed || !bytes.Equal(r.res.Response.Body, resp1.Body)):
				t.Fatalf("second after the first committed: got %s (replayed %t), want the replay of %s", r.res.Response.Body, r.res.Replayed, resp1.Body)
			case !firstCommits && r.res.Replayed:
				t.Fatalf("second after the first rolled back: got a replay, want its own commit")
			}
			if n := e.effects(name); n != 1 {
				t.Fatalf("ledger: got %d effects, want 1", n)
			}
		})
	}
}

// CompleteTx repeated in a second transaction by the lease that committed
// already is refused: that transaction's writes would be a second copy.
func TestCompleteTxRepeatedInSecondTx(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOpts{})
	att, _, err := e.guard.Begin(e.ctx, e.key("k"), fpA)
	if err != nil {
		t.Fatal(err)
	}
	att.StopRenewal()
	resp := &idem.Response{Status: 201, Body: []byte("once")}
	complete := func() error {
		return pgx.BeginFunc(e.ctx, e.pool, func(tx pgx.Tx) error {
			if _, err := e.charge("k", "x")(att.Context(), tx); err != nil {
				return err
			}
			return e.store.CompleteTx(e.ctx, tx, att.Lease(), resp, time.Hour)
		})
	}
	if err := complete(); err != nil {
		t.Fatal(err)
	}
	// No Relay: Redis still holds the lease in flight.
	err = complete()
	var ace *tieredstore.AlreadyCompletedError
	if !errors.As(err, &ace) || !ace.ByLease || string(ace.Response.Body) != "once" {
		t.Fatalf("second CompleteTx by the same lease: got %v, want an AlreadyCompletedError by this lease", err)
	}
	if n := e.effects("k"); n != 1 {
		t.Fatalf("ledger: got %d effects, want 1", n)
	}
}

// A holder that outlived its lease, nobody having taken the key over,
// cannot complete it in its transaction: CompleteTx answers ErrLeaseLost
// (a plain lost lease, not a completion found), and the transaction, rolled
// back as the documentation says, leaves no effect and no completion.
func TestCompleteTxExpiredLease(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOpts{})
	key := e.key("k")
	acq, err := e.store.Acquire(e.ctx, idem.AcquireRequest{Key: key, Fingerprint: fpA, LeaseID: idem.NewLeaseID(), TTL: 100 * time.Millisecond})
	if err != nil || acq.Outcome != idem.Acquired {
		t.Fatalf("Acquire: got %v, %v; want acquired", acq.Outcome, err)
	}
	time.Sleep(150 * time.Millisecond)
	err = pgx.BeginFunc(e.ctx, e.pool, func(tx pgx.Tx) error {
		if _, err := e.charge("k", "late")(e.ctx, tx); err != nil {
			return err
		}
		return e.store.CompleteTx(e.ctx, tx, acq.Lease, &idem.Response{Status: 201, Body: []byte("late")}, time.Hour)
	}) // rolled back on CompleteTx's error
	var ace *tieredstore.AlreadyCompletedError
	var ste *tieredstore.StaleTokenError
	if !errors.Is(err, idem.ErrLeaseLost) || errors.As(err, &ace) || errors.As(err, &ste) {
		t.Errorf("CompleteTx after the lease ended: got error %v, want ErrLeaseLost", err)
	}
	if n := e.effects("k"); n != 0 {
		t.Errorf("ledger: got %d effects, want 0", n)
	}
	var rows int
	if err := e.pool.QueryRow(e.ctx, "SELECT count(*) FROM idem_completions WHERE namespace = $1", e.prefix).Scan(&rows); err != nil {
		t.Fatal(err)
	}
	if rows != 0 {
		t.Errorf("completions in PostgreSQL: got %d, want 0", rows)
	}
	if rec, ok, err := e.store.Get(e.ctx, key); err != nil || ok {
		t.Errorf("Get after the rollback: got %+v, %t, %v; want no record", rec, ok, err)
	}
	next, err := e.store.Acquire(e.ctx, idem.AcquireRequest{Key: key, Fingerprint: fpA, LeaseID: idem.NewLeaseID(), TTL: time.Minute})
	if err != nil || next.Outcome != idem.Acquired || next.Lease.Token <= acq.Lease.Token {
		t.Errorf("Acquire after the expired lease: got %v token %d, %v; want acquired with a token > %d", next.Outcome, next.Lease.Token, err, acq.Lease.Token)
	}
}

// The relay down while commits happen: Redis stops answering between the
// commit and the relay. The completion is durable; the outbox holds it,
// and the background relay copies it once Redis is back.
func TestRelayDown(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOpts{ownRedis: true,
		ropts: redisstore.Options{Timeout: 300 * time.Millisecond},
		opts:  tieredstore.Options{RelayInterval: 50 * time.Millisecond, RelayDelay: 100 * time.Millisecond}})
	const n = 5
	type open struct {
		att  *idem.Attempt
		tx   pgx.Tx
		resp *idem.Response
	}
	var opened []open
	for i := range n {
		name := fmt.Sprint("k", i)
		att, acq, err := e.guard.Begin(e.ctx, e.key(name), fpA)
		if err != nil || acq.Outcome != idem.Acquired {
			t.Fatal(acq.Outcome, err)
		}
		att.StopRenewal()
		tx, err := e.pool.Begin(e.ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(e.ctx)
		resp, _ := e.charge(name, "first")(att.Context(), tx)
		if err := e.store.CompleteTx(e.ctx, tx, att.Lease(), resp, time.Hour); err != nil {
			t.Fatal(err)
		}
		opened = append(opened, open{att, tx, resp})
	}
	// Redis stops answering after the CompleteTx calls, before the commits.
	if err := e.srv.Pause(); err != nil {
		t.Fatal(err)
	}
	var leases []idem.Lease
	for i, o := range opened {
		if err := o.tx.Commit(e.ctx); err != nil {
			t.Fatal(err)
		}
		o.att.Stop()
		leases = append(leases, o.att.Lease())
		if i < 2 { // the others never call Relay: a process that died after COMMIT
			if err := e.store.Relay(e.ctx, o.att.Lease(), o.resp, time.Hour); err == nil {
				t.Fatalf("Relay while Redis is paused: got no error")
			}
		}
	}
	time.Sleep(300 * time.Millisecond) // several polls fail meanwhile
	if got := e.unrelayed(); got != n {
		t.Fatalf("outbox while Redis is down: got %d rows, want %d", got, n)
	}
	if got, err := e.store.Pending(e.ctx); got != n || err != nil {
		t.Fatalf("Pending while Redis is down: got %d, %v; want %d", got, err, n)
	}
	if err := e.srv.Resume(); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "the outbox did not drain", func() bool { return e.unrelayed() == 0 })
	if got, err := e.store.Pending(e.ctx); got != 0 || err != nil {
		t.Fatalf("Pending once the outbox drained: got %d, %v; want 0", got, err)
	}
	for i, l := range leases {
		rec, ok := e.redisRecord(fmt.Sprint("k", i))
		if !ok || rec.State != idem.StateCompleted || rec.Token != l.Token {
			t.Fatalf("k%d in Redis after the relay: got %v %+v, want completed with token %d", i, ok, rec, l.Token)
		}
		if acq, _, _ := e.run(fmt.Sprint("k", i), fpA, "again"); acq.Outcome != idem.Replay {
			t.Fatalf("k%d: got %v, want a replay", i, acq.Outcome)
		}
	}
}

// A completion committed with a token that Redis, having lost the key,
// undercuts: the lower token cannot commit; the store raises the key's
// token in Redis above the committed one.
func TestStaleToken(t *testing.T) {
	t.Parallel()
	for _, verify := range []bool{false, true} {
		t.Run(fmt.Sprintf("VerifyAcquire=%t", verify), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, envOpts{opts: tieredstore.Options{VerifyAcquire: verify}})
			key := e.key("k")
			// An expired completion whose token is an hour ahead of the clock.
			committed := uint64(time.Now().Add(time.Hour).UnixMilli())
			_, err := e.pool.Exec(e.ctx, `INSERT INTO idem_completions
				(namespace, key, token, lease_id, fingerprint, response, completed_at, expires_at, relayed)
				VALUES ($1, $2, $3, $4, $5, $6, now() - interval '2 hours', now() - interval '1 hour', true)`,
				e.prefix, key[:], int64(committed), make([]byte, 16), fpA[:], mustEncode(t, &idem.Response{Status: 200}))
			if err != nil {
				t.Fatal(err)
			}
			_, acq, res, err := e.runKey("k")
			if verify {
				if err != nil || acq.Outcome != idem.Acquired || acq.Lease.Token <= committed || res.Replayed {
					t.Fatalf("with VerifyAcquire: got %v token %d, %v; want a lease above %d that commits", acq.Outcome, acq.Lease.Token, err, committed)
				}
				return
			}
			if !errors.Is(err, tieredstore.ErrStaleToken) || !errors.Is(err, idem.ErrLeaseLost) {
				t.Fatalf("stale token: got %v, want ErrStaleToken", err)
			}
			if n := e.effects("k"); n != 0 {
				t.Fatalf("ledger: got %d effects, want 0", n)
			}
			_, acq, res, err = e.runKey("k")
			if err != nil || acq.Lease.Token <= committed || res.Replayed {
				t.Fatalf("next run: got token %d, %v; want a token above %d that commits", acq.Lease.Token, err, committed)
			}
		})
	}
}

func (e *env) runKey(name string) (idem.Key, idem.Acquisition, idem.Result, error) {
	acq, res, err := e.run(name, fpA, "run")
	return e.key(name), acq, res, err
}

func mustEncode(t *testing.T, r *idem.Response) []byte {
	b, err := r.AppendBinary(nil)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// Get answers from Redis, and from PostgreSQL when Redis lost a completed
// key; Delete removes the key from both.
func TestGetAndDelete(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOpts{ownRedis: true})
	acq, res, err := e.run("k", fpA, "first")
	if err != nil {
		t.Fatal(err)
	}
	key := e.key("k")
	e.flushAll()
	rec, ok, err := e.store.Get(e.ctx, key)
	if err != nil || !ok || rec.State != idem.StateCompleted || rec.Token != acq.Lease.Token || rec.Fingerprint != fpA ||
		!bytes.Equal(rec.Response.Body, res.Response.Body) || rec.TTL <= 59*time.Minute {
		t.Fatalf("Get after FLUSHALL: got %+v %v %v, want the completion from PostgreSQL", rec, ok, err)
	}
	if _, ok := e.redisRecord("k"); ok {
		t.Fatal("Get wrote to Redis; it must only read")
	}
	if had, err := e.store.Delete(e.ctx, key); err != nil || !had {
		t.Fatalf("Delete: got %t, %v; want true", had, err)
	}
	if _, ok, err := e.store.Get(e.ctx, key); ok || err != nil {
		t.Fatalf("Get after Delete: got %v %v, want a miss", ok, err)
	}
	if acq, _, err := e.run("k", fpA, "after delete"); err != nil || acq.Outcome != idem.Acquired {
		t.Fatalf("run after Delete: got %v %v, want acquired", acq.Outcome, err)
	}
}

// Relay after Redis lost the lease's record: it reads the completion back
// from PostgreSQL and copies it from there.
func TestRelayAfterRedisLostTheLease(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOpts{ownRedis: true, opts: tieredstore.Options{RelayInterval: -1}})
	att, _, err := e.guard.Begin(e.ctx, e.key("k"), fpA)
	if err != nil {
		t.Fatal(err)
	}
	att.StopRenewal()
	resp := &idem.Response{Status: 201, Body: []byte("committed")}
	err = pgx.BeginFunc(e.ctx, e.pool, func(tx pgx.Tx) error {
		return e.store.CompleteTx(e.ctx, tx, att.Lease(), resp, time.Hour)
	})
	if err != nil {
		t.Fatal(err)
	}
	att.Stop()
	e.flushAll()
	if err := e.store.Relay(e.ctx, att.Lease(), resp, time.Hour); err != nil {
		t.Fatal(err)
	}
	rec, ok := e.redisRecord("k")
	if !ok || rec.State != idem.StateCompleted || rec.Fingerprint != fpA || string(rec.Response.Body) != "committed" {
		t.Fatalf("Redis after the relay: got %v %+v, want the completion with its fingerprint", ok, rec)
	}
	// Without a background relay, RelayPending copies what is left.
	if n, err := e.store.RelayPending(e.ctx); err != nil {
		t.Fatal(err)
	} else if n != 0 {
		t.Logf("RelayPending copied %d rows (RelayDelay not yet over for the others)", n)
	}
}

// The tiered store under idemhttp's middleware and idemmsg's
// Deduplicator, with VerifyAcquire: a key whose Redis record was lost is
// replayed from PostgreSQL, and the handler does not run again.
func TestUnderIdemHTTPAndIdemmsg(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOpts{ownRedis: true, opts: tieredstore.Options{VerifyAcquire: true}})
	var runs atomic.Int64
	h := idemhttp.Middleware(e.store, idemhttp.Config{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := runs.Add(1)
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "run %d", n)
	}))
	srv := httptest.NewServer(h)
	defer srv.Close()
	post := func() (string, bool) {
		req, _ := http.NewRequestWithContext(e.ctx, http.MethodPost, srv.URL+"/charges", strings.NewReader(`{"cents":100}`))
		req.Header.Set(idemhttp.HeaderKey, "http-1")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusCreated {
			t.Fatalf("status %d: %s", resp.StatusCode, body)
		}
		return string(body), resp.Header.Get(idemhttp.HeaderReplayed) == "true"
	}
	if body, replayed := post(); body != "run 1" || replayed {
		t.Fatalf("first POST: got %q (replayed %t)", body, replayed)
	}
	if body, replayed := post(); body != "run 1" || !replayed {
		t.Fatalf("second POST: got %q (replayed %t), want the replay", body, replayed)
	}
	e.flushAll()
	if body, replayed := post(); body != "run 1" || !replayed || runs.Load() != 1 {
		t.Fatalf("POST after FLUSHALL: got %q (replayed %t) after %d runs, want the replay from PostgreSQL and 1 run", body, replayed, runs.Load())
	}

	d, err := idemmsg.New(e.store, idemmsg.Config{Namespace: "orders"})
	if err != nil {
		t.Fatal(err)
	}
	handled := 0
	fn := func(context.Context) error { handled++; return nil }
	for i, want := range []idemmsg.Outcome{idemmsg.Executed, idemmsg.Replayed} {
		res, err := d.Handle(e.ctx, idemmsg.Delivery{Key: "msg-1", Attempt: i + 1}, fn)
		if err != nil || res.Outcome != want {
			t.Fatalf("delivery %d: got %v %v, want %v", i+1, res.Outcome, err, want)
		}
	}
	e.flushAll()
	if res, err := d.Handle(e.ctx, idemmsg.Delivery{Key: "msg-1", Attempt: 3}, fn); err != nil || res.Outcome != idemmsg.Replayed || handled != 1 {
		t.Fatalf("delivery after FLUSHALL: got %v %v after %d runs, want a duplicate and 1 run", res.Outcome, err, handled)
	}
}
