package main

import (
	"testing"
)

// The proxy on Redis serves replays from the store's replay cache and
// counts them: the first request runs, the first replay reads the record
// into the cache (a miss), the next ones are hits.
func TestProxyRedisReplayCache(t *testing.T) {
	t.Parallel()
	up := newTestUpstream(t)
	p := startProxy(t, nil, "--upstream", up.URL, "--store", "redis://"+proxyRedis(t).Addr())
	const key = "cache-1"
	wantStatus(t, key, mustSend(t, "POST", p.url("/payments"), key, `{"amount":1}`), 201, "")
	for i := range 4 {
		r := mustSend(t, "POST", p.url("/payments"), key, `{"amount":1}`)
		if r.status != 201 || !r.replayed() {
			t.Fatalf("repeat %d: got %d (replayed %t), want the replay", i, r.status, r.replayed())
		}
	}
	if n := up.runsOf(key); n != 1 {
		t.Fatalf("the upstream ran %d times, want 1", n)
	}
	if got := p.metric("idem_redis_cache_hits_total"); got != 3 {
		t.Errorf("idem_redis_cache_hits_total: got %v, want 3", got)
	}
	if got := p.metric("idem_redis_cache_misses_total"); got != 2 {
		t.Errorf("idem_redis_cache_misses_total: got %v, want 2 (the first request, the first replay)", got)
	}
}
