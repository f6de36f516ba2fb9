package redisstore_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redisserver"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/idemkit/idem/redisstore"
)

// startPair starts a private primary and a replica of it, and waits
// (bounded) until the replica is in sync.
func startPair(t *testing.T) (primary, replica *redisserver.Server) {
	t.Helper()
	primary, err := redisserver.StartServer()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(primary.Stop)
	replica, err = redisserver.StartServer(redisserver.WithArgs("--replicaof", "127.0.0.1", strconv.Itoa(primary.Port())))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(replica.Stop)
	waitFor(t, 10*time.Second, "replica in sync", func() bool {
		info, err := replica.Do("INFO", "replication")
		link, _ := redisserver.InfoField(info, "master_link_status")
		return err == nil && link == "up"
	})
	return primary, replica
}

func waitFor(t *testing.T, limit time.Duration, what string, ok func() bool) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for !ok() {
		if time.Now().After(deadline) {
			t.Fatalf("no %s after %v", what, limit)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// acquire takes key with a fresh lease, or fails the test.
func acquire(t *testing.T, s *redisstore.Store, key idem.Key) idem.Lease {
	t.Helper()
	acq, err := s.Acquire(context.Background(), idem.AcquireRequest{Key: key, LeaseID: idem.NewLeaseID(), TTL: 10 * time.Second})
	if err != nil || acq.Outcome != idem.Acquired {
		t.Fatalf("acquire %v: %v, %v", key, acq.Outcome, err)
	}
	return acq.Lease
}

// TestWaitReplicas: with WaitReplicas=1 a completion is on the replica when
// Complete returns; with the replica down, Complete says so within
// WaitTimeout and the record stays on the primary.
func TestWaitReplicas(t *testing.T) {
	primary, replica := startPair(t)
	const waitTimeout = 500 * time.Millisecond
	opts := redisstore.Options{WaitReplicas: 1, WaitTimeout: waitTimeout}
	stores := map[string]*redisstore.Store{
		"go-redis": goredisClient(t, redis.NewClient(&redis.Options{Addr: primary.Addr()}), "pair").store(t, opts),
		"rueidis":  rueidisClient(t, []string{primary.Addr()}, "pair").store(t, opts),
	}
	ctx := context.Background()
	resp := &idem.Response{Status: 201, Body: []byte("charged")}

	i := 0
	for name, s := range stores {
		i++
		key := scope(i)
		l := acquire(t, s, key)
		if err := s.Complete(ctx, l, resp, time.Minute); err != nil {
			t.Fatalf("%s: complete with a live replica: %v", name, err)
		}
		// No polling: WAIT returned, so the replica has applied it.
		v, err := replica.Do("GET", s.KeyName(key))
		if err != nil || !strings.HasPrefix(v, "C") {
			t.Fatalf("%s: the replica's value right after Complete: %q, %v; want a completed record", name, v, err)
		}
		// A repeat (as after a lost reply) writes again, so its WAIT
		// covers the record too, and succeeds.
		if err := s.Complete(ctx, l, resp, time.Minute); err != nil {
			t.Fatalf("%s: repeated complete: %v", name, err)
		}
		// Asking for more replicas than there are: the error names both.
		s2 := must(redisstore.New(redis.NewClient(&redis.Options{Addr: primary.Addr()}), redisstore.Options{WaitReplicas: 2, WaitTimeout: 100 * time.Millisecond}))
		l2 := acquire(t, s2, scope(100+i))
		err = s2.Complete(ctx, l2, resp, time.Minute)
		var re *redisstore.ReplicationError
		if !errors.As(err, &re) || re.Want != 2 || re.Acked != 1 {
			t.Fatalf("%s: complete asking for 2 replicas of 1: %v", name, err)
		}
	}

	replica.Kill()
	for name, s := range stores {
		i++
		key := scope(i)
		l := acquire(t, s, key)
		start := time.Now()
		err := s.Complete(ctx, l, resp, time.Minute)
		took := time.Since(start)
		var se *idem.StoreError
		var re *redisstore.ReplicationError
		if !errors.Is(err, redisstore.ErrNotReplicated) || !errors.As(err, &se) || se.Op != "complete" ||
			!errors.As(err, &re) || re.Acked != 0 || re.Want != 1 || re.Timeout != waitTimeout {
			t.Fatalf("%s: complete with the replica down: %v; want a StoreError matching ErrNotReplicated, 0 of 1", name, err)
		}
		if took < waitTimeout-50*time.Millisecond || took > waitTimeout+time.Second {
			t.Errorf("%s: complete took %v; want about WaitTimeout (%v)", name, took, waitTimeout)
		}
		t.Logf("%s: %v after %v", name, err, took)
		// WAIT rolls nothing back: the record is completed on the primary,
		// and repeats are replayed from it.
		rec, ok, err := s.Get(ctx, key)
		if err != nil || !ok || rec.State != idem.StateCompleted || string(rec.Response.Body) != "charged" {
			t.Fatalf("%s: record after the failed wait: %+v, %v, %v", name, rec, ok, err)
		}
		acq, err := s.Acquire(ctx, idem.AcquireRequest{Key: key, LeaseID: idem.NewLeaseID(), TTL: time.Second})
		if err != nil || acq.Outcome != idem.Replay {
			t.Fatalf("%s: acquire after the failed wait: %v, %v; want replay", name, acq.Outcome, err)
		}
		// A lost lease is still ErrLeaseLost, not a replication error.
		if err := s.Complete(ctx, idem.Lease{Key: scope(999), ID: idem.NewLeaseID(), Token: 1}, resp, time.Minute); !errors.Is(err, idem.ErrLeaseLost) {
			t.Fatalf("%s: complete without a lease: %v; want ErrLeaseLost", name, err)
		}
	}
}

// TestWaitGuard shows what a caller of Guard.Do sees when the replicas do
// not acknowledge: the response with the error; the key is completed.
func TestWaitGuard(t *testing.T) {
	primary, replica := startPair(t)
	s := must(redisstore.New(redis.NewClient(&redis.Options{Addr: primary.Addr()}), redisstore.Options{WaitReplicas: 1, WaitTimeout: 200 * time.Millisecond}))
	g := must(idem.New(s, idem.Config{}))
	replica.Kill()
	ran := 0
	work := func(context.Context) (*idem.Response, error) { ran++; return &idem.Response{Status: 200}, nil }
	res, err := g.Do(context.Background(), scope(1), idem.Fingerprint{}, work)
	if !errors.Is(err, redisstore.ErrNotReplicated) || res.Response == nil || res.Response.Status != 200 {
		t.Fatalf("Do: %+v, %v; want the response and ErrNotReplicated", res, err)
	}
	res, err = g.Do(context.Background(), scope(1), idem.Fingerprint{}, work)
	if err != nil || !res.Replayed || ran != 1 {
		t.Fatalf("second Do: %+v, %v, ran %d; want a replay, one run", res, err, ran)
	}
}

// TestWaitCluster: on Redis Cluster every completion is on the replica of
// the key's primary when Complete returns, with both clients, also when
// the key's slot moves under a client that has not noticed (MOVED) and
// while it is migrating (ASK).
func TestWaitCluster(t *testing.T) {
	ctx := context.Background()
	for _, c := range clients(t)[2:] {
		t.Run(c.name, func(t *testing.T) {
			s := c.store(t, redisstore.Options{WaitReplicas: 1, WaitTimeout: time.Second, Prefix: redistest.Prefix("wait")})
			resp := &idem.Response{Status: 200, Body: []byte("ok")}
			for i := range 30 {
				key := scope(i)
				if err := s.Complete(ctx, acquire(t, s, key), resp, time.Minute); err != nil {
					t.Fatalf("complete %d: %v", i, err)
				}
				if !onReplica(t, s.KeyName(key)) {
					t.Fatalf("complete %d returned before a replica had the record", i)
				}
			}

			// ASK: the key's slot is migrating and the key has moved.
			key := scope(1000)
			key2 := scope(2000)
			for i := 2001; keySlot(s.KeyName(key2)) != keySlot(s.KeyName(key)); i++ { // a key in the same slot
				key2 = scope(i)
			}
			l, l2 := acquire(t, s, key), acquire(t, s, key2)
			mv := startMove(t, s.KeyName(key))
			mv.migrateKeys(t)
			if err := s.Complete(ctx, l, resp, time.Minute); err != nil {
				t.Fatalf("complete during migration (ASK): %v", err)
			}
			// MOVED: the slot now belongs to the target; the client's map
			// still says the source.
			mv.finish(t)
			// (A replica answers for the slots its primary owns: this
			// check has to wait for the end of the move, and for the
			// replica to hear of it: it answers MOVED until then.)
			for deadline := time.Now().Add(10 * time.Second); !onReplicaOf(t, mv.dst, s.KeyName(key)); {
				if time.Now().After(deadline) {
					t.Fatal("the record completed during the migration is not on the target's replica after 10s")
				}
				time.Sleep(50 * time.Millisecond)
			}
			if err := s.Complete(ctx, l2, resp, time.Minute); err != nil {
				t.Fatalf("complete after the slot moved (MOVED): %v", err)
			}
			if !onReplicaOf(t, mv.dst, s.KeyName(key2)) {
				t.Fatal("complete after the move returned before the target's replica had the record")
			}
		})
	}
}

func TestWaitOptions(t *testing.T) {
	c := redis.NewClient(&redis.Options{Addr: single.Addr(), ReadTimeout: time.Second})
	defer c.Close()
	bad := map[string]redisstore.Options{
		"negative":             {WaitReplicas: -1},
		"sub-millisecond":      {WaitReplicas: 1, WaitTimeout: time.Microsecond},
		"over Timeout":         {WaitReplicas: 1, WaitTimeout: 2 * time.Second, Timeout: time.Second},
		"over ReadTimeout":     {WaitReplicas: 1, WaitTimeout: time.Second, Timeout: 5 * time.Second},
		"default over Timeout": {WaitReplicas: 1, Timeout: 500 * time.Millisecond},
	}
	for name, o := range bad {
		if _, err := redisstore.New(c, o); err == nil {
			t.Errorf("%s: New accepted %+v", name, o)
		}
	}
	ring := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": single.Addr()}})
	defer ring.Close()
	if _, err := redisstore.New(ring, redisstore.Options{WaitReplicas: 1}); err == nil {
		t.Error("New accepted a Ring with WaitReplicas")
	}
	if _, err := redisstore.New(ring, redisstore.Options{}); err != nil {
		t.Errorf("New refused a Ring without WaitReplicas: %v", err)
	}
	if _, err := redisstore.New(c, redisstore.Options{WaitReplicas: 1, WaitTimeout: 500 * time.Millisecond}); err != nil {
		t.Errorf("New refused good WAIT options: %v", err)
	}
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

func clusterNodes(t *testing.T) []redisserver.ClusterNode {
	t.Helper()
	nodes, err := cluster.Topology()
	if err != nil {
		t.Fatal(err)
	}
	return nodes
}

func slotOf(t *testing.T, key string) int {
	t.Helper()
	v, err := cluster.Nodes()[0].Do("CLUSTER", "KEYSLOT", key)
	if err != nil {
		t.Fatal(err)
	}
	n, _ := strconv.Atoi(v)
	return n
}

// keySlot is Redis Cluster's hash slot of a key with a hash tag.
func keySlot(key string) int {
	_, tag, _ := strings.Cut(key, "{")
	tag, _, _ = strings.Cut(tag, "}")
	var crc uint16 // CRC16/XMODEM
	for i := 0; i < len(tag); i++ {
		crc ^= uint16(tag[i]) << 8
		for range 8 {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
	}
	return int(crc % 16384)
}

func server(addr string) *redisserver.Server {
	for _, s := range cluster.Nodes() {
		if s.Addr() == addr {
			return s
		}
	}
	panic("no node " + addr)
}

// onReplica reports whether the replica of key's primary holds key.
func onReplica(t *testing.T, key string) bool {
	slot := slotOf(t, key)
	for _, n := range clusterNodes(t) {
		for _, r := range n.Slots {
			if n.Primary && r[0] <= slot && slot <= r[1] {
				return onReplicaOf(t, n, key)
			}
		}
	}
	t.Fatalf("no primary owns slot %d", slot)
	return false
}

// onReplicaOf reports whether every replica of primary holds key.
func onReplicaOf(t *testing.T, primary redisserver.ClusterNode, key string) bool {
	found := false
	for _, n := range clusterNodes(t) {
		if n.Primary || n.Master != primary.ID {
			continue
		}
		found = true
		c := redis.NewClient(&redis.Options{Addr: n.Addr, OnConnect: func(ctx context.Context, cn *redis.Conn) error {
			return cn.ReadOnly(ctx).Err()
		}})
		v, err := c.Get(context.Background(), key).Result()
		c.Close()
		if err != nil || !strings.HasPrefix(v, "C") {
			t.Logf("replica %s: %q, %v", n.Addr, v, err)
			return false
		}
	}
	return found
}

// move is one slot moving from one primary to another, step by step as
// redis-cli --cluster reshard does it.
type move struct {
	slot     int
	src, dst redisserver.ClusterNode
}

func startMove(t *testing.T, key string) *move {
	t.Helper()
	m := &move{slot: slotOf(t, key)}
	var primaries []redisserver.ClusterNode
	for _, n := range clusterNodes(t) {
		if n.Primary {
			primaries = append(primaries, n)
		}
	}
	for i, n := range primaries {
		for _, r := range n.Slots {
			if r[0] <= m.slot && m.slot <= r[1] {
				m.src, m.dst = n, primaries[(i+1)%len(primaries)]
			}
		}
	}
	if m.src.ID == "" {
		t.Fatalf("no primary owns slot %d", m.slot)
	}
	s := strconv.Itoa(m.slot)
	for _, step := range []struct {
		addr string
		args []string
	}{
		{m.dst.Addr, []string{"CLUSTER", "SETSLOT", s, "IMPORTING", m.src.ID}},
		{m.src.Addr, []string{"CLUSTER", "SETSLOT", s, "MIGRATING", m.dst.ID}},
	} {
		if _, err := server(step.addr).Do(step.args...); err != nil {
			t.Fatalf("%v on %s: %v", step.args, step.addr, err)
		}
	}
	return m
}

// migrateKeys moves every key of the slot to the target.
func (m *move) migrateKeys(t *testing.T) {
	t.Helper()
	src := server(m.src.Addr)
	for {
		keys, err := src.Do("CLUSTER", "GETKEYSINSLOT", strconv.Itoa(m.slot), "100")
		if err != nil {
			t.Fatal(err)
		}
		if keys == "" {
			return
		}
		host, port, _ := strings.Cut(m.dst.Addr, ":")
		args := append([]string{"MIGRATE", host, port, "", "0", "5000", "KEYS"}, strings.Split(keys, "\n")...)
		if _, err := src.Do(args...); err != nil {
			t.Fatal(fmt.Errorf("%v: %w", args[:6], err))
		}
	}
}

// finish gives the slot to the target, telling the target first, then
// the source, then the other primaries (as redis-cli does).
func (m *move) finish(t *testing.T) {
	t.Helper()
	m.migrateKeys(t)
	addrs := []string{m.dst.Addr, m.src.Addr}
	for _, n := range clusterNodes(t) {
		if n.Primary && n.ID != m.dst.ID && n.ID != m.src.ID {
			addrs = append(addrs, n.Addr)
		}
	}
	for _, addr := range addrs {
		if _, err := server(addr).Do("CLUSTER", "SETSLOT", strconv.Itoa(m.slot), "NODE", m.dst.ID); err != nil {
			t.Fatalf("SETSLOT NODE on %s: %v", addr, err)
		}
	}
}
