package tieredstore_test

import (
	"context"
	"regexp"
	"testing"

	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/redisstore"
	"github.com/idemkit/idem/tieredstore"
)

// A tiered store's namespace names both of its databases: the Redis
// store's id, and the PostgreSQL database's own. Two PostgreSQL databases
// behind one Redis database and prefix (or two Redis databases in front
// of one PostgreSQL database) have two namespaces; two stores on the same
// pair have one. Without the PostgreSQL id (tables of v1.0, NoStoreID)
// the Redis id still names the Redis database.
func TestStoreID(t *testing.T) {
	ctx := context.Background()
	c := newRueidis(t, shared.Addr())
	prefix := uniquePrefix("storeid")
	withIDs := regexp.MustCompile(`^tiered redis prefix "` + regexp.QuoteMeta(prefix) + `" store [0-9a-f]{32} postgres table idem_completions namespace "` +
		regexp.QuoteMeta(prefix) + `" store [0-9a-f]{32}$`)
	a := newStore(t, c, newPool(t, 4), prefix, redisstore.Options{}, tieredstore.Options{RelayInterval: -1})
	nsA := a.Namespace()
	if !withIDs.MatchString(nsA) {
		t.Fatalf("Namespace %q: want the Redis store's and PostgreSQL's store ids", nsA)
	}
	if ns := newStore(t, c, newPool(t, 4), prefix, redisstore.Options{}, tieredstore.Options{RelayInterval: -1}).Namespace(); ns != nsA {
		t.Errorf("a second store on the same databases: %q, want %q", ns, nsA)
	}
	other := pgtest.New(t)
	b := newStore(t, c, other, prefix, redisstore.Options{}, tieredstore.Options{Migrate: true, RelayInterval: -1})
	if ns := b.Namespace(); ns == nsA || !withIDs.MatchString(ns) {
		t.Errorf("another PostgreSQL database behind the same Redis: %q, A's %q; want another namespace", ns, nsA)
	}
	if b.LegacyNamespace() != a.LegacyNamespace() {
		t.Errorf("LegacyNamespace %q and %q: want v1.0's, the same", b.LegacyNamespace(), a.LegacyNamespace())
	}
	// PostgreSQL without the id: NoStoreID creates none.
	if _, err := other.Exec(ctx, "DROP TABLE idem_completions_store_id"); err != nil {
		t.Fatal(err)
	}
	ro := newStore(t, c, other, prefix, redisstore.Options{NoStoreID: true}, tieredstore.Options{NoStoreID: true, RelayInterval: -1})
	want := regexp.MustCompile(`^tiered redis prefix "` + regexp.QuoteMeta(prefix) + `" store [0-9a-f]{32} postgres table idem_completions namespace "` +
		regexp.QuoteMeta(prefix) + `"$`)
	if ns := ro.Namespace(); !want.MatchString(ns) {
		t.Errorf("NoStoreID on PostgreSQL without an id: %q, want the Redis id alone", ns)
	}
	var exists bool
	if err := other.QueryRow(ctx, "SELECT to_regclass('idem_completions_store_id') IS NOT NULL").Scan(&exists); err != nil || exists {
		t.Errorf("NoStoreID created the id's table (%v)", err)
	}
}
