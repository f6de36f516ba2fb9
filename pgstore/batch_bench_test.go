package pgstore_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/pgstore"
	"github.com/idemkit/idem/storetest"
)

// BenchmarkAcquireCompleteBatch is BenchmarkAcquireComplete with batched
// transitions: 64 goroutines on 8 connections, each acquiring 16 unique
// keys with one AcquireMany (one statement) and completing them with one
// CompleteMany (one statement). pairs/s counts keys; the latencies are of
// one batch of 16 pairs.
//
//	go test -run '^$' -bench AcquireComplete -benchtime 5s ./pgstore/
func BenchmarkAcquireCompleteBatch(b *testing.B) {
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
			storetest.BenchmarkBatchPairs(b, newStore(b, pool, pgstore.Options{Migrate: true, Namespace: name + "-batch"}), 64, 16)
		})
	}
}
