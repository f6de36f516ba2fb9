package main

import (
	"strings"
	"testing"

	"github.com/idemkit/idem/internal/redisserver"
)

// The proxy refuses to start on a Redis whose maxmemory-policy evicts keys
// (managed Redis's default volatile-lru, and allkeys-lru), with one line
// that says why and how to allow it; allow_eviction=1 in the URL starts it
// with a WARN, and /metrics shows the policy.
func TestProxyEvictingRedis(t *testing.T) {
	t.Parallel()
	up := newTestUpstream(t)
	for _, policy := range []string{"volatile-lru", "allkeys-lru"} {
		srv, err := redisserver.StartServer(redisserver.WithArgs("--maxmemory-policy", policy))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(srv.Stop)
		code, stderr := runIdem(t, nil, "proxy", "--listen", "127.0.0.1:0", "--upstream", up.URL, "--store", "redis://"+srv.Addr()+"/1")
		lines := strings.Split(strings.TrimSpace(stderr), "\n")
		last := lines[len(lines)-1]
		if code == 0 || !strings.Contains(last, policy) || !strings.Contains(last, "runs its work again") || !strings.Contains(last, "allow_eviction=1") {
			t.Errorf("%s: exit %d, stderr:\n%s\nwant a refusal naming the policy, why and allow_eviction=1", policy, code, stderr)
		}
		if len(lines) != 1 {
			t.Errorf("%s: want the refusal on one line, got:\n%s", policy, stderr)
		}
		p := startProxy(t, nil, "--upstream", up.URL, "--store", "redis://"+srv.Addr()+"/1?allow_eviction=1")
		if !strings.Contains(p.logText(), `"level":"WARN"`) || !strings.Contains(p.logText(), policy) {
			t.Errorf("%s with allow_eviction=1: no WARN naming the policy in\n%s", policy, p.logText())
		}
		if got := p.metric("idem_redis_evicting_policy"); got != 1 {
			t.Errorf("%s: idem_redis_evicting_policy %v, want 1", policy, got)
		}
		if !strings.Contains(p.logText(), `"store":"redis://`+srv.Addr()+`/1"`) {
			t.Errorf("start-up log does not name the database /1:\n%s", p.logText())
		}
	}
	// noeviction starts, and says so in /metrics.
	p := startProxy(t, nil, "--upstream", up.URL, "--store", "redis://"+proxyRedis(t).Addr())
	if got := p.metric("idem_redis_evicting_policy"); got != 0 {
		t.Errorf("noeviction: idem_redis_evicting_policy %v, want 0", got)
	}
	if got := p.metric("idem_redis_policy_checks_total"); got < 1 {
		t.Errorf("idem_redis_policy_checks_total %v, want at least 1", got)
	}
}
