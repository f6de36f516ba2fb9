package storetest

import (
	"context"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// BenchmarkBatchPairs is BenchmarkPairs with batches: each of goroutines
// acquires size unique random keys with one AcquireMany, then completes
// them with one CompleteMany. b.N counts pairs. It reports pairs/s and the
// p50 and p99 of one batch of pairs (acquire and complete).
func BenchmarkBatchPairs(b *testing.B, s idem.BatchStore, goroutines, size int) {
	ctx := context.Background()
	resp := &idem.Response{Status: 201, Body: []byte(`{"id":"ch_1","amount":1000}`)}
	var mu sync.Mutex
	var lat []time.Duration
	b.SetParallelism(max(1, goroutines/runtime.GOMAXPROCS(0)))
	b.ReportAllocs()
	b.ResetTimer()
	start := time.Now()
	pairs := 0
	b.RunParallel(func(pb *testing.PB) {
		local := make([]time.Duration, 0, 1024)
		reqs := make([]idem.AcquireRequest, 0, size)
		cs := make([]idem.Completion, 0, size)
		n := 0
		for more := true; more; {
			reqs = reqs[:0]
			for len(reqs) < size {
				if more = pb.Next(); !more {
					break
				}
				reqs = append(reqs, idem.AcquireRequest{Key: newKey(), LeaseID: idem.NewLeaseID(), TTL: 30 * time.Second})
			}
			if len(reqs) == 0 {
				break
			}
			t0 := time.Now()
			cs = cs[:0]
			for _, r := range s.AcquireMany(ctx, reqs) {
				if r.Err != nil || r.Outcome != idem.Acquired {
					b.Errorf("acquire: %v %v", r.Outcome, r.Err)
					return
				}
				cs = append(cs, idem.Completion{Lease: r.Lease, Response: resp, Retention: time.Minute})
			}
			for _, err := range s.CompleteMany(ctx, cs) {
				if err != nil {
					b.Error(err)
					return
				}
			}
			local = append(local, time.Since(t0))
			n += len(reqs)
		}
		mu.Lock()
		lat = append(lat, local...)
		pairs += n
		mu.Unlock()
	})
	elapsed := time.Since(start)
	b.StopTimer()
	if len(lat) == 0 {
		return
	}
	slices.Sort(lat)
	b.ReportMetric(float64(pairs)/elapsed.Seconds(), "pairs/s")
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds()), "p50-µs")
	b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds()), "p99-µs")
}
