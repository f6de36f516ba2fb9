package redisstore_test

import (
	"context"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/redisstore"
)

// BenchmarkAcquireComplete measures full acquire+complete pairs on unique
// keys from 64 goroutines against the package's private redis-server, with
// each client library: rueidis as Open sets it up, go-redis with a pool of
// 64 connections. It reports pairs/s and the p50/p99 of one pair.
//
//	go test -run '^$' -bench AcquireComplete -benchtime 5s ./redisstore/
func BenchmarkAcquireComplete(b *testing.B) {
	stores := map[string]func(b *testing.B) *redisstore.Store{
		"go-redis": func(b *testing.B) *redisstore.Store {
			// 64 goroutines need 64 connections; go-redis's default pool is 10 per CPU.
			c := redis.NewClient(&redis.Options{Addr: single.Addr(), PoolSize: 64})
			b.Cleanup(func() { c.Close() })
			s, _ := redisstore.New(c, redisstore.Options{Prefix: uniquePrefix("bench")})
			return s
		},
		"rueidis": func(b *testing.B) *redisstore.Store { // as Open configures it
			s, err := redisstore.Open("redis://"+single.Addr(), redisstore.Options{Prefix: uniquePrefix("bench")})
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { s.Close() })
			return s
		},
	}
	for _, name := range []string{"rueidis", "go-redis"} {
		b.Run(name, func(b *testing.B) {
			benchPairs(b, stores[name](b))
		})
	}
}

func benchPairs(b *testing.B, s idem.Store) {
	ctx := context.Background()
	resp := &idem.Response{Status: 201, Body: []byte(`{"id":"ch_1","amount":1000}`)}
	var seq atomic.Int64
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
			k := scope(int(seq.Add(1)) + 1_000_000)
			t0 := time.Now()
			acq, err := s.Acquire(ctx, idem.AcquireRequest{Key: k, LeaseID: idem.NewLeaseID(), TTL: 30 * time.Second})
			if err != nil || acq.Outcome != idem.Acquired {
				b.Errorf("acquire: %v %v", acq.Outcome, err)
				return
			}
			if err := s.Complete(ctx, acq.Lease, resp, time.Minute); err != nil {
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
