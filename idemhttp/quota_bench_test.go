package idemhttp_test

import (
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/memstore"
)

// BenchmarkQuota is the keyed path (a new key, executed and stored, on
// the memory store, in process: no network to hide the cost) with the
// per-tenant quota off and on, side by side: 64 tenants (Authorization
// headers), limits never reached, so that every request pays the count
// and none is refused. BENCHMARKS.md has the figures.
func BenchmarkQuota(b *testing.B) {
	for _, c := range []struct {
		name  string
		quota *idemhttp.Quota
	}{
		{"off", idemhttp.NoQuota},
		{"on", &idemhttp.Quota{InFlight: 1 << 20, Records: 1 << 30, Bytes: 1 << 50}},
	} {
		b.Run("quota="+c.name, func(b *testing.B) {
			h := idemhttp.Middleware(memstore.New(memstore.Options{}), idemhttp.Config{Quota: c.quota})(http.HandlerFunc(noop))
			var seq atomic.Int64
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					n := seq.Add(1)
					req := httptest.NewRequest("POST", "/charges", strings.NewReader(`{"amount":1000}`))
					req.Header.Set(idemhttp.HeaderKey, "k"+strconv.FormatInt(n, 10))
					req.Header.Set("Authorization", "Bearer tenant-"+strconv.FormatInt(n%64, 10))
					w := httptest.NewRecorder()
					h.ServeHTTP(w, req)
					if w.Code != http.StatusCreated {
						b.Errorf("status %d", w.Code)
					}
				}
			})
		})
	}
}

// BenchmarkQuotaInterleaved runs the two configurations of BenchmarkQuota
// in alternating blocks of 512 requests on one goroutine, so that a
// machine whose load changes during the run (a shared one) weighs on both
// alike; it reports each one's time per request and the quota's cost in
// throughput (cost-%: how much less the quota's side serves per second).
func BenchmarkQuotaInterleaved(b *testing.B) {
	hs := []http.Handler{
		idemhttp.Middleware(memstore.New(memstore.Options{}), idemhttp.Config{Quota: idemhttp.NoQuota})(http.HandlerFunc(noop)),
		idemhttp.Middleware(memstore.New(memstore.Options{}), idemhttp.Config{Quota: &idemhttp.Quota{InFlight: 1 << 20, Records: 1 << 30, Bytes: 1 << 50}})(http.HandlerFunc(noop)),
	}
	var spent [2]time.Duration
	var done [2]int
	const block = 512
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		side := (i / block) % 2
		start := time.Now()
		req := httptest.NewRequest("POST", "/charges", strings.NewReader(`{"amount":1000}`))
		req.Header.Set(idemhttp.HeaderKey, "k"+strconv.Itoa(i))
		req.Header.Set("Authorization", "Bearer tenant-"+strconv.Itoa(i%64))
		w := httptest.NewRecorder()
		hs[side].ServeHTTP(w, req)
		spent[side] += time.Since(start)
		done[side]++
		if w.Code != http.StatusCreated {
			b.Fatalf("status %d", w.Code)
		}
	}
	if done[0] == 0 || done[1] == 0 {
		return
	}
	off, on := float64(spent[0])/float64(done[0]), float64(spent[1])/float64(done[1])
	b.ReportMetric(off, "off-ns/req")
	b.ReportMetric(on, "on-ns/req")
	b.ReportMetric((1-off/on)*100, "cost-%")
}
