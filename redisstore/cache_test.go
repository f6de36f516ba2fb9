package redisstore_test

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/rueidis"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redisserver"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/idemkit/idem/redisstore"
)

// leakyCache is a rueidis.CacheStore that never forgets: one store shared
// by every connection of a client, that ignores invalidations (Delete),
// lost connections (Close) and expiry. A store built on it shows what the
// replay cache would serve without each of rueidis's invalidation paths:
// the tests below run every scenario on it too and require a stale replay
// there, so that they are known to catch one.
type leakyCache struct {
	mu      sync.Mutex
	vals    map[string]rueidis.RedisMessage
	flights map[string]*leakyEntry
}

type leakyEntry struct {
	done chan struct{}
	v    rueidis.RedisMessage
	err  error
}

func (e *leakyEntry) Wait(ctx context.Context) (rueidis.RedisMessage, error) {
	select {
	case <-e.done:
		return e.v, e.err
	case <-ctx.Done():
		return rueidis.RedisMessage{}, ctx.Err()
	}
}

func newLeakyCache() *leakyCache {
	return &leakyCache{vals: map[string]rueidis.RedisMessage{}, flights: map[string]*leakyEntry{}}
}

func (c *leakyCache) Flight(key, cmd string, _ time.Duration, _ time.Time) (rueidis.RedisMessage, rueidis.CacheEntry) {
	c.mu.Lock()
	defer c.mu.Unlock()
	k := key + "\x00" + cmd
	if v, ok := c.vals[k]; ok {
		return v, nil
	}
	if e, ok := c.flights[k]; ok {
		return rueidis.RedisMessage{}, e
	}
	c.flights[k] = &leakyEntry{done: make(chan struct{})}
	return rueidis.RedisMessage{}, nil
}

func (c *leakyCache) Update(key, cmd string, v rueidis.RedisMessage) int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	k := key + "\x00" + cmd
	c.vals[k] = v
	if e := c.flights[k]; e != nil {
		delete(c.flights, k)
		e.v = v
		close(e.done)
	}
	return 0
}

func (c *leakyCache) Cancel(key, cmd string, err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	k := key + "\x00" + cmd
	if e := c.flights[k]; e != nil {
		delete(c.flights, k)
		e.err = err
		close(e.done)
	}
}

func (c *leakyCache) Delete([]rueidis.RedisMessage) {} // the leak

func (c *leakyCache) Close(err error) { // wakes the waiters, keeps the values
	c.mu.Lock()
	defer c.mu.Unlock()
	for k, e := range c.flights {
		delete(c.flights, k)
		e.err = err
		close(e.done)
	}
}

// cacheSetup is a store with the replay cache and the client under it.
type cacheSetup struct {
	store *redisstore.Store
	c     rueidis.Client
}

// cachedStore returns a store over a rueidis client with client-side
// caching, as Open builds it (leaky: over a leakyCache instead).
func cachedStore(t *testing.T, o rueidis.ClientOption, leaky bool) cacheSetup {
	t.Helper()
	o.MaxFlushDelay = 20 * time.Microsecond
	if leaky {
		lc := newLeakyCache()
		o.NewCacheStoreFn = func(rueidis.CacheStoreOption) rueidis.CacheStore { return lc }
	}
	c, err := rueidis.NewClient(o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	s, err := redisstore.NewRueidis(c, redisstore.Options{Prefix: redistest.Prefix("cache")})
	if err != nil {
		t.Fatal(err)
	}
	return cacheSetup{s, c}
}

var cacheSeq atomic.Int64

// settle makes a round trip on the connection the cached reads of key
// use (a cached GET of another key with the same hash tag, so the same
// slot and connection): every invalidation Redis sent on it before is
// applied when it returns. A write by another client is followed by
// its invalidation, sent when the write is; a real caller cannot tell it
// from a write a moment later.
func (cs cacheSetup) settle(t *testing.T, key idem.Key) {
	t.Helper()
	name := cs.store.KeyName(key) + "settle" + strconv.FormatInt(cacheSeq.Add(1), 10)
	deadline := time.Now().Add(15 * time.Second)
	for {
		err := cs.c.DoCache(context.Background(), cs.c.B().Get().Key(name).Cache(), time.Second).Error()
		if err == nil || rueidis.IsRedisNil(err) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("settle: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func cacheKey(t *testing.T) idem.Key {
	k, err := idem.Scope{Tenant: "t", Method: "POST", Route: "/pay"}.Key(t.Name() + strconv.FormatInt(cacheSeq.Add(1), 10))
	if err != nil {
		t.Fatal(err)
	}
	return k
}

var cacheFP = idem.SumFingerprint([]byte("a"))

// acquireRetry is Acquire, retried for a while on errors (a failover).
func acquireRetry(t *testing.T, s *redisstore.Store, key idem.Key, fp idem.Fingerprint) idem.Acquisition {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		a, err := s.Acquire(context.Background(), idem.AcquireRequest{Key: key, Fingerprint: fp, LeaseID: idem.NewLeaseID(), TTL: 10 * time.Second})
		if err == nil {
			return a
		}
		if time.Now().After(deadline) {
			t.Fatalf("acquire: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// completeWith acquires key and completes it with body, kept for retention.
func completeWith(t *testing.T, s *redisstore.Store, key idem.Key, body string, retention time.Duration) {
	t.Helper()
	a := acquireRetry(t, s, key, cacheFP)
	if a.Outcome != idem.Acquired {
		t.Fatalf("acquire before completing %q: %v, want acquired", body, a.Outcome)
	}
	if err := s.Complete(context.Background(), a.Lease, &idem.Response{Status: 201, Body: []byte(body)}, retention); err != nil {
		t.Fatal(err)
	}
}

// replayed returns the body a replay of key answers, "" when Acquire
// answers anything else (it then holds the lease it got, if any).
func replayed(t *testing.T, s *redisstore.Store, key idem.Key) (string, idem.Acquisition) {
	t.Helper()
	a := acquireRetry(t, s, key, cacheFP)
	if a.Outcome != idem.Replay {
		return "", a
	}
	return string(a.Response.Body), a
}

// staleAfter runs one scenario: key completes with "r1" and is replayed
// until the cache holds it; event makes the record go away on the
// server (it must not be replayed after that); then the key must be
// acquired anew, completed with "r2", and replayed as "r2". It returns
// what was replayed stale ("" if nothing).
func staleAfter(t *testing.T, cs cacheSetup, retention time.Duration, event func(key idem.Key)) string {
	t.Helper()
	key := cacheKey(t)
	completeWith(t, cs.store, key, "r1", retention)
	hits := cs.store.CacheStats().Hits
	for range 3 {
		if body, a := replayed(t, cs.store, key); body != "r1" {
			t.Fatalf("replay before the event: %v %q, want replay r1", a.Outcome, body)
		}
	}
	if cs.store.CacheStats().Hits == hits {
		t.Fatal("three replays, no cache hit: the scenario does not start from a cached record")
	}
	event(key)
	body, a := replayed(t, cs.store, key)
	if body != "" {
		return body
	}
	if a.Outcome != idem.Acquired {
		t.Fatalf("after the event: %v, want acquired", a.Outcome)
	}
	if err := cs.store.Complete(context.Background(), a.Lease, &idem.Response{Status: 201, Body: []byte("r2")}, time.Minute); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		body, a := replayed(t, cs.store, key)
		if body != "r2" {
			if body == "" {
				t.Fatalf("replay after the new completion: %v", a.Outcome)
			}
			return body
		}
	}
	return ""
}

// cacheScenarios are the ways a completed record goes away, each run on
// the real cache (no stale replay allowed) and on the leaky one (a stale
// replay required: the scenario is known to catch it).
func runCacheScenario(t *testing.T, newSetup func(t *testing.T, leaky bool) cacheSetup, retention time.Duration,
	event func(t *testing.T, cs cacheSetup, key idem.Key)) {
	for _, leaky := range []bool{false, true} {
		t.Run(map[bool]string{false: "cache", true: "leaky-control"}[leaky], func(t *testing.T) {
			cs := newSetup(t, leaky)
			stale := staleAfter(t, cs, retention, func(key idem.Key) { event(t, cs, key) })
			switch {
			case !leaky && stale != "":
				t.Fatalf("stale replay %q after the record went away on the server", stale)
			case leaky && stale == "":
				t.Fatal("the leaky cache served nothing stale: the scenario does not exercise invalidation")
			}
		})
	}
}

// privateServer starts a redis-server for one test (the disruptive
// scenarios must not touch the package's shared one).
func privateServer(t *testing.T) *redisserver.Server {
	t.Helper()
	srv, err := redisserver.StartServer()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	return srv
}

func singleSetup(srv *redisserver.Server) func(t *testing.T, leaky bool) cacheSetup {
	return func(t *testing.T, leaky bool) cacheSetup {
		return cachedStore(t, rueidis.ClientOption{InitAddress: []string{srv.Addr()}}, leaky)
	}
}

func mustDo(t *testing.T, srv *redisserver.Server, args ...string) string {
	t.Helper()
	out, err := srv.Do(args...)
	if err != nil {
		t.Fatalf("%s: %v", strings.Join(args, " "), err)
	}
	return out
}

// TestCachePurge: a purge (Store.Delete) by this store and by another
// process's (idem purge) leaves nothing to replay.
func TestCachePurge(t *testing.T) {
	srv := privateServer(t)
	t.Run("own", func(t *testing.T) {
		runCacheScenario(t, singleSetup(srv), time.Minute, func(t *testing.T, cs cacheSetup, key idem.Key) {
			if ok, err := cs.store.Delete(context.Background(), key); err != nil || !ok {
				t.Fatalf("Delete: %v, %v", ok, err)
			}
		})
	})
	t.Run("other", func(t *testing.T) {
		runCacheScenario(t, singleSetup(srv), time.Minute, func(t *testing.T, cs cacheSetup, key idem.Key) {
			mustDo(t, srv, "DEL", cs.store.KeyName(key)) // as idem purge does, from elsewhere
			cs.settle(t, key)
		})
	})
}

// TestCacheExpiry: a record whose retention ended is not replayed, even
// though nothing invalidates it before Redis notices the expiry.
func TestCacheExpiry(t *testing.T) {
	srv := privateServer(t)
	runCacheScenario(t, singleSetup(srv), 300*time.Millisecond, func(t *testing.T, cs cacheSetup, key idem.Key) {
		time.Sleep(400 * time.Millisecond)
	})
}

// TestCacheLostConnection: the server drops the client's connections
// (CLIENT KILL) and the record is deleted while they are down: the
// tracking that would have told is gone with them.
func TestCacheLostConnection(t *testing.T) {
	srv := privateServer(t)
	runCacheScenario(t, singleSetup(srv), time.Minute, func(t *testing.T, cs cacheSetup, key idem.Key) {
		mustDo(t, srv, "CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
		mustDo(t, srv, "DEL", cs.store.KeyName(key))
		cs.settle(t, key)
	})
}

// TestCacheRestart: the server restarts (its data gone: no persistence).
func TestCacheRestart(t *testing.T) {
	srv := privateServer(t)
	runCacheScenario(t, singleSetup(srv), time.Minute, func(t *testing.T, cs cacheSetup, key idem.Key) {
		if err := srv.Restart(); err != nil {
			t.Fatal(err)
		}
		cs.settle(t, key)
	})
}

// TestCacheFlushAll: FLUSHALL invalidates everything cached.
func TestCacheFlushAll(t *testing.T) {
	srv := privateServer(t)
	runCacheScenario(t, singleSetup(srv), time.Minute, func(t *testing.T, cs cacheSetup, key idem.Key) {
		mustDo(t, srv, "FLUSHALL")
		cs.settle(t, key)
	})
}

// TestCacheCluster: a purge on Redis Cluster (the cache is per node
// connection) leaves nothing to replay.
func TestCacheCluster(t *testing.T) {
	runCacheScenario(t, func(t *testing.T, leaky bool) cacheSetup {
		return cachedStore(t, rueidis.ClientOption{InitAddress: cluster.Addrs()}, leaky)
	}, time.Minute, func(t *testing.T, cs cacheSetup, key idem.Key) {
		rc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cluster.Addrs()})
		defer rc.Close()
		if err := rc.Del(context.Background(), cs.store.KeyName(key)).Err(); err != nil {
			t.Fatal(err)
		}
		cs.settle(t, key)
	})
}

// TestCacheSentinelFailover: after SENTINEL FAILOVER, the record is
// deleted on the new primary; the cache read from the old one must not
// answer.
func TestCacheSentinelFailover(t *testing.T) {
	set, err := redisserver.StartSentinelSet()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(set.Stop)
	runCacheScenario(t, func(t *testing.T, leaky bool) cacheSetup {
		return cachedStore(t, rueidis.ClientOption{InitAddress: set.SentinelAddrs(),
			Sentinel: rueidis.SentinelOption{MasterSet: redisserver.SentinelMasterName}}, leaky)
	}, time.Minute, func(t *testing.T, cs cacheSetup, key idem.Key) {
		if err := set.Failover(true); err != nil {
			t.Fatal(err)
		}
		rc := redis.NewClient(&redis.Options{Addr: set.MasterAddr()})
		defer rc.Close()
		if err := rc.Del(context.Background(), cs.store.KeyName(key)).Err(); err != nil {
			t.Fatal(err)
		}
		// Wait until the client writes to the new primary.
		deadline := time.Now().Add(30 * time.Second)
		for {
			if err := cs.c.Do(context.Background(), cs.c.B().Set().Key(cs.store.KeyName(key)+"probe").Value("x").Build()).Error(); err == nil {
				break
			} else if time.Now().After(deadline) {
				t.Fatalf("the client does not reach the new primary: %v", err)
			}
			time.Sleep(50 * time.Millisecond)
		}
		cs.settle(t, key)
	})
}

// TestCacheNoRoundTrip: replays of a cached record send nothing to Redis,
// with the store Open builds; with CacheSize < 0 each one runs the script.
func TestCacheNoRoundTrip(t *testing.T) {
	srv := privateServer(t)
	commands := func() int {
		info := mustDo(t, srv, "INFO", "stats")
		v, _ := redisserver.InfoField(info, "total_commands_processed")
		n, err := strconv.Atoi(v)
		if err != nil {
			t.Fatalf("total_commands_processed %q", v)
		}
		return n
	}
	for _, size := range []int{0, -1} {
		t.Run(fmt.Sprintf("CacheSize=%d", size), func(t *testing.T) {
			s, err := redisstore.Open("redis://"+srv.Addr(), redisstore.Options{Prefix: redistest.Prefix("rt"), CacheSize: size})
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			key := cacheKey(t)
			completeWith(t, s, key, "r1", time.Minute)
			replayed(t, s, key) // reads it into the cache
			before := commands()
			for range 20 {
				if body, a := replayed(t, s, key); body != "r1" {
					t.Fatalf("replay: %v %q", a.Outcome, body)
				}
			}
			sent := commands() - before - 1 // the INFO itself
			st := s.CacheStats()
			if size < 0 {
				if st.Enabled || st.Hits != 0 || sent < 20 {
					t.Fatalf("cache off: %+v, %d commands for 20 replays, want no hits and a script each", st, sent)
				}
				return
			}
			if !st.Enabled || st.Hits < 20 || sent != 0 {
				t.Fatalf("cache on: %+v, %d commands for 20 replays, want 20 hits and none", st, sent)
			}
		})
	}
}

// TestCacheKeepsReplayRules: what the cache answers is what the script
// answers: another fingerprint is a mismatch, another tenant's key of
// the same name is its own record, an in-flight key stays in flight.
func TestCacheKeepsReplayRules(t *testing.T) {
	s, err := redisstore.Open("redis://"+single.Addr(), redisstore.Options{Prefix: redistest.Prefix("rules")})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := context.Background()
	scoped := func(tenant, client string) idem.Key {
		k, err := idem.Scope{Tenant: tenant, Method: "POST", Route: "/pay"}.Key(client)
		if err != nil {
			t.Fatal(err)
		}
		return k
	}
	client := "k-" + strconv.FormatInt(cacheSeq.Add(1), 10)
	key := scoped("a", client)
	completeWith(t, s, key, "r1", time.Minute)
	for range 3 {
		replayed(t, s, key)
	}
	if s.CacheStats().Hits == 0 {
		t.Fatal("no cache hit")
	}
	// A replay's response is the caller's: changing it changes no later replay.
	if _, a := replayed(t, s, key); len(a.Response.Body) == 2 {
		a.Response.Body[0] = 'X'
	}
	if body, _ := replayed(t, s, key); body != "r1" {
		t.Fatalf("after a caller changed its replayed body: replay %q, want r1", body)
	}
	a, err := s.Acquire(ctx, idem.AcquireRequest{Key: key, Fingerprint: idem.SumFingerprint([]byte("b")), LeaseID: idem.NewLeaseID(), TTL: time.Second})
	if err != nil || a.Outcome != idem.Mismatch {
		t.Fatalf("another fingerprint: %v, %v; want mismatch", a.Outcome, err)
	}
	if body, a := replayed(t, s, scoped("b", client)); body != "" || a.Outcome != idem.Acquired {
		t.Fatalf("another tenant's key: %v %q, want acquired", a.Outcome, body)
	}
	if _, a := replayed(t, s, scoped("b", client)); a.Outcome != idem.InFlight {
		t.Fatalf("the in-flight key again: %v, want in_flight", a.Outcome)
	}
}

// cachedClients are the stores with the replay cache on, as Open builds
// them (rueidis with client-side caching), on the single node and on the
// cluster: TestConformance runs storetest on them next to clients(t),
// whose rueidis stores have the cache off.
func cachedClients(t testing.TB) []client {
	var out []client
	for _, d := range []struct {
		name string
		url  string
	}{
		{"single", "redis://" + single.Addr()},
		{"cluster", "redis://" + cluster.Addrs()[0] + "?addr=" + strings.Join(cluster.Addrs()[1:], "&addr=")},
	} {
		raw, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: cluster.Addrs(), DisableCache: true})
		if d.name == "single" {
			raw, err = rueidis.NewClient(rueidis.ClientOption{InitAddress: []string{single.Addr()}, DisableCache: true})
		}
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(raw.Close)
		out = append(out, client{
			name: "rueidis+cache/" + d.name,
			store: func(t testing.TB, opts redisstore.Options) *redisstore.Store {
				s, err := redisstore.Open(d.url, opts)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { s.Close() })
				if !s.CacheStats().Enabled {
					t.Fatal("Open: the replay cache is off")
				}
				return s
			},
			set: func(ctx context.Context, key, value string) error {
				return raw.Do(ctx, raw.B().Set().Key(key).Value(value).Build()).Error()
			},
		})
	}
	return out
}

// BenchmarkReplay measures one Acquire answered replay, one at a time, on
// the package's private redis-server with the store Open builds: with the
// replay cache (a hit: no round trip) and with it off (the acquire script).
//
//	go test -run '^$' -bench Replay -benchtime 20000x ./redisstore/
func BenchmarkReplay(b *testing.B) {
	for _, c := range []struct {
		name string
		size int
	}{{"cache", 0}, {"nocache", -1}} {
		b.Run(c.name, func(b *testing.B) {
			s, err := redisstore.Open("redis://"+single.Addr(), redisstore.Options{Prefix: redistest.Prefix("benchreplay"), CacheSize: c.size})
			if err != nil {
				b.Fatal(err)
			}
			defer s.Close()
			ctx := context.Background()
			key := scope(int(cacheSeq.Add(1)))
			a, err := s.Acquire(ctx, idem.AcquireRequest{Key: key, Fingerprint: cacheFP, LeaseID: idem.NewLeaseID(), TTL: time.Minute})
			if err != nil || a.Outcome != idem.Acquired {
				b.Fatal(a.Outcome, err)
			}
			if err := s.Complete(ctx, a.Lease, &idem.Response{Status: 201, Body: []byte(`{"id":"ch_1"}`)}, time.Hour); err != nil {
				b.Fatal(err)
			}
			req := idem.AcquireRequest{Key: key, Fingerprint: cacheFP, LeaseID: idem.NewLeaseID(), TTL: time.Minute}
			b.ReportAllocs()
			for b.Loop() {
				if a, err := s.Acquire(ctx, req); err != nil || a.Outcome != idem.Replay {
					b.Fatal(a.Outcome, err)
				}
			}
		})
	}
}
