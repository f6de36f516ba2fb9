package redisstore_test

import (
	"fmt"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/internal/redisserver"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/idemkit/idem/redisstore"
	"github.com/idemkit/idem/storetest"
)

// BenchmarkAcquireCompleteBatch is BenchmarkAcquireComplete with batched
// transitions, beside the single-key calls in the same run: 64
// goroutines, each acquiring 16 unique keys with one AcquireMany and
// completing them with one CompleteMany ("batch"), or one key at a time
// with Acquire and Complete ("single"), against the package's private
// redis-server, with each client library set up as in
// BenchmarkAcquireComplete. pairs/s counts keys; the latencies are of one
// batch of 16 pairs, or of one pair. redis-cpu-µs/pair is the server's
// CPU time (INFO cpu, user + sys) per pair.
//
//	go test -run '^$' -bench AcquireCompleteBatch -benchtime 5s ./redisstore/
func BenchmarkAcquireCompleteBatch(b *testing.B) {
	info := redis.NewClient(&redis.Options{Addr: single.Addr()})
	defer info.Close()
	for _, name := range []string{"rueidis", "go-redis"} {
		for _, size := range []int{1, 16} {
			mode := fmt.Sprintf("batch=%d", size)
			if size == 1 {
				mode = "single"
			}
			b.Run(name+"/"+mode, func(b *testing.B) {
				var s *redisstore.Store
				switch name {
				case "go-redis":
					c := redis.NewClient(&redis.Options{Addr: single.Addr(), PoolSize: 64})
					b.Cleanup(func() { c.Close() })
					s, _ = redisstore.New(c, redisstore.Options{Prefix: redistest.Prefix("bench")})
				default:
					var err error
					if s, err = redisstore.Open("redis://"+single.Addr(), redisstore.Options{Prefix: redistest.Prefix("bench")}); err != nil {
						b.Fatal(err)
					}
					b.Cleanup(func() { s.Close() })
				}
				cpu0, err := redisserver.CPUTime(b.Context(), info)
				if err != nil {
					b.Fatal(err)
				}
				if size == 1 {
					storetest.BenchmarkPairs(b, s, 64)
				} else {
					storetest.BenchmarkBatchPairs(b, s, 64, size)
				}
				cpu1, err := redisserver.CPUTime(b.Context(), info)
				if err != nil {
					b.Fatal(err)
				}
				b.ReportMetric(float64((cpu1-cpu0).Microseconds())/float64(b.N), "redis-cpu-µs/pair")
			})
		}
	}
}
