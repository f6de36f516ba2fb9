package tiered

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
	"github.com/idemkit/idem/tieredstore"
)

// The Sentinel group below is reliability/failover's (a primary, its
// replica and three sentinels on loopback), repeated here: test files of
// another package cannot be imported.

const masterName = "mymaster"

type sentinelSet struct {
	primary, replica *redistest.Server
	addrs            []string
}

func waitUntil(t *testing.T, limit time.Duration, ok func() string) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for {
		why := ok()
		if why == "" {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("after %v: %s", limit, why)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func startSentinelSet(t *testing.T) *sentinelSet {
	t.Helper()
	primary := newRedis(t)
	replica, err := redistest.StartServer(redistest.WithArgs("--replicaof", "127.0.0.1", strconv.Itoa(primary.Port())))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(replica.Stop)
	s := &sentinelSet{primary: primary, replica: replica}
	for range 3 {
		s.addrs = append(s.addrs, startSentinel(t, primary.Port()))
	}
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
		text := fmt.Sprintf("port %d\nbind 127.0.0.1\ndaemonize no\ndir %s\nlogfile %s\n"+
			"sentinel monitor %s 127.0.0.1 %d 2\nsentinel down-after-milliseconds %s 5000\nsentinel failover-timeout %s 10000\n",
			port, dir, filepath.Join(dir, "sentinel.log"), masterName, primaryPort, masterName, masterName)
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

// failover is SENTINEL FAILOVER; then, as in reliability/failover's short
// run, the test demotes the old primary once every sentinel names the new
// one (the sentinel itself does it some 8 s later, in the long run).
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

// TestSentinelFailover fails the Sentinel-managed Redis over under load,
// without WAIT. Completions written to the old primary between the
// promotion and its demotion are lost from Redis; on the plain Redis store
// their keys run again, on the tiered store they cannot commit again.
func TestSentinelFailover(t *testing.T) {
	kinds := []mode{tieredTx, redisPlain}
	if reltest.Long() {
		kinds = modes
	}
	for _, m := range kinds {
		t.Run(m.String(), func(t *testing.T) {
			set := startSentinelSet(t)
			url := "redis://" + set.addrs[0] + "?master_set=" + masterName + "&addr=" + strings.Join(set.addrs[1:], "&addr=")
			h := newHarness(t, m, url, tieredstore.Options{RelayInterval: 200 * time.Millisecond, RelayDelay: 500 * time.Millisecond})
			start := time.Now()
			var took time.Duration
			tl := run(h, ms(500, 3000), ms(1000, 5000), func() {
				set.failover(t)
				took = time.Since(start)
			})
			if m == redisPlain {
				if tl.duplicates == 0 {
					t.Log("plain Redis: no duplicate effect after the failover (no completion landed on the old primary in the window)")
				}
			} else {
				assertTiered(t, tl)
			}
			h.report("Sentinel failover under load", "SENTINEL FAILOVER "+masterName+" without WAIT under load ("+strconv.Itoa(workers)+" workers)"+demotion(),
				tl, fmt.Sprintf("%s; fault took %v", tl.runs(m), took.Round(10*time.Millisecond)))
		})
	}
}

func demotion() string {
	if reltest.Long() {
		return "; the sentinel demotes the old primary ~8 s later"
	}
	return "; the test demotes the old primary once the sentinels name the new one"
}
