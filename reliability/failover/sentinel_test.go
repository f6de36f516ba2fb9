package failover

import (
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/internal/redisserver"
	"github.com/idemkit/idem/internal/reltest"
	"github.com/idemkit/idem/redisstore"
)

func sentinelClients(s *redisserver.SentinelSet) []storeClient {
	return []storeClient{
		{"go-redis", func(t *testing.T, opts redisstore.Options) *redisstore.Store {
			rc := redis.NewFailoverClient(&redis.FailoverOptions{MasterName: redisserver.SentinelMasterName, SentinelAddrs: s.SentinelAddrs()})
			t.Cleanup(func() { rc.Close() })
			st, err := redisstore.New(rc, opts)
			if err != nil {
				t.Fatal(err)
			}
			return st
		}},
		{"rueidis", func(t *testing.T, opts redisstore.Options) *redisstore.Store {
			st, err := redisstore.Open(s.URL(), opts)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { st.Close() })
			return st
		}},
	}
}

// TestSentinelFailover fails a Sentinel-managed primary over under load,
// with each client, without and with WaitReplicas=1. Between the
// promotion of the replica and the demotion of the old primary, clients
// still write to the old primary, and what they write there is lost when
// it resyncs from the new one. With WAIT those completions return
// ErrNotReplicated instead of success, so no acknowledged completion is
// lost.
func TestSentinelFailover(t *testing.T) {
	sentinelFailover(t, redisserver.Redis7, redisstore.PathAuto)
}

// TestSentinelFailoverNative is TestSentinelFailover on Valkey 9.1 (built
// by scripts/test.sh) with redisstore's native path (no Lua).
func TestSentinelFailoverNative(t *testing.T) {
	sentinelFailover(t, redisserver.Valkey9, redisstore.PathNative)
}

func sentinelFailover(t *testing.T, kind redisserver.Kind, path redisstore.Path) {
	for _, name := range []string{"go-redis", "rueidis"} {
		for _, wait := range []int{0, 1} {
			t.Run(fmt.Sprintf("%s/wait=%d", name, wait), func(t *testing.T) {
				set, err := redisserver.StartSentinelSet(redisserver.WithKind(kind))
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(set.Stop)
				var sc storeClient
				for _, c := range sentinelClients(set) {
					if c.name == name {
						sc = c
					}
				}
				opts := redisstore.Options{Prefix: prefix("sf"), Path: path}
				store := "redis sentinel (1+1, 3 sentinels), " + name
				if path == redisstore.PathNative {
					store = string(kind) + " sentinel (1+1, 3 sentinels), native path, " + name
				}
				if wait > 0 {
					opts.WaitReplicas, opts.WaitTimeout = wait, 250*time.Millisecond
					store += ", WaitReplicas=1"
				}
				s := scenario{
					name:   "failover: SENTINEL FAILOVER under load",
					store:  store,
					fault:  "SENTINEL FAILOVER " + redisserver.SentinelMasterName + demotion(),
					spec:   loadSpec{workers: 8, copies: 3, key: keyspace(nil)},
					warmup: time.Duration(reltest.Scale(300, 3000)) * time.Millisecond,
					after:  time.Duration(reltest.Scale(500, 5000)) * time.Millisecond,
				}
				// SENTINEL FAILOVER; the old primary is demoted by the
				// test in the short run, by the sentinels ~8 s later in
				// the long run (see SentinelSet.Failover).
				r := s.run(t, sentinelStore(t, sc, opts), func(t *testing.T) {
					if err := set.Failover(!reltest.Long()); err != nil {
						t.Fatal(err)
					}
				})
				if wait > 0 && r.lost > 0 {
					t.Errorf("WaitReplicas=1: %d completions confirmed by WAIT were lost", r.lost)
				}
				if wait > 0 && r.badReplay > 0 {
					t.Errorf("WaitReplicas=1: %d keys replayed another result than the confirmed one", r.badReplay)
				}
				// The scenario must have hit the window WAIT guards: some
				// completions written to the old primary after the
				// promotion, which no replica acknowledged.
				if wait > 0 && r.errs["not_replicated"] == 0 {
					t.Errorf("WaitReplicas=1: no completion failed its WAIT, so the failover window was never hit and the 0 lost proves nothing")
				}
			})
		}
	}
}

func sentinelStore(t *testing.T, sc storeClient, opts redisstore.Options) *redisstore.Store {
	return sc.open(t, opts)
}

func demotion() string {
	if reltest.Long() {
		return " (the sentinel demotes the old primary ~8 s later)"
	}
	return " (the test demotes the old primary once the sentinels name the new one)"
}
