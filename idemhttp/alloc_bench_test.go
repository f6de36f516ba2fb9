package idemhttp_test

import (
	"bytes"
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/redisstore"
)

// benchWriter is a minimal, reusable http.ResponseWriter: reset between
// requests, so that what BenchmarkServe counts is the middleware's work,
// not a writer's.
type benchWriter struct {
	h      http.Header
	status int
	n      int
}

func (w *benchWriter) Header() http.Header { return w.h }
func (w *benchWriter) WriteHeader(s int) {
	if w.status == 0 {
		w.status = s
	}
}
func (w *benchWriter) Write(p []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	w.n += len(p)
	return len(p), nil
}

// SetWriteDeadline is there as on net/http's writer, which the
// middleware bounds its writes with (Config.ClientWriteTimeout).
func (w *benchWriter) SetWriteDeadline(time.Time) error { return nil }

func (w *benchWriter) reset() {
	clear(w.h)
	w.status, w.n = 0, 0
}

// rewindBody is a request body that can be read again (reset), so that
// the request is built once and only the middleware allocates.
type rewindBody struct{ bytes.Reader }

func (*rewindBody) Close() error { return nil }

// BenchmarkServe calls the middleware's ServeHTTP directly (no network,
// no client): a POST with a JSON body and an Authorization header (the
// tenant), without a key (passthrough), with a new key each time (first)
// and with one stored key (replay), on memstore and on the package's
// private redis-server (redisstore.Open's default client). Allocations are
// the middleware's, the handler's (noop) and the store's only: the request
// and the writer are reused.
//
//	go test -run '^$' -bench Serve -benchmem -count 5 ./idemhttp/
func BenchmarkServe(b *testing.B) {
	const payload = `{"amount":1000}`
	cases := []struct {
		name  string
		store func(b *testing.B) idem.Store
		key   string // "": none, "new": a new one each time
	}{
		{"passthrough", func(*testing.B) idem.Store { return memstore.New(memstore.Options{}) }, ""},
		{"first/memstore", func(*testing.B) idem.Store { return memstore.New(memstore.Options{}) }, "new"},
		{"replay/memstore", func(*testing.B) idem.Store { return memstore.New(memstore.Options{}) }, "same"},
		{"first/redis", func(b *testing.B) idem.Store { return redistest.Store(b, redisSrv, redisstore.Options{}) }, "new"},
		{"replay/redis", func(b *testing.B) idem.Store { return redistest.Store(b, redisSrv, redisstore.Options{}) }, "same"},
	}
	for _, c := range cases {
		b.Run(c.name, func(b *testing.B) {
			h := withStore(c.store(b))
			body := &rewindBody{}
			r, _ := http.NewRequest(http.MethodPost, "http://api.example/charges", nil)
			r.Header.Set("Content-Type", "application/json")
			r.Header.Set("Authorization", "Bearer sk_test_4eC39HqLyjWDarjtT1zdp7dc")
			r.ContentLength = int64(len(payload))
			r.Body = body
			w := &benchWriter{h: http.Header{}}
			serve := func(key []string) {
				body.Reset([]byte(payload))
				if key != nil {
					r.Header[idemhttp.HeaderKey] = key
				}
				w.reset()
				h.ServeHTTP(w, r)
				if w.status != http.StatusCreated {
					b.Fatalf("status %d", w.status)
				}
			}
			// The keys are built before the clock runs, as a client
			// sends them: one per request, or one stored key.
			keys := make([][]string, b.N)
			for i := range keys {
				switch c.key {
				case "new":
					keys[i] = []string{"k" + strconv.Itoa(i)}
				case "same":
					keys[i] = []string{"same"}
				}
			}
			if c.key != "" {
				serve([]string{"warm"}) // warm: the connection, the scripts
				serve([]string{"same"}) // the replayed key
			}
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				serve(keys[i])
			}
		})
	}
}
