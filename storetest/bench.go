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

// BenchmarkPairs measures full acquire+complete pairs on unique random
// keys from the given number of goroutines, and reports pairs/s and the
// p50 and p99 of one pair. Every store's benchmarks call it, so their
// figures compare.
func BenchmarkPairs(b *testing.B, s idem.Store, goroutines int) {
	ctx := context.Background()
	resp := &idem.Response{Status: 201, Body: []byte(`{"id":"ch_1","amount":1000}`)}
	var mu sync.Mutex
	var lat []time.Duration
	b.SetParallelism(max(1, goroutines/runtime.GOMAXPROCS(0)))
	b.ReportAllocs()
	b.ResetTimer()
	start := time.Now()
	b.RunParallel(func(pb *testing.PB) {
		local := make([]time.Duration, 0, 1024)
		for pb.Next() {
			t0 := time.Now()
			acq, err := s.Acquire(ctx, idem.AcquireRequest{Key: newKey(), LeaseID: idem.NewLeaseID(), TTL: 30 * time.Second})
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
