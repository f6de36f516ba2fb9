package redisserver

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/idemkit/idem/internal/childproc"
)

const (
	// clusterSlots is the number of hash slots in a Redis Cluster.
	clusterSlots = 16384
	// minPrimaries is the smallest cluster redis-cli --cluster create makes.
	minPrimaries = 3
	// clusterCreateTimeout bounds the redis-cli --cluster create run.
	clusterCreateTimeout = 60 * time.Second
	// clusterReadyTimeout bounds the wait for the cluster to converge.
	clusterReadyTimeout = 30 * time.Second
)

// Cluster is a private Redis Cluster on 127.0.0.1: N primaries, each with R
// replicas, every node a Server of its own.
type Cluster struct {
	nodes []*Server // primaries first, as roles were when the cluster was created
}

// StartCluster starts primaries*(1+replicasPerPrimary) cluster nodes
// (--cluster-enabled yes, --cluster-node-timeout 2000, each with its own
// temporary directory and a free port whose bus port, port+10000, is free
// too), joins them with redis-cli --cluster create, and waits, at most 30s,
// until every node reports cluster_state:ok, all 16384 slots assigned, all
// nodes known, cluster_size equal to primaries and, in CLUSTER NODES, the
// right number of masters and replicas with none failing, and every replica
// reports master_link_status:up. opts apply to every node. redis-cli
// --cluster create needs at least 3 primaries.
func StartCluster(primaries, replicasPerPrimary int, opts ...Option) (*Cluster, error) {
	if primaries < minPrimaries {
		return nil, fmt.Errorf("redisserver: a cluster needs at least %d primaries, got %d", minPrimaries, primaries)
	}
	if replicasPerPrimary < 0 {
		return nil, fmt.Errorf("redisserver: negative replicas per primary: %d", replicasPerPrimary)
	}
	cli, err := lookPath("redis-cli", "redis-tools")
	if err != nil {
		return nil, err
	}
	cfg := config{cluster: true}
	for _, opt := range opts {
		opt(&cfg)
	}
	bin, err := cfg.binary()
	if err != nil {
		return nil, err
	}

	nodes := make([]*Server, primaries*(1+replicasPerPrimary))
	errs := make([]error, len(nodes))
	var wg sync.WaitGroup
	for i := range nodes {
		wg.Go(func() { nodes[i], errs[i] = startServer(bin, cfg) })
	}
	wg.Wait()
	c := &Cluster{nodes: slices.DeleteFunc(nodes, func(s *Server) bool { return s == nil })}
	if err := errors.Join(errs...); err != nil {
		c.Stop()
		return nil, err
	}
	if err := c.create(cli, replicasPerPrimary); err != nil {
		c.Stop()
		return nil, err
	}
	if err := c.waitReady(primaries); err != nil {
		c.Stop()
		return nil, err
	}
	if err := c.sortPrimariesFirst(); err != nil {
		c.Stop()
		return nil, err
	}
	return c, nil
}

// MustStartCluster is StartCluster for TestMain: on failure it prints the
// error to stderr and exits the test binary with status 1.
func MustStartCluster(primaries, replicasPerPrimary int, opts ...Option) *Cluster {
	c, err := StartCluster(primaries, replicasPerPrimary, opts...)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	return c
}

// Addrs returns the addresses of all nodes, primaries first.
func (c *Cluster) Addrs() []string {
	addrs := make([]string, len(c.nodes))
	for i, s := range c.nodes {
		addrs[i] = s.Addr()
	}
	return addrs
}

// Nodes returns all nodes, primaries first. The roles are those at start;
// after a failover they may differ.
func (c *Cluster) Nodes() []*Server { return slices.Clone(c.nodes) }

// Stop stops all nodes concurrently (see Server.Stop). It is safe to call
// more than once.
func (c *Cluster) Stop() {
	var wg sync.WaitGroup
	for _, s := range c.nodes {
		wg.Go(s.Stop)
	}
	wg.Wait()
}

// create runs redis-cli --cluster create over all nodes.
func (c *Cluster) create(cli string, replicasPerPrimary int) error {
	ctx, cancel := context.WithTimeout(context.Background(), clusterCreateTimeout)
	defer cancel()
	args := append([]string{"--cluster", "create"}, c.Addrs()...)
	args = append(args, "--cluster-replicas", strconv.Itoa(replicasPerPrimary), "--cluster-yes")
	cmd := exec.CommandContext(ctx, cli, args...)
	cmd.SysProcAttr = childproc.SysProcAttr()
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("redisserver: redis-cli --cluster create: %w\n%s", err, out)
	}
	return nil
}

// waitReady polls all nodes until the cluster is ready or
// clusterReadyTimeout passes; the error names the last unmet condition.
func (c *Cluster) waitReady(primaries int) error {
	deadline := time.Now().Add(clusterReadyTimeout)
	for {
		reason := c.notReady(primaries)
		if reason == "" {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("redisserver: cluster not ready after %v: %s", clusterReadyTimeout, reason)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// notReady returns why the cluster is not ready yet, or "" if it is.
func (c *Cluster) notReady(primaries int) string {
	want := []struct{ field, value string }{
		{"cluster_state", "ok"},
		{"cluster_slots_assigned", strconv.Itoa(clusterSlots)},
		{"cluster_known_nodes", strconv.Itoa(len(c.nodes))},
		{"cluster_size", strconv.Itoa(primaries)},
	}
	replicas := 0
	for _, s := range c.nodes {
		info, err := do(s.Addr(), time.Second, "CLUSTER", "INFO")
		if err != nil {
			return fmt.Sprintf("%s: CLUSTER INFO: %v", s.Addr(), err)
		}
		for _, w := range want {
			if got, _ := InfoField(info, w.field); got != w.value {
				return fmt.Sprintf("%s: %s is %q, want %q", s.Addr(), w.field, got, w.value)
			}
		}
		nodes, err := do(s.Addr(), time.Second, "CLUSTER", "NODES")
		if err != nil {
			return fmt.Sprintf("%s: CLUSTER NODES: %v", s.Addr(), err)
		}
		if reason := checkNodesView(nodes, primaries, len(c.nodes)-primaries); reason != "" {
			return fmt.Sprintf("%s: CLUSTER NODES: %s", s.Addr(), reason)
		}
		repl, err := do(s.Addr(), time.Second, "INFO", "replication")
		if err != nil {
			return fmt.Sprintf("%s: INFO replication: %v", s.Addr(), err)
		}
		if role, _ := InfoField(repl, "role"); role == "slave" {
			replicas++
			if link, _ := InfoField(repl, "master_link_status"); link != "up" {
				return fmt.Sprintf("%s: master_link_status is %q, want \"up\"", s.Addr(), link)
			}
		}
	}
	if want := len(c.nodes) - primaries; replicas != want {
		return fmt.Sprintf("%d replicas, want %d", replicas, want)
	}
	return ""
}

// checkNodesView checks one node's CLUSTER NODES reply: role changes reach
// the other nodes by gossip, after the replicas' own INFO already says they
// replicate, so this is what tells that every node sees the final topology.
// It returns why the view is not final yet, or "" if it is.
func checkNodesView(nodes string, primaries, replicas int) string {
	masters, slaves := 0, 0
	for line := range strings.Lines(nodes) {
		fields := strings.Fields(line)
		if len(fields) < 3 {
			return fmt.Sprintf("malformed line %q", line)
		}
		for flag := range strings.SplitSeq(fields[2], ",") {
			switch flag {
			case "master":
				masters++
			case "slave":
				slaves++
			case "fail?", "fail", "handshake", "noaddr":
				return fmt.Sprintf("node %s is flagged %s", fields[1], flag)
			}
		}
	}
	if masters != primaries || slaves != replicas {
		return fmt.Sprintf("%d masters and %d replicas, want %d and %d", masters, slaves, primaries, replicas)
	}
	return ""
}

// sortPrimariesFirst orders c.nodes by role, as reported by ROLE, keeping
// the start order within each role.
func (c *Cluster) sortPrimariesFirst() error {
	primary := make(map[*Server]bool, len(c.nodes))
	for _, s := range c.nodes {
		role, err := do(s.Addr(), doTimeout, "ROLE")
		if err != nil {
			return fmt.Errorf("redisserver: ROLE on %s: %w", s.Addr(), err)
		}
		primary[s] = strings.HasPrefix(role, "master\n")
	}
	slices.SortStableFunc(c.nodes, func(a, b *Server) int {
		switch {
		case primary[a] == primary[b]:
			return 0
		case primary[a]:
			return -1
		default:
			return 1
		}
	})
	return nil
}

// ClusterNode is one node as CLUSTER NODES describes it.
type ClusterNode struct {
	ID      string
	Addr    string // host:port, without the bus port
	Master  string // for a replica, its primary's ID; "-" for a primary
	Primary bool
	Slots   [][2]int // the slot ranges a primary serves, inclusive
}

// Owns reports whether n serves slot.
func (n ClusterNode) Owns(slot int) bool {
	for _, r := range n.Slots {
		if r[0] <= slot && slot <= r[1] {
			return true
		}
	}
	return false
}

// Topology reads CLUSTER NODES from the first node that answers, sorted
// by address.
func (c *Cluster) Topology() ([]ClusterNode, error) {
	var out string
	var err error
	for _, s := range c.nodes {
		if out, err = s.Do("CLUSTER", "NODES"); err == nil {
			break
		}
	}
	if err != nil {
		return nil, err
	}
	nodes := ParseClusterNodes(out)
	slices.SortFunc(nodes, func(a, b ClusterNode) int { return strings.Compare(a.Addr, b.Addr) })
	return nodes, nil
}

// ParseClusterNodes parses the reply of CLUSTER NODES. Slots being
// migrated ("[slot->-id]") are left out.
func ParseClusterNodes(out string) []ClusterNode {
	var nodes []ClusterNode
	for line := range strings.Lines(out) {
		f := strings.Fields(line)
		if len(f) < 8 {
			continue
		}
		n := ClusterNode{ID: f[0], Addr: strings.Split(f[1], "@")[0], Master: f[3], Primary: strings.Contains(f[2], "master")}
		for _, r := range f[8:] {
			if strings.HasPrefix(r, "[") {
				continue
			}
			lo, hi, _ := strings.Cut(r, "-")
			a, _ := strconv.Atoi(lo)
			b := a
			if hi != "" {
				b, _ = strconv.Atoi(hi)
			}
			n.Slots = append(n.Slots, [2]int{a, b})
		}
		nodes = append(nodes, n)
	}
	return nodes
}
