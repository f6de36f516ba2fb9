//go:build unix

package crash

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/mysqltest"
	"github.com/idemkit/idem/mysqlstore"
)

// mysqlSchema is pgSchema on MySQL: the effect table and its fencing
// table, in the same database as the idem records; crash_effects.k is
// deliberately not unique.
var mysqlSchema = []string{
	"CREATE TABLE IF NOT EXISTS crash_fence (k VARCHAR(255) PRIMARY KEY, max_token BIGINT NOT NULL) ENGINE=InnoDB",
	"CREATE TABLE IF NOT EXISTS crash_effects (id BIGINT AUTO_INCREMENT PRIMARY KEY, k VARCHAR(255) NOT NULL, token BIGINT NOT NULL, inc INT NOT NULL) ENGINE=InnoDB",
}

// mysqlChild sets up a child server of kind "mysql": mysqlstore on the
// go-sql-driver DSN dsn, and serveMySQL.
func (c *childServer) mysqlChild(dsn string, log *slog.Logger) (http.Handler, error) {
	mysql.SetLogger(log2discard{})
	db, err := sql.Open("mysql", dsn)
	if err != nil {
		return nil, err
	}
	db.SetMaxOpenConns(6)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	c.mys, err = mysqlstore.New(ctx, db, mysqlstore.Options{Logger: log})
	if err != nil {
		return nil, err
	}
	c.g, err = idem.New(c.mys, idem.Config{Lease: c.lease, OnRenew: func(k idem.Key, err error) {
		if err != nil {
			log.Warn("crash child: renewal failed", "key", k.String(), "error", err)
		}
	}})
	if err != nil {
		return nil, err
	}
	c.db = db
	return http.HandlerFunc(c.serveMySQL), nil
}

// log2discard silences the driver's log of connections a killed peer left.
type log2discard struct{}

func (log2discard) Print(...any) {}

// mysqlServer is the private MariaDB the mysql tests of the package share
// (each test has its own database), started on first use.
var (
	mysqlOnce sync.Once
	mysqlSrv  *mysqltest.Server
	mysqlErr  error
)

func stopMySQL() {
	if mysqlSrv != nil {
		mysqlSrv.Stop()
	}
}

// setupMySQL is setupStore for kind "mysql".
func setupMySQL(t *testing.T) storeEnv {
	t.Helper()
	mysqlOnce.Do(func() { mysqlSrv, mysqlErr = mysqltest.Start() })
	if mysqlErr != nil {
		t.Fatal(mysqlErr)
	}
	db := mysqlSrv.New(t)
	var name string
	if err := db.QueryRow("SELECT DATABASE()").Scan(&name); err != nil {
		t.Fatal(err)
	}
	s, err := mysqlstore.New(t.Context(), db, mysqlstore.Options{Migrate: true})
	if err != nil {
		t.Fatal(err)
	}
	for _, q := range mysqlSchema {
		if _, err := db.Exec(q); err != nil {
			t.Fatal(err)
		}
	}
	effects := func(ctx context.Context) (map[string][]pgEffect, error) {
		rows, err := db.QueryContext(ctx, "SELECT k, token, inc FROM crash_effects ORDER BY id")
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
	return storeEnv{url: mysqlSrv.DSN(name), store: s, effects: effects}
}

// TestCrashMySQL is TestCrashPostgres on mysqlstore (a private MariaDB):
// the effect row and CompleteTx in one transaction, exactly one effect per
// key whatever the kill point.
func TestCrashMySQL(t *testing.T) {
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
			runCrash(t, "mysql", cc)
		})
	}
}

// serveMySQL is servePG on mysqlstore: it runs the effect and the completion in one transaction:
// Guard.Begin, report "before", BEGIN, fence check + effect row,
// CompleteTx, report "after" (effect written, not committed), COMMIT,
// Stop, report "committed", answer.
func (c *childServer) serveMySQL(w http.ResponseWriter, r *http.Request) {
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
	tx, err := c.db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		fail(http.StatusServiceUnavailable, err)
		return
	}
	defer tx.Rollback() // a no-op after Commit
	var got int64
	_, err = tx.ExecContext(ctx, "INSERT INTO crash_fence (k, max_token) VALUES (?, ?) "+
		"ON DUPLICATE KEY UPDATE max_token = GREATEST(max_token, ?)", key, int64(lease.Token), int64(lease.Token))
	if err == nil {
		err = tx.QueryRowContext(ctx, "SELECT max_token FROM crash_fence WHERE k = ?", key).Scan(&got)
	}
	applied := err == nil && got == int64(lease.Token)
	if err == nil && applied {
		_, err = tx.ExecContext(ctx, "INSERT INTO crash_effects (k, token, inc) VALUES (?, ?, ?)", key, int64(lease.Token), c.inc)
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
	err = c.mys.CompleteTx(ctx, tx, lease, resp, time.Hour)
	if err != nil {
		fail(http.StatusServiceUnavailable, err)
		return
	}
	if err := c.report(key, lease.Token, "after", applied, ""); err != nil {
		fail(http.StatusBadGateway, err)
		return
	}
	if err := tx.Commit(); err != nil {
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
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusOK)
	w.Write(bytes.Clone(enc))
}
