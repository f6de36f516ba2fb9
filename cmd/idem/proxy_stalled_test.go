package main

// A client that stops reading without disconnecting is a client gone once
// --client-write-timeout passes: the upstream's response is read to its
// end and stored, and the retry gets the replay.

import (
	"fmt"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/nettest"
)

// fetchFinal repeats fetch, as a client honouring 409 would, until the
// answer is something else (bounded).
func fetchFinal(t *testing.T, base, key string, size int64) fetched {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		f := fetch(t, base, key, size)
		if f.status != http.StatusConflict {
			return f
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: still 409 after 60s: the client that stopped reading holds the key", key)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func TestProxyClientStopsReading(t *testing.T) {
	t.Parallel()
	proxyStores(t, func(t *testing.T, store string) {
		const size = 16 * mib // far more than the socket buffers hold
		up := newBigUpstream(t)
		args := []string{"--upstream", up.URL, "--store", store, "--blob", "mem://", "--client-write-timeout", "300ms"}
		if store != "memory" {
			// The same from a route of the --config file, over a flag
			// that sets no limit.
			file := filepath.Join(t.TempDir(), "idem.yaml")
			writeFile(t, file, "routes:\n  - match: \"POST /export\"\n    client_write_timeout: 300ms\n")
			args = append(args, "--client-write-timeout", "0", "--config", file)
		}
		p := startProxy(t, nil, args...)

		key := "stall-" + strings.ReplaceAll(t.Name(), "/", "-")
		body := `{"report":"q3"}` // as fetch sends it: the fingerprint covers it
		nettest.DialStalled(t, p.addr, fmt.Sprintf("POST /export?size=%d HTTP/1.1\r\nHost: 127.0.0.1\r\nIdempotency-Key: %s\r\n"+
			"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", size, key, len(body), body))
		// The stalled request holds the key once it reached the upstream.
		deadline := time.Now().Add(10 * time.Second)
		for up.runsOf(key) == 0 {
			if time.Now().After(deadline) {
				t.Fatal("the stalled request did not reach the upstream within 10s")
			}
			time.Sleep(10 * time.Millisecond)
		}

		f := fetchFinal(t, p.url(""), key, size)
		wantWhole(t, "retry after the client stopped reading", f, key, size)
		if f.header.Get("Idempotent-Replayed") != "true" {
			t.Fatal("retry: got a fresh response, want the replay")
		}
		if n := up.runsOf(key); n != 1 {
			t.Fatalf("got %d upstream executions, want 1", n)
		}
		if !p.awaitLog(`"client_gone":true`) {
			t.Fatalf("log: no request with client_gone:\n%s", p.logText())
		}
		if got := p.metric(`idem_client_gone_total{outcome="executed"}`); got != 1 {
			t.Errorf("idem_client_gone_total: got %v, want 1", got)
		}
		if strings.Contains(p.logText(), "upstream_aborted") {
			t.Errorf("log: a stalled client was logged as upstream_aborted")
		}
	})
}
