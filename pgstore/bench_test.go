package pgstore_test

import (
	"context"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/pgstore"
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
			benchPairs(b, newStore(b, pool, pgstore.Options{Migrate: true, Namespace: name}))
		})
	}
}

func benchPairs(b *testing.B, s *pgstore.Store) {
	ctx := context.Background()
	var mu sync.Mutex
	var lat []time.Duration
	const goroutines = 64
	b.SetParallelism(max(1, goroutines/runtime.GOMAXPROCS(0)))
	b.ReportAllocs()
	b.ResetTimer()
	start := time.Now()
	b.RunParallel(func(pb *testing.PB) {
		local := make([]time.Duration, 0, 1024)
		for pb.Next() {
			k := newKey(int(benchKeys.Add(1)))
			t0 := time.Now()
			acq, err := s.Acquire(ctx, idem.AcquireRequest{Key: k, LeaseID: idem.NewLeaseID(), TTL: 30 * time.Second})
			if err != nil || acq.Outcome != idem.Acquired {
				b.Errorf("acquire: %v %v", acq.Outcome, err)
				return
			}
			if err := s.Complete(ctx, acq.Lease, benchResp, time.Minute); err != nil {
				b.Error(err)
				return
			}
			local = append(local, time.Since(t0))
		}
		mu.Lock()
		lat = append(lat, local...)
		mu.Unlock()
	})
	elapsed := time.Since(start)
	b.StopTimer()
	if len(lat) == 0 {
		return
	}
	slices.Sort(lat)
	b.ReportMetric(float64(len(lat))/elapsed.Seconds(), "pairs/s")
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds()), "p50-µs")
	b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds()), "p99-µs")
}

// benchKeys numbers the benchmark's keys: every run takes new ones.
var benchKeys atomic.Int64

var benchResp = &idem.Response{Status: 201, Body: []byte(`{"id":"ch_1","amount":1000}`)}
