package idemhttp_test

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/rueidis"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/redisstore"
)

// noop is the benchmarks' handler: it does nothing but answer.
func noop(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	io.WriteString(w, `{"id":"ch_1"}`)
}

// withStore is noop behind the middleware.
func withStore(store idem.Store) http.Handler {
	return idemhttp.Middleware(store, idemhttp.Config{})(http.HandlerFunc(noop))
}

// benchServer serves h on loopback, with a client that keeps connections.
func benchServer(b *testing.B, h http.Handler) (*httptest.Server, *http.Client) {
	srv := httptest.NewServer(h)
	b.Cleanup(srv.Close)
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 256}}
	b.Cleanup(client.CloseIdleConnections)
	return srv, client
}

var benchSeq atomic.Int64

// post sends one POST; key "" sends none, "new" a fresh one.
func post(b *testing.B, client *http.Client, url, key string) {
	req, _ := http.NewRequest("POST", url, strings.NewReader(`{"amount":1000}`))
	switch key {
	case "":
	case "new":
		req.Header.Set(idemhttp.HeaderKey, "k"+strconv.FormatInt(benchSeq.Add(1), 10))
	default:
		req.Header.Set(idemhttp.HeaderKey, key)
	}
	resp, err := client.Do(req)
	if err != nil {
		b.Error(err)
		return
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusCreated {
		b.Errorf("status %d", resp.StatusCode)
	}
}

func reportLatency(b *testing.B, lat []time.Duration) {
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds())/1e3, "p50-µs")
	b.ReportMetric(float64(lat[len(lat)*99/100].Nanoseconds())/1e3, "p99-µs")
}

// pingHandler answers like noop after one Redis PING through a client set
// up as redisstore.Open sets its own: the Redis round trip as a handler
// pays it, with Redis idle between requests as it is in the other cases.
func pingHandler(b *testing.B) http.Handler {
	c, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: []string{redisSrv.Addr()}, DisableCache: true, MaxFlushDelay: 20 * time.Microsecond})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(c.Close)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if err := c.Do(r.Context(), c.B().Ping().Build()).Error(); err != nil {
			b.Error(err)
		}
		noop(w, r)
	})
}

// BenchmarkLatency sends requests one at a time and reports p50/p99 per
// request: without the middleware, without it but with one Redis PING in
// the handler (the round trip as a handler pays it), and first requests
// (new keys) and replays through the middleware on the package's private
// redis-server (as redisstore.Open sets it up: replays from the replay
// cache; and with the cache off, replays by the acquire script) and on
// memstore.
// Allocations are per request, client included.
//
//	go test -run '^$' -bench Latency -benchtime 5000x ./idemhttp/
func BenchmarkLatency(b *testing.B) {
	cases := []struct {
		name    string
		handler func(b *testing.B) http.Handler
		key     string
	}{
		{"no-layer", func(*testing.B) http.Handler { return http.HandlerFunc(noop) }, ""},
		{"no-layer+ping", pingHandler, ""},
		{"first/redis", func(b *testing.B) http.Handler { return withStore(redistest.Store(b, redisSrv, redisstore.Options{})) }, "new"},
		{"replay/redis", func(b *testing.B) http.Handler { return withStore(redistest.Store(b, redisSrv, redisstore.Options{})) }, "same"},
		{"replay/redis-nocache", func(b *testing.B) http.Handler {
			return withStore(redistest.Store(b, redisSrv, redisstore.Options{CacheSize: -1}))
		}, "same"},
		{"first/memstore", func(*testing.B) http.Handler { return withStore(memstore.New(memstore.Options{})) }, "new"},
		{"replay/memstore", func(*testing.B) http.Handler { return withStore(memstore.New(memstore.Options{})) }, "same"},
	}
	for _, c := range cases {
		b.Run(c.name, func(b *testing.B) {
			srv, client := benchServer(b, c.handler(b))
			post(b, client, srv.URL, c.key) // warm: connection, scripts, the replayed key
			lat := make([]time.Duration, 0, b.N)
			b.ReportAllocs()
			for b.Loop() {
				t0 := time.Now()
				post(b, client, srv.URL, c.key)
				lat = append(lat, time.Since(t0))
			}
			reportLatency(b, lat)
		})
	}
}

// BenchmarkThroughput drives the server from 16 and from 128 goroutines
// and reports requests per second without the middleware and with it
// (first requests on new keys, and replays, on the private redis-server;
// first requests on memstore; first requests on Redis without the look-up
// of v1.0's keys, Config.V1Scopes).
//
//	go test -run '^$' -bench Throughput -benchtime 5s ./idemhttp/
func BenchmarkThroughput(b *testing.B) {
	for _, goroutines := range []int{16, 128} {
		for _, c := range []struct {
			name    string
			handler func(b *testing.B) http.Handler
			key     string
		}{
			{"no-layer", func(*testing.B) http.Handler { return http.HandlerFunc(noop) }, ""},
			{"first/redis", func(b *testing.B) http.Handler { return withStore(redistest.Store(b, redisSrv, redisstore.Options{})) }, "new"},
			{"replay/redis", func(b *testing.B) http.Handler { return withStore(redistest.Store(b, redisSrv, redisstore.Options{})) }, "same"},
			{"first/memstore", func(*testing.B) http.Handler { return withStore(memstore.New(memstore.Options{})) }, "new"},
			// Without the look-up of v1.0's keys (on by default for a
			// retention after start, one store read per first request).
			{"first/redis-v1off", func(b *testing.B) http.Handler {
				return idemhttp.Middleware(redistest.Store(b, redisSrv, redisstore.Options{}), idemhttp.Config{V1Scopes: -1})(http.HandlerFunc(noop))
			}, "new"},
		} {
			b.Run(fmt.Sprintf("g%d/%s", goroutines, c.name), func(b *testing.B) {
				srv, client := benchServer(b, c.handler(b))
				post(b, client, srv.URL, c.key)
				b.SetParallelism(max(1, goroutines/runtime.GOMAXPROCS(0)))
				b.ReportAllocs()
				var once sync.Once
				var start time.Time
				var n atomic.Int64
				b.RunParallel(func(pb *testing.PB) {
					once.Do(func() { start = time.Now() })
					for pb.Next() {
						post(b, client, srv.URL, c.key)
						n.Add(1)
					}
				})
				b.ReportMetric(float64(n.Load())/time.Since(start).Seconds(), "req/s")
			})
		}
	}
}

// BenchmarkPingAfterIdle measures a Redis PING sent after Redis has been
// idle for a while (the client busy-waits, so only Redis idles): on a
// virtual machine an idle CPU is slow to wake, which is why the round trip
// a serial request pays is longer than a back-to-back PING.
//
//	go test -run '^$' -bench PingAfterIdle -benchtime 3000x ./idemhttp/
func BenchmarkPingAfterIdle(b *testing.B) {
	c, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: []string{redisSrv.Addr()}, DisableCache: true})
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	for _, gap := range []time.Duration{0, 20 * time.Microsecond, 100 * time.Microsecond, 200 * time.Microsecond, 500 * time.Microsecond} {
		b.Run("gap="+gap.String(), func(b *testing.B) {
			lat := make([]time.Duration, 0, b.N)
			for b.Loop() {
				for t := time.Now(); time.Since(t) < gap; {
				}
				t0 := time.Now()
				if err := c.Do(b.Context(), c.B().Ping().Build()).Error(); err != nil {
					b.Fatal(err)
				}
				lat = append(lat, time.Since(t0))
			}
			reportLatency(b, lat)
		})
	}
}
