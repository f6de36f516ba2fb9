package main

import (
	"bytes"
	"context"
	"errors"
	"net/url"
	"strings"
	"testing"

	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/tieredstore"
)

// --store with two URLs is the tiered store; malformed forms are usage
// errors, found before any connection is tried, that never show a
// password.
func TestOpenStoreTieredForms(t *testing.T) {
	for _, spec := range []string{
		"redis://127.0.0.1:1 postgres://u:s3cretpw@127.0.0.1:1/db postgres://127.0.0.1:1/db",
		"redis://127.0.0.1:1 redis://127.0.0.1:2",
		"postgres://u:s3cretpw@127.0.0.1:1/a postgres://127.0.0.1:1/b",
		"redis://127.0.0.1:1 mysql://u:s3cretpw@127.0.0.1:1/db",
		"redis://127.0.0.1:1 postgres:u:s3cretpw@127.0.0.1:1/db",
		"redis://:s3cretpw@127.0.0.1:1?dbb=1 postgres://127.0.0.1:1/db",
		"redis:127.0.0.1:1 postgres://127.0.0.1:1/db",
		"redis://127.0.0.1:1 postgres://u:s3cretpw@127.0.0.1:notaport/db",
		"host=db password=s3cretpw",
	} {
		_, _, err := openStore(t.Context(), spec, "")
		var ue usageError
		if !errors.As(err, &ue) || strings.Contains(err.Error(), "s3cretpw") {
			t.Errorf("--store %q: got %v; want a usage error without the password", spec, err)
		}
	}
	// Well formed, in either order: the URLs are accepted and dialled
	// (nothing listens on port 1).
	for _, spec := range []string{
		"redis://127.0.0.1:1 postgres://127.0.0.1:1/db?connect_timeout=1",
		"  postgres://127.0.0.1:1/db?connect_timeout=1\tredis://127.0.0.1:1  ",
	} {
		_, _, err := openStore(t.Context(), spec, "")
		if err == nil || errors.As(err, new(usageError)) || !strings.Contains(err.Error(), "connection refused") {
			t.Errorf("--store %q: got %v; want a connection error, not a usage error", spec, err)
		}
	}
}

// The proxy on the tiered store: a completed request survives the loss of
// its Redis record (FLUSHALL): the repeat is replayed from PostgreSQL, the
// upstream is not called again, and Redis is refilled.
func TestProxyTieredStore(t *testing.T) {
	pool := pgtest.New(t)
	u, err := url.Parse(pgtest.URL())
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/" + pool.Config().ConnConfig.Database
	rs := proxyRedis(t)
	up := newTestUpstream(t)
	p := startProxy(t, nil, "--upstream", up.URL, "--store", "redis://"+rs.Addr()+" "+u.String())

	first := mustSend(t, "POST", p.url("/payments"), "tiered-1", `{"amount":100}`)
	wantStatus(t, "first request", first, 201, "")
	again := mustSend(t, "POST", p.url("/payments"), "tiered-1", `{"amount":100}`)
	if !again.replayed() || !bytes.Equal(again.body, first.body) {
		t.Fatalf("repeat: got %s (replayed %t), want the replay of %s", again.body, again.replayed(), first.body)
	}
	if _, err := rs.Do("FLUSHALL"); err != nil {
		t.Fatal(err)
	}
	lost := mustSend(t, "POST", p.url("/payments"), "tiered-1", `{"amount":100}`)
	if !lost.replayed() || !bytes.Equal(lost.body, first.body) {
		t.Fatalf("repeat after FLUSHALL: got %d %s (replayed %t), want the replay of %s from PostgreSQL", lost.status, lost.body, lost.replayed(), first.body)
	}
	if n := up.runsOf("tiered-1"); n != 1 {
		t.Fatalf("upstream runs: got %d, want 1", n)
	}
	if keys, err := rs.Do("DBSIZE"); err != nil || keys != "1" {
		t.Fatalf("Redis after the replay from PostgreSQL: DBSIZE %q (%v), want 1 (refilled)", keys, err)
	}
	var rows int
	if err := pool.QueryRow(context.Background(), "SELECT count(*) FROM "+tieredstore.DefaultTable).Scan(&rows); err != nil || rows != 1 {
		t.Fatalf("completions in PostgreSQL: got %d (%v), want 1", rows, err)
	}
	wantStatus(t, "other body", mustSend(t, "POST", p.url("/payments"), "tiered-1", `{"amount":999}`), 422, "urn:idem:problem:mismatch")
}
