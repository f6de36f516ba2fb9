package failover

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/internal/proctest"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/idemkit/idem/internal/reltest"
	"github.com/idemkit/idem/redisstore"
)

const masterName = "mymaster"

// sentinelSet is a private primary, its replica and three sentinels that
// monitor them, all on loopback.
type sentinelSet struct {
	primary, replica *redistest.Server
	addrs            []string // sentinels
}

func startSentinelSet(t *testing.T) *sentinelSet {
	t.Helper()
	primary, err := redistest.StartServer()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(primary.Stop)
	replica, err := redistest.StartServer(redistest.WithArgs("--replicaof", "127.0.0.1", strconv.Itoa(primary.Port())))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(replica.Stop)
	s := &sentinelSet{primary: primary, replica: replica}
	for range 3 {
		s.addrs = append(s.addrs, startSentinel(t, primary.Port()))
	}
	// Ready: the replica is in sync and every sentinel knows it as a
	// healthy replica.
	waitUntil(t, 15*time.Second, func() string {
		info, err := replica.Do("INFO", "replication")
		if link, _ := redistest.InfoField(info, "master_link_status"); err != nil || link != "up" {
			return "replica not in sync"
		}
		for _, addr := range s.addrs {
			sc := redis.NewSentinelClient(&redis.Options{Addr: addr})
			reps, err := sc.Replicas(context.Background(), masterName).Result()
			sc.Close()
			if err != nil || len(reps) != 1 || reps[0]["flags"] != "slave" || reps[0]["master-link-status"] != "ok" {
				return fmt.Sprintf("sentinel %s: replicas %v, %v", addr, reps, err)
			}
		}
		return ""
	})
	return s
}

// startSentinel starts redis-server --sentinel on a free loopback port
// with its own directory and config file, and waits until it answers.
func startSentinel(t *testing.T, primaryPort int) string {
	t.Helper()
	dir := t.TempDir()
	conf := filepath.Join(dir, "sentinel.conf")
	for attempt := 1; ; attempt++ {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		port := l.Addr().(*net.TCPAddr).Port
		l.Close()
		text := fmt.Sprintf(`port %d
bind 127.0.0.1
daemonize no
dir %s
logfile %s
sentinel monitor %s 127.0.0.1 %d 2
sentinel down-after-milliseconds %s 5000
sentinel failover-timeout %s 10000
`, port, dir, filepath.Join(dir, "sentinel.log"), masterName, primaryPort, masterName, masterName)
		if err := os.WriteFile(conf, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command("redis-server", conf, "--sentinel")
		cmd.SysProcAttr = proctest.SysProcAttr()
		if err := cmd.Start(); err != nil {
			t.Fatalf("starting redis-server --sentinel: %v", err)
		}
		done := make(chan struct{})
		go func() { cmd.Wait(); close(done) }()
		stop := func() {
			cmd.Process.Kill()
			select {
			case <-done:
			case <-time.After(5 * time.Second):
			}
		}
		addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
		sc := redis.NewSentinelClient(&redis.Options{Addr: addr, DialTimeout: 200 * time.Millisecond})
		ready := false
		for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
			if sc.Ping(context.Background()).Err() == nil {
				ready = true
				break
			}
			select {
			case <-done:
				deadline = time.Time{}
			default:
			}
		}
		sc.Close()
		if ready {
			t.Cleanup(stop)
			return addr
		}
		stop()
		if attempt == 3 {
			log, _ := os.ReadFile(filepath.Join(dir, "sentinel.log"))
			t.Fatalf("sentinel on %s did not start:\n%s", addr, log)
		}
	}
}

// failover runs SENTINEL FAILOVER (a forced failover: the sentinel
// promotes the replica; it turns the old primary into a replica of the
// new one only some 8 s later, once it sees it still reporting itself as
// primary) and waits until every sentinel names the new primary. Then,
// in the short run, it demotes the old primary itself, as the sentinel
// would later; in the long run it waits for the sentinel to do it.
func (s *sentinelSet) failover(t *testing.T) {
	ctx := context.Background()
	sc := redis.NewSentinelClient(&redis.Options{Addr: s.addrs[0]})
	defer sc.Close()
	waitUntil(t, 10*time.Second, func() string {
		if err := sc.Failover(ctx, masterName).Err(); err != nil {
			return "SENTINEL FAILOVER: " + err.Error()
		}
		return ""
	})
	waitUntil(t, 20*time.Second, func() string {
		for _, addr := range s.addrs {
			c := redis.NewSentinelClient(&redis.Options{Addr: addr})
			got, err := c.GetMasterAddrByName(ctx, masterName).Result()
			c.Close()
			if err != nil || strings.Join(got, ":") != s.replica.Addr() {
				return fmt.Sprintf("sentinel %s names %v (%v), want %s", addr, got, err, s.replica.Addr())
			}
		}
		if role, _ := s.replica.Do("ROLE"); !strings.HasPrefix(role, "master") {
			return "replica not promoted"
		}
		return ""
	})
	if !reltest.Long() {
		if _, err := s.primary.Do("REPLICAOF", "127.0.0.1", strconv.Itoa(s.replica.Port())); err != nil {
			t.Fatalf("REPLICAOF on the old primary: %v", err)
		}
	}
	waitUntil(t, 30*time.Second, func() string {
		info, _ := s.primary.Do("INFO", "replication")
		if link, _ := redistest.InfoField(info, "master_link_status"); link != "up" {
			return "old primary does not replicate from the new one yet"
		}
		return ""
	})
}

func sentinelClients(s *sentinelSet) []storeClient {
	return []storeClient{
		{"go-redis", func(t *testing.T, opts redisstore.Options) *redisstore.Store {
			rc := redis.NewFailoverClient(&redis.FailoverOptions{MasterName: masterName, SentinelAddrs: s.addrs})
			t.Cleanup(func() { rc.Close() })
			st, err := redisstore.New(rc, opts)
			if err != nil {
				t.Fatal(err)
			}
			return st
		}},
		{"rueidis", func(t *testing.T, opts redisstore.Options) *redisstore.Store {
			st, err := redisstore.Open("redis://"+s.addrs[0]+"?master_set="+masterName+"&addr="+strings.Join(s.addrs[1:], "&addr="), opts)
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
	for _, name := range []string{"go-redis", "rueidis"} {
		for _, wait := range []int{0, 1} {
			t.Run(fmt.Sprintf("%s/wait=%d", name, wait), func(t *testing.T) {
				set := startSentinelSet(t)
				var sc storeClient
				for _, c := range sentinelClients(set) {
					if c.name == name {
						sc = c
					}
				}
				opts := redisstore.Options{Prefix: prefix("sf")}
				store := "redis sentinel (1+1, 3 sentinels), " + name
				if wait > 0 {
					opts.WaitReplicas, opts.WaitTimeout = wait, 250*time.Millisecond
					store += ", WaitReplicas=1"
				}
				s := scenario{
					name:   "failover: SENTINEL FAILOVER under load",
					store:  store,
					fault:  "SENTINEL FAILOVER " + masterName + demotion(),
					spec:   loadSpec{workers: 8, copies: 3, key: keyspace(nil)},
					warmup: time.Duration(reltest.Scale(300, 3000)) * time.Millisecond,
					after:  time.Duration(reltest.Scale(500, 5000)) * time.Millisecond,
				}
				r := s.run(t, sentinelStore(t, sc, opts), set.failover)
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
