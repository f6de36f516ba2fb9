package pgstore_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/pgstore"
	"github.com/idemkit/idem/storetest"
)

// BenchmarkAcquireComplete measures full acquire+complete pairs on unique
// keys from 64 goroutines, against the local PostgreSQL server, as
// redisstore's benchmark of the same name does against redis-server. It
// reports pairs/s and the p50/p99 of one pair.
//
// The 64 goroutines share a pool of 8 connections. PostgreSQL runs one
// process per connection, and on a 2-core machine more of them only add
// context switches: 64 connections gave about a quarter fewer pairs/s and
// twice the p99.
//
// Each call commits, and a commit waits for its WAL to reach the disk.
// The "async-commit" run sets synchronous_commit = off for its sessions:
// commits no longer wait for the flush, and a server crash may lose the
// last fraction of a second of them (never corrupting anything), which is
// closer to the durability of the Redis servers measured (no AOF).
//
//	go test -run '^$' -bench AcquireComplete -benchtime 5s ./pgstore/
func BenchmarkAcquireComplete(b *testing.B) {
	cfg := pgtest.New(b).Config()
	cfg.MaxConns = 8
	for _, commit := range []string{"on", "off"} {
		name := map[string]string{"on": "durable", "off": "async-commit"}[commit]
		b.Run(name, func(b *testing.B) {
			cfg := cfg.Copy()
			cfg.ConnConfig.RuntimeParams["synchronous_commit"] = commit
			pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
			if err != nil {
				b.Fatal(err)
			}
			defer pool.Close()
			storetest.BenchmarkPairs(b, newStore(b, pool, pgstore.Options{Migrate: true, Namespace: name}), 64)
		})
	}
}
