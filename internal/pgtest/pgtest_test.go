package pgtest_test

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/pgtest"
)

// TestPrivateDatabase checks that each New gets a database of its own and
// that the database is gone once its test has ended.
func TestPrivateDatabase(t *testing.T) {
	ctx := context.Background()
	var names [2]string
	for i := range names {
		t.Run("db", func(t *testing.T) {
			pool := pgtest.New(t)
			if err := pool.QueryRow(ctx, "SELECT current_database()").Scan(&names[i]); err != nil {
				t.Fatal(err)
			}
			if !strings.HasPrefix(names[i], "idemtest_") {
				t.Errorf("current_database: got %q, want idemtest_...", names[i])
			}
			if _, err := pool.Exec(ctx, "CREATE TABLE t (x int)"); err != nil {
				t.Fatalf("CREATE TABLE in a fresh database: %v", err)
			}
		})
	}
	if names[0] == names[1] {
		t.Fatalf("two calls of New: both got database %q, want distinct ones", names[0])
	}

	admin, err := pgx.Connect(ctx, pgtest.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(ctx)
	for _, name := range names {
		var n int
		if err := admin.QueryRow(ctx, "SELECT count(*) FROM pg_database WHERE datname = $1", name).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n != 0 {
			t.Errorf("database %s still exists after its test ended, want it dropped", name)
		}
	}
}
