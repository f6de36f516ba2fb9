//go:build unix

package crash

// The child side: the test binary re-executed with envChild set runs one
// server instead of the tests (see TestMain), prints "LISTEN <addr>" on
// stdout and serves until it is killed.

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/mysqlstore"
	"github.com/idemkit/idem/pgstore"
	"github.com/idemkit/idem/redisstore"
	"github.com/idemkit/idem/tieredstore"
)

// Environment of a child server.
const (
	envChild    = "IDEM_CRASH_CHILD"     // "redis", "pg", "tiered" or "mysql": run a server of that kind
	envStoreURL = "IDEM_CRASH_STORE_URL" // redis:// or postgres:// URL of the shared store; for tiered, both, separated by a space
	envLedger   = "IDEM_CRASH_LEDGER"    // base URL of the parent's ledger
	envInc      = "IDEM_CRASH_INC"       // this incarnation's number
	envLeaseMS  = "IDEM_CRASH_LEASE_MS"  // lease in milliseconds
	envWaitMS   = "IDEM_CRASH_WAIT_MS"   // idemhttp Config.Wait in milliseconds
)

// headerMode selects a zombie behaviour for one request. It is not part of
// the fingerprint (method, path, query, Content-Type, body), so the
// takeover request without it is the same request.
const headerMode = "X-Crash-Mode"

// Zombie modes: after the phase "before" returns (the process was paused
// there and resumed), wait for the context's cancellation, then write the
// effect with the old token anyway, then answer 200 (the middleware then
// tries Complete) or 503 (it tries Release).
const (
	modeZombieComplete = "zombie-complete"
	modeZombieRelease  = "zombie-release"
)

// Scope of every key: the middleware's Tenant and Route are fixed, so the
// parent derives the same idem.Key for Get.
const (
	tenant = "crash"
	route  = "/work"
)

var scope = idem.Scope{Tenant: tenant, Method: http.MethodPost, Route: route}

// answer is the body of a successful response.
type answer struct {
	Key     string `json:"key"`
	Token   uint64 `json:"token"`
	Inc     int    `json:"inc"`
	Applied bool   `json:"applied"`
}

// childMain runs a child server; it returns only on a setup failure.
func childMain(kind string) int {
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	c := &childServer{
		ledger: os.Getenv(envLedger),
		hc:     &http.Client{Timeout: 15 * time.Second},
		log:    log,
	}
	c.inc, _ = strconv.Atoi(os.Getenv(envInc))
	leaseMS, _ := strconv.Atoi(os.Getenv(envLeaseMS))
	waitMS, _ := strconv.Atoi(os.Getenv(envWaitMS))
	c.lease = time.Duration(leaseMS) * time.Millisecond
	c.wait = time.Duration(waitMS) * time.Millisecond

	var h http.Handler
	switch kind {
	case "redis":
		store, err := redisstore.Open(os.Getenv(envStoreURL), redisstore.Options{})
		if err != nil {
			fmt.Fprintln(os.Stderr, "child:", err)
			return 2
		}
		mw, err := idemhttp.NewMiddleware(store, idemhttp.Config{
			Lease:  c.lease,
			Wait:   c.wait,
			Tenant: func(*http.Request) string { return tenant },
			Route:  func(*http.Request) string { return route },
			Logger: log,
		})
		if err != nil {
			fmt.Fprintln(os.Stderr, "child:", err)
			return 2
		}
		h = mw(http.HandlerFunc(c.serveRedis))
	case "pg", "tiered":
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		pgURL := os.Getenv(envStoreURL)
		var redisURL string
		if kind == "tiered" {
			urls := strings.Fields(pgURL)
			if len(urls) != 2 {
				fmt.Fprintln(os.Stderr, "child: want a Redis URL and a PostgreSQL URL")
				return 2
			}
			redisURL, pgURL = urls[0], urls[1]
		}
		cfg, err := pgxpool.ParseConfig(pgURL)
		if err != nil {
			fmt.Fprintln(os.Stderr, "child:", err)
			return 2
		}
		cfg.MaxConns = 6
		pool, err := pgxpool.NewWithConfig(ctx, cfg)
		if err != nil {
			fmt.Fprintln(os.Stderr, "child:", err)
			return 2
		}
		var store idem.Store
		if kind == "pg" {
			c.pgs, err = pgstore.New(ctx, pool, pgstore.Options{})
			store = c.pgs
		} else {
			// The tiered store, its background relay quick: a completion whose
			// process died between COMMIT and the relay is copied to Redis
			// by the relay of another process.
			var rs *redisstore.Store
			if rs, err = redisstore.Open(redisURL, redisstore.Options{}); err == nil {
				c.ts, err = tieredstore.New(ctx, rs, pool, tieredstore.Options{RelayInterval: 100 * time.Millisecond,
					RelayDelay: 300 * time.Millisecond, Logger: log})
				store = c.ts
			}
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "child:", err)
			return 2
		}
		g, err := idem.New(store, idem.Config{Lease: c.lease, OnRenew: func(k idem.Key, err error) {
			if err != nil {
				log.Warn("crash child: renewal failed", "key", k.String(), "error", err)
			}
		}})
		if err != nil {
			fmt.Fprintln(os.Stderr, "child:", err)
			return 2
		}
		c.pool, c.g = pool, g
		h = http.HandlerFunc(c.servePG)
	case "mysql":
		var err error
		if h, err = c.mysqlChild(os.Getenv(envStoreURL), log); err != nil {
			fmt.Fprintln(os.Stderr, "child:", err)
			return 2
		}
	default:
		fmt.Fprintf(os.Stderr, "child: unknown kind %q\n", kind)
		return 2
	}

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 2
	}
	fmt.Printf("LISTEN %s\n", ln.Addr())
	mux := http.NewServeMux()
	mux.Handle("POST "+route, h)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	err = srv.Serve(ln) // until killed
	fmt.Fprintln(os.Stderr, "child: serve:", err)
	return 1
}

type childServer struct {
	inc    int
	ledger string
	hc     *http.Client
	log    *slog.Logger
	lease  time.Duration
	wait   time.Duration

	// pg and tiered only
	pool *pgxpool.Pool
	pgs  *pgstore.Store     // pg
	ts   *tieredstore.Store // tiered
	g    *idem.Guard

	// mysql only
	db  *sql.DB
	mys *mysqlstore.Store
}

// report tells the parent that the handler of (key, token) reached phase;
// the parent may kill or pause this process before it answers. It does
// not use the request's context: a zombie must get through.
func (c *childServer) report(key string, token uint64, phase string, applied bool, cause string) error {
	q := url.Values{
		"key": {key}, "token": {strconv.FormatUint(token, 10)}, "inc": {strconv.Itoa(c.inc)},
		"phase": {phase}, "applied": {strconv.FormatBool(applied)}, "cause": {cause},
	}
	resp, err := c.hc.Post(c.ledger+"/phase?"+q.Encode(), "", nil)
	if err != nil {
		return err
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("phase %s: ledger answered %s", phase, resp.Status)
	}
	return nil
}

// apply writes the effect to the parent's fencing ledger: true when the
// ledger accepted the token, false when it refused it as stale.
func (c *childServer) apply(key string, token uint64) (bool, error) {
	q := url.Values{"key": {key}, "token": {strconv.FormatUint(token, 10)}, "inc": {strconv.Itoa(c.inc)}}
	resp, err := c.hc.Post(c.ledger+"/apply?"+q.Encode(), "", nil)
	if err != nil {
		return false, err
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	switch resp.StatusCode {
	case http.StatusOK:
		return true, nil
	case http.StatusConflict:
		return false, nil
	}
	return false, fmt.Errorf("apply: ledger answered %s", resp.Status)
}

// serveRedis is the handler behind idemhttp.Middleware: report "before",
// apply the effect on the ledger with the lease's token, report "after",
// answer 200.
func (c *childServer) serveRedis(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	lease, ok := idem.LeaseFromContext(ctx)
	if !ok {
		http.Error(w, "no lease in the handler's context", http.StatusInternalServerError)
		return
	}
	key := r.Header.Get(idemhttp.HeaderKey)
	if want, err := scope.Key(key); err != nil || want != lease.Key {
		http.Error(w, "lease key does not match the scoped key", http.StatusInternalServerError)
		return
	}
	mode := r.Header.Get(headerMode)
	if err := c.report(key, lease.Token, "before", false, ""); err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	cause := ""
	if mode != "" {
		// A zombie: it was paused at "before" past its lease. Renewal
		// finds the lease gone once the process runs again; wait for it
		// (bounded), then go on as a handler that does not look at its
		// context would.
		select {
		case <-ctx.Done():
			cause = fmt.Sprint(context.Cause(ctx))
			if errors.Is(context.Cause(ctx), idem.ErrLeaseLost) {
				cause = "ErrLeaseLost"
			}
		case <-time.After(3 * c.lease):
			cause = "not cancelled"
		}
	}
	if mode == "" && ctx.Err() != nil {
		// The lease was lost (a starved process): a well-behaved handler
		// does not write its effect then. The retry runs it.
		http.Error(w, "lease lost before the effect", http.StatusServiceUnavailable)
		return
	}
	applied, err := c.apply(key, lease.Token)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	if err := c.report(key, lease.Token, "after", applied, cause); err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	if mode == modeZombieRelease {
		http.Error(w, "zombie: answering 503 so that the middleware releases", http.StatusServiceUnavailable)
		return
	}
	writeAnswer(w, answer{Key: key, Token: lease.Token, Inc: c.inc, Applied: applied})
}

func writeAnswer(w http.ResponseWriter, a answer) {
	body, _ := json.Marshal(a)
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusOK)
	w.Write(body)
}

// pgSchema is the effect table and its fencing table, in the same
// database as the idem records. effects.key is deliberately not unique:
// only idem may keep a key from being applied twice.
const pgSchema = `
CREATE TABLE IF NOT EXISTS crash_fence (
	key       text   PRIMARY KEY,
	max_token bigint NOT NULL
);
CREATE TABLE IF NOT EXISTS crash_effects (
	id    bigserial PRIMARY KEY,
	key   text      NOT NULL,
	token bigint    NOT NULL,
	inc   int       NOT NULL
)`

// servePG runs the effect and the completion in one transaction:
// Guard.Begin, report "before", BEGIN, fence check + effect row,
// CompleteTx, report "after" (effect written, not committed), COMMIT,
// Stop, report "committed", answer.
func (c *childServer) servePG(w http.ResponseWriter, r *http.Request) {
	key := r.Header.Get(idemhttp.HeaderKey)
	k, err := scope.Key(key)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, 1<<10))
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	// Like idemhttp's Config.Wait: a duplicate waits (bounded) for the
	// holder's answer, or takes the key over once the holder's lease ends.
	var (
		att *idem.Attempt
		acq idem.Acquisition
	)
	for deadline := time.Now().Add(c.wait); ; {
		att, acq, err = c.g.Begin(r.Context(), k, idem.SumFingerprint(body))
		if err != nil || acq.Outcome != idem.InFlight || time.Now().After(deadline) {
			break
		}
		select {
		case <-r.Context().Done():
			return
		case <-time.After(min(acq.RetryAfter+time.Millisecond, 50*time.Millisecond)):
		}
	}
	if err != nil {
		c.log.Warn("crash child: acquire failed", "key", key, "error", err)
		w.Header().Set("Retry-After", "1")
		http.Error(w, err.Error(), http.StatusServiceUnavailable)
		return
	}
	switch acq.Outcome {
	case idem.Replay:
		for name, vs := range acq.Response.Header {
			w.Header()[name] = vs
		}
		w.Header().Set(idemhttp.HeaderReplayed, "true")
		w.WriteHeader(acq.Response.Status)
		w.Write(acq.Response.Body)
		return
	case idem.InFlight:
		w.Header().Set("Retry-After", "1")
		http.Error(w, "in flight", http.StatusConflict)
		return
	case idem.Mismatch:
		http.Error(w, "mismatch", http.StatusUnprocessableEntity)
		return
	}
	lease := att.Lease()
	fail := func(status int, err error) {
		c.log.Warn("crash child: request failed", "key", key, "token", att.Lease().Token, "lease_ttl", att.Lease().TTL,
			"status", status, "error", err, "cause", context.Cause(att.Context()), "request_cause", context.Cause(r.Context()))
		att.Release(context.WithoutCancel(r.Context()))
		w.Header().Set("Retry-After", "1")
		http.Error(w, err.Error(), status)
	}
	if err := c.report(key, lease.Token, "before", false, ""); err != nil {
		fail(http.StatusBadGateway, err)
		return
	}
	ctx := att.Context()
	tx, err := c.pool.Begin(ctx)
	if err != nil {
		fail(http.StatusServiceUnavailable, err)
		return
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) // a no-op after Commit
	applied := true
	var got int64
	err = tx.QueryRow(ctx, `INSERT INTO crash_fence (key, max_token) VALUES ($1, $2)
		ON CONFLICT (key) DO UPDATE SET max_token = EXCLUDED.max_token
		WHERE crash_fence.max_token <= EXCLUDED.max_token
		RETURNING max_token`, key, int64(lease.Token)).Scan(&got)
	if errors.Is(err, pgx.ErrNoRows) {
		applied, err = false, nil
	}
	if err == nil && applied {
		_, err = tx.Exec(ctx, `INSERT INTO crash_effects (key, token, inc) VALUES ($1, $2, $3)`, key, int64(lease.Token), c.inc)
	}
	if err != nil {
		fail(http.StatusServiceUnavailable, err)
		return
	}
	a := answer{Key: key, Token: lease.Token, Inc: c.inc, Applied: applied}
	enc, _ := json.Marshal(a)
	resp := &idem.Response{Status: http.StatusOK, Header: http.Header{"Content-Type": {"application/json"}}, Body: enc}
	// No renewal may wait on the row lock CompleteTx takes: it would find
	// the record completed once the commit lands and cancel ctx, the
	// context the commit runs with (idem.Attempt.StopRenewal).
	att.StopRenewal()
	if c.ts != nil {
		err = c.ts.CompleteTx(ctx, tx, lease, resp, time.Hour)
	} else {
		err = c.pgs.CompleteTx(ctx, tx, lease, resp, time.Hour)
	}
	var done *tieredstore.AlreadyCompletedError
	if errors.As(err, &done) && !done.Mismatch {
		// Tiered: the key committed already (its completion had not reached
		// Redis when this lease was granted): roll this run back and answer
		// with the first commit's response, as a replay.
		tx.Rollback(context.WithoutCancel(ctx))
		att.Stop()
		for name, vs := range done.Response.Header {
			w.Header()[name] = vs
		}
		w.Header().Set(idemhttp.HeaderReplayed, "true")
		w.WriteHeader(done.Response.Status)
		w.Write(done.Response.Body)
		return
	}
	if err != nil {
		fail(http.StatusServiceUnavailable, err)
		return
	}
	if err := c.report(key, lease.Token, "after", applied, ""); err != nil {
		fail(http.StatusBadGateway, err)
		return
	}
	if err := tx.Commit(ctx); err != nil {
		// Committed with the answer lost, or not: a retry gets the replay
		// or runs again; Release changes nothing after a commit.
		fail(http.StatusServiceUnavailable, err)
		return
	}
	att.Stop()
	if err := c.report(key, lease.Token, "committed", applied, ""); err != nil {
		fail(http.StatusBadGateway, err)
		return
	}
	if c.ts != nil {
		// Tiered: the synchronous relay. A kill at "committed" skips it.
		if err := c.ts.Relay(context.WithoutCancel(r.Context()), lease, resp, time.Hour); err != nil {
			c.log.Warn("crash child: relay failed", "key", key, "error", err)
		}
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusOK)
	w.Write(bytes.Clone(enc))
}
