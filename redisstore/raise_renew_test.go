package redisstore_test

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/idemkit/idem/redisstore"
)

// TestNativeRaiseKeepsRenew: on the native path, a Renew that lands
// between RaiseToken's read and its SET IFEQ (Renew leaves the value as
// it was, so the compare still matches) keeps its expiry.
func TestNativeRaiseKeepsRenew(t *testing.T) {
	for kind, srv := range startKinds(t) {
		if wantPath[kind] != redisstore.PathNative {
			continue
		}
		t.Run(string(kind), func(t *testing.T) {
			ctx := context.Background()
			var armed atomic.Bool
			var renewErr error
			prefix := redistest.Prefix("raise")
			other := redis.NewClient(&redis.Options{Addr: srv.Addr()})
			t.Cleanup(func() { other.Close() })
			renewer, err := redisstore.New(other, redisstore.Options{Prefix: prefix, Path: redisstore.PathNative})
			if err != nil {
				t.Fatal(err)
			}
			var l idem.Lease
			gr := redis.NewClient(&redis.Options{Addr: srv.Addr()})
			t.Cleanup(func() { gr.Close() })
			gr.AddHook(beforeHook{func(cmd redis.Cmder) {
				if strings.Contains(strings.ToUpper(fmt.Sprint(cmd.Args()...)), "IFEQ") && armed.CompareAndSwap(true, false) {
					renewErr = renewer.Renew(ctx, l, time.Minute)
				}
			}})
			s, err := redisstore.New(gr, redisstore.Options{Prefix: prefix, Path: redisstore.PathNative})
			if err != nil {
				t.Fatal(err)
			}
			key := cacheKey(t)
			l = lease(t, s, key, fpA, 2*time.Second)
			armed.Store(true)
			raised, err := s.RaiseToken(ctx, l, l.Token+1000)
			if err != nil || raised.Token != l.Token+1001 {
				t.Fatalf("RaiseToken: got %+v, %v; want token %d", raised, err, l.Token+1001)
			}
			if armed.Load() || renewErr != nil {
				t.Fatalf("the Renew between the read and the SET did not run (armed %v) or failed: %v", armed.Load(), renewErr)
			}
			if rec := get(t, s, key); rec.Token != raised.Token || rec.TTL < 30*time.Second {
				t.Fatalf("after Renew(1m) and RaiseToken: got token %d, TTL %v; want token %d and the renewed expiry (about 1m)", rec.Token, rec.TTL, raised.Token)
			}
		})
	}
}

// beforeHook runs f before each command go-redis sends alone.
type beforeHook struct{ f func(redis.Cmder) }

func (h beforeHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h beforeHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.f(cmd)
		return next(ctx, cmd)
	}
}
func (h beforeHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
