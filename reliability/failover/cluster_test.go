package failover

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redisserver"
	"github.com/idemkit/idem/internal/reltest"
	"github.com/idemkit/idem/redisstore"
)

// One private cluster, 3 primaries with a replica each, for the package,
// started by the first test that needs it.
var (
	clusterOnce sync.Once
	clus        *redisserver.Cluster
	clusErr     error
)

func sharedCluster(t *testing.T) *redisserver.Cluster {
	clusterOnce.Do(func() { clus, clusErr = redisserver.StartCluster(3, 1) })
	if clusErr != nil {
		t.Fatal(clusErr)
	}
	return clus
}

func stopCluster() {
	if clus != nil {
		clus.Stop()
	}
}

// storeClient opens a Store on one client library.
type storeClient struct {
	name string
	open func(t *testing.T, opts redisstore.Options) *redisstore.Store
}

func clusterClients(c *redisserver.Cluster) []storeClient {
	addrs := c.Addrs()
	return []storeClient{
		{"go-redis", func(t *testing.T, opts redisstore.Options) *redisstore.Store {
			rc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs})
			t.Cleanup(func() { rc.Close() })
			s, err := redisstore.New(rc, opts)
			if err != nil {
				t.Fatal(err)
			}
			return s
		}},
		{"rueidis", func(t *testing.T, opts redisstore.Options) *redisstore.Store {
			s, err := redisstore.Open("redis://"+addrs[0]+"?addr="+strings.Join(addrs[1:], "&addr="), opts)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { s.Close() })
			return s
		}},
	}
}

// node is one line of CLUSTER NODES.
type node = redisserver.ClusterNode

// topology reads CLUSTER NODES from the first node that answers.
func topology(t *testing.T, c *redisserver.Cluster) []node {
	t.Helper()
	nodes, err := c.Topology()
	if err != nil {
		t.Fatal(err)
	}
	return nodes
}

func primaries(nodes []node) []node {
	return slices.DeleteFunc(slices.Clone(nodes), func(n node) bool { return !n.Primary })
}

func serverAt(c *redisserver.Cluster, addr string) *redisserver.Server {
	for _, s := range c.Nodes() {
		if s.Addr() == addr {
			return s
		}
	}
	panic("no cluster node at " + addr)
}

// waitUntil polls ok every 50ms until it returns "" or limit passes; then
// the test fails with ok's last reason.
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

// stable reports why the cluster is not settled: every node answers, says
// cluster_state:ok, sees 3 primaries with slots and 3 replicas, none
// failing, and every replica's link is up.
func stable(c *redisserver.Cluster) string {
	for _, s := range c.Nodes() {
		info, err := s.Do("CLUSTER", "INFO")
		if err != nil {
			return err.Error()
		}
		if v, _ := redisserver.InfoField(info, "cluster_state"); v != "ok" {
			return s.Addr() + ": cluster_state " + v
		}
		out, err := s.Do("CLUSTER", "NODES")
		if err != nil {
			return err.Error()
		}
		masters, slaves := 0, 0
		for line := range strings.Lines(out) {
			f := strings.Fields(line)
			if strings.Contains(f[2], "fail") {
				return s.Addr() + " sees " + f[1] + " as " + f[2]
			}
			if strings.Contains(f[2], "master") && len(f) > 8 {
				masters++
			}
			if strings.Contains(f[2], "slave") {
				slaves++
			}
		}
		if masters != 3 || slaves != 3 {
			return fmt.Sprintf("%s sees %d primaries with slots and %d replicas", s.Addr(), masters, slaves)
		}
		repl, err := s.Do("INFO", "replication")
		if err != nil {
			return err.Error()
		}
		if role, _ := redisserver.InfoField(repl, "role"); role == "slave" {
			if link, _ := redisserver.InfoField(repl, "master_link_status"); link != "up" {
				return s.Addr() + ": replica link " + link
			}
		}
	}
	return ""
}

// clusterFailover promotes the replica of the shard-th primary with a
// manual CLUSTER FAILOVER (graceful: the primary stops writes and the
// replica catches up before it takes over) and waits until the cluster has
// settled with the roles swapped.
func clusterFailover(c *redisserver.Cluster, shard int) func(t *testing.T) {
	return func(t *testing.T) {
		nodes := topology(t, c)
		p := primaries(nodes)[shard]
		var r node
		for _, n := range nodes {
			if n.Master == p.ID {
				r = n
			}
		}
		if r.ID == "" {
			t.Fatalf("primary %s has no replica", p.Addr)
		}
		if _, err := serverAt(c, r.Addr).Do("CLUSTER", "FAILOVER"); err != nil {
			t.Fatalf("CLUSTER FAILOVER on %s: %v", r.Addr, err)
		}
		waitUntil(t, 20*time.Second, func() string {
			if role, _ := serverAt(c, r.Addr).Do("ROLE"); !strings.HasPrefix(role, "master") {
				return r.Addr + " not promoted"
			}
			if role, _ := serverAt(c, p.Addr).Do("ROLE"); !strings.HasPrefix(role, "slave") {
				return p.Addr + " not demoted"
			}
			return stable(c)
		})
	}
}

func TestClusterFailover(t *testing.T) {
	c := sharedCluster(t)
	waitUntil(t, 20*time.Second, func() string { return stable(c) })
	for i, sc := range clusterClients(c) {
		t.Run(sc.name, func(t *testing.T) {
			store := sc.open(t, redisstore.Options{Prefix: prefix("cf")})
			s := scenario{
				name:   "failover: CLUSTER FAILOVER under load",
				store:  "redis cluster (3+3), " + sc.name,
				fault:  "manual CLUSTER FAILOVER of one shard's replica",
				spec:   loadSpec{workers: 8, copies: 3, key: keyspace(nil)},
				warmup: time.Duration(reltest.Scale(400, 3000)) * time.Millisecond,
				after:  time.Duration(reltest.Scale(600, 5000)) * time.Millisecond,
			}
			r := s.run(t, store, clusterFailover(c, i%3))
			assertClusterRow(t, r)
		})
	}
}

// assertClusterRow: on Cluster, a graceful failover and MIGRATE lose
// nothing, and the clients absorb every redirection.
func assertClusterRow(t *testing.T, r result) {
	t.Helper()
	if r.lost > 0 || r.badReplay > 0 {
		t.Errorf("%d acknowledged completions lost (%d keys replayed another result)", r.lost, r.badReplay)
	}
	for _, e := range []string{"MOVED", "ASK", "TRYAGAIN"} {
		if r.errs[e] > 0 {
			t.Errorf("%d %s errors reached the client", r.errs[e], e)
		}
	}
}

// keyspace returns the load's keys: with hot keys, even indices cycle
// through them (repeated keys, in the hot slots) and odd ones are fresh;
// without, every index is a fresh key.
func keyspace(hot []idem.Key) func(int) idem.Key {
	var mu sync.Mutex
	fresh := map[int]idem.Key{}
	return func(i int) idem.Key {
		if len(hot) > 0 && i%2 == 0 {
			return hot[(i/2)%len(hot)]
		}
		mu.Lock()
		defer mu.Unlock()
		k, ok := fresh[i]
		if !ok {
			k = randomKey()
			fresh[i] = k
		}
		return k
	}
}

// crcTable drives CRC16/XMODEM, Redis Cluster's key hash.
var crcTable = func() (t [256]uint16) {
	for i := range t {
		crc := uint16(i) << 8
		for range 8 {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
		t[i] = crc
	}
	return t
}()

func crc16(crc uint16, b byte) uint16 { return crc<<8 ^ crcTable[byte(crc>>8)^b] }

// keySlot is the Cluster hash slot of k's record: CRC16 of its hash tag,
// the key's base64url form.
func keySlot(k idem.Key) int {
	var crc uint16
	for _, b := range []byte(k.String()) {
		crc = crc16(crc, b)
	}
	return int(crc % 16384)
}

// hotKeys returns n keys whose records lie in slots. Only the last byte
// of a key changes the last two characters of its base64 form, so each
// random 15-byte start is tried with all 256 last bytes at the cost of
// two CRC steps each.
func hotKeys(slots []int, n int) []idem.Key {
	var in [16384]bool
	for _, s := range slots {
		in[s] = true
	}
	const alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
	keys := make([]idem.Key, 0, n)
	for len(keys) < n {
		var k idem.Key
		for i := 0; i < 15; i++ {
			k[i] = byte(rand.Uint32())
		}
		head := k.String()[:20] // bytes 0-14
		var crc uint16
		for i := range len(head) {
			crc = crc16(crc, head[i])
		}
		for last := range 256 {
			c := crc16(crc16(crc, alphabet[last>>2]), alphabet[(last&3)<<4])
			if in[c%16384] && len(keys) < n {
				k[15] = byte(last)
				keys = append(keys, k)
			}
		}
	}
	for _, k := range keys[:min(len(keys), 10)] {
		if !in[keySlot(k)] {
			panic("hotKeys: a key outside the hot slots")
		}
	}
	return keys
}

// reshard moves slots from src to dst the way redis-cli --cluster reshard
// does: IMPORTING on the target, MIGRATING on the source, MIGRATE of the
// slot's keys a few at a time, then SETSLOT NODE on the target, the
// source and the other primaries. Traffic meanwhile gets ASK and MOVED.
func reshard(c *redisserver.Cluster, src, dst node, slots []int, stats *reshardStats) func(t *testing.T) {
	return func(t *testing.T) {
		srcS, dstS := serverAt(c, src.Addr), serverAt(c, dst.Addr)
		host, port, _ := strings.Cut(dst.Addr, ":")
		do := func(s *redisserver.Server, args ...string) string {
			out, err := s.Do(args...)
			if err != nil {
				t.Fatalf("%v on %s: %v", args, s.Addr(), err)
			}
			return out
		}
		for _, slot := range slots {
			sl := strconv.Itoa(slot)
			do(dstS, "CLUSTER", "SETSLOT", sl, "IMPORTING", src.ID)
			do(srcS, "CLUSTER", "SETSLOT", sl, "MIGRATING", dst.ID)
			for {
				out := do(srcS, "CLUSTER", "GETKEYSINSLOT", sl, "5")
				if out == "" {
					break
				}
				keys := strings.Split(out, "\n")
				stats.keys += len(keys)
				do(srcS, append([]string{"MIGRATE", host, port, "", "0", "5000", "KEYS"}, keys...)...)
				time.Sleep(time.Millisecond) // let traffic meet a half-moved slot
			}
			do(dstS, "CLUSTER", "SETSLOT", sl, "NODE", dst.ID)
			do(srcS, "CLUSTER", "SETSLOT", sl, "NODE", dst.ID)
			for _, p := range primaries(topology(t, c)) {
				if p.ID != src.ID && p.ID != dst.ID {
					do(serverAt(c, p.Addr), "CLUSTER", "SETSLOT", sl, "NODE", dst.ID)
				}
			}
			stats.slots++
		}
		waitUntil(t, 20*time.Second, func() string {
			for _, n := range primaries(topology(t, c)) {
				for _, s := range slots {
					if n.Owns(s) && n.ID != dst.ID {
						return fmt.Sprintf("slot %d still at %s", s, n.Addr)
					}
				}
			}
			return stable(c)
		})
	}
}

type reshardStats struct{ slots, keys int }

func TestClusterReshard(t *testing.T) {
	c := sharedCluster(t)
	waitUntil(t, 20*time.Second, func() string { return stable(c) })
	for i, sc := range clusterClients(c) {
		t.Run(sc.name, func(t *testing.T) {
			ps := primaries(topology(t, c))
			src, dst := ps[i%3], ps[(i+1)%3]
			// Hot slots: spread over the source's slots.
			var own []int
			for _, r := range src.Slots {
				for s := r[0]; s <= r[1]; s++ {
					own = append(own, s)
				}
			}
			nslots := reltest.Scale(16, 64)
			slots := make([]int, nslots)
			for j := range slots {
				slots[j] = own[j*len(own)/nslots]
			}
			hot := hotKeys(slots, reltest.Scale(1500, 8000))
			store := sc.open(t, redisstore.Options{Prefix: prefix("rs")})
			var st reshardStats
			s := scenario{
				name:   "failover: resharding hot slots under load",
				store:  "redis cluster (3+3), " + sc.name,
				fault:  fmt.Sprintf("%d hot slots moved (SETSLOT IMPORTING/MIGRATING, MIGRATE, SETSLOT NODE)", nslots),
				spec:   loadSpec{workers: 8, copies: 2, key: keyspace(hot)},
				warmup: time.Duration(reltest.Scale(300, 3000)) * time.Millisecond,
				after:  time.Duration(reltest.Scale(400, 3000)) * time.Millisecond,
				notes:  fmt.Sprintf("half the sends on %d keys in the moving slots", len(hot)),
			}
			r := s.run(t, store, reshard(c, src, dst, slots, &st))
			t.Logf("moved %d slots, %d keys", st.slots, st.keys)
			if st.keys == 0 {
				t.Error("no keys were migrated: the load did not reach the hot slots")
			}
			assertClusterRow(t, r)
		})
	}
}
