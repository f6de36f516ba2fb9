package tieredstore_test

import (
	"context"
	"crypto/rand"
	"fmt"
	"log/slog"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/rueidis"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/internal/redisserver"
	"github.com/idemkit/idem/redisstore"
	"github.com/idemkit/idem/storetest"
	"github.com/idemkit/idem/tieredstore"
)

// One private redis-server and one private PostgreSQL database (with the
// table migrated) for the package; tests that break Redis start their own.
var (
	shared   *redisserver.Server
	database string
)

func TestMain(m *testing.M) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	url, drop, err := pgtest.CreateDatabase(ctx)
	cancel()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	database = url
	if err := migrate(url); err != nil {
		drop()
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	shared, err = redisserver.StartServer()
	if err != nil {
		drop()
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	code := m.Run()
	shared.Stop()
	if err := drop(); err != nil {
		fmt.Fprintln(os.Stderr, err)
	}
	os.Exit(code)
}

// migrate creates the table once, before the tests: a migration that
// creates an index waits for every transaction writing to the table.
func migrate(url string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return err
	}
	defer pool.Close()
	return tieredstore.Migrate(ctx, pool, "")
}

// newPool returns a pool on the package's database, closed when tb ends.
func newPool(tb testing.TB, maxConns int32) *pgxpool.Pool {
	tb.Helper()
	cfg, err := pgxpool.ParseConfig(database)
	if err != nil {
		tb.Fatal(err)
	}
	cfg.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(pool.Close)
	return pool
}

// newRueidis returns a rueidis client on addr, closed when tb ends.
func newRueidis(tb testing.TB, addr string) rueidis.Client {
	tb.Helper()
	c, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: []string{addr}, DisableCache: true})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(c.Close)
	return c
}

// uniquePrefix is a Redis prefix and PostgreSQL namespace no other test
// (of this run or another) uses.
func uniquePrefix(name string) string {
	return "tiered:" + name + ":" + rand.Text()[:8] + ":"
}

// newStore returns a tiered store on c and pool, closed when tb ends.
func newStore(tb testing.TB, c rueidis.Client, pool *pgxpool.Pool, prefix string, ropts redisstore.Options, opts tieredstore.Options) *tieredstore.Store {
	tb.Helper()
	ropts.Prefix = prefix
	rs, err := redisstore.NewRueidis(c, ropts)
	if err != nil {
		tb.Fatal(err)
	}
	opts.Namespace = prefix
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.NewTextHandler(tb.Output(), nil))
	}
	s, err := tieredstore.New(context.Background(), rs, pool, opts)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { s.Close() })
	return s
}

func TestConformance(t *testing.T) {
	pool := newPool(t, pgtest.MaxConns)
	c := newRueidis(t, shared.Addr())
	for _, verify := range []bool{false, true} {
		t.Run(fmt.Sprintf("VerifyAcquire=%t", verify), func(t *testing.T) {
			t.Parallel()
			storetest.Run(t, func(t *testing.T, prefix string) storetest.Fixture {
				s := newStore(t, c, pool, prefix, redisstore.Options{}, tieredstore.Options{VerifyAcquire: verify})
				return storetest.Fixture{
					Store: s,
					Sleep: time.Sleep,
					Corrupt: func(key idem.Key) error {
						return c.Do(context.Background(), c.B().Set().Key(s.Redis().KeyName(key)).Value("not a record").Build()).Error()
					},
				}
			})
		})
	}
}

// beginner hides the pool's type from BeginFunc, which then takes its
// general path (COMMIT sent on its own, after the completion).
type beginner struct{ *pgxpool.Pool }

// With the table and its indexes in place, Migrate takes no lock: it
// returns while a writer's transaction is open on the table, where CREATE
// INDEX IF NOT EXISTS would wait for it and queue later writers behind.
func TestMigrateBesideWriter(t *testing.T) {
	pool := newPool(t, 4)
	ctx := t.Context()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `LOCK TABLE `+tieredstore.DefaultTable+` IN ROW EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	mctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := tieredstore.Migrate(mctx, pool, ""); err != nil {
		t.Errorf("Migrate beside an open writer: %v, want nil at once", err)
	}
}
