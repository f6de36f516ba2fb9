package upstreamtest

import (
	"crypto/rand"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"testing"
	"time"
)

// Counter is an HTTP upstream that counts the requests it serves by path,
// so that a test sees whether a request reached it, whatever carried the
// key (a webhook's delivery header, a field of the body). It answers 201
// application/json with a body unique to each execution ({"run":n,
// "path":..,"body":..,"nonce":..}: byte-identical answers prove a replay)
// and an X-Upstream-Run header. A request with X-Test-Delay (a Go
// duration) is held that long first, or until its client leaves.
type Counter struct {
	*httptest.Server

	mu     sync.Mutex
	runs   map[string]int
	bodies map[string]string
	header map[string]http.Header
}

// StartCounter starts a Counter on a free loopback port; it is closed when
// the test ends.
func StartCounter(t testing.TB) *Counter {
	t.Helper()
	c := &Counter{runs: map[string]int{}, bodies: map[string]string{}, header: map[string]http.Header{}}
	c.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		c.mu.Lock()
		c.runs[r.URL.Path]++
		n := c.runs[r.URL.Path]
		c.bodies[r.URL.Path] = string(body)
		c.header[r.URL.Path] = r.Header.Clone()
		c.mu.Unlock()
		if d, err := time.ParseDuration(r.Header.Get("X-Test-Delay")); err == nil {
			select {
			case <-time.After(d):
			case <-r.Context().Done():
				return
			}
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("X-Upstream-Run", strconv.Itoa(n))
		w.WriteHeader(http.StatusCreated)
		json.NewEncoder(w).Encode(map[string]any{"run": n, "path": r.URL.Path, "body": string(body), "nonce": rand.Text()})
	}))
	t.Cleanup(c.Close)
	return c
}

// Runs is how many requests for path the upstream has served (started).
func (c *Counter) Runs(path string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.runs[path]
}

// Body is the body of the last request for path ("" before any).
func (c *Counter) Body(path string) string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.bodies[path]
}

// Header is the header of the last request for path (nil before any).
func (c *Counter) Header(path string) http.Header {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.header[path]
}
