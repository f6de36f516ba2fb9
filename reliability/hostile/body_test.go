package hostile

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/reltest"
)

// TestHugeBodies sends 100 MB bodies to a keyed POST: declared with
// Content-Length and streamed, declared with Expect: 100-continue (the
// body only follows a 100 Continue), and chunked. Each must get 413 within
// seconds while the server reads only a bounded part of the body (counted
// on its connections) and allocates a bounded amount; nothing is stored,
// and the same key then works for a normal request.
func TestHugeBodies(t *testing.T) {
	store, prefix := newRedisStore(t, rdb)
	a := &app{}
	ts, counter := startServer(t, idemhttp.Middleware(store, idemhttp.Config{Logger: quietLogger()})(a.handler()), func(s *http.Server) {
		s.ReadHeaderTimeout = 5 * time.Second
	})
	addr := ts.Listener.Addr().String()
	client := newClient(10 * time.Second)
	const size = 100_000_000
	const readLimit = 10 << 20  // what the server may read of a refused body
	const allocLimit = 10 << 20 // what the whole process may allocate meanwhile

	cases := []struct {
		name   string
		header string
		body   func() io.Reader
	}{
		{"declared", fmt.Sprintf("Content-Length: %d\r\n", size), func() io.Reader { return io.LimitReader(zeros{}, size) }},
		{"declared, Expect: 100-continue", fmt.Sprintf("Content-Length: %d\r\nExpect: 100-continue\r\n", size), nil},
		{"chunked", "Transfer-Encoding: chunked\r\n", func() io.Reader { return chunked(size) }},
	}
	// Warm up: the store's connections and buffers are made before the
	// first measurement.
	if w := mustPost(t, client, ts.URL+"/charges", "warm-up", "{}", nil); w.status != http.StatusCreated {
		t.Fatalf("warm-up: %d %s", w.status, w.body)
	}
	a.runs.Store(0)
	for i, c := range cases {
		key := fmt.Sprintf("huge-body-%d", i)
		head := "POST /charges HTTP/1.1\r\nHost: hostile\r\nContent-Type: application/octet-stream\r\nIdempotency-Key: " + key + "\r\n" + c.header + "\r\n"
		var body io.Reader
		if c.body != nil {
			body = c.body()
		}
		recordsBefore := len(keysWith(t, rdb, prefix))
		readBefore := counter.read.Load()
		var res rawResult
		total, retained := allocated(func() { res = rawExchange(addr, head, body, 30*time.Second) })
		read := counter.read.Load() - readBefore
		errs := map[string]int{}
		switch {
		case res.err != nil:
			errs["transport"]++
			t.Errorf("%s: %v", c.name, res.err)
		case res.status != http.StatusRequestEntityTooLarge || !strings.Contains(res.body, idemhttp.ProblemBodyTooLarge):
			t.Errorf("%s: %d %.200q, want 413 %s", c.name, res.status, res.body, idemhttp.ProblemBodyTooLarge)
		}
		if res.status >= 400 {
			errs[fmt.Sprint(res.status)]++
		}
		if res.elapsed > 10*time.Second {
			t.Errorf("%s: answered after %v", c.name, res.elapsed)
		}
		if read > readLimit {
			t.Errorf("%s: the server read %s of the body, want at most %s", c.name, mib(read), mib(readLimit))
		}
		if total > allocLimit {
			t.Errorf("%s: %s allocated during the request, want under %s", c.name, mib(total), mib(allocLimit))
		}
		if n := len(keysWith(t, rdb, prefix)) - recordsBefore; n != 0 {
			t.Errorf("%s: %d records written for a refused request", c.name, n)
		}
		if n := a.runs.Load(); n != 0 {
			t.Errorf("%s: handler ran %d times", c.name, n)
		}
		// The key is free: a normal request with it runs once, then replays.
		first := mustPost(t, client, ts.URL+"/charges", key, `{"amount":1}`, nil)
		again := mustPost(t, client, ts.URL+"/charges", key, `{"amount":1}`, nil)
		if first.status != http.StatusCreated || again.status != http.StatusCreated || again.header.Get(idemhttp.HeaderReplayed) != "true" || again.body != first.body {
			t.Errorf("%s: same key afterwards: %d %q then %d %q (replayed %q), want 201 then its replay",
				c.name, first.status, first.body, again.status, again.body, again.header.Get(idemhttp.HeaderReplayed))
		}
		if n := a.runs.Swap(0); n != 1 {
			t.Errorf("%s: handler ran %d times for the normal request and its repeat, want 1", c.name, n)
		}
		reltest.Report(t, reltest.Row{
			Scenario: "hostile: 100 MB body, " + c.name, Store: "redis (single)", Fault: "100 MB request body to a keyed POST (MaxBodySize 1 MiB)",
			Requests: 3, Keys: 1, ClientErrors: errs,
			Notes: fmt.Sprintf("413 after %v; client wrote %s, server read %s; allocated %s (live heap %+.2f MiB after GC); 0 records; same key then ran once and replayed",
				res.elapsed.Round(time.Millisecond), mib(res.written), mib(read), mib(total), float64(retained)/(1<<20)),
		})
	}
}
