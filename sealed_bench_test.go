package idem_test

import (
	"context"
	"crypto/rand"
	"net/http"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
)

// BenchmarkGuardReplaySealed is the replay of a 1 KiB response through
// Guard.Do on memstore, clear and sealed side by side (issue 34: at most
// 10 µs per replay with sealing).
func BenchmarkGuardReplaySealed(b *testing.B) {
	sealBench(b, func(b *testing.B, g *idem.Guard, fn func(context.Context) (*idem.Response, error)) {
		ctx := context.Background()
		key, fp := idem.Key{1}, idem.Fingerprint{1}
		if _, err := g.Do(ctx, key, fp, fn); err != nil {
			b.Fatal(err)
		}
		b.ReportAllocs()
		for b.Loop() {
			if res, err := g.Do(ctx, key, fp, fn); err != nil || !res.Replayed {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkGuardFirstSealed is a first execution (Acquire, then Complete of
// a 1 KiB response) on memstore, clear and sealed side by side.
func BenchmarkGuardFirstSealed(b *testing.B) {
	sealBench(b, func(b *testing.B, g *idem.Guard, fn func(context.Context) (*idem.Response, error)) {
		ctx := context.Background()
		var n uint64
		b.ReportAllocs()
		for b.Loop() {
			n++
			var key idem.Key
			for i := range 8 {
				key[i] = byte(n >> (8 * i))
			}
			if _, err := g.Do(ctx, key, idem.Fingerprint{1}, fn); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// sealBench runs run as sub-benchmarks "clear" and "sealed", each with a
// Guard on memstore (sealing under a one-key ring, or not) and work that
// answers a 1 KiB JSON response.
func sealBench(b *testing.B, run func(b *testing.B, g *idem.Guard, fn func(context.Context) (*idem.Response, error))) {
	body := make([]byte, 1<<10)
	rand.Read(body)
	resp := &idem.Response{Status: 200, Header: http.Header{"Content-Type": {"application/json"}}, Body: body}
	fn := func(context.Context) (*idem.Response, error) { return resp, nil }
	for _, mode := range []string{"clear", "sealed"} {
		b.Run(mode, func(b *testing.B) {
			cfg := idem.Config{}
			if mode == "sealed" {
				cfg.Seal = testRing(b, "k1")
			}
			run(b, mustGuard(b, memstore.New(memstore.Options{}), cfg), fn)
		})
	}
}
