package main

import (
	"context"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/mysqltest"
	"github.com/idemkit/idem/internal/pgtest"
)

// TestGCWrongDatabase's case on PostgreSQL and MySQL: a proxy on database
// A writes a blob; idem gc --store on database B of the same server, with
// the same table name, must judge none of A's blobs, with or without
// --dry-run, whether B has a store id of its own or none (a table of
// v1.0's, or one whose id row is gone); gc creates no id in B. A blob
// named with v1.0's namespace is never judged, on either database, and
// still replays. gc on A still deletes A's real orphan.
func TestGCWrongDatabaseSQL(t *testing.T) {
	for _, kind := range []string{"postgres", "mysql"} {
		t.Run(kind, func(t *testing.T) {
			dbA, dbB, onB := twoSQLDatabases(t, kind)
			ctx := context.Background()
			bb := newBlobBackend(t, "file")
			up := newBigUpstream(t)
			p := startBlobProxy(t, "--upstream", up.URL, "--store", dbA, "--blob", bb.url)
			wantWhole(t, "first", fetch(t, p.base(), "live", 5*mib), "live", 5*mib)
			storeA := openPrefixed(t, dbA, "")
			live := completedBlob(t, storeA, "live")
			nsA := storeA.(idem.Namespacer).Namespace()
			legacyNS := nsA
			if n, ok := storeA.(interface{ LegacyNamespace() string }); ok {
				legacyNS = n.LegacyNamespace()
			} else {
				t.Errorf("%T has no LegacyNamespace", storeA)
			}
			if !strings.HasPrefix(nsA, legacyNS+" store ") || len(nsA) != len(legacyNS)+len(" store ")+32 {
				t.Errorf("database A's namespace %q: want v1.0's %q and a store id", nsA, legacyNS)
			}
			if n, ok := idem.ParseBlobName(live); !ok || n.Namespace != idem.BlobNamespace(nsA) {
				t.Errorf("the proxy's blob %s: want it in namespace %s (%s)", live, idem.BlobNamespace(nsA), nsA)
			}
			if !strings.Contains(p.LogText(), `"blob_namespace":"`+idem.BlobNamespace(nsA)) {
				t.Errorf("the proxy did not log its blob namespace %s:\n%s", idem.BlobNamespace(nsA), p.LogText())
			}
			// A record of v1.0: its blob named with v1.0's namespace.
			wantWhole(t, "old, first", fetch(t, p.base(), "old", 2*mib), "old", 2*mib)
			old := renameToLegacy(t, bb, storeA, "old", legacyNS)
			// A real orphan of A: an attempt that never completed.
			orphan := putBlob(t, bb.open, idem.NewBlobName(nsA, idem.Lease{Key: storedKey("orphan"), Token: 42})).Name
			all := []string{live, old, orphan}
			slices.Sort(all)

			// B has a store of its own (a proxy ran on it): its own id.
			if nsB := openPrefixed(t, dbB, "").(idem.Namespacer).Namespace(); nsB == nsA || !strings.HasPrefix(nsB, legacyNS+" store ") {
				t.Errorf("database B's namespace %q, A's %q: want one table, two store ids", nsB, nsA)
			}
			for _, v := range []struct{ name, sql string }{
				{"B with its own id", ""},
				{"B with no id row", "DELETE FROM idem_records_store_id"},
				{"B with v1.0's tables (no id table)", "DROP TABLE idem_records_store_id"},
			} {
				if v.sql != "" {
					onB.exec(t, v.sql)
				}
				noID := v.sql != ""
				for _, dry := range []bool{true, false} {
					args := []string{"--store", dbB, "--blob", bb.url}
					if dry {
						args = append(args, "--dry-run")
					}
					res := runGCJSON(t, args...)
					if res.Orphans != 0 || res.Kept != 0 || res.Other != 2 || res.OtherNamespaces[idem.BlobNamespace(nsA)] != 2 ||
						res.Legacy != 1 || res.NoStoreID != noID {
						t.Errorf("%s: idem gc %q: %+v; want nothing deleted or kept, A's 2 blobs left as another namespace, the v1.0 blob as legacy, no_store_id %t",
							v.name, args, res, noID)
					}
					if got := bb.names(t); !slices.Equal(got, all) {
						t.Fatalf("%s: after idem gc %q: %v, want every blob still there: %v", v.name, args, got, all)
					}
				}
				if noID {
					code, out := runIdemOut(t, "gc", "--store", dbB, "--blob", bb.url, "--min-age", "0")
					for _, want := range []string{"deleted 0 orphans", "judged nothing: the store has no store id", "written by idem v1.0"} {
						if code != 0 || !strings.Contains(out, want) {
							t.Errorf("%s: idem gc: exit %d, want %q in\n%s", v.name, code, want, out)
						}
					}
					// inspect and purge create no id either.
					for _, cmd := range [][]string{
						{"inspect", "--store", dbB, "--key", "live", "--route", "/export"},
						{"purge", "--store", dbB, "--key", "absent", "--route", "/export", "--yes"},
					} {
						if code, out := runIdemOut(t, cmd...); code != 0 && code != 1 {
							t.Errorf("idem %s: exit %d\n%s", cmd[0], code, out)
						}
					}
					if rows, table := onB.storeIDRows(t); rows != 0 || table != (v.sql[:6] == "DELETE") {
						t.Errorf("%s: after gc, inspect and purge, B has %d id rows (id table there: %t): want them to create nothing", v.name, rows, table)
					}
				}
			}

			// The right database deletes its orphan, keeps the live blob
			// and leaves v1.0's alone.
			res := runGCJSON(t, "--store", dbA, "--blob", bb.url)
			if res.Orphans != 1 || res.Kept != 1 || res.Legacy != 1 || res.Other != 0 || res.NoStoreID || res.Namespace != nsA {
				t.Errorf("idem gc on A: %+v; want the orphan deleted, 1 kept, 1 legacy", res)
			}
			if got, want := bb.names(t), slices.DeleteFunc(slices.Clone(all), func(n string) bool { return n == orphan }); !slices.Equal(got, want) {
				t.Fatalf("after idem gc on A: %v, want %v", got, want)
			}
			wantWhole(t, "the replay after idem gc", fetch(t, p.base(), "live", 5*mib), "live", 5*mib)
			wantWhole(t, "the replay of v1.0's blob", fetch(t, p.base(), "old", 2*mib), "old", 2*mib)
			if up.runsOf("live") != 1 || up.runsOf("old") != 1 {
				t.Errorf("the upstream ran live %d times, old %d; want once each", up.runsOf("live"), up.runsOf("old"))
			}
			if _, _, err := storeA.Get(ctx, storedKey("live")); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// sqlDB runs statements on a test's database.
type sqlDB struct {
	kind  string
	run   func(q string) error
	query func(q string) (int, error) // a count
}

func (d sqlDB) exec(t *testing.T, q string) {
	t.Helper()
	if err := d.run(q); err != nil {
		t.Fatalf("%s: %v", q, err)
	}
}

func (d sqlDB) count(t *testing.T, q string) int {
	t.Helper()
	n, err := d.query(q)
	if err != nil {
		t.Fatalf("%s: %v", q, err)
	}
	return n
}

// storeIDRows returns the rows of the store id's table, and whether the
// table exists.
func (d sqlDB) storeIDRows(t *testing.T) (int, bool) {
	t.Helper()
	q := "SELECT count(*) FROM information_schema.tables WHERE table_name = 'idem_records_store_id'"
	if d.kind == "mysql" {
		q += " AND table_schema = DATABASE()"
	}
	if d.count(t, q) == 0 {
		return 0, false
	}
	return d.count(t, "SELECT count(*) FROM idem_records_store_id"), true
}

// twoSQLDatabases returns the URLs of two private databases of one server
// (PostgreSQL or a private MariaDB), and a handle on the second.
func twoSQLDatabases(t *testing.T, kind string) (a, b string, onB sqlDB) {
	t.Helper()
	var urlOf func() (string, sqlDB)
	switch kind {
	case "postgres":
		urlOf = func() (string, sqlDB) {
			pool := pgtest.New(t)
			u, err := url.Parse(pgtest.URL())
			if err != nil {
				t.Fatal(err)
			}
			u.Path = "/" + pool.Config().ConnConfig.Database
			ctx := context.Background()
			return u.String(), sqlDB{kind: kind,
				run: func(q string) error { _, err := pool.Exec(ctx, q); return err },
				query: func(q string) (n int, err error) {
					err = pool.QueryRow(ctx, q).Scan(&n)
					return n, err
				}}
		}
	case "mysql":
		ms, err := mysqltest.Start()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(ms.Stop)
		urlOf = func() (string, sqlDB) {
			db := ms.New(t)
			var name string
			if err := db.QueryRow("SELECT DATABASE()").Scan(&name); err != nil {
				t.Fatal(err)
			}
			return ms.URL(name), sqlDB{kind: kind,
				run: func(q string) error { _, err := db.Exec(q); return err },
				query: func(q string) (n int, err error) {
					err = db.QueryRow(q).Scan(&n)
					return n, err
				}}
		}
	default:
		t.Fatalf("no database kind %q", kind)
	}
	a, _ = urlOf()
	b, onB = urlOf()
	return a, b, onB
}

// renameToLegacy makes the completed record of clientKey in store refer
// to a copy of its blob named with namespace legacyNS (as v1.0 named it),
// and deletes the original: the record as v1.0 left it. It returns the
// copy's name.
func renameToLegacy(t *testing.T, bb *blobBackend, store idem.Store, clientKey, legacyNS string) string {
	t.Helper()
	ctx := context.Background()
	name := completedBlob(t, store, clientKey)
	rec, _, err := store.Get(ctx, storedKey(clientKey))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := store.Delete(ctx, storedKey(clientKey)); err != nil {
		t.Fatal(err)
	}
	acq, err := store.Acquire(ctx, idem.AcquireRequest{Key: storedKey(clientKey), Fingerprint: rec.Fingerprint, LeaseID: idem.NewLeaseID(), TTL: time.Minute})
	if err != nil || acq.Outcome != idem.Acquired {
		t.Fatalf("acquire %s: %v %v", clientKey, acq.Outcome, err)
	}
	legacy := *rec.Response.Blob
	legacy.Name = idem.NewBlobName(legacyNS, acq.Lease)
	copyBlob(t, bb, name, legacy.Name)
	resp := *rec.Response
	resp.Blob = &legacy
	if err := store.Complete(ctx, acq.Lease, &resp, time.Hour); err != nil {
		t.Fatal(err)
	}
	if err := bb.open.Delete(ctx, name); err != nil {
		t.Fatal(err)
	}
	return legacy.Name
}
