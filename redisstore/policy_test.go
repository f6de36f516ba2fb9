package redisstore_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/rueidis"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redisserver"
	"github.com/idemkit/idem/redisstore"
)

// logBuf is a slog destination safe for the store's background checks.
type logBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuf) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logBuf) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func (l *logBuf) logger() *slog.Logger { return slog.New(slog.NewTextHandler(l, nil)) }

// openers opens a store on addr with each way the package offers.
func openers(addr string, auth ...string) map[string]func(opts redisstore.Options) (*redisstore.Store, func(), error) {
	return map[string]func(opts redisstore.Options) (*redisstore.Store, func(), error){
		"New": func(opts redisstore.Options) (*redisstore.Store, func(), error) {
			o := &redis.Options{Addr: addr}
			if len(auth) == 2 {
				o.Username, o.Password = auth[0], auth[1]
			}
			c := redis.NewClient(o)
			s, err := redisstore.New(c, opts)
			return s, func() { c.Close() }, err
		},
		"NewRueidis": func(opts redisstore.Options) (*redisstore.Store, func(), error) {
			o := rueidis.ClientOption{InitAddress: []string{addr}, DisableCache: true}
			if len(auth) == 2 {
				o.Username, o.Password = auth[0], auth[1]
			}
			c, err := rueidis.NewClient(o)
			if err != nil {
				return nil, func() {}, err
			}
			s, err := redisstore.NewRueidis(c, opts)
			return s, c.Close, err
		},
		"Open": func(opts redisstore.Options) (*redisstore.Store, func(), error) {
			u := "redis://" + addr
			if len(auth) == 2 {
				u = "redis://" + auth[0] + ":" + auth[1] + "@" + addr
			}
			s, err := redisstore.Open(u, opts)
			if err != nil {
				return nil, func() {}, err
			}
			return s, func() { s.Close() }, nil
		},
	}
}

// TestEvictingPolicyRefused: a server whose maxmemory-policy evicts keys
// is refused by every constructor with one line that says why and how to
// allow it; with Options.AllowEviction (or allow_eviction=1) it opens and
// logs a WARN.
func TestEvictingPolicyRefused(t *testing.T) {
	for _, policy := range []string{"volatile-lru", "allkeys-lru"} {
		srv := redisserver.MustStartServer(redisserver.WithArgs("--maxmemory-policy", policy))
		t.Cleanup(srv.Stop)
		for name, open := range openers(srv.Addr()) {
			t.Run(policy+"/"+name, func(t *testing.T) {
				s, done, err := open(redisstore.Options{})
				defer done()
				if !errors.Is(err, redisstore.ErrEvictingPolicy) {
					t.Fatalf("got store %v, error %v; want ErrEvictingPolicy", s, err)
				}
				msg := err.Error()
				for _, want := range []string{policy, srv.Addr(), "runs its work again", "noeviction", "AllowEviction", "allow_eviction=1"} {
					if !strings.Contains(msg, want) {
						t.Errorf("error %q does not say %q", msg, want)
					}
				}
				if strings.Contains(msg, "\n") {
					t.Errorf("error %q is more than one line", msg)
				}
				var log logBuf
				s, done2, err := open(redisstore.Options{AllowEviction: true, Logger: log.logger()})
				defer done2()
				if err != nil {
					t.Fatalf("with AllowEviction: %v", err)
				}
				if st := s.PolicyStats(); !st.Evicting || st.Policy != policy || !st.Allowed {
					t.Errorf("PolicyStats %+v: want Evicting, Policy %s, Allowed", st, policy)
				}
				if !strings.Contains(log.String(), "level=WARN") || !strings.Contains(log.String(), policy) {
					t.Errorf("with AllowEviction, no WARN naming %s: %q", policy, log.String())
				}
			})
		}
		t.Run(policy+"/allow_eviction=1", func(t *testing.T) {
			s, err := redisstore.Open("redis://"+srv.Addr()+"?allow_eviction=1", redisstore.Options{Logger: slog.New(slog.DiscardHandler)})
			if err != nil {
				t.Fatal(err)
			}
			s.Close()
			if _, err := redisstore.Open("redis://"+srv.Addr()+"?allow_eviction=0", redisstore.Options{}); !errors.Is(err, redisstore.ErrEvictingPolicy) {
				t.Errorf("allow_eviction=0: got %v, want ErrEvictingPolicy", err)
			}
			if _, err := redisstore.Open("redis://"+srv.Addr()+"?allow_eviction=maybe", redisstore.Options{}); !errors.Is(err, redisstore.ErrBadURL) {
				t.Errorf("allow_eviction=maybe: got %v, want ErrBadURL", err)
			}
		})
	}
}

// TestNoEvictionOpens: the default policy (noeviction) opens without a word.
func TestNoEvictionOpens(t *testing.T) {
	for name, open := range openers(single.Addr()) {
		t.Run(name, func(t *testing.T) {
			var log logBuf
			s, done, err := open(redisstore.Options{Logger: log.logger()})
			defer done()
			if err != nil {
				t.Fatal(err)
			}
			if st := s.PolicyStats(); st.Evicting || st.Unknown || st.Policy != "noeviction" || st.Checks != 1 {
				t.Errorf("PolicyStats %+v: want noeviction after one check", st)
			}
			if log.String() != "" {
				t.Errorf("logged %q, want nothing", log.String())
			}
		})
	}
}

// TestPolicyWithoutConfig: where CONFIG is disabled (managed services),
// the policy is read from INFO memory; where INFO is refused too, the
// store opens with a WARN saying it could not tell.
func TestPolicyWithoutConfig(t *testing.T) {
	noConfig := redisserver.MustStartServer(redisserver.WithArgs("--maxmemory-policy", "volatile-lru", "--rename-command", "CONFIG", ""))
	t.Cleanup(noConfig.Stop)
	for name, open := range openers(noConfig.Addr()) {
		t.Run("INFO/"+name, func(t *testing.T) {
			_, done, err := open(redisstore.Options{})
			defer done()
			if !errors.Is(err, redisstore.ErrEvictingPolicy) || !strings.Contains(err.Error(), "volatile-lru") {
				t.Fatalf("got %v, want ErrEvictingPolicy naming volatile-lru (from INFO memory)", err)
			}
		})
	}
	// A user the ACL denies both (as some managed services do).
	neither := redisserver.MustStartServer(redisserver.WithArgs("--maxmemory-policy", "volatile-lru"))
	t.Cleanup(neither.Stop)
	if _, err := neither.Do("ACL", "SETUSER", "app", "on", ">pw", "~*", "+@all", "-config", "-info"); err != nil {
		t.Fatal(err)
	}
	for name, open := range openers(neither.Addr(), "app", "pw") {
		t.Run("neither/"+name, func(t *testing.T) {
			var log logBuf
			s, done, err := open(redisstore.Options{Logger: log.logger()})
			defer done()
			if err != nil {
				t.Fatalf("got %v, want a store (and a WARN)", err)
			}
			if st := s.PolicyStats(); !st.Unknown || st.UnknownChecks != 1 {
				t.Errorf("PolicyStats %+v: want Unknown", st)
			}
			if l := log.String(); !strings.Contains(l, "level=WARN") || !strings.Contains(l, "could not read maxmemory-policy") {
				t.Errorf("logged %q, want a WARN that the policy could not be read", l)
			}
		})
	}
}

// TestPolicyCluster: on Redis Cluster every primary is checked.
func TestPolicyCluster(t *testing.T) {
	c := redisserver.MustStartCluster(3, 0)
	t.Cleanup(c.Stop)
	victim := c.Nodes()[2]
	if _, err := victim.Do("CONFIG", "SET", "maxmemory-policy", "volatile-lru"); err != nil {
		t.Fatal(err)
	}
	gc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs()})
	defer gc.Close()
	if _, err := redisstore.New(gc, redisstore.Options{}); !errors.Is(err, redisstore.ErrEvictingPolicy) || !strings.Contains(err.Error(), victim.Addr()) {
		t.Errorf("go-redis cluster: got %v, want ErrEvictingPolicy naming %s", err, victim.Addr())
	}
	rc, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: c.Addrs(), DisableCache: true})
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	if _, err := redisstore.NewRueidis(rc, redisstore.Options{}); !errors.Is(err, redisstore.ErrEvictingPolicy) || !strings.Contains(err.Error(), victim.Addr()) {
		t.Errorf("rueidis cluster: got %v, want ErrEvictingPolicy naming %s", err, victim.Addr())
	}
	if _, err := redisstore.Open("redis://"+c.Addrs()[0]+"?addr="+c.Addrs()[1], redisstore.Options{}); !errors.Is(err, redisstore.ErrEvictingPolicy) {
		t.Errorf("Open cluster: got %v, want ErrEvictingPolicy", err)
	}
	if s, err := redisstore.New(gc, redisstore.Options{AllowEviction: true, Logger: slog.New(slog.DiscardHandler)}); err != nil || !s.PolicyStats().Evicting {
		t.Errorf("go-redis cluster with AllowEviction: %v", err)
	}
}

// TestPolicyRecheck: a policy changed after the store opened (CONFIG SET
// here; a failover in TestPolicyFailover) is noticed by the next checks:
// a WARN and PolicyStats.
func TestPolicyRecheck(t *testing.T) {
	srv := redisserver.MustStartServer()
	t.Cleanup(srv.Stop)
	for name, open := range openers(srv.Addr()) {
		t.Run(name, func(t *testing.T) {
			if _, err := srv.Do("CONFIG", "SET", "maxmemory-policy", "noeviction"); err != nil {
				t.Fatal(err)
			}
			var log logBuf
			s, done, err := open(redisstore.Options{PolicyRecheck: time.Millisecond, Logger: log.logger()})
			defer done()
			if err != nil {
				t.Fatal(err)
			}
			if _, err := srv.Do("CONFIG", "SET", "maxmemory-policy", "allkeys-lru"); err != nil {
				t.Fatal(err)
			}
			waitEvicting(t, s)
			// The check counts before it logs: give the WARN a moment.
			warned := func() bool {
				l := log.String()
				return strings.Contains(l, "level=WARN") && strings.Contains(l, "allkeys-lru")
			}
			for deadline := time.Now().Add(5 * time.Second); !warned() && time.Now().Before(deadline); {
				time.Sleep(5 * time.Millisecond)
			}
			if !warned() {
				t.Errorf("logged %q, want a WARN naming allkeys-lru", log.String())
			}
		})
	}
}

// waitEvicting makes store calls until a recheck finds the evicting
// policy (each call may start one), for at most 10s.
func waitEvicting(t *testing.T, s *redisstore.Store) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		s.Get(context.Background(), idem.Key{})
		if st := s.PolicyStats(); st.Evicting {
			if st.EvictingChecks == 0 || st.Checks < 2 {
				t.Errorf("PolicyStats %+v: want the recheck counted", st)
			}
			return
		}
	}
	t.Fatalf("no recheck found the evicting policy: PolicyStats %+v", s.PolicyStats())
}

// TestPolicyFailover: behind Sentinel, a failover to a replica whose
// policy evicts is noticed after the store opened on the primary.
func TestPolicyFailover(t *testing.T) {
	if testing.Short() {
		t.Skip("a Sentinel failover takes seconds")
	}
	set, err := redisserver.StartSentinelSet()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(set.Stop)
	var log logBuf
	s, err := redisstore.Open(set.URL(), redisstore.Options{PolicyRecheck: time.Millisecond, Logger: log.logger()})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := setReplicaPolicy(set, "volatile-lru"); err != nil {
		t.Fatal(err)
	}
	if st := s.PolicyStats(); st.Evicting {
		t.Fatalf("evicting before the failover: %+v", st)
	}
	// The id reaches the replica like any write (asynchronously): wait
	// for it, as the records' WaitReplicas would.
	pc := redis.NewClient(&redis.Options{Addr: set.MasterAddr()})
	if n, err := pc.Do(context.Background(), "WAIT", 1, 5000).Int(); err != nil || n != 1 {
		t.Fatalf("WAIT 1: %d %v", n, err)
	}
	pc.Close()
	if err := set.Failover(true); err != nil {
		t.Fatal(err)
	}
	waitEvicting(t, s)
	if l := log.String(); !strings.Contains(l, "volatile-lru") {
		t.Errorf("logged %q, want a WARN naming volatile-lru", l)
	}
	// The store id came over with the records: a store opened on the new
	// primary has the same Namespace, so its sweeps judge the same blobs.
	after, err := redisstore.Open(set.URL(), redisstore.Options{AllowEviction: true, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	defer after.Close()
	if after.Namespace() != s.Namespace() {
		t.Errorf("Namespace after the failover %q, before %q", after.Namespace(), s.Namespace())
	}
}

// setReplicaPolicy sets the policy of the Sentinel set's replica.
func setReplicaPolicy(set *redisserver.SentinelSet, policy string) error {
	c := redis.NewClient(&redis.Options{Addr: set.MasterAddr()})
	defer c.Close()
	info, err := c.Info(context.Background(), "replication").Result()
	if err != nil {
		return err
	}
	ip, _ := redisserver.InfoField(info, "slave0")
	// slave0:ip=127.0.0.1,port=NNNN,state=online,...
	var addr string
	for _, f := range strings.Split(ip, ",") {
		if v, ok := strings.CutPrefix(f, "port="); ok {
			addr = "127.0.0.1:" + v
		}
	}
	if addr == "" {
		return errors.New("no replica in INFO replication: " + info)
	}
	r := redis.NewClient(&redis.Options{Addr: addr})
	defer r.Close()
	return r.ConfigSet(context.Background(), "maxmemory-policy", policy).Err()
}

// TestEvictionRunsRetryAgain shows why an evicting policy is refused:
// with eviction allowed and maxmemory small, a flood of other keys evicts
// a victim's completed record, and its retry is granted a new lease (its
// work runs a second time) instead of the replay.
func TestEvictionRunsRetryAgain(t *testing.T) {
	srv := redisserver.MustStartServer(redisserver.WithArgs("--maxmemory", "4mb", "--maxmemory-policy", "volatile-lru"))
	t.Cleanup(srv.Stop)
	s, err := redisstore.Open("redis://"+srv.Addr()+"?allow_eviction=1", redisstore.Options{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := context.Background()
	claim := func(k idem.Key) idem.Acquisition {
		t.Helper()
		a, err := s.Acquire(ctx, idem.AcquireRequest{Key: k, LeaseID: idem.NewLeaseID(), TTL: time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		return a
	}
	body := bytes.Repeat([]byte("x"), 1024)
	run := func(k idem.Key) {
		t.Helper()
		a := claim(k)
		if a.Outcome != idem.Acquired {
			t.Fatalf("key %v: %v, want Acquired", k, a.Outcome)
		}
		if err := s.Complete(ctx, a.Lease, &idem.Response{Status: 201, Body: body}, 24*time.Hour); err != nil {
			t.Fatal(err)
		}
	}
	victim := scope(-1)
	run(victim)
	if a := claim(victim); a.Outcome != idem.Replay {
		t.Fatalf("victim's retry before the flood: %v, want Replay", a.Outcome)
	}
	// The flood: other keys, each with 1 KiB of random body (which no
	// compression shrinks), until Redis has evicted the victim's record
	// (approximated LRU takes a few MiB past maxmemory).
	flood := 0
	for ; flood < 100000; flood++ {
		rand.Read(body)
		run(scope(flood))
		if flood%500 == 0 {
			if n, _ := srv.Do("EXISTS", s.KeyName(victim)); n == "0" {
				break
			}
		}
	}
	info, _ := srv.Do("INFO", "stats")
	evicted, _ := redisserver.InfoField(info, "evicted_keys")
	t.Logf("a flood of %d keys evicted %s records, the victim's among them", flood, evicted)
	if a := claim(victim); a.Outcome != idem.Acquired {
		t.Fatalf("victim's retry after the flood: %v; want Acquired (the record evicted, the work run again)", a.Outcome)
	}
}
