package main

import (
	"crypto/rand"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"
)

// Unkeyed requests with a body pass through the proxy with their body
// streamed to the upstream. Go's HTTP/1 server closes a request body once
// the response header goes out, and Go's transport reads a body once more
// after its declared Content-Length (to check that it holds no more): when
// that read came after the close, the transport tore down the upstream
// connection and cut the response in the middle of its body. The proxy
// ends such a body at its Content-Length itself.
//
// Not parallel: 2 GB through the proxy would slow the timing-bound tests
// that run beside it.
func TestProxyUnkeyedBodyLargeResponses(t *testing.T) {
	const size = 10 * mib
	const requests = 200
	body := make([]byte, size)
	rand.Read(body)
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body) // it reads its request before it answers
		w.Header().Set("Content-Type", "application/octet-stream")
		w.Header().Set("Content-Length", strconv.Itoa(size))
		for p := body; len(p) > 0; p = p[min(len(p), 32*kib):] {
			if _, err := w.Write(p[:min(len(p), 32*kib)]); err != nil {
				return
			}
		}
	}))
	t.Cleanup(up.Close)
	// The proxy built without -race, as in production: the race detector
	// slows it down enough to hide the race.
	p := startBlobProxy(t, "--upstream", up.URL)

	client := &http.Client{Timeout: 2 * time.Minute, Transport: &http.Transport{MaxIdleConnsPerHost: 1}}
	t.Cleanup(client.CloseIdleConnections)
	var failed []string
	for range requests {
		req, _ := http.NewRequest("POST", p.base()+"/export", strings.NewReader(`{"report":"q3"}`))
		req.Header.Set("Content-Type", "application/json")
		what := ""
		resp, err := client.Do(req)
		if err == nil {
			var got int64
			got, err = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if err != nil || got != size || resp.StatusCode != http.StatusOK {
				what = fmt.Sprintf("status %d after %d bytes: %v", resp.StatusCode, got, err)
			}
		} else {
			what = err.Error()
		}
		if what != "" {
			failed = append(failed, what)
		}
	}
	if len(failed) > 0 {
		t.Errorf("%d of %d unkeyed POSTs with a %d-byte response failed; the first: %q",
			len(failed), requests, size, failed[:min(len(failed), 3)])
		for line := range strings.Lines(p.LogText()) {
			if strings.Contains(line, `"level":"WARN"`) {
				t.Logf("the proxy's first warning: %s", strings.TrimSpace(line))
				break
			}
		}
	}
}
