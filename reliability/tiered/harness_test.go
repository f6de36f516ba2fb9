package tiered

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/internal/reltest"
	"github.com/idemkit/idem/redisstore"
	"github.com/idemkit/idem/tieredstore"
)

// Timing of every scenario.
const (
	lease        = time.Second
	storeTimeout = 500 * time.Millisecond
	grace        = 500 * time.Millisecond
	workers      = 8
)

// mode is how the load completes its keys.
type mode int

const (
	// tieredTx: the tiered store, the ledger row and the completion in one
	// transaction (BeginFunc).
	tieredTx mode = iota
	// tieredVerify: the same, with Options.VerifyAcquire.
	tieredVerify
	// redisPlain: the plain Redis store; the ledger row in its own
	// transaction, then Complete on Redis (what a user of redisstore does
	// with a database effect).
	redisPlain
)

func (m mode) String() string { return [...]string{"tiered", "tiered-verify", "redis"}[m] }

// store names the store of m on Redis deployment topo for the rows.
func (m mode) store(topo string) string {
	switch m {
	case tieredTx:
		return "tiered: redis (" + topo + ", rueidis) + postgres (CompleteTx)"
	case tieredVerify:
		return "tiered: redis (" + topo + ", rueidis) + postgres (CompleteTx, VerifyAcquire)"
	}
	return "redis (" + topo + ", rueidis); effect committed in postgres, then Complete"
}

// harness drives load through a Guard on one store and keeps, per key,
// what every client got. The ledger table, in the same PostgreSQL
// database as the completions, holds one row per committed effect.
type harness struct {
	t      *testing.T
	mode   mode
	pool   *pgxpool.Pool
	redis  *redisstore.Store
	store  idem.Store
	tiered *tieredstore.Store // nil in redisPlain
	guard  *idem.Guard
	prefix string
	topo   string // the Redis deployment, for the rows

	// skipRelay makes the tiered load complete by hand without the
	// synchronous relay (CompleteTx, COMMIT, no Relay), as a process
	// whose relay is down.
	skipRelay atomic.Bool

	mu       sync.Mutex
	got      map[string][]byte // the first 2xx body a client got, per key
	lost     map[string]bool   // a client later got another body
	execs    map[string]int    // runs of the work, rolled back or not
	sent     []string          // every key sent, in order of first send
	requests int
	replays  int // from Acquire (Redis, or PostgreSQL with VerifyAcquire)
	pgReplay int // from BeginFunc: the run's CompleteTx found the first commit
	errs     map[string]int
	samples  map[string]string
	seq      atomic.Int64
}

func newHarness(t *testing.T, m mode, redisURL string, opts tieredstore.Options) *harness {
	t.Helper()
	pool := pgtest.New(t)
	ctx := t.Context()
	topo := "single"
	if strings.Contains(redisURL, "master_set=") {
		topo = "sentinel 1+1, 3 sentinels"
	}
	h := &harness{t: t, mode: m, pool: pool, topo: topo, prefix: fmt.Sprintf("rel-%d:", time.Now().UnixNano()%1e9),
		got: map[string][]byte{}, lost: map[string]bool{}, execs: map[string]int{}, errs: map[string]int{}, samples: map[string]string{}}
	rs, err := redisstore.Open(redisURL, redisstore.Options{Prefix: h.prefix, Timeout: storeTimeout})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rs.Close() })
	h.redis = rs
	h.store = rs
	if m != redisPlain {
		opts.Namespace, opts.Migrate = h.prefix, true
		opts.VerifyAcquire = m == tieredVerify
		if opts.Logger == nil {
			opts.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
		}
		s, err := tieredstore.New(ctx, rs, pool, opts)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		h.tiered, h.store = s, s
	}
	if h.guard, err = idem.New(h.store, idem.Config{Lease: lease, Retention: time.Hour}); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE ledger (key text NOT NULL, token bigint NOT NULL, body text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	return h
}

var fp = idem.Fingerprint{1}

func scopeKey(name string) idem.Key {
	k, err := idem.Scope{Route: "charges"}.Key(name)
	if err != nil {
		panic(err)
	}
	return k
}

// body names one run of the work on name.
func (h *harness) body(name string) string {
	h.mu.Lock()
	h.execs[name]++
	h.mu.Unlock()
	return fmt.Sprintf("%s#%d", name, h.seq.Add(1))
}

// send runs one request for name, as a client would, and records what it
// got.
func (h *harness) send(ctx context.Context, name string) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	key := scopeKey(name)
	var (
		body     []byte
		err      error
		replayed bool
		fromPG   bool
	)
	att, acq, err := h.guard.Begin(ctx, key, fp)
	switch {
	case err != nil:
	case acq.Outcome == idem.Replay:
		body, replayed = acq.Response.Body, true
	case acq.Outcome == idem.InFlight:
		err = idem.ErrInFlight
	case acq.Outcome == idem.Mismatch:
		err = idem.ErrMismatch
	case h.mode == redisPlain:
		b := h.body(name)
		if _, err = h.pool.Exec(ctx, "INSERT INTO ledger (key, token, body) VALUES ($1, $2, $3)", name, int64(att.Lease().Token), b); err != nil {
			att.Release(context.WithoutCancel(ctx))
			break
		}
		resp := &idem.Response{Status: 201, Body: []byte(b)}
		if err = att.Complete(context.WithoutCancel(ctx), resp); err == nil {
			body = resp.Body
		}
	case h.skipRelay.Load():
		body, replayed, err = h.withoutRelay(ctx, att, name)
		fromPG = replayed
	default:
		var res idem.Result
		res, err = h.tiered.BeginFunc(ctx, h.pool, att, func(ctx context.Context, tx pgx.Tx) (*idem.Response, error) {
			b := h.body(name)
			l, _ := idem.LeaseFromContext(ctx)
			if _, err := tx.Exec(ctx, "INSERT INTO ledger (key, token, body) VALUES ($1, $2, $3)", name, int64(l.Token), b); err != nil {
				return nil, err
			}
			return &idem.Response{Status: 201, Body: []byte(b)}, nil
		})
		if err == nil {
			body, replayed, fromPG = res.Response.Body, res.Replayed, res.Replayed
		}
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.requests++
	if err != nil {
		c := classify(err)
		h.errs[c]++
		if _, ok := h.samples[c]; !ok {
			h.samples[c] = err.Error()
		}
		return
	}
	switch {
	case fromPG:
		h.pgReplay++
	case replayed:
		h.replays++
	}
	if first, ok := h.got[name]; !ok {
		h.got[name] = body
	} else if string(first) != string(body) {
		h.lost[name] = true
	}
}

// withoutRelay completes by hand without the synchronous relay: the
// completion reaches Redis only through the outbox.
func (h *harness) withoutRelay(ctx context.Context, att *idem.Attempt, name string) ([]byte, bool, error) {
	finish := context.WithoutCancel(ctx)
	tx, err := h.pool.Begin(finish)
	if err != nil {
		att.Release(finish)
		return nil, false, err
	}
	defer tx.Rollback(finish)
	b := h.body(name)
	if _, err := tx.Exec(finish, "INSERT INTO ledger (key, token, body) VALUES ($1, $2, $3)", name, int64(att.Lease().Token), b); err != nil {
		att.Release(finish)
		return nil, false, err
	}
	att.StopRenewal()
	err = h.tiered.CompleteTx(finish, tx, att.Lease(), &idem.Response{Status: 201, Body: []byte(b)}, att.Retention())
	var ace *tieredstore.AlreadyCompletedError
	if errors.As(err, &ace) && !ace.Mismatch {
		tx.Rollback(finish)
		att.Stop()
		return ace.Response.Body, true, nil
	}
	if err == nil {
		err = tx.Commit(finish)
	}
	if err != nil {
		tx.Rollback(finish)
		att.Release(finish)
		return nil, false, err
	}
	att.Stop()
	return []byte(b), false, nil
}

// classify names what a client saw instead of an answer.
func classify(err error) string {
	var se *idem.StoreError
	switch {
	case errors.Is(err, idem.ErrInFlight):
		return "in_flight"
	case errors.Is(err, idem.ErrMismatch):
		return "mismatch"
	case errors.Is(err, tieredstore.ErrStaleToken):
		return "stale_token"
	case errors.Is(err, idem.ErrLeaseLost):
		return "lease_lost"
	case errors.As(err, &se) && se.Op == "acquire":
		return "acquire_failed"
	case errors.As(err, &se):
		return se.Op + "_failed"
	case errors.Is(err, context.DeadlineExceeded):
		return "timeout"
	}
	return "other"
}

// load sends requests from workers goroutines until stop is closed: half
// of them for a new key, half for a key sent before (a retry, a
// duplicate delivery).
func (h *harness) load(stop <-chan struct{}) (wait func()) {
	var wg sync.WaitGroup
	var next atomic.Int64
	for range workers {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				var name string
				h.mu.Lock()
				if n := len(h.sent); n > 0 && rand.IntN(2) == 0 {
					name = h.sent[rand.IntN(n)]
				} else {
					name = fmt.Sprintf("k%06d", next.Add(1))
					h.sent = append(h.sent, name)
				}
				h.mu.Unlock()
				h.send(context.Background(), name)
			}
		})
	}
	return wg.Wait
}

// settle waits a lease and the grace, then sends every key until it
// answers (at most 5 rounds), so that every key ends completed. It
// returns the keys still in flight after that: stuck.
func (h *harness) settle() (stuck int) {
	time.Sleep(lease + grace)
	h.mu.Lock()
	keys := slices.Clone(h.sent)
	h.mu.Unlock()
	for round := 0; round < 5 && len(keys) > 0; round++ {
		var mu sync.Mutex
		var again []string
		parallel(keys, func(name string) {
			h.send(context.Background(), name)
			h.mu.Lock()
			_, ok := h.got[name]
			h.mu.Unlock()
			if !ok {
				mu.Lock()
				again = append(again, name)
				mu.Unlock()
			}
		})
		keys = again
		if len(keys) > 0 {
			time.Sleep(200 * time.Millisecond)
		}
	}
	return len(keys)
}

func parallel(keys []string, fn func(string)) { reltest.Parallel(keys, workers, fn) }

// tally is what a scenario found.
type tally struct {
	requests, keys, duplicates, lost, stuck int
	effects                                 int // ledger rows
	wrongBody                               int // keys whose committed effect is not what clients got
	mismatch                                int // keys whose completion row and ledger row disagree
	reruns                                  int // runs of the work beyond the first, rolled back or not
	replays, pgReplays                      int
	errs                                    map[string]int
}

// check counts duplicates (ledger rows beyond the first per key), lost
// completions (a key whose clients got two different answers), and checks
// the ledger against what clients got and against the completions table.
func (h *harness) check(stuck int) tally {
	t := h.t
	ctx := context.Background()
	tl := tally{stuck: stuck, errs: map[string]int{}}
	rows, err := h.pool.Query(ctx, "SELECT key, count(*), min(body) FROM ledger GROUP BY key")
	if err != nil {
		t.Fatal(err)
	}
	committed := map[string]string{}
	for rows.Next() {
		var key, body string
		var n int
		if err := rows.Scan(&key, &n, &body); err != nil {
			t.Fatal(err)
		}
		tl.effects += n
		tl.duplicates += n - 1
		committed[key] = body
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	tl.requests, tl.keys, tl.lost = h.requests, len(h.sent), len(h.lost)
	tl.replays, tl.pgReplays = h.replays, h.pgReplay
	for k, v := range h.errs {
		tl.errs[k] = v
	}
	for _, name := range h.sent {
		tl.reruns += max(h.execs[name]-1, 0)
		if got, ok := h.got[name]; ok && committed[name] != string(got) {
			tl.wrongBody++
			if tl.wrongBody <= 3 {
				t.Logf("%s: clients got %q, the ledger holds %q", name, got, committed[name])
			}
		}
	}
	for c, s := range h.samples {
		t.Logf("first %s: %s", c, s)
	}
	if h.tiered != nil {
		// Every committed effect has its completion, with its body, and the
		// other way round.
		for name, body := range committed {
			key := scopeKey(name)
			var resp []byte
			err := h.pool.QueryRow(ctx, "SELECT response FROM idem_completions WHERE namespace = $1 AND key = $2", h.prefix, key[:]).Scan(&resp)
			var r idem.Response
			if err != nil || r.UnmarshalBinary(resp) != nil || string(r.Body) != body {
				tl.mismatch++
				if tl.mismatch <= 3 {
					t.Logf("%s: ledger %q, completion %q (%v)", name, body, r.Body, err)
				}
			}
		}
		var rowsN int
		if err := h.pool.QueryRow(ctx, "SELECT count(*) FROM idem_completions WHERE namespace = $1", h.prefix).Scan(&rowsN); err != nil {
			t.Fatal(err)
		}
		if rowsN != len(committed) {
			t.Errorf("%d completions, %d keys with an effect: want as many", rowsN, len(committed))
		}
	}
	return tl
}

// assertTiered is what the tiered store promises under every fault.
func assertTiered(t *testing.T, tl tally) {
	t.Helper()
	if tl.duplicates != 0 || tl.lost != 0 || tl.stuck != 0 {
		t.Errorf("duplicates %d, lost %d, stuck %d: want 0 each", tl.duplicates, tl.lost, tl.stuck)
	}
	if tl.wrongBody != 0 || tl.mismatch != 0 {
		t.Errorf("%d keys whose effect is not what clients got, %d whose completion differs from the effect: want 0", tl.wrongBody, tl.mismatch)
	}
	if tl.errs["mismatch"] != 0 {
		t.Errorf("%d mismatches: want 0", tl.errs["mismatch"])
	}
	// The load ran: at least three requests per worker. A healthy run sends
	// thousands; a loaded machine has been seen to fall below 100 (in
	// reliability/failover, whose check this is too); a load stuck in its
	// first requests stays at about one per worker.
	if tl.requests < 3*workers {
		t.Errorf("only %d requests, fewer than %d: the load did not run", tl.requests, 3*workers)
	}
}

// unrelayed counts the outbox.
func (h *harness) unrelayed() int {
	var n int
	if err := h.pool.QueryRow(context.Background(), "SELECT count(*) FROM idem_completions WHERE namespace = $1 AND NOT relayed", h.prefix).Scan(&n); err != nil {
		h.t.Fatal(err)
	}
	return n
}

// unrelayedBefore counts the outbox rows committed before t.
func (h *harness) unrelayedBefore(t time.Time) int {
	var n int
	if err := h.pool.QueryRow(context.Background(), "SELECT count(*) FROM idem_completions WHERE namespace = $1 AND NOT relayed AND completed_at <= $2", h.prefix, t).Scan(&n); err != nil {
		h.t.Fatal(err)
	}
	return n
}

func (h *harness) report(scenario, fault string, tl tally, notes string) {
	reltest.Report(h.t, reltest.Row{Scenario: scenario, Store: h.mode.store(h.topo), Fault: fault,
		Requests: tl.requests, Keys: tl.keys, Duplicates: tl.duplicates, Lost: tl.lost, Stuck: tl.stuck,
		ClientErrors: tl.errs, Notes: strings.TrimPrefix(notes, "; ")})
}

// runs describes the work's runs for the notes.
func (tl tally) runs(m mode) string {
	switch m {
	case redisPlain:
		return fmt.Sprintf("%d committed effects for %d keys: the work ran again for keys whose completion Redis lost (or never stored: a Complete that failed), and every run committed; %d replays",
			tl.effects, tl.keys, tl.replays)
	case tieredVerify:
		return fmt.Sprintf("%d committed effects for %d keys; %d replays at Acquire (from Redis, or from PostgreSQL when Redis had lost the key); %d runs beyond the first, every one rolled back (%d at CompleteTx, answered with the first commit)",
			tl.effects, tl.keys, tl.replays, tl.reruns, tl.pgReplays)
	}
	return fmt.Sprintf("%d committed effects for %d keys; %d replays from Redis; %d runs beyond the first (their key's Redis record lost, or not yet relayed), every one rolled back (%d at CompleteTx, answered with the first commit as a replay)",
		tl.effects, tl.keys, tl.replays, tl.reruns, tl.pgReplays)
}
