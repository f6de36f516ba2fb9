package pgstore_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"log/slog"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/pgstore"
)

// withID matches a Namespace that carries a store id.
var withID = regexp.MustCompile(`^postgres table idem_records namespace "" store [0-9a-f]{32}$`)

const legacyNS = `postgres table idem_records namespace ""`

// Namespace names the database: one id for every store on one database
// (another pool, as another process has), another id on another
// database with the same table; a database without the id keeps v1.0's
// namespace, and NoStoreID creates nothing.
func TestStoreID(t *testing.T) {
	ctx := context.Background()
	poolA := pgtest.New(t)
	a := newStore(t, poolA, pgstore.Options{Migrate: true})
	nsA := a.Namespace()
	if !withID.MatchString(nsA) || a.LegacyNamespace() != legacyNS {
		t.Fatalf("Namespace %q, LegacyNamespace %q: want the table, the namespace and a store id", nsA, a.LegacyNamespace())
	}
	// Another pool on the same database (another process): the same id.
	other, err := pgxpool.NewWithConfig(ctx, poolA.Config())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(other.Close) // before the database is dropped
	if ns := newStore(t, other, pgstore.Options{}).Namespace(); ns != nsA {
		t.Errorf("a second pool on database A: namespace %q, want %q", ns, nsA)
	}
	if ns := newStore(t, other, pgstore.Options{NoStoreID: true}).Namespace(); ns != nsA {
		t.Errorf("NoStoreID on database A: namespace %q, want %q (it reads the id)", ns, nsA)
	}
	// Another database, same table: another id.
	poolB := pgtest.New(t)
	if ns := newStore(t, poolB, pgstore.Options{Migrate: true}).Namespace(); ns == nsA || !withID.MatchString(ns) {
		t.Errorf("database B: namespace %q, A's %q: want another store id", ns, nsA)
	}

	// A database migrated by v1.0: no id table.
	poolC := pgtest.New(t)
	if err := pgstore.Migrate(ctx, poolC, ""); err != nil {
		t.Fatal(err)
	}
	if _, err := poolC.Exec(ctx, "DROP TABLE idem_records_store_id"); err != nil {
		t.Fatal(err)
	}
	if ns := newStore(t, poolC, pgstore.Options{NoStoreID: true}).Namespace(); ns != legacyNS {
		t.Errorf("NoStoreID on a database without an id: namespace %q, want v1.0's %q", ns, legacyNS)
	}
	var log bytes.Buffer
	w := newStore(t, poolC, pgstore.Options{Logger: slog.New(slog.NewTextHandler(&log, nil))})
	if ns := w.Namespace(); ns != legacyNS || !strings.Contains(log.String(), "no store id") || !strings.Contains(log.String(), "Migrate") {
		t.Errorf("New without Migrate on v1.0's tables: namespace %q, log %q; want v1.0's namespace and a WARN naming Migrate", ns, log.String())
	}
	if idTable(t, poolC) {
		t.Fatal("New without Migrate created the id's table")
	}
	// The id's row gone (the table there): NoStoreID does not store one,
	// New does.
	if err := pgstore.Migrate(ctx, poolC, ""); err != nil {
		t.Fatal(err)
	}
	if _, err := poolC.Exec(ctx, "DELETE FROM idem_records_store_id"); err != nil {
		t.Fatal(err)
	}
	if ns := newStore(t, poolC, pgstore.Options{NoStoreID: true}).Namespace(); ns != legacyNS || idRows(t, poolC) != 0 {
		t.Errorf("NoStoreID on an empty id table: namespace %q, %d rows; want v1.0's namespace and no row", ns, idRows(t, poolC))
	}
	if ns := newStore(t, poolC, pgstore.Options{}).Namespace(); !withID.MatchString(ns) || idRows(t, poolC) != 1 {
		t.Errorf("New on an empty id table: namespace %q, %d rows; want a store id, stored", ns, idRows(t, poolC))
	}

	// Stores opening a new database at once agree on one id.
	poolD := pgtest.New(t)
	var wg sync.WaitGroup
	nss := make([]string, 8)
	for i := range nss {
		wg.Go(func() {
			s, err := pgstore.New(ctx, poolD, pgstore.Options{Migrate: true})
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
	if n := idRows(t, poolD); n != 1 {
		t.Errorf("id rows: %d, want 1", n)
	}
}

// A database that does not answer does not fail New without Migrate, as
// in v1.0: the namespace is v1.0's meanwhile.
func TestStoreIDUnreachable(t *testing.T) {
	pool, err := pgxpool.New(context.Background(), "postgres://postgres@127.0.0.1:1/none?connect_timeout=2")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	s, err := pgstore.New(context.Background(), pool, pgstore.Options{})
	if err != nil {
		t.Fatalf("New on a server that does not answer: %v", err)
	}
	if ns := s.Namespace(); ns != legacyNS {
		t.Errorf("Namespace %q, want v1.0's %q until the id is read", ns, legacyNS)
	}
}

func idTable(t *testing.T, pool *pgxpool.Pool) bool {
	t.Helper()
	var ok bool
	if err := pool.QueryRow(context.Background(), "SELECT to_regclass('idem_records_store_id') IS NOT NULL").Scan(&ok); err != nil {
		t.Fatal(err)
	}
	return ok
}

func idRows(t *testing.T, pool *pgxpool.Pool) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), "SELECT count(*) FROM idem_records_store_id").Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// An upgrade from v1.0 where the tables were made by an administrator and
// the store's role may not create any: New with Migrate still opens (as
// in v1.0, where every object existed), with v1.0's namespace and a WARN.
func TestStoreIDRoleWithoutCreate(t *testing.T) {
	ctx := context.Background()
	admin := pgtest.New(t)
	if err := pgstore.Migrate(ctx, admin, ""); err != nil {
		t.Fatal(err)
	}
	role := "idemtest_" + strings.ToLower(rand.Text()[:12])
	for _, q := range []string{
		"DROP TABLE idem_records_store_id", // the tables as v1.0 made them
		"CREATE ROLE " + role + " LOGIN",
		"REVOKE CREATE ON SCHEMA public FROM PUBLIC",
		"GRANT SELECT, INSERT, UPDATE, DELETE ON idem_records TO " + role,
		"GRANT USAGE ON SEQUENCE idem_records_token TO " + role,
	} {
		if _, err := admin.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	t.Cleanup(func() {
		if _, err := admin.Exec(context.Background(), "DROP OWNED BY "+role+"; DROP ROLE "+role); err != nil {
			t.Error(err)
		}
	})
	cfg := admin.Config().Copy()
	cfg.ConnConfig.User = role
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	var log bytes.Buffer
	s, err := pgstore.New(ctx, pool, pgstore.Options{Migrate: true, Logger: slog.New(slog.NewTextHandler(&log, nil))})
	if err != nil {
		t.Fatalf("New with Migrate by a role that may not create tables, on v1.0's tables: %v", err)
	}
	if ns := s.Namespace(); ns != legacyNS || !strings.Contains(log.String(), "no store id") {
		t.Errorf("namespace %q, log %q: want v1.0's namespace and a WARN", ns, log.String())
	}
	l := lease(t, s, newKey(1), time.Minute)
	if err := s.Complete(ctx, l, resp, time.Minute); err != nil {
		t.Fatal(err)
	}
}
