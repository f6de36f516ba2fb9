package caddyidem

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/idemkit/idem/internal/mysqltest"
)

// TestMySQLStore: store mysql://… (a private MariaDB) as idem proxy's
// --store: the tables are created, a key runs once, its repeat is the
// byte-identical replay, and the reaper (reap_interval) deletes the
// records expired for the store's grace (moved back rather than waited
// for).
func TestMySQLStore(t *testing.T) {
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
	up := startCounter(t, 0)
	base := startCaddy(t, fmt.Sprintf("\tidempotency {\n\t\tstore %s\n\t\tretention 1s\n\t\treap_interval 100ms\n\t}\n\treverse_proxy %s",
		ms.URL(name), strings.TrimPrefix(up.srv.URL, "http://")))
	key := "mysql-" + runID
	first := post(t, base+"/pay", key, `{"amount":1}`)
	if first.status != 201 || first.replayed != "" {
		t.Fatalf("first: got %d (replayed %q) %q, want the upstream's 201", first.status, first.replayed, first.body)
	}
	again := post(t, base+"/pay", key, `{"amount":1}`)
	if again.status != 201 || again.replayed != "true" || again.body != first.body || up.count(key) != 1 {
		t.Errorf("repeat: got %d (replayed %q) %q after %d executions, want the replay of %q after 1",
			again.status, again.replayed, again.body, up.count(key), first.body)
	}
	for i := range 2 {
		if a := post(t, base+"/pay", fmt.Sprint("mysql-reap-", i, "-", runID), `{}`); a.status != 201 {
			t.Fatalf("request %d: got %d %q, want 201", i, a.status, a.body)
		}
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
		t.Fatalf("rows after 3 keys: got %d, want 3 (the records are in MySQL)", n)
	}
	// Expired for longer than the grace (a minute): what the reaper deletes.
	if _, err := db.Exec("UPDATE idem_records SET expires_at = expires_at - INTERVAL 61 SECOND"); err != nil {
		t.Fatal(err)
	}
	if a := post(t, base+"/pay", "mysql-recent-"+runID, `{}`); a.status != 201 {
		t.Fatalf("request: got %d %q, want 201", a.status, a.body)
	}
	deadline := time.Now().Add(10 * time.Second)
	for rows() != 1 {
		if time.Now().After(deadline) {
			t.Fatalf("after 10s: %d rows, want the 3 expired ones reaped and 1 kept", rows())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestStoreURLErrors: a store URL that cannot work is refused when the
// config loads, saying what to write, without the URL (it may hold a
// password).
func TestStoreURLErrors(t *testing.T) {
	for _, tc := range []struct{ url, want string }{
		{"mysql:u:s3cretpw@127.0.0.1/db", "store: not a MySQL URL of a form Open accepts (mysql://[user[:pass]@]host[:port]/db[?params], mariadb://…): no host"},
		{"mysql://u:s3cretpw@127.0.0.1:1/", "not a MySQL URL of a form Open accepts (mysql://[user[:pass]@]host[:port]/db[?params], mariadb://…): it names no database"},
		{"mysql://u:s3cretpw@127.0.0.1:1/db?timeout=soon", "not a MySQL URL of a form Open accepts (mysql://[user[:pass]@]host[:port]/db[?params], mariadb://…): its parameters"},
		{"postgres:u:s3cretpw@127.0.0.1/db", "store: not a PostgreSQL URL of a form Open accepts (postgres://[user[:pass]@]host[:port]/db[?params], postgresql://…): no host"},
		{"mongodb://u:s3cretpw@127.0.0.1:1/db", `unknown scheme "mongodb"; want memory, redis://`},
	} {
		_, _, err := open(testContext(t), storeSpec{url: tc.url}, nil)
		if err == nil || !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), "s3cretpw") {
			t.Errorf("store %s: got error %v, want one containing %q and not the password", tc.url, err, tc.want)
		}
	}
}

// testContext is a caddy.Context that ends with the test.
func testContext(t *testing.T) caddy.Context {
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	t.Cleanup(cancel)
	return ctx
}
