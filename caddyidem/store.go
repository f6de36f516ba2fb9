package caddyidem

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/blobstore"
	"github.com/idemkit/idem/internal/sidecar"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/mysqlstore"
	"github.com/idemkit/idem/pgstore"
	"github.com/idemkit/idem/redisstore"
	"github.com/idemkit/idem/tieredstore"
)

// pool holds the open stores and blob stores of the process, each shared
// by the handlers that name it and closed when the last one is cleaned up.
// A config reload provisions the new handlers before it cleans up the old
// ones, so a store lives on across reloads: the memory store keeps its
// records, and no connection is reopened.
var pool = caddy.NewUsagePool()

// storeSpec is what identifies a store in the pool.
type storeSpec struct {
	url, prefix string
	memLimit    int64         // memory only
	reapEvery   time.Duration // PostgreSQL and MySQL only; 0: no reaper
}

// key is the pool's key of the store; it holds the URL, and so maybe a
// password, and is never shown.
func (s storeSpec) key() string {
	return fmt.Sprintf("store\x00%s\x00%s\x00%d\x00%d", s.url, s.prefix, s.memLimit, s.reapEvery)
}

// openStore is a store in the pool, with the function that closes it.
type openStore struct {
	idem.Store
	close func()
}

func (s openStore) Destruct() error {
	s.close()
	return nil
}

// takeStore returns the store spec names, opening it when no handler has
// it open; the handler gives it back with pool.Delete(key).
func takeStore(ctx caddy.Context, spec storeSpec, logger *slog.Logger) (idem.Store, string, error) {
	key := spec.key()
	v, _, err := pool.LoadOrNew(key, func() (caddy.Destructor, error) {
		s, closeStore, err := open(ctx, spec, logger)
		if err != nil {
			return nil, err
		}
		return openStore{s, closeStore}, nil
	})
	if err != nil {
		return nil, "", err
	}
	return v.(openStore).Store, key, nil
}

// storeForms names what store takes, for its errors.
const storeForms = "want memory, redis://host:port[/db], rediss://…, valkey(s)://…, postgres://…, mysql://…, " +
	"or for the tiered store a Redis URL and a PostgreSQL URL (two arguments)"

// open opens the store spec names. The stores outlive the config that
// opened them (the pool), so their connections and background work do not
// take ctx's cancellation. Errors never repeat the URL: it may hold a
// password.
func open(ctx caddy.Context, spec storeSpec, logger *slog.Logger) (idem.Store, func(), error) {
	bg := context.WithoutCancel(ctx)
	if isMemory(spec.url) {
		return memstore.New(memstore.Options{MaxBytes: spec.memLimit}), func() {}, nil
	}
	if fields := strings.Fields(spec.url); len(fields) > 1 {
		return openTiered(bg, fields, spec, logger)
	}
	u, err := url.Parse(spec.url)
	if err != nil {
		return nil, nil, errors.New("store: not a URL (the value is not shown: it may hold a password); " + storeForms)
	}
	switch u.Scheme {
	case "redis", "rediss", "valkey", "valkeys":
		// A Redis whose maxmemory-policy evicts keys is refused unless
		// the URL says allow_eviction=1 (redisstore.ErrEvictingPolicy).
		s, err := redisstore.Open(spec.url, redisstore.Options{Prefix: spec.prefix, Logger: logger})
		if err != nil {
			return nil, nil, fmt.Errorf("store %s://%s: %w", u.Scheme, u.Host, err)
		}
		return s, func() { s.Close() }, nil
	case "postgres", "postgresql":
		p, err := openPG(bg, spec.url)
		if err != nil {
			return nil, nil, err
		}
		s, err := pgstore.New(bg, p, pgstore.Options{Namespace: spec.prefix, Migrate: true, Logger: logger})
		if err != nil {
			p.Close()
			return nil, nil, fmt.Errorf("store %s://%s: %w", u.Scheme, u.Host, err)
		}
		if spec.reapEvery <= 0 {
			return s, p.Close, nil
		}
		rctx, stop := context.WithCancel(bg)
		var wg sync.WaitGroup
		wg.Go(func() { s.RunReaper(rctx, spec.reapEvery, reapBatch) }) // both positive: no error
		return s, func() { stop(); wg.Wait(); p.Close() }, nil
	case "mysql", "mariadb":
		return openMySQL(bg, u, spec, logger)
	}
	return nil, nil, fmt.Errorf("store: unknown scheme %q; %s", u.Scheme, storeForms)
}

// openMySQL opens a mysqlstore on mysql://[user[:pass]@]host[:port]/db[?params]
// (params are go-sql-driver/mysql's DSN parameters), creating its tables
// if missing, with its reaper when spec.reapEvery is positive: as idem
// proxy's --store mysql://….
func openMySQL(ctx context.Context, u *url.URL, spec storeSpec, logger *slog.Logger) (idem.Store, func(), error) {
	cfg, err := sidecar.MySQLConfig(u, pgConnectTimeout)
	if err != nil {
		return nil, nil, fmt.Errorf("store: %w", err)
	}
	conn, err := mysql.NewConnector(cfg)
	if err != nil {
		return nil, nil, fmt.Errorf("store: the MySQL URL: %w", err)
	}
	db := sql.OpenDB(conn)
	s, err := mysqlstore.New(ctx, db, mysqlstore.Options{Namespace: spec.prefix, Migrate: true, Logger: logger})
	if err != nil {
		db.Close()
		return nil, nil, fmt.Errorf("store %s://%s: %w", u.Scheme, u.Host, err)
	}
	if spec.reapEvery <= 0 {
		return s, func() { db.Close() }, nil
	}
	rctx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() { s.RunReaper(rctx, spec.reapEvery, reapBatch) }) // both positive: no error
	return s, func() { stop(); wg.Wait(); db.Close() }, nil
}

// openTiered opens the tiered store of a Redis URL and a PostgreSQL URL,
// in either order, as idem proxy does: Acquire checks PostgreSQL after
// Redis grants a lease (tieredstore.Options.VerifyAcquire), since the
// upstream's effects are outside PostgreSQL.
func openTiered(ctx context.Context, fields []string, spec storeSpec, logger *slog.Logger) (idem.Store, func(), error) {
	const form = "store with two URLs is the tiered store: one Redis URL and one PostgreSQL URL"
	if len(fields) != 2 {
		return nil, nil, fmt.Errorf("%s; got %d", form, len(fields))
	}
	var redisURL, pgURL string
	for _, f := range fields {
		u, err := url.Parse(f)
		if err != nil {
			return nil, nil, errors.New(form + "; one of the two does not parse as a URL (not shown: it may hold a password)")
		}
		switch u.Scheme {
		case "redis", "rediss", "valkey", "valkeys":
			if redisURL != "" {
				return nil, nil, errors.New(form + "; got two Redis URLs")
			}
			redisURL = f
		case "postgres", "postgresql":
			if pgURL != "" {
				return nil, nil, errors.New(form + "; got two PostgreSQL URLs")
			}
			pgURL = f
		default:
			return nil, nil, fmt.Errorf("%s; unknown scheme %q", form, u.Scheme)
		}
	}
	if redisURL == "" || pgURL == "" {
		return nil, nil, errors.New(form + "; got only one kind")
	}
	rs, err := redisstore.Open(redisURL, redisstore.Options{Prefix: spec.prefix, Logger: logger})
	if err != nil {
		return nil, nil, fmt.Errorf("store (tiered), Redis: %w", err)
	}
	p, err := openPG(ctx, pgURL)
	if err != nil {
		rs.Close()
		return nil, nil, err
	}
	s, err := tieredstore.New(ctx, rs, p, tieredstore.Options{Namespace: spec.prefix, Migrate: true, VerifyAcquire: true,
		ReapInterval: reapOption(spec.reapEvery), Logger: logger})
	if err != nil {
		p.Close()
		rs.Close()
		return nil, nil, fmt.Errorf("store (tiered), PostgreSQL: %w", err)
	}
	return s, func() { s.Close(); p.Close(); rs.Close() }, nil
}

// reapOption is tieredstore.Options.ReapInterval for an interval where 0
// means never.
func reapOption(every time.Duration) time.Duration {
	if every <= 0 {
		return -1
	}
	return every
}

// pgConnectTimeout bounds connecting to PostgreSQL or MySQL when the URL
// does not say (connect_timeout=SECONDS, timeout=…), as in idem proxy.
const pgConnectTimeout = 10 * time.Second

func openPG(ctx context.Context, spec string) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(spec)
	if err != nil {
		return nil, fmt.Errorf("store: the PostgreSQL URL: %w", err) // pgconn masks the password
	}
	if cfg.ConnConfig.ConnectTimeout == 0 {
		cfg.ConnConfig.ConnectTimeout = pgConnectTimeout
	}
	return pgxpool.NewWithConfig(ctx, cfg)
}

// openBlobs is a blob store in the pool.
type openBlobs struct{ *blobstore.Bucket }

func (b openBlobs) Destruct() error { return b.Close() }

// takeBlobs returns the blob store rawURL names, opening it when no
// handler has it open; the handler gives it back with pool.Delete(key).
func takeBlobs(ctx caddy.Context, rawURL string) (idem.BlobStore, string, error) {
	key := "blob\x00" + rawURL
	v, _, err := pool.LoadOrNew(key, func() (caddy.Destructor, error) {
		b, err := blobstore.Open(context.WithoutCancel(ctx), rawURL)
		if err != nil {
			return nil, fmt.Errorf("blob: %w", err)
		}
		return openBlobs{b}, nil
	})
	if err != nil {
		return nil, "", err
	}
	return v.(openBlobs).Bucket, key, nil
}
