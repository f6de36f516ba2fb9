package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"regexp"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/pgstore"
	"github.com/idemkit/idem/redisstore"
	"github.com/idemkit/idem/tieredstore"
)

// storeFlagHelp documents the --store flag.
const storeFlagHelp = `where records live: memory, redis://[user:pass@]host:port[/db], rediss://… (TLS), ` +
	`redis://host:port?addr=host2:port2 (Cluster), redis://host:port?master_set=NAME&addr=… (Sentinel: the addresses are sentinels), ` +
	`postgres://… (PostgreSQL; the table is created if missing), ` +
	`or a Redis URL and a PostgreSQL URL separated by a space (the tiered store: leases and replays on Redis, ` +
	`completions in PostgreSQL, relayed to Redis; its table is created if missing)`

// openStore opens the store a --store value names, with its key prefix
// (Redis) or namespace (PostgreSQL). close releases its connections.
func openStore(ctx context.Context, spec, prefix string) (store idem.Store, close func(), err error) {
	return openStoreWith(ctx, spec, prefix, storeOptions{})
}

// storeOptions are what idem proxy sets on its store. The zero value
// leaves each store as its package makes it.
type storeOptions struct {
	// maxBytes is memstore.Options.MaxBytes: 0, no bound.
	maxBytes int64
	// reapEvery is how often the reaper of a PostgreSQL store (pgstore,
	// and the tiered store's table) deletes expired records. 0: the
	// store's own way (pgstore: no reaper; the tiered store: its
	// background reaper, every tieredstore.DefaultReapInterval). Negative:
	// no reaper.
	reapEvery time.Duration
	// onReap receives each pass of the reaper (pgstore.Options.OnReap).
	onReap func(deleted int, took time.Duration, err error)
	// logger receives the stores' background failures; nil: slog.Default().
	logger *slog.Logger
}

// reapBatch is the most records one statement of the proxy's PostgreSQL
// reaper deletes (the tiered store's background reaper uses the same).
const reapBatch = 1000

// openStoreWith is openStore with o. With o.reapEvery positive, a
// pgstore's reaper runs until close, which stops it (and waits for a pass
// in progress) before closing the pool.
func openStoreWith(ctx context.Context, spec, prefix string, o storeOptions) (store idem.Store, close func(), err error) {
	if spec == "" || spec == "memory" {
		return memstore.New(memstore.Options{MaxBytes: o.maxBytes}), func() {}, nil
	}
	if fields := strings.Fields(spec); len(fields) > 1 {
		return openTiered(ctx, fields, prefix, o)
	}
	if hostPort.MatchString(spec) { // localhost:6379: no scheme
		return nil, nil, usageError{fmt.Sprintf("--store %s: want a URL; for Redis: redis://%s", spec, spec)}
	}
	if spec == "mem" || spec == "memstore" || spec == "mem://" || spec == "memory://" {
		return nil, nil, usageError{fmt.Sprintf("--store %s: the in-process store is written memory", spec)}
	}
	// Errors never repeat spec otherwise: it may hold a password.
	u, err := url.Parse(spec)
	if err != nil {
		return nil, nil, usageError{"--store: not a URL (the value is not shown: it may hold a password); " + storeForms}
	}
	switch u.Scheme {
	case "redis", "rediss", "valkey", "valkeys":
		s, err := redisstore.Open(spec, redisstore.Options{Prefix: prefix})
		if errors.Is(err, redisstore.ErrBadURL) {
			return nil, nil, usageError{"--store: " + strings.TrimPrefix(err.Error(), "redisstore: Open: ")}
		} else if err != nil {
			return nil, nil, err
		}
		return s, func() { s.Close() }, nil
	case "postgres", "postgresql":
		if u.Opaque != "" {
			return nil, nil, usageError{"--store: no host: write postgres://[user:pass@]host:port/db (is the // after postgres: missing?)"}
		}
		pool, err := pgxpool.New(ctx, spec)
		if err != nil {
			return nil, nil, err
		}
		s, err := pgstore.New(ctx, pool, pgstore.Options{Namespace: prefix, Migrate: true, Logger: o.logger, OnReap: o.onReap})
		if err != nil {
			pool.Close()
			return nil, nil, err
		}
		if o.reapEvery <= 0 {
			return s, pool.Close, nil
		}
		rctx, stop := context.WithCancel(context.WithoutCancel(ctx))
		var wg sync.WaitGroup
		wg.Go(func() { s.RunReaper(rctx, o.reapEvery, reapBatch) }) // interval and batch are positive: no error
		return s, func() { stop(); wg.Wait(); pool.Close() }, nil
	}
	return nil, nil, usageError{fmt.Sprintf("--store: unknown scheme %q; %s", u.Scheme, storeForms)}
}

// storeForms names what --store takes, for its usage errors.
const storeForms = "want memory, redis://host:port[/db], rediss://…, valkey(s)://…, postgres://…, " +
	"or for the tiered store 'redis://host:port postgres://host/db' (two URLs, one space between them)"

// openTiered opens the tiered store that two --store URLs name, one for
// Redis and one for PostgreSQL, in either order. The Redis prefix and the
// PostgreSQL namespace are both prefix. Acquire checks PostgreSQL after
// Redis grants a lease (tieredstore.Options.VerifyAcquire): the proxy's
// upstream effects are outside PostgreSQL, so a key whose Redis record was
// lost is replayed from PostgreSQL rather than sent upstream again.
func openTiered(ctx context.Context, fields []string, prefix string, o storeOptions) (idem.Store, func(), error) {
	const form = "--store with two URLs is the tiered store: 'redis://host:port[/db] postgres://[user@]host[:port]/db' (one Redis URL, one PostgreSQL URL, one space between them)"
	if len(fields) != 2 {
		return nil, nil, usageError{fmt.Sprintf("%s; got %d words (the value is not shown: it may hold a password)", form, len(fields))}
	}
	var redisURL, pgURL string
	for _, f := range fields {
		u, err := url.Parse(f)
		if err != nil {
			return nil, nil, usageError{form + "; one of the two does not parse as a URL (not shown: it may hold a password)"}
		}
		switch u.Scheme {
		case "redis", "rediss", "valkey", "valkeys":
			if redisURL != "" {
				return nil, nil, usageError{form + "; got two Redis URLs"}
			}
			redisURL = f
		case "postgres", "postgresql":
			if pgURL != "" {
				return nil, nil, usageError{form + "; got two PostgreSQL URLs"}
			}
			if u.Opaque != "" {
				return nil, nil, usageError{"--store: the PostgreSQL URL has no host: write postgres://[user:pass@]host:port/db (is the // after postgres: missing?)"}
			}
			pgURL = f
		default:
			return nil, nil, usageError{fmt.Sprintf("%s; unknown scheme %q", form, u.Scheme)}
		}
	}
	if redisURL == "" || pgURL == "" {
		return nil, nil, usageError{form + "; got no " + map[bool]string{true: "Redis", false: "PostgreSQL"}[redisURL == ""] + " URL"}
	}
	if _, err := pgxpool.ParseConfig(pgURL); err != nil {
		// pgconn's parse errors show the URL with its password masked.
		return nil, nil, usageError{"--store: the PostgreSQL URL: " + err.Error()}
	}
	// The background reaper runs every o.reapEvery (0: its default;
	// negative: none); Close stops it before closing the pool.
	s, err := tieredstore.Open(ctx, redisURL, pgURL, redisstore.Options{Prefix: prefix},
		tieredstore.Options{Namespace: prefix, Migrate: true, VerifyAcquire: true,
			ReapInterval: o.reapEvery, OnReap: o.onReap, Logger: o.logger})
	if errors.Is(err, redisstore.ErrBadURL) {
		return nil, nil, usageError{"--store: " + strings.TrimPrefix(err.Error(), "redisstore: Open: ")}
	} else if err != nil {
		return nil, nil, err
	}
	return s, func() { s.Close() }, nil
}

// hostPort matches a bare host:port, which users write for Redis.
var hostPort = regexp.MustCompile(`^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}$`)
