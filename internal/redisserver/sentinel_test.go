package redisserver

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

func TestSentinelSet(t *testing.T) {
	t.Parallel()
	start := time.Now()
	s, err := StartSentinelSet()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Stop)
	t.Logf("sentinel set ready in %v", time.Since(start).Round(time.Millisecond))

	addrs := s.SentinelAddrs()
	if len(addrs) != 3 {
		t.Fatalf("SentinelAddrs() = %v, want 3", addrs)
	}
	if want := "redis://" + addrs[0] + "?master_set=mymaster&addr=" + addrs[1] + "&addr=" + addrs[2]; s.URL() != want {
		t.Errorf("URL() = %q, want %q", s.URL(), want)
	}
	first, second := s.primary, s.replica
	if s.MasterAddr() != first.Addr() {
		t.Errorf("MasterAddr() = %s, want the first server %s", s.MasterAddr(), first.Addr())
	}
	// A go-redis failover client finds the primary through the sentinels.
	fc := redis.NewFailoverClient(&redis.FailoverOptions{MasterName: SentinelMasterName, SentinelAddrs: addrs})
	defer fc.Close()
	if err := fc.Set(context.Background(), "k", "v", 0).Err(); err != nil {
		t.Fatalf("SET through the sentinels: %v", err)
	}

	for i, want := range []*Server{second, first} {
		start = time.Now()
		if err := s.Failover(true); err != nil {
			t.Fatalf("failover %d: %v", i+1, err)
		}
		t.Logf("failover %d took %v", i+1, time.Since(start).Round(time.Millisecond))
		if s.MasterAddr() != want.Addr() {
			t.Errorf("after failover %d: MasterAddr() = %s, want %s", i+1, s.MasterAddr(), want.Addr())
		}
		if role, _, _ := strings.Cut(mustDo(t, want, "ROLE"), "\n"); role != "master" {
			t.Errorf("after failover %d: %s has role %q, want master", i+1, want.Addr(), role)
		}
	}

	pids := []int{pid(t, first), pid(t, second)}
	ports := []int{first.Port(), second.Port()}
	for _, sn := range s.sentinels {
		pids = append(pids, sn.proc.cmd.Process.Pid)
		ports = append(ports, sn.port)
	}
	s.Stop()
	s.Stop()
	for i := range pids {
		assertGone(t, pids[i])
		assertClosed(t, ports[i])
	}
}

func TestCPUTime(t *testing.T) {
	t.Parallel()
	srv := newTestServer(t)
	c := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	defer c.Close()
	ctx := context.Background()
	cpu0, err := CPUTime(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 2000 {
		if err := c.Set(ctx, "k"+strconv.Itoa(i), "v", 0).Err(); err != nil {
			t.Fatal(err)
		}
	}
	cpu1, err := CPUTime(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	if cpu0 < 0 || cpu1 <= cpu0 {
		t.Errorf("CPUTime before and after 2000 SETs: %v, %v; want a positive, growing time", cpu0, cpu1)
	}
}
