package main

import (
	"context"
	"fmt"
	"net/url"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/pgstore"
	"github.com/idemkit/idem/redisstore"
)

// storeFlagHelp documents the --store flag.
const storeFlagHelp = `where records live: memory, redis://[user:pass@]host:port[/db], rediss://… (TLS), ` +
	`redis://host:port?addr=host2:port2 (Cluster), redis://host:port?master_set=NAME&addr=… (Sentinel: the addresses are sentinels), ` +
	`postgres://… (PostgreSQL; the table is created if missing)`

// openStore opens the store a --store value names, with its key prefix
// (Redis) or namespace (PostgreSQL). close releases its connections.
func openStore(ctx context.Context, spec, prefix string) (store idem.Store, close func(), err error) {
	if spec == "" || spec == "memory" {
		return memstore.New(memstore.Options{}), func() {}, nil
	}
	// Errors never repeat spec: it may hold a password.
	u, err := url.Parse(spec)
	if err != nil {
		return nil, nil, usageError{"--store: not a URL (the value is not shown: it may hold a password)"}
	}
	switch u.Scheme {
	case "redis", "rediss", "valkey", "valkeys":
		s, err := redisstore.Open(spec, redisstore.Options{Prefix: prefix})
		if err != nil {
			return nil, nil, err
		}
		return s, func() { s.Close() }, nil
	case "postgres", "postgresql":
		pool, err := pgxpool.New(ctx, spec)
		if err != nil {
			return nil, nil, err
		}
		s, err := pgstore.New(ctx, pool, pgstore.Options{Namespace: prefix, Migrate: true})
		if err != nil {
			pool.Close()
			return nil, nil, err
		}
		return s, pool.Close, nil
	}
	return nil, nil, usageError{fmt.Sprintf("--store: unknown scheme %q: want memory, redis://…, rediss://…, valkey(s)://… or postgres://…", u.Scheme)}
}
