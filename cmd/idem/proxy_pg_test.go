package main

import (
	"bytes"
	"net/url"
	"testing"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/pgtest"
)

// The proxy on a PostgreSQL store: --store postgres://… creates the table
// and behaves as on Redis.
func TestProxyPostgresStore(t *testing.T) {
	pool := pgtest.New(t)
	u, err := url.Parse(pgtest.URL())
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/" + pool.Config().ConnConfig.Database
	up := newTestUpstream(t)
	p := startProxy(t, nil, "--upstream", up.URL, "--store", u.String())

	first := mustSend(t, "POST", p.url("/payments"), "pg-1", `{"amount":100}`)
	wantStatus(t, "first request", first, 201, "")
	again := mustSend(t, "POST", p.url("/payments"), "pg-1", `{"amount":100}`)
	wantStatus(t, "repeat", again, 201, "")
	if !again.replayed() || !bytes.Equal(again.body, first.body) {
		t.Fatalf("repeat: got %s (replayed %t), want the replay of %s", again.body, again.replayed(), first.body)
	}
	wantStatus(t, "other body", mustSend(t, "POST", p.url("/payments"), "pg-1", `{"amount":999}`), 422, idemhttp.ProblemMismatch)
	if n := up.runsOf("pg-1"); n != 1 {
		t.Fatalf("upstream runs: got %d, want 1", n)
	}
	var records int
	if err := pool.QueryRow(t.Context(), "SELECT count(*) FROM idem_records WHERE state = 2").Scan(&records); err != nil || records != 1 {
		t.Fatalf("completed records in PostgreSQL: got %d (%v), want 1", records, err)
	}
}
