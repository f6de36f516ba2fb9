package main

import (
	"crypto/rand"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/redisserver"
)

// BenchmarkProxyBlobReplay compares, for a 10 MiB response, a replay from
// the blob store through idem proxy (on Redis) with serving the same bytes
// from an upstream that only streams them from memory: straight, and
// through the proxy as a request without a key (the upstream answers
// every time).
// MB/s is the response body's throughput to one client on loopback. It
// also reports the Redis record's MEMORY USAGE and the proxy's peak RSS.
//
//	go test -run '^$' -bench BlobReplay -benchtime 30x ./cmd/idem
func BenchmarkProxyBlobReplay(b *testing.B) {
	const size = 10 << 20
	body := make([]byte, size)
	rand.Read(body)
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/octet-stream")
		w.Header().Set("Content-Length", strconv.Itoa(size))
		for p := body; len(p) > 0; p = p[min(len(p), 32<<10):] {
			if _, err := w.Write(p[:min(len(p), 32<<10)]); err != nil {
				return
			}
		}
	}))
	defer up.Close()
	redis, err := redisserver.StartServer()
	if err != nil {
		b.Fatal(err)
	}
	defer redis.Stop()

	get := func(b *testing.B, url, key string) {
		req, _ := http.NewRequest("POST", url, strings.NewReader("{}"))
		req.Header.Set("Content-Type", "application/json")
		if key != "" {
			req.Header.Set(idemhttp.HeaderKey, key)
		}
		resp, err := bigClient.Do(req)
		if err != nil {
			b.Fatal(err)
		}
		n, err := io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if err != nil || n != size || resp.StatusCode != http.StatusOK {
			b.Fatalf("%s: %d, %d bytes, %v", url, resp.StatusCode, n, err)
		}
	}
	b.Run("upstream", func(b *testing.B) {
		b.SetBytes(size)
		for b.Loop() {
			get(b, up.URL+"/export", "")
		}
	})
	for _, kind := range []string{"passthrough", "file", "s3"} {
		b.Run(kind, func(b *testing.B) {
			args := []string{"--upstream", up.URL, "--store", "redis://" + redis.Addr()}
			var bb *blobBackend
			if kind != "passthrough" {
				bb = newBlobBackend(b, kind)
				args = append(args, "--blob", bb.url)
			}
			p := startBlobProxy(b, args...)
			key := ""
			if bb != nil {
				key = "bench-" + kind + "-" + rand.Text()[:8] // -count runs each on a blob store of its own
				get(b, p.base()+"/export", key)               // stored
				get(b, p.base()+"/export", key)               // completed: the next are replays
			}
			b.SetBytes(size)
			b.ResetTimer()
			for b.Loop() {
				get(b, p.base()+"/export", key)
			}
			b.StopTimer()
			b.ReportMetric(float64(peakRSS(b, p.Cmd.Process.Pid))/(1<<20), "peak-RSS-MiB")
			if key != "" {
				usage, _ := redis.Do("MEMORY", "USAGE", "idem:{"+storedKey(key).String()+"}")
				if n, err := strconv.Atoi(usage); err == nil {
					b.ReportMetric(float64(n), "record-bytes")
				}
			}
		})
	}
}
