package redisstore_test

import (
	"context"
	"crypto/rand"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/rueidis"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/idemkit/idem/redisstore"
)

func randomKey() idem.Key {
	var k idem.Key
	rand.Read(k[:])
	return k
}

// TestKeySlot checks the store's hash slots against CLUSTER KEYSLOT.
func TestKeySlot(t *testing.T) {
	c := redis.NewClient(&redis.Options{Addr: cluster.Addrs()[0]})
	defer c.Close()
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cluster.Addrs()})
	defer cc.Close()
	s, err := redisstore.New(cc, redisstore.Options{})
	if err != nil {
		t.Fatal(err)
	}
	for range 200 {
		k := randomKey()
		want, err := c.ClusterKeySlot(context.Background(), s.KeyName(k)).Result()
		if err != nil {
			t.Fatal(err)
		}
		if got := redisstore.KeySlot(k); int64(got) != want {
			t.Fatalf("key %v: got slot %d, want %d", k, got, want)
		}
	}
}

// TestBatchRoundTrips counts the commands a batch sends: one script call
// for 16 keys on a single node, with either client.
func TestBatchRoundTrips(t *testing.T) {
	ctx := context.Background()
	var sent atomic.Int64
	gr := redis.NewClient(&redis.Options{Addr: single.Addr()})
	gr.AddHook(countHook{&sent})
	defer gr.Close()
	ru, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: []string{single.Addr()}, DisableCache: true})
	if err != nil {
		t.Fatal(err)
	}
	defer ru.Close()
	viaGoredis, _ := redisstore.New(gr, redisstore.Options{Prefix: redistest.Prefix("brt-go-redis")})
	viaRueidis, _ := redisstore.NewRueidis(countingRueidis{ru, &sent}, redisstore.Options{Prefix: redistest.Prefix("brt-rueidis")})
	for name, s := range map[string]*redisstore.Store{"go-redis": viaGoredis, "rueidis": viaRueidis} {
		t.Run(name, func(t *testing.T) {
			reqs := make([]idem.AcquireRequest, 16)
			for i := range reqs {
				reqs[i] = idem.AcquireRequest{Key: randomKey(), LeaseID: idem.NewLeaseID(), TTL: time.Minute}
			}
			s.AcquireMany(ctx, reqs[:1]) // loads the script (NOSCRIPT, then EVAL)
			s.CompleteMany(ctx, nil)
			before := sent.Load()
			acqs := s.AcquireMany(ctx, reqs[1:])
			if got := sent.Load() - before; got != 1 {
				t.Errorf("AcquireMany of 15 keys: got %d commands, want 1", got)
			}
			cs := make([]idem.Completion, 0, len(acqs))
			for _, a := range acqs {
				if a.Err != nil || a.Outcome != idem.Acquired {
					t.Fatalf("AcquireMany: %v %v", a.Outcome, a.Err)
				}
				cs = append(cs, idem.Completion{Lease: a.Lease, Response: &idem.Response{Status: 200}, Retention: time.Minute})
			}
			s.CompleteMany(ctx, cs[:1])
			before = sent.Load()
			for i, err := range s.CompleteMany(ctx, cs[1:]) {
				if err != nil {
					t.Fatalf("CompleteMany: %d: %v", i, err)
				}
			}
			if got := sent.Load() - before; got != 1 {
				t.Errorf("CompleteMany of 14 keys: got %d commands, want 1", got)
			}
		})
	}
}

// TestBatchSharedSlots runs batches on the Cluster whose keys share hash
// slots (found by trying keys), mixed with keys of other slots: one script
// call per slot, several keys in some, and no CROSSSLOT. Then it flushes
// the scripts on every node and runs them again (NOSCRIPT, then EVAL).
func TestBatchSharedSlots(t *testing.T) {
	ctx := context.Background()
	// Three keys in one slot, two in another, and five of their own.
	bySlot := map[uint16][]idem.Key{}
	var keys []idem.Key
	for len(keys) < 5 {
		k := randomKey()
		sl := redisstore.KeySlot(k)
		bySlot[sl] = append(bySlot[sl], k)
		if n := len(bySlot[sl]); n == 2 && len(keys) == 3 || n == 3 && len(keys) == 0 {
			keys = append(keys, bySlot[sl]...)
		}
	}
	for range 5 {
		keys = append(keys, randomKey())
	}
	for _, c := range clients(t)[2:] { // the cluster ones
		t.Run(c.name, func(t *testing.T) {
			s := c.store(t, redisstore.Options{Prefix: redistest.Prefix("slots")})
			for pass := range 2 {
				if pass == 1 {
					for _, n := range cluster.Nodes() {
						nc := redis.NewClient(&redis.Options{Addr: n.Addr()})
						nc.ScriptFlush(ctx)
						nc.Close()
					}
				}
				reqs := make([]idem.AcquireRequest, 0, 2*len(keys))
				for _, k := range keys {
					reqs = append(reqs, idem.AcquireRequest{Key: k, LeaseID: idem.NewLeaseID(), TTL: time.Minute})
				}
				for _, k := range keys {
					reqs = append(reqs, idem.AcquireRequest{Key: k, LeaseID: idem.NewLeaseID(), TTL: time.Minute})
				}
				acqs := s.AcquireMany(ctx, reqs)
				var cs []idem.Completion
				for i, a := range acqs {
					want := idem.Acquired
					if pass == 1 {
						want = idem.Replay
					}
					if i >= len(keys) && pass == 0 {
						want = idem.InFlight
					}
					if a.Err != nil || a.Outcome != want {
						t.Fatalf("pass %d: AcquireMany answer %d: got %v %v, want %v", pass, i, a.Outcome, a.Err, want)
					}
					if a.Outcome == idem.Acquired {
						cs = append(cs, idem.Completion{Lease: a.Lease, Response: &idem.Response{Status: 200 + i}, Retention: time.Minute})
					}
				}
				for i, err := range s.CompleteMany(ctx, cs) {
					if err != nil {
						t.Fatalf("pass %d: CompleteMany answer %d: %v", pass, i, err)
					}
				}
			}
		})
	}
}
