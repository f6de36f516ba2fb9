package memstore_test

import (
	"context"
	"encoding/binary"
	"errors"
	"math/rand/v2"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/storetest"
)

// fakeClock is a clock that moves only when told to.
type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func newFakeClock() *fakeClock {
	return &fakeClock{now: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)}
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) Sleep(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

func TestConformance(t *testing.T) {
	t.Parallel()
	storetest.Run(t, func(t *testing.T, _ string) storetest.Fixture {
		c := newFakeClock()
		s := memstore.New(memstore.Options{Clock: c.Now})
		return storetest.Fixture{Store: s, Sleep: c.Sleep, Corrupt: s.Corrupt}
	})
}

func TestConformanceRealClock(t *testing.T) {
	t.Parallel()
	storetest.Run(t, func(t *testing.T, _ string) storetest.Fixture {
		s := memstore.New(memstore.Options{})
		return storetest.Fixture{Store: s, Sleep: time.Sleep, Corrupt: s.Corrupt}
	})
}

// key returns a distinct key for each i.
func key(i uint64) idem.Key {
	var k idem.Key
	binary.LittleEndian.PutUint64(k[:], i)
	binary.LittleEndian.PutUint64(k[8:], i*0x9E3779B97F4A7C15)
	return k
}

func acquire(t testing.TB, s *memstore.Store, k idem.Key, ttl time.Duration) idem.Acquisition {
	t.Helper()
	acq, err := s.Acquire(context.Background(), idem.AcquireRequest{Key: k, LeaseID: idem.NewLeaseID(), TTL: ttl})
	if err != nil {
		t.Fatalf("Acquire: got error %v, want none", err)
	}
	return acq
}

// TestSweepBoundsLen floods the store with keys that are never used again
// and checks that later writes reclaim them once they have expired.
func TestSweepBoundsLen(t *testing.T) {
	c := newFakeClock()
	s := memstore.New(memstore.Options{Clock: c.Now})
	const flood, writes = 100_000, 10_000
	for i := range uint64(flood) {
		acquire(t, s, key(i), time.Second)
	}
	if n := s.Len(); n != flood {
		t.Fatalf("after the flood: got Len %d, want %d", n, flood)
	}
	c.Sleep(2 * time.Second)
	if n := s.Len(); n != flood {
		t.Fatalf("after expiry, before any write: got Len %d, want %d (nothing sweeps in the background)", n, flood)
	}
	for i := range uint64(100) {
		acquire(t, s, key(flood+i), time.Hour)
	}
	if n := s.Len(); n >= flood {
		t.Errorf("after 100 writes: got Len %d, want < %d", n, flood)
	}
	for i := range uint64(writes - 100) {
		acquire(t, s, key(flood+100+i), time.Hour)
	}
	// Each write drops up to 16 expired records from its shard: 10,000
	// writes over 64 shards reclaim the ~1,560 expired records per shard
	// with room to spare.
	if n := s.Len(); n != writes {
		t.Errorf("after %d writes: got Len %d, want %d (only the live records)", writes, n, writes)
	}
}

// TestLazyExpiry checks that a method meeting an expired record drops it.
func TestLazyExpiry(t *testing.T) {
	c := newFakeClock()
	s := memstore.New(memstore.Options{Clock: c.Now, Shards: 1})
	// The sweep of one call drops at most 16 records; Get drops the rest
	// one by one.
	for i := range uint64(20) {
		acquire(t, s, key(i), time.Second)
	}
	c.Sleep(time.Second)
	for i := range uint64(20) {
		if _, ok, err := s.Get(context.Background(), key(i)); ok || err != nil {
			t.Fatalf("Get of an expired key: got %t, %v; want false, nil", ok, err)
		}
	}
	if n := s.Len(); n != 0 {
		t.Errorf("after reading every expired key: got Len %d, want 0", n)
	}
}

// TestOptions checks that any Shards value gives a working store.
func TestOptions(t *testing.T) {
	for _, shards := range []int{-1, 0, 1, 3, 64, 1 << 20} {
		s := memstore.New(memstore.Options{Shards: shards})
		for i := range uint64(8) {
			if acq := acquire(t, s, key(i), time.Minute); acq.Outcome != idem.Acquired {
				t.Fatalf("Shards %d: got outcome %v, want acquired", shards, acq.Outcome)
			}
		}
		if n := s.Len(); n != 8 {
			t.Errorf("Shards %d: got Len %d, want 8", shards, n)
		}
	}
}

// TestRace runs every method from many goroutines over few keys while the
// clock moves, so records expire, are swept and are taken over. Tokens
// handed out for a key must never repeat.
func TestRace(t *testing.T) {
	c := newFakeClock()
	s := memstore.New(memstore.Options{Clock: c.Now, Shards: 4})
	const workers, ops, keys = 16, 2000, 32
	var tokens [keys]sync.Map // token → struct{}
	var dup atomic.Int64
	var wg sync.WaitGroup
	ctx := context.Background()
	for w := range workers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 1))
			var held []idem.Lease
			for range ops {
				k := rng.IntN(keys)
				switch op := rng.IntN(10); {
				case op < 4:
					acq, err := s.Acquire(ctx, idem.AcquireRequest{Key: key(uint64(k)), LeaseID: idem.NewLeaseID(), TTL: time.Duration(1+rng.IntN(20)) * time.Millisecond})
					if err != nil {
						t.Errorf("Acquire: %v", err)
						return
					}
					if acq.Outcome == idem.Acquired {
						if _, loaded := tokens[k].LoadOrStore(acq.Lease.Token, struct{}{}); loaded {
							dup.Add(1)
						}
						held = append(held, acq.Lease)
					}
				case op < 8 && len(held) > 0:
					l := held[len(held)-1]
					held = held[:len(held)-1]
					var err error
					switch op {
					case 4:
						err = s.Renew(ctx, l, 5*time.Millisecond)
					case 5, 6:
						err = s.Complete(ctx, l, &idem.Response{Status: 200, Header: http.Header{"X": {"y"}}}, time.Duration(1+rng.IntN(20))*time.Millisecond)
					default:
						err = s.Release(ctx, l)
					}
					if err != nil && !errors.Is(err, idem.ErrLeaseLost) {
						t.Errorf("op %d: %v", op, err)
					}
				case op == 8:
					if _, _, err := s.Get(ctx, key(uint64(k))); err != nil {
						t.Errorf("Get: %v", err)
					}
				default:
					c.Sleep(time.Duration(rng.IntN(3)) * time.Millisecond)
				}
			}
		})
	}
	wg.Wait()
	if n := dup.Load(); n > 0 {
		t.Errorf("got %d repeated tokens, want none", n)
	}
}

var benchResp = &idem.Response{
	Status: 201,
	Header: http.Header{"Content-Type": {"application/json"}},
	Body:   []byte(`{"id":"ord_8f14e45fceea167a","status":"created","amount":{"value":1999,"currency":"EUR"}}`),
}

// BenchmarkAcquireComplete acquires and completes distinct keys from
// parallel goroutines. Retention is short, so the store stays small and
// sweeping is part of the cost.
func BenchmarkAcquireComplete(b *testing.B) {
	s := memstore.New(memstore.Options{})
	ctx := context.Background()
	var worker atomic.Uint64
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		w := worker.Add(1) << 40
		for i := w; pb.Next(); i++ {
			acq, err := s.Acquire(ctx, idem.AcquireRequest{Key: key(i), LeaseID: idem.LeaseID{1}, TTL: time.Minute})
			if err != nil || acq.Outcome != idem.Acquired {
				b.Fatalf("Acquire: got %v, %v; want acquired", acq.Outcome, err)
			}
			if err := s.Complete(ctx, acq.Lease, benchResp, 50*time.Millisecond); err != nil {
				b.Fatalf("Complete: %v", err)
			}
		}
	})
}

// BenchmarkReplay replays completed keys from parallel goroutines.
func BenchmarkReplay(b *testing.B) {
	s := memstore.New(memstore.Options{})
	ctx := context.Background()
	const keys = 1024
	for i := range uint64(keys) {
		acq := acquire(b, s, key(i), time.Minute)
		if err := s.Complete(ctx, acq.Lease, benchResp, time.Hour); err != nil {
			b.Fatal(err)
		}
	}
	var worker atomic.Uint64
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		i := worker.Add(1) * 97
		for pb.Next() {
			i++
			acq, err := s.Acquire(ctx, idem.AcquireRequest{Key: key(i % keys), LeaseID: idem.LeaseID{1}, TTL: time.Minute})
			if err != nil || acq.Outcome != idem.Replay {
				b.Fatalf("Acquire: got %v, %v; want replay", acq.Outcome, err)
			}
		}
	})
}

// BenchmarkAcquireCompleteBounded is BenchmarkAcquireComplete on a store
// with a bound it never reaches: the cost of the check.
func BenchmarkAcquireCompleteBounded(b *testing.B) {
	s := memstore.New(memstore.Options{MaxBytes: 1 << 40})
	ctx := context.Background()
	var worker atomic.Uint64
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		w := worker.Add(1) << 40
		for i := w; pb.Next(); i++ {
			acq, err := s.Acquire(ctx, idem.AcquireRequest{Key: key(i), LeaseID: idem.LeaseID{1}, TTL: time.Minute})
			if err != nil || acq.Outcome != idem.Acquired {
				b.Fatalf("Acquire: got %v, %v; want acquired", acq.Outcome, err)
			}
			if err := s.Complete(ctx, acq.Lease, benchResp, 50*time.Millisecond); err != nil {
				b.Fatalf("Complete: %v", err)
			}
		}
	})
}

// BenchmarkAcquireFull acquires new keys in a full store of live records:
// the cost of a refusal (two critical sections, and a look at every
// shard's earliest expiry).
func BenchmarkAcquireFull(b *testing.B) {
	s := memstore.New(memstore.Options{MaxBytes: 1024 * memstore.RecordOverhead})
	ctx := context.Background()
	for i := range uint64(1024) {
		acquire(b, s, key(i), time.Hour)
	}
	var worker atomic.Uint64
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		w := worker.Add(1) << 40
		for i := w; pb.Next(); i++ {
			if _, err := s.Acquire(ctx, idem.AcquireRequest{Key: key(i), LeaseID: idem.LeaseID{1}, TTL: time.Minute}); !errors.Is(err, memstore.ErrFull) {
				b.Fatalf("Acquire: got %v, want ErrFull", err)
			}
		}
	})
}
