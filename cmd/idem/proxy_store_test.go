package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/url"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/pgtest"
)

// The proxy on --store memory with a small --memory-limit: once full, a
// new key gets 503 with the store-full problem (the upstream not called),
// a stored key still replays, and /metrics counts the refusal. The
// start-up log warns that memory is not for production.
func TestProxyMemoryLimit(t *testing.T) {
	t.Parallel()
	up := newTestUpstream(t)
	const limit = 4 << 10
	// --quota-bytes 0: the default quota (an eighth of the limit per
	// tenant) would refuse this one client's keys before the store fills.
	p := startProxy(t, nil, "--upstream", up.URL, "--memory-limit", "4KiB", "--quota-bytes", "0")
	if !strings.Contains(p.logText(), `"level":"WARN","msg":"`+memoryStoreWarning+`"`) {
		t.Errorf("start-up log: no WARN %q in\n%s", memoryStoreWarning, p.logText())
	}

	var stored []string
	var full result
	for i := range 100 {
		key := fmt.Sprint("mem-", i)
		r := mustSend(t, "POST", p.url("/payments"), key, `{"amount":1}`)
		if r.status == 503 {
			full = r
			if up.runsOf(key) != 0 {
				t.Fatalf("%s refused, but the upstream ran it", key)
			}
			break
		}
		wantStatus(t, key, r, 201, "")
		stored = append(stored, key)
	}
	if full.status != 503 || len(stored) < 2 {
		t.Fatalf("after %d stored keys: got no 503, want the store full within a 4 KiB limit", len(stored))
	}
	wantStatus(t, "a new key in a full store", full, 503, idemhttp.ProblemStoreFull)
	var prob idemhttp.Problem
	json.Unmarshal(full.body, &prob)
	if !strings.Contains(prob.Detail, "takes no new key until older ones expire") || full.header.Get("Retry-After") == "" {
		t.Errorf("503: got %s (Retry-After %q), want a detail that says the store is full, and Retry-After", full.body, full.header.Get("Retry-After"))
	}
	again := mustSend(t, "POST", p.url("/payments"), stored[0], `{"amount":1}`)
	if again.status != 201 || !again.replayed() {
		t.Fatalf("a stored key in a full store: got %d (replayed %t) %s, want its replay", again.status, again.replayed(), again.body)
	}
	wantStatus(t, "another new key", mustSend(t, "POST", p.url("/payments"), "mem-new", `{"amount":1}`), 503, idemhttp.ProblemStoreFull)

	if got := p.metric("idem_memory_refused_total"); got != 2 {
		t.Errorf("idem_memory_refused_total: got %v, want 2", got)
	}
	if got := p.metric(`idem_requests_total{outcome="store_error"}`); got != 2 {
		t.Errorf(`idem_requests_total{outcome="store_error"}: got %v, want 2`, got)
	}
	if got := p.metric("idem_memory_records"); got != float64(len(stored)) {
		t.Errorf("idem_memory_records: got %v, want %d", got, len(stored))
	}
	if got := p.metric("idem_memory_limit_bytes"); got != limit {
		t.Errorf("idem_memory_limit_bytes: got %v, want %d", got, limit)
	}
	// Requests ran one at a time: the store may exceed the limit by one
	// response at most.
	b := p.metric("idem_memory_bytes")
	if per := b / float64(len(stored)); b > limit+per {
		t.Errorf("idem_memory_bytes: got %v for %d records, want at most the limit %d plus one response", b, len(stored), limit)
	}
	t.Logf("%d records of about %.0f bytes each filled %d bytes", len(stored), b/float64(len(stored)), limit)
}

// pgStoreURL returns the URL of pool's private database.
func pgStoreURL(t *testing.T, pool *pgxpool.Pool) string {
	t.Helper()
	u, err := url.Parse(pgtest.URL())
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/" + pool.Config().ConnConfig.Database
	return u.String()
}

// reapCase is one proxy on a PostgreSQL store whose expired rows the
// reaper should (or, with --reap-interval 0, should not) delete.
type reapCase struct {
	table string // where the completed records are
	grace string // the store's reap grace, as an SQL interval
	store func(t *testing.T, pgURL string) string
}

var reapCases = map[string]reapCase{
	"postgres": {table: "idem_records", grace: "1 minute", store: func(_ *testing.T, pgURL string) string { return pgURL }},
	"tiered": {table: "idem_completions", grace: "1 hour", store: func(t *testing.T, pgURL string) string {
		return "redis://" + proxyRedis(t).Addr() + " " + pgURL
	}},
}

// The proxy reaps its PostgreSQL table, pgstore's or the tiered store's:
// with --retention 1s, the completed records are deleted once they have
// been expired for the store's grace (the test moves their expiry back by
// the grace rather than wait for it), and /metrics counts them; a record
// within the grace stays. With --reap-interval 0 nothing is deleted.
func TestProxyReapsPostgres(t *testing.T) {
	t.Parallel()
	for name, c := range reapCases {
		for _, interval := range []string{"100ms", "0"} {
			t.Run(name+"/reap-interval="+interval, func(t *testing.T) {
				t.Parallel()
				pool := pgtest.New(t)
				up := newTestUpstream(t)
				p := startProxy(t, nil, "--upstream", up.URL, "--store", c.store(t, pgStoreURL(t, pool)),
					"--retention", "1s", "--reap-interval", interval, "--log-level", "debug")
				rows := func(where string) int {
					t.Helper()
					var n int
					if err := pool.QueryRow(t.Context(), "SELECT count(*) FROM "+c.table+" "+where).Scan(&n); err != nil {
						t.Fatal(err)
					}
					return n
				}
				for i := range 3 {
					wantStatus(t, "request", mustSend(t, "POST", p.url("/payments"), fmt.Sprint("reap-", i), `{}`), 201, "")
				}
				if n := rows(""); n != 3 {
					t.Fatalf("rows after 3 requests: got %d, want 3", n)
				}
				// Expired for longer than the grace: what the reaper deletes.
				if _, err := pool.Exec(t.Context(), "UPDATE "+c.table+" SET expires_at = expires_at - interval '"+c.grace+" 1 second'"); err != nil {
					t.Fatal(err)
				}
				wantStatus(t, "request", mustSend(t, "POST", p.url("/payments"), "reap-recent", `{}`), 201, "")

				if interval == "0" {
					time.Sleep(time.Second) // ten passes, had there been a reaper
					if n := rows(""); n != 4 {
						t.Fatalf("--reap-interval 0: got %d rows, want the 4 kept", n)
					}
					if got := p.metric("idem_reaped_total"); got != 0 {
						t.Fatalf("--reap-interval 0: idem_reaped_total %v, want 0", got)
					}
					return
				}
				deadline := time.Now().Add(10 * time.Second)
				for rows("") != 1 {
					if time.Now().After(deadline) {
						t.Fatalf("after 10s: %d rows, want the 3 expired ones reaped and 1 kept", rows(""))
					}
					time.Sleep(50 * time.Millisecond)
				}
				if n := rows("WHERE expires_at > now()"); n != 1 {
					t.Fatalf("the record within its retention: got %d rows, want it kept", n)
				}
				if got := p.metric("idem_reaped_total"); got != 3 {
					t.Errorf("idem_reaped_total: got %v, want 3", got)
				}
				if got := p.metric(`idem_reaps_total{result="ok"}`); got < 1 {
					t.Errorf(`idem_reaps_total{result="ok"}: got %v, want at least 1`, got)
				}
				if got := p.metric(`idem_reaps_total{result="error"}`); got != 0 {
					t.Errorf(`idem_reaps_total{result="error"}: got %v, want 0`, got)
				}
				if !p.awaitLog(`"level":"INFO","msg":"reaped expired records","deleted":3,"took":"`) {
					t.Errorf("no INFO line for the pass that deleted 3 in\n%s", p.logText())
				} else if !regexp.MustCompile(`"msg":"reaped expired records","deleted":3,"took":"[0-9.]+[µm]?s"`).MatchString(p.logText()) {
					t.Errorf("the pass's duration is not written with its unit in\n%s", p.logText())
				}
				if !p.awaitLog(`"level":"DEBUG","msg":"reaped expired records","deleted":0`) {
					t.Errorf("no DEBUG line for a pass that deleted nothing in\n%s", p.logText())
				}
				if name == "tiered" {
					if got := p.metric("idem_outbox_pending"); got != 0 {
						t.Errorf("idem_outbox_pending: got %v, want 0 (Redis up)", got)
					}
				}
				// The reaper stops before the store closes: a clean exit.
				if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
					t.Fatal(err)
				}
				if code := p.awaitExit(10 * time.Second); code != 0 {
					t.Fatalf("exit status after SIGTERM: got %d, want 0", code)
				}
				if log := p.logText(); strings.Contains(log, "reap failed") || strings.Contains(log, `"level":"ERROR"`) {
					t.Errorf("errors at shutdown in\n%s", log)
				}
			})
		}
	}
}

// idem_outbox_pending counts the tiered store's completions that wait for
// the relay to Redis: it rises while Redis does not answer and falls back
// to zero once the relay has copied them.
func TestProxyOutboxPending(t *testing.T) {
	t.Parallel()
	pool := pgtest.New(t)
	rs := proxyRedis(t)
	up := newTestUpstream(t)
	p := startProxy(t, nil, "--upstream", up.URL, "--store", "redis://"+rs.Addr()+" "+pgStoreURL(t, pool))
	for i := range 3 {
		wantStatus(t, "request", mustSend(t, "POST", p.url("/payments"), fmt.Sprint("outbox-", i), `{}`), 201, "")
	}
	awaitMetric := func(series string, want float64) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for got := p.metric(series); got != want; got = p.metric(series) {
			if time.Now().After(deadline) {
				t.Fatalf("%s: got %v after 10s, want %v", series, got, want)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	awaitMetric("idem_outbox_pending", 0)
	// The synchronous relay copied them, and its marks are written.
	deadline := time.Now().Add(10 * time.Second)
	for {
		var n int
		if err := pool.QueryRow(t.Context(), "SELECT count(*) FROM idem_completions WHERE NOT relayed").Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after 10s: %d completions not marked relayed, want 0", n)
		}
		time.Sleep(20 * time.Millisecond)
	}
	// Redis stops answering; the three completions are back in the outbox
	// (as if their relay had failed), old enough for the poll.
	if err := rs.Pause(); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(t.Context(), "UPDATE idem_completions SET relayed = false, completed_at = now() - interval '1 minute'"); err != nil {
		t.Fatal(err)
	}
	awaitMetric("idem_outbox_pending", 3)
	if err := rs.Resume(); err != nil {
		t.Fatal(err)
	}
	awaitMetric("idem_outbox_pending", 0)
	again := mustSend(t, "POST", p.url("/payments"), "outbox-0", `{}`)
	if again.status != 201 || !again.replayed() || !bytes.Contains(again.body, []byte(`"key":"outbox-0"`)) {
		t.Fatalf("repeat after the relay: got %d %s (replayed %t), want the replay", again.status, again.body, again.replayed())
	}
}

// --reap-interval and --memory-limit refuse values that mean nothing.
func TestProxyStoreFlagErrors(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--reap-interval", "-1s"}, "--reap-interval -1s: must not be negative (0: never)"},
		{[]string{"--memory-limit", "lots"}, "memory-limit"},
		{[]string{"--memory-limit", "-1"}, "memory-limit"},
	} {
		code, stderr := runIdem(t, nil, append([]string{"proxy", "--upstream", "http://u"}, c.args...)...)
		if code != 2 || !strings.Contains(stderr, c.want) {
			t.Errorf("%q: got exit status %d, stderr %q; want 2 and %q", c.args, code, stderr, c.want)
		}
	}
}
