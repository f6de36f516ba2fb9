package main

import (
	"bytes"
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/mysqltest"
)

// TestProxyMySQL runs idem proxy on --store mysql://… (a private MariaDB):
// one execution per key, byte-identical replays, and the reaper deleting
// the records expired for the store's grace (moved back rather than
// waited for), counted in /metrics.
func TestProxyMySQL(t *testing.T) {
	t.Parallel()
	ms, err := mysqltest.Start()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ms.Stop)
	db := ms.New(t)
	var name string
	if err := db.QueryRow("SELECT DATABASE()").Scan(&name); err != nil {
		t.Fatal(err)
	}
	up := newTestUpstream(t)
	p := startProxy(t, nil, "--upstream", up.URL, "--store", ms.URL(name),
		"--retention", "1s", "--reap-interval", "100ms")
	first := mustSend(t, "POST", p.url("/payments"), "my-1", `{"amount":1}`)
	wantStatus(t, "first request", first, 201, "")
	again := mustSend(t, "POST", p.url("/payments"), "my-1", `{"amount":1}`)
	wantStatus(t, "repeat", again, 201, "")
	if !bytes.Equal(first.body, again.body) {
		t.Errorf("replay: got body %s, want %s", again.body, first.body)
	}
	up.mu.Lock()
	runs := up.runs["my-1"]
	up.mu.Unlock()
	if runs != 1 {
		t.Errorf("upstream ran %d times for one key, want 1", runs)
	}
	for i := range 2 {
		wantStatus(t, "request", mustSend(t, "POST", p.url("/payments"), fmt.Sprint("reap-", i), `{}`), 201, "")
	}
	rows := func() int {
		t.Helper()
		var n int
		if err := db.QueryRow("SELECT count(*) FROM idem_records").Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if n := rows(); n != 3 {
		t.Fatalf("rows after 3 keys: got %d, want 3", n)
	}
	// Expired for longer than the grace (a minute): what the reaper deletes.
	if _, err := db.Exec("UPDATE idem_records SET expires_at = expires_at - INTERVAL 61 SECOND"); err != nil {
		t.Fatal(err)
	}
	wantStatus(t, "request", mustSend(t, "POST", p.url("/payments"), "reap-recent", `{}`), 201, "")
	deadline := time.Now().Add(10 * time.Second)
	for rows() != 1 {
		if time.Now().After(deadline) {
			t.Fatalf("after 10s: %d rows, want the 3 expired ones reaped and 1 kept", rows())
		}
		time.Sleep(50 * time.Millisecond)
	}
	if got := p.metric("idem_reaped_total"); got != 3 {
		t.Errorf("idem_reaped_total: got %v, want 3", got)
	}
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code := p.awaitExit(10 * time.Second); code != 0 {
		t.Fatalf("exit status after SIGTERM: got %d, want 0", code)
	}
	if log := p.logText(); strings.Contains(log, "reap failed") || strings.Contains(log, `"level":"ERROR"`) {
		t.Errorf("errors at shutdown in\n%s", log)
	}
}
