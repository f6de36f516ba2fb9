package idemmsg_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemmsg"
	"github.com/idemkit/idem/internal/redisserver"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/redisstore"
)

// BenchmarkHandleBatch is one HandleBatch call per op: 16 deliveries of
// fresh keys, the trivial handler, one after another (Concurrency 1),
// settle doing nothing: the Deduplicator's own work per batch, with its
// allocations (-benchmem; per message: divide by 16). On memstore, and
// on rueidis (redisstore.Open) on the system's redis-server (the Lua
// path) and on each server kind $IDEM_BENCH_SERVERS lists (the native
// path on Valkey 9.1 and Redis 8.6):
//
//	IDEM_BENCH_SERVERS=valkey-9.1,redis-8.6 go test -run '^$' -bench HandleBatch -benchmem ./idemmsg/
func BenchmarkHandleBatch(b *testing.B) {
	b.Run("memstore", func(b *testing.B) { benchHandleBatch(b, memstore.New(memstore.Options{})) })
	kinds, err := redisserver.BenchKinds()
	if err != nil {
		b.Fatal(err)
	}
	addrs := map[string]string{"redis-7.0": srv.Addr()}
	names := []string{"redis-7.0"}
	for _, kind := range kinds {
		if kind == redisserver.Redis7 {
			continue
		}
		s, err := redisserver.StartServer(redisserver.WithKind(kind))
		if err != nil {
			b.Fatal(err)
		}
		defer s.Stop()
		addrs[string(kind)] = s.Addr()
		names = append(names, string(kind))
	}
	for _, name := range names {
		b.Run("rueidis/"+name, func(b *testing.B) {
			s, err := redisstore.Open("redis://"+addrs[name], redisstore.Options{Prefix: fmt.Sprintf("idemmsg-bench:%d:", time.Now().UnixNano())})
			if err != nil {
				b.Fatal(err)
			}
			defer s.Close()
			benchHandleBatch(b, s)
		})
	}
}

func benchHandleBatch(b *testing.B, store idem.Store) {
	d, err := idemmsg.New(store, idemmsg.Config{Namespace: "bench"})
	if err != nil {
		b.Fatal(err)
	}
	const size = 16
	dls := make([]idemmsg.Delivery, size)
	ctx := context.Background()
	handler := func(context.Context, int) error { return nil }
	settled := 0
	settle := func(g []idemmsg.Settled) error {
		for _, st := range g {
			if st.Err != nil || st.Result.Outcome != idemmsg.Executed {
				return fmt.Errorf("delivery %d: %v, %v", st.Index, st.Result.Outcome, st.Err)
			}
		}
		settled += len(g)
		return nil
	}
	keys := make([]string, b.N*size) // made before the timing
	for i := range keys {
		keys[i] = fmt.Sprintf("k-%d-%d", time.Now().UnixNano(), i)
	}
	b.ReportAllocs()
	b.ResetTimer()
	for n := range b.N {
		for i := range dls {
			dls[i] = idemmsg.Delivery{Key: keys[n*size+i], Attempt: 1}
		}
		if err := d.HandleBatch(ctx, dls, idemmsg.BatchOptions{}, handler, settle); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	if settled != b.N*size {
		b.Fatalf("settled %d of %d", settled, b.N*size)
	}
}
