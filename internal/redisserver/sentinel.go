package redisserver

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/internal/childproc"
)

// SentinelMasterName is the name under which the sentinels of a
// SentinelSet monitor its primary (SENTINEL GET-MASTER-ADDR-BY-NAME,
// go-redis FailoverOptions.MasterName, rueidis's master_set).
const SentinelMasterName = "mymaster"

const (
	// sentinelCount is how many sentinels a SentinelSet runs.
	sentinelCount = 3
	// sentinelQuorum is how many sentinels must agree the primary is down.
	sentinelQuorum = 2
	// sentinelDownAfterMs is the sentinels' down-after-milliseconds.
	sentinelDownAfterMs = 5000
	// sentinelFailoverTimeoutMs is the sentinels' failover-timeout.
	sentinelFailoverTimeoutMs = 10000
	// sentinelStartAttempts is how many fresh ports a sentinel is tried on.
	sentinelStartAttempts = 3
	// sentinelStartTimeout bounds the wait for one sentinel to answer PING.
	sentinelStartTimeout = 5 * time.Second
	// sentinelReadyTimeout bounds the wait for the replica to be in sync
	// and known to every sentinel.
	sentinelReadyTimeout = 15 * time.Second
	// failoverAcceptTimeout bounds the retries of SENTINEL FAILOVER.
	failoverAcceptTimeout = 10 * time.Second
	// failoverPromoteTimeout bounds the wait for every sentinel to name
	// the promoted replica.
	failoverPromoteTimeout = 20 * time.Second
	// failoverDemoteTimeout bounds the wait for the old primary to
	// replicate from the new one.
	failoverDemoteTimeout = 30 * time.Second
	// pollInterval is how often the Sentinel waits poll.
	pollInterval = 50 * time.Millisecond
)

// SentinelSet is a private Sentinel deployment on 127.0.0.1: a primary,
// one replica of it and three sentinels that monitor it as
// SentinelMasterName (quorum 2, down-after-milliseconds 5000,
// failover-timeout 10000). Its methods are safe for concurrent use, but
// only one Failover may run at a time.
type SentinelSet struct {
	sentinels []*sentinel

	mu               sync.Mutex
	primary, replica *Server // the current roles, as of the last Failover
	stopped          bool
}

// sentinel is one redis-server --sentinel process.
type sentinel struct {
	port int
	dir  string // holds sentinel.conf (rewritten by the sentinel) and the log
	proc *process
}

// StartSentinelSet starts a primary and a replica (StartServer, the
// replica with --replicaof), then three sentinels, one after the other,
// each on a free port with its own temporary directory and config file
// (a sentinel that does not answer PING within 5s is retried on another
// port, three times at most). It returns once the replica reports
// master_link_status:up and every sentinel lists it as a healthy replica
// (flags "slave", master-link-status "ok"), waiting at most 15s. On error
// everything started is stopped.
func StartSentinelSet(opts ...Option) (*SentinelSet, error) {
	var cfg config
	for _, opt := range opts {
		opt(&cfg)
	}
	bin, err := cfg.binary()
	if err != nil {
		return nil, err
	}
	s := &SentinelSet{}
	if s.primary, err = StartServer(opts...); err != nil {
		return nil, err
	}
	if s.replica, err = StartServer(append(slices.Clone(opts), WithArgs("--replicaof", "127.0.0.1", strconv.Itoa(s.primary.Port())))...); err != nil {
		s.Stop()
		return nil, err
	}
	for range sentinelCount {
		sn, err := startSentinel(bin, s.primary.Port())
		if err != nil {
			s.Stop()
			return nil, err
		}
		s.sentinels = append(s.sentinels, sn)
	}
	if err := waitFor(sentinelReadyTimeout, s.notReady); err != nil {
		s.Stop()
		return nil, fmt.Errorf("redisserver: sentinel set not ready: %w", err)
	}
	return s, nil
}

// notReady returns why the set is not ready yet, or "" if it is: the
// replica is in sync and every sentinel knows it as a healthy replica.
func (s *SentinelSet) notReady() string {
	info, err := s.replica.Do("INFO", "replication")
	if link, _ := InfoField(info, "master_link_status"); err != nil || link != "up" {
		return "replica not in sync"
	}
	for _, addr := range s.SentinelAddrs() {
		sc := redis.NewSentinelClient(&redis.Options{Addr: addr})
		reps, err := sc.Replicas(context.Background(), SentinelMasterName).Result()
		sc.Close()
		if err != nil || len(reps) != 1 || reps[0]["flags"] != "slave" || reps[0]["master-link-status"] != "ok" {
			return fmt.Sprintf("sentinel %s: replicas %v, %v", addr, reps, err)
		}
	}
	return ""
}

// startSentinel starts redis-server --sentinel monitoring the primary on
// primaryPort, and waits until it answers PING.
func startSentinel(bin string, primaryPort int) (*sentinel, error) {
	dir, err := os.MkdirTemp("", "redisserver-sentinel-")
	if err != nil {
		return nil, fmt.Errorf("redisserver: %w", err)
	}
	s := &sentinel{dir: dir}
	logPath := filepath.Join(dir, "sentinel.log")
	for attempt := 1; ; attempt++ {
		if s.port, _, err = reservePorts(false); err != nil {
			break
		}
		if err = s.launch(bin, primaryPort, logPath); err == nil {
			return s, nil
		}
		releasePorts(s.port, 0)
		if attempt == sentinelStartAttempts {
			log, _ := os.ReadFile(logPath)
			err = fmt.Errorf("%w\n--- sentinel log ---\n%s", err, log)
			break
		}
	}
	_ = os.RemoveAll(dir)
	return nil, err
}

// launch writes the config for s.port and starts the sentinel; on failure
// the process is killed.
func (s *sentinel) launch(bin string, primaryPort int, logPath string) error {
	conf := filepath.Join(s.dir, "sentinel.conf")
	text := fmt.Sprintf(`port %d
bind 127.0.0.1
daemonize no
dir %s
logfile %s
sentinel monitor %s 127.0.0.1 %d %d
sentinel down-after-milliseconds %s %d
sentinel failover-timeout %s %d
`, s.port, s.dir, logPath, SentinelMasterName, primaryPort, sentinelQuorum,
		SentinelMasterName, sentinelDownAfterMs, SentinelMasterName, sentinelFailoverTimeoutMs)
	if err := os.WriteFile(conf, []byte(text), 0o644); err != nil {
		return fmt.Errorf("redisserver: %w", err)
	}
	cmd := exec.Command(bin, conf, "--sentinel")
	cmd.Dir = s.dir
	cmd.SysProcAttr = childproc.SysProcAttr()
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("redisserver: starting redis-server --sentinel: %w", err)
	}
	p := &process{cmd: cmd, done: make(chan struct{})}
	go func() {
		_ = cmd.Wait()
		close(p.done)
	}()
	// PING through go-redis, as the suites this came from did: its
	// retries (with backoff) on a refused connection space the sentinels'
	// starts some 100ms apart. A bare PING starts them closer together,
	// and that alone made the forced failover of reliability/failover
	// some 0.7s faster (usually 0.9s instead of 1.6s), changing the
	// window those suites measure.
	sc := redis.NewSentinelClient(&redis.Options{Addr: s.addr(), DialTimeout: 200 * time.Millisecond})
	defer sc.Close()
	for deadline := time.Now().Add(sentinelStartTimeout); ; {
		if sc.Ping(context.Background()).Err() == nil {
			s.proc = p
			return nil
		}
		if p.exited() || time.Now().After(deadline) {
			p.kill()
			return fmt.Errorf("redisserver: sentinel on %s did not start", s.addr())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// addr returns the sentinel's address.
func (s *sentinel) addr() string { return loopback(s.port) }

// stop kills the sentinel, releases its port and removes its directory.
func (s *sentinel) stop() {
	if s.proc != nil {
		s.proc.kill()
		s.proc = nil
	}
	releasePorts(s.port, 0)
	_ = os.RemoveAll(s.dir)
}

// SentinelAddrs returns the addresses of the three sentinels.
func (s *SentinelSet) SentinelAddrs() []string {
	addrs := make([]string, len(s.sentinels))
	for i, sn := range s.sentinels {
		addrs[i] = sn.addr()
	}
	return addrs
}

// MasterAddr returns the address of the primary: at start the first
// server, after a Failover the replica it promoted.
func (s *SentinelSet) MasterAddr() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.primary.Addr()
}

// URL returns the Sentinel URL that redisstore.Open (rueidis.ParseURL)
// takes: "redis://SENTINEL1?master_set=mymaster&addr=SENTINEL2&addr=SENTINEL3".
func (s *SentinelSet) URL() string {
	addrs := s.SentinelAddrs()
	return "redis://" + addrs[0] + "?master_set=" + SentinelMasterName + "&addr=" + strings.Join(addrs[1:], "&addr=")
}

// Failover forces a failover with SENTINEL FAILOVER on the first sentinel
// (retried for up to 10s while the sentinel refuses it) and waits, at most
// 20s, until every sentinel names the replica as the primary and it
// reports role master. The sentinels turn the old primary into a replica
// of the new one only some 8s later, once they see it still reporting
// itself as primary: with demoteOld, Failover does that itself at once
// (REPLICAOF); without, it leaves it to them. Either way it then waits, at
// most 30s, until the old primary replicates from the new one, and
// returns; from then on the two servers have swapped roles, so Failover
// may be called again.
func (s *SentinelSet) Failover(demoteOld bool) error {
	s.mu.Lock()
	old, next := s.primary, s.replica
	s.mu.Unlock()
	ctx := context.Background()
	sc := redis.NewSentinelClient(&redis.Options{Addr: s.sentinels[0].addr()})
	defer sc.Close()
	err := waitFor(failoverAcceptTimeout, func() string {
		if err := sc.Failover(ctx, SentinelMasterName).Err(); err != nil {
			return "SENTINEL FAILOVER: " + err.Error()
		}
		return ""
	})
	if err != nil {
		return err
	}
	err = waitFor(failoverPromoteTimeout, func() string {
		for _, addr := range s.SentinelAddrs() {
			c := redis.NewSentinelClient(&redis.Options{Addr: addr})
			got, err := c.GetMasterAddrByName(ctx, SentinelMasterName).Result()
			c.Close()
			if err != nil || strings.Join(got, ":") != next.Addr() {
				return fmt.Sprintf("sentinel %s names %v (%v), want %s", addr, got, err, next.Addr())
			}
		}
		if role, _ := next.Do("ROLE"); !strings.HasPrefix(role, "master") {
			return "replica not promoted"
		}
		return ""
	})
	if err != nil {
		return err
	}
	s.mu.Lock()
	s.primary, s.replica = next, old
	s.mu.Unlock()
	if demoteOld {
		if _, err := old.Do("REPLICAOF", "127.0.0.1", strconv.Itoa(next.Port())); err != nil {
			return fmt.Errorf("redisserver: REPLICAOF on the old primary: %w", err)
		}
	}
	return waitFor(failoverDemoteTimeout, func() string {
		info, _ := old.Do("INFO", "replication")
		if link, _ := InfoField(info, "master_link_status"); link != "up" {
			return "old primary does not replicate from the new one yet"
		}
		return ""
	})
}

// Stop kills the sentinels (SIGKILL), then stops both servers (see
// Server.Stop), and removes every temporary directory. It is safe to call
// more than once.
func (s *SentinelSet) Stop() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stopped {
		return
	}
	s.stopped = true
	for _, sn := range s.sentinels {
		sn.stop()
	}
	for _, srv := range []*Server{s.replica, s.primary} {
		if srv != nil {
			srv.Stop()
		}
	}
}

// waitFor polls cond every 50ms until it returns "" or limit passes; the
// error carries cond's last answer.
func waitFor(limit time.Duration, cond func() string) error {
	deadline := time.Now().Add(limit)
	for {
		why := cond()
		if why == "" {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("redisserver: after %v: %s", limit, why)
		}
		time.Sleep(pollInterval)
	}
}
