package redisstore_test

import (
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/idemkit/idem/redisstore"
	"github.com/idemkit/idem/storetest"
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
			s, _ := redisstore.New(c, redisstore.Options{Prefix: redistest.Prefix("bench")})
			return s
		},
		"rueidis": func(b *testing.B) *redisstore.Store { // as Open configures it
			s, err := redisstore.Open("redis://"+single.Addr(), redisstore.Options{Prefix: redistest.Prefix("bench")})
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { s.Close() })
			return s
		},
	}
	for _, name := range []string{"rueidis", "go-redis"} {
		b.Run(name, func(b *testing.B) {
			storetest.BenchmarkPairs(b, stores[name](b), 64)
		})
	}
}
