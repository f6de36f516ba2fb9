package redisstore_test

import (
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/internal/redisserver"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/idemkit/idem/redisstore"
	"github.com/idemkit/idem/storetest"
)

// BenchmarkAcquireCompletePath is BenchmarkAcquireCompleteBatch's single
// pairs (64 goroutines, unique keys) on each server that has both paths,
// Lua and native, in the same run: redis-cpu-µs/pair is the server's CPU
// time (INFO cpu, user + sys) per acquire+complete pair, the figure the
// native path is for.
//
//	go test -run '^$' -bench AcquireCompletePath -benchtime 5s ./redisstore/
func BenchmarkAcquireCompletePath(b *testing.B) {
	srvs := startKindsB(b)
	for _, kind := range []redisserver.Kind{redisserver.Valkey9, redisserver.Redis8} {
		srv := srvs[kind]
		info := redis.NewClient(&redis.Options{Addr: srv.Addr()})
		b.Cleanup(func() { info.Close() })
		for _, name := range []string{"rueidis", "go-redis"} {
			for _, path := range []redisstore.Path{redisstore.PathLua, redisstore.PathNative} {
				b.Run(string(kind)+"/"+name+"/"+path.String(), func(b *testing.B) {
					var s *redisstore.Store
					opts := redisstore.Options{Prefix: redistest.Prefix("bench"), Path: path}
					switch name {
					case "go-redis":
						c := redis.NewClient(&redis.Options{Addr: srv.Addr(), PoolSize: 64})
						b.Cleanup(func() { c.Close() })
						s, _ = redisstore.New(c, opts)
					default:
						var err error
						if s, err = redisstore.Open("redis://"+srv.Addr(), opts); err != nil {
							b.Fatal(err)
						}
						b.Cleanup(func() { s.Close() })
					}
					cpu0, err := redisserver.CPUTime(b.Context(), info)
					if err != nil {
						b.Fatal(err)
					}
					storetest.BenchmarkPairs(b, s, 64)
					cpu1, err := redisserver.CPUTime(b.Context(), info)
					if err != nil {
						b.Fatal(err)
					}
					b.ReportMetric(float64((cpu1-cpu0).Microseconds())/float64(b.N), "redis-cpu-µs/pair")
				})
			}
		}
	}
}
