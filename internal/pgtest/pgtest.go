// Package pgtest gives tests a private database on a real PostgreSQL
// server.
//
// New connects to the server at IDEM_PG_URL (default DefaultURL: the local
// cluster, which scripts/test.sh starts, or installs and starts, before the
// tests), creates a database of its own named idemtest_<random>, and
// returns a pool on it. The database is dropped, with its connections,
// when the test ends. Nothing is shared between tests but the server, so
// tests and test packages may run in parallel.
//
//	func TestSomething(t *testing.T) {
//		pool := pgtest.New(t)
//		...
//	}
//
// A server that cannot be reached fails the test with a message saying how
// to start one: tests that need PostgreSQL never skip.
package pgtest

import (
	"context"
	"crypto/rand"
	"fmt"
	neturl "net/url"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// DefaultURL is the server used when IDEM_PG_URL is unset: the local
// cluster, with trust authentication for local TCP connections.
const DefaultURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"

// MaxConns bounds each pool New returns. A server allows 100 connections
// by default, and several test packages may hold a pool at once.
const MaxConns = 16

// setupTimeout bounds connecting, creating and dropping a database.
const setupTimeout = 30 * time.Second

// URL returns the administrative connection string: IDEM_PG_URL, or
// DefaultURL.
func URL() string {
	if u := os.Getenv("IDEM_PG_URL"); u != "" {
		return u
	}
	return DefaultURL
}

// New creates a private database and returns a pool on it, of at most
// MaxConns connections. The pool is closed and the database dropped when tb
// ends. It stops tb when the server cannot be reached or the database
// cannot be created.
func New(tb testing.TB) *pgxpool.Pool {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), setupTimeout)
	defer cancel()
	url, dropDB, err := CreateDatabase(ctx)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		if err := dropDB(); err != nil {
			tb.Error(err)
		}
	})
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		tb.Fatalf("pgtest: IDEM_PG_URL: %v", err)
	}
	cfg.MaxConns = MaxConns
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		tb.Fatalf("pgtest: pool: %v", err)
	}
	tb.Cleanup(pool.Close) // runs before drop: cleanups run last added, first called
	if err := pool.Ping(ctx); err != nil {
		tb.Fatalf("pgtest: connect: %v", err)
	}
	return pool
}

// CreateDatabase creates a private database and returns its URL, and drop,
// which drops it with the sessions still on it. It is for what has no
// testing.TB, such as a package's examples (set up in TestMain).
func CreateDatabase(ctx context.Context) (url string, drop func() error, err error) {
	admin, err := pgx.Connect(ctx, URL())
	if err != nil {
		return "", nil, fmt.Errorf("pgtest: cannot reach PostgreSQL at %s: %v\n"+
			"Run the tests with ./scripts/test.sh, which starts the local cluster (or installs it),\n"+
			"or start it yourself: pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start\n"+
			"or set IDEM_PG_URL to a server where this user may CREATE DATABASE", URL(), err)
	}
	defer admin.Close(context.Background())
	name := "idemtest_" + strings.ToLower(rand.Text()[:16])
	ident := pgx.Identifier{name}.Sanitize()
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+ident); err != nil {
		return "", nil, fmt.Errorf("pgtest: CREATE DATABASE %s: %v", name, err)
	}
	u, err := neturl.Parse(URL())
	if err != nil || u.Scheme == "" {
		dropDatabase(ident)
		return "", nil, fmt.Errorf("pgtest: IDEM_PG_URL must be a postgres:// URL")
	}
	u.Path = "/" + name
	return u.String(), func() error { return dropDatabase(ident) }, nil
}

// dropDatabase drops the database ident (quoted), ending any session
// still on it.
func dropDatabase(ident string) error {
	ctx, cancel := context.WithTimeout(context.Background(), setupTimeout)
	defer cancel()
	admin, err := pgx.Connect(ctx, URL())
	if err != nil {
		return fmt.Errorf("pgtest: drop %s: %v", ident, err)
	}
	defer admin.Close(context.Background())
	if _, err := admin.Exec(ctx, "DROP DATABASE IF EXISTS "+ident+" WITH (FORCE)"); err != nil {
		return fmt.Errorf("pgtest: DROP DATABASE %s: %v", ident, err)
	}
	return nil
}
