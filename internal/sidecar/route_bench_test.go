package sidecar

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/memstore"
)

// BenchmarkRouteFirstRequest is what a route's middleware costs a first
// request (a new key, executed and stored on a memory store, in front of
// a handler that answers 201), in process, without the network: with
// the Idempotency-Key header (v1.0's records not looked for), with a
// GitHub webhook's signature verified over its body (one secret), and
// with the same signed requests keyed by a header and nothing verified.
// The body is 1 KiB, as in scripts/proxybench-webhook.sh. Each request
// is one tenant's (anonymous, or webhook:github). Besides ns/op (wall
// time, which the machine's other load moves), it reports cpu-ns/op: the
// process's user and system time per request, which moves less.
func BenchmarkRouteFirstRequest(b *testing.B) {
	const secret = "benchmark-secret"
	body := `{"action":"opened","pad":"` + strings.Repeat("x", 1024-len(`{"action":"opened","pad":""}`)) + `"}`
	mac := hmac.New(sha256.New, []byte(secret))
	mac.Write([]byte(body))
	sig := "sha256=" + hex.EncodeToString(mac.Sum(nil))
	secrets := filepath.Join(b.TempDir(), "secrets")
	if err := os.WriteFile(secrets, []byte(secret+"\n"), 0o600); err != nil {
		b.Fatal(err)
	}
	signed := map[string]string{"X-Hub-Signature-256": sig, "X-GitHub-Event": "pull_request"}
	for _, c := range []struct {
		name, keyHeader string
		headers         map[string]string
		set             func(*Settings)
	}{
		{"idempotency-key", idemhttp.HeaderKey, nil, func(*Settings) {}},
		{"github-webhook", "X-GitHub-Delivery", signed, func(s *Settings) {
			s.Webhook, s.WebhookSecretFile = "github", secrets
		}},
		{"key-header-unverified", "X-GitHub-Delivery", signed, func(s *Settings) { s.Key = "header:X-GitHub-Delivery" }},
	} {
		b.Run(c.name, func(b *testing.B) {
			s := DefaultSettings()
			c.set(&s)
			if err := s.Validate(Underscored); err != nil {
				b.Fatal(err)
			}
			env := Env{Metrics: NewMetrics(Underscored), Logger: slog.New(slog.DiscardHandler)}
			mw, err := s.Middleware(memstore.New(memstore.Options{}), TenantFunc("", ""), nil, env)
			if err != nil {
				b.Fatal(err)
			}
			var runs atomic.Int64
			h := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				io.Copy(io.Discard, r.Body)
				runs.Add(1)
				w.WriteHeader(http.StatusCreated)
				io.WriteString(w, `{"ok":true}`)
			}))
			var seq atomic.Int64
			cpu0 := cpuTime(b)
			b.ReportAllocs()
			b.SetBytes(int64(len(body)))
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					r := httptest.NewRequest(http.MethodPost, "http://bench.example/hook", strings.NewReader(body))
					r.Header.Set("Content-Type", "application/json")
					r.Header.Set(c.keyHeader, "bench-"+strconv.FormatInt(seq.Add(1), 10))
					for k, v := range c.headers {
						r.Header.Set(k, v)
					}
					w := httptest.NewRecorder()
					h.ServeHTTP(w, r)
					if w.Code != http.StatusCreated || w.Header().Get(idemhttp.HeaderReplayed) != "" {
						b.Errorf("%s: got %d (replayed %q) %s; want 201, executed", c.name, w.Code, w.Header().Get(idemhttp.HeaderReplayed), w.Body)
						return
					}
				}
			})
			b.ReportMetric(float64(cpuTime(b)-cpu0)/float64(b.N), "cpu-ns/op")
			if n := runs.Load(); n != seq.Load() {
				b.Errorf("%s: the handler ran %d times for %d first requests; want once each", c.name, n, seq.Load())
			}
		})
	}
}

// cpuTime is the process's user and system CPU time so far.
func cpuTime(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
