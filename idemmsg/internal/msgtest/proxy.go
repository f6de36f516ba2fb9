package msgtest

import (
	"context"
	"encoding/json"
	"strings"
	"sync"
	"testing"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/rs/zerolog"
)

// Proxy is a TCP proxy (toxiproxy, in process) on a free loopback port in
// front of a broker or a store: the adapters' harnesses point their
// consumers at Addr, so that a test can cut the connections between the
// two without touching either.
type Proxy struct {
	srv   *toxiproxy.ApiServer
	proxy *toxiproxy.Proxy
	// Addr is the proxy's listening address, host:port on 127.0.0.1.
	Addr string

	mu  sync.Mutex
	cut string // "reset" or "blackhole" while cut, else ""
}

// NewProxy starts a proxy to upstream (host:port), removed when the test
// ends.
func NewProxy(t testing.TB, upstream string) *Proxy {
	t.Helper()
	srv := toxiproxy.NewServer(toxiproxy.NewMetricsContainer(nil), zerolog.Nop())
	p := toxiproxy.NewProxy(srv, strings.NewReplacer(":", "_", ".", "_").Replace(upstream), "127.0.0.1:0", upstream)
	if err := srv.Collection.Add(p, true); err != nil {
		t.Fatalf("msgtest: toxiproxy in front of %s: %v", upstream, err)
	}
	t.Cleanup(func() { srv.Collection.Clear() })
	return &Proxy{srv: srv, proxy: p, Addr: p.Listen}
}

// Reset resets every connection through the proxy and refuses new ones
// until Restore: a broker or store that went away at once.
func (p *Proxy) Reset(t testing.TB) {
	t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cut = "reset"
	p.proxy.Stop() // closes the listener and every connection
}

// Blackhole drops every byte, in either direction, on the connections
// open now and on new ones, until Restore: a silent network partition (no
// reset, no FIN), which a client notices only by its own timeouts or
// heartbeats.
func (p *Proxy) Blackhole(t testing.TB) {
	t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cut = "blackhole"
	for _, stream := range []string{"upstream", "downstream"} {
		js, _ := json.Marshal(map[string]any{"name": "blackhole-" + stream, "type": "timeout", "stream": stream,
			"attributes": map[string]int64{"timeout": 0}})
		if _, err := p.proxy.Toxics.AddToxicJson(strings.NewReader(string(js))); err != nil {
			t.Fatalf("msgtest: blackhole %s: %v", stream, err)
		}
	}
}

// Restore ends a Reset or a Blackhole. The connections that were black-
// holed are closed then (toxiproxy's timeout toxic drops their bytes and
// closes them when it is removed), as a client's own keepalive or
// heartbeat would have ended them: a client that noticed the silence
// sooner has reconnected already, and new connections go through.
func (p *Proxy) Restore(t testing.TB) {
	t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	switch p.cut {
	case "reset":
		if err := p.proxy.Start(); err != nil {
			t.Fatalf("msgtest: restarting the proxy on %s: %v", p.Addr, err)
		}
	case "blackhole":
		for _, stream := range []string{"upstream", "downstream"} {
			if err := p.proxy.Toxics.RemoveToxic(context.Background(), "blackhole-"+stream); err != nil {
				t.Fatalf("msgtest: removing the blackhole (%s): %v", stream, err)
			}
		}
	}
	p.cut = ""
}

// Cut is Blackhole when blackhole is set, Reset otherwise, and returns
// Restore bound to t: what an adapter harness's adaptertest.Faults.Cut
// does with its consumers' proxy.
func (p *Proxy) Cut(t testing.TB, blackhole bool) (restore func()) {
	t.Helper()
	if blackhole {
		p.Blackhole(t)
	} else {
		p.Reset(t)
	}
	return func() { p.Restore(t) }
}
