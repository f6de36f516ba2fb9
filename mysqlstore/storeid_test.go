package mysqlstore_test

import (
	"bytes"
	"context"
	"database/sql"
	"log/slog"
	"regexp"
	"strings"
	"sync"
	"testing"

	"github.com/idemkit/idem/mysqlstore"
)

// withID matches a Namespace that carries a store id.
var withID = regexp.MustCompile(`^mysql table idem_records namespace "" store [0-9a-f]{32}$`)

const legacyNS = `mysql table idem_records namespace ""`

// Namespace names the database (schema): one id for every store on one
// database (another pool, as another process has), another id on
// another database of the same server with the same table; a database
// without the id keeps v1.0's namespace, and NoStoreID creates nothing.
func TestStoreID(t *testing.T) {
	ctx := context.Background()
	dbA := srv.New(t)
	a := newStore(t, dbA, mysqlstore.Options{Migrate: true})
	nsA := a.Namespace()
	if !withID.MatchString(nsA) || a.LegacyNamespace() != legacyNS {
		t.Fatalf("Namespace %q, LegacyNamespace %q: want the table, the namespace and a store id", nsA, a.LegacyNamespace())
	}
	var name string
	if err := dbA.QueryRow("SELECT DATABASE()").Scan(&name); err != nil {
		t.Fatal(err)
	}
	other, err := sql.Open("mysql", srv.DSN(name))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { other.Close() })
	if ns := newStore(t, other, mysqlstore.Options{}).Namespace(); ns != nsA {
		t.Errorf("a second pool on database A: namespace %q, want %q", ns, nsA)
	}
	if ns := newStore(t, other, mysqlstore.Options{NoStoreID: true}).Namespace(); ns != nsA {
		t.Errorf("NoStoreID on database A: namespace %q, want %q (it reads the id)", ns, nsA)
	}
	dbB := srv.New(t)
	if ns := newStore(t, dbB, mysqlstore.Options{Migrate: true}).Namespace(); ns == nsA || !withID.MatchString(ns) {
		t.Errorf("database B: namespace %q, A's %q: want another store id", ns, nsA)
	}

	// A database migrated by v1.0: no id table.
	dbC := srv.New(t)
	if err := mysqlstore.Migrate(ctx, dbC, ""); err != nil {
		t.Fatal(err)
	}
	if _, err := dbC.Exec("DROP TABLE idem_records_store_id"); err != nil {
		t.Fatal(err)
	}
	if ns := newStore(t, dbC, mysqlstore.Options{NoStoreID: true}).Namespace(); ns != legacyNS {
		t.Errorf("NoStoreID on a database without an id: namespace %q, want v1.0's %q", ns, legacyNS)
	}
	var log bytes.Buffer
	w := newStore(t, dbC, mysqlstore.Options{Logger: slog.New(slog.NewTextHandler(&log, nil))})
	if ns := w.Namespace(); ns != legacyNS || !strings.Contains(log.String(), "no store id") || !strings.Contains(log.String(), "Migrate") {
		t.Errorf("New without Migrate on v1.0's tables: namespace %q, log %q; want v1.0's namespace and a WARN naming Migrate", ns, log.String())
	}
	var tables int
	if err := dbC.QueryRow("SELECT count(*) FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name = 'idem_records_store_id'").Scan(&tables); err != nil || tables != 0 {
		t.Fatalf("New without Migrate: %d id tables (%v), want none created", tables, err)
	}
	if err := mysqlstore.Migrate(ctx, dbC, ""); err != nil {
		t.Fatal(err)
	}
	if _, err := dbC.Exec("DELETE FROM idem_records_store_id"); err != nil {
		t.Fatal(err)
	}
	if ns := newStore(t, dbC, mysqlstore.Options{NoStoreID: true}).Namespace(); ns != legacyNS || idRows(t, dbC) != 0 {
		t.Errorf("NoStoreID on an empty id table: namespace %q, %d rows; want v1.0's namespace and no row", ns, idRows(t, dbC))
	}
	if ns := newStore(t, dbC, mysqlstore.Options{}).Namespace(); !withID.MatchString(ns) || idRows(t, dbC) != 1 {
		t.Errorf("New on an empty id table: namespace %q, %d rows; want a store id, stored", ns, idRows(t, dbC))
	}

	// Stores opening a new database at once agree on one id.
	dbD := srv.New(t)
	var wg sync.WaitGroup
	nss := make([]string, 8)
	for i := range nss {
		wg.Go(func() {
			s, err := mysqlstore.New(ctx, dbD, mysqlstore.Options{Migrate: true})
			if err != nil {
				t.Error(err)
				return
			}
			nss[i] = s.Namespace()
		})
	}
	wg.Wait()
	for _, ns := range nss {
		if ns != nss[0] || !withID.MatchString(ns) {
			t.Fatalf("8 stores opening a new database at once: namespaces %q, want one store id", nss)
		}
	}
	if n := idRows(t, dbD); n != 1 {
		t.Errorf("id rows: %d, want 1", n)
	}
}

// A server that does not answer does not fail New without Migrate, as in
// v1.0: the namespace is v1.0's meanwhile.
func TestStoreIDUnreachable(t *testing.T) {
	db, err := sql.Open("mysql", "root@tcp(127.0.0.1:1)/none?timeout=2s")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	s, err := mysqlstore.New(context.Background(), db, mysqlstore.Options{})
	if err != nil {
		t.Fatalf("New on a server that does not answer: %v", err)
	}
	if ns := s.Namespace(); ns != legacyNS {
		t.Errorf("Namespace %q, want v1.0's %q until the id is read", ns, legacyNS)
	}
}

func idRows(t *testing.T, db *sql.DB) int {
	t.Helper()
	var n int
	if err := db.QueryRow("SELECT count(*) FROM idem_records_store_id").Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}
