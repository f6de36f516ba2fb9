package hostile

import (
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/reltest"
)

// TestHugeHeaders sends 1 MiB headers and headers just over net/http's
// limit (MaxHeaderBytes, default 1 MiB, which the proxy also uses, plus the
// 4 KiB net/http allows beyond it). Over the limit net/http answers 431
// before the middleware sees the request; under it, a 1 MiB
// Idempotency-Key gets idemhttp's 400, and a 1 MiB header of another name
// is an ordinary request whose header is never stored.
// Each case runs concurrently from several clients and must answer within
// seconds, store nothing it rejects, and allocate a bounded amount.
func TestHugeHeaders(t *testing.T) {
	store, prefix := newRedisStore(t, rdb)
	a := &app{}
	ts, _ := startServer(t, idemhttp.Middleware(store, idemhttp.Config{Logger: quietLogger()})(a.handler()), func(s *http.Server) {
		s.ReadHeaderTimeout = 5 * time.Second // MaxHeaderBytes left at its default, 1 MiB
	})
	addr := ts.Listener.Addr().String()
	clients := reltest.Scale(2, 32)
	// net/http reads up to MaxHeaderBytes (default 1 MiB) plus 4 KiB of
	// request line and headers: a 1 MiB header value still fits.
	const over = 1<<20 + 16<<10

	head := func(extra string) string {
		return "POST /charges HTTP/1.1\r\nHost: hostile\r\nContent-Type: application/json\r\nContent-Length: 2\r\n" + extra + "\r\n"
	}
	cases := []struct {
		name    string
		extra   func(i int) string // extra header lines for client i
		status  int
		problem string
		stored  int // records per client
	}{
		{"1 MiB Idempotency-Key", func(int) string { return "Idempotency-Key: " + strings.Repeat("k", 1<<20) + "\r\n" },
			http.StatusBadRequest, idemhttp.ProblemKeyInvalid, 0},
		{"1 MiB + 16 KiB Idempotency-Key", func(int) string { return "Idempotency-Key: " + strings.Repeat("k", over) + "\r\n" },
			http.StatusRequestHeaderFieldsTooLarge, "", 0},
		{"~1 MB of repeated Idempotency-Key headers", func(int) string {
			return strings.Repeat("Idempotency-Key: dup\r\n", 47_000)
		}, http.StatusBadRequest, idemhttp.ProblemKeyInvalid, 0},
		{"1 MiB other header, valid key", func(i int) string {
			return fmt.Sprintf("Idempotency-Key: big-other-%d\r\nX-Junk: %s\r\n", i, strings.Repeat("j", 1<<20))
		}, http.StatusCreated, "", 1},
		{"1 MiB + 16 KiB other header, valid key", func(i int) string {
			return fmt.Sprintf("Idempotency-Key: over-other-%d\r\nX-Junk: %s\r\n", i, strings.Repeat("j", over))
		}, http.StatusRequestHeaderFieldsTooLarge, "", 0},
		{"11k headers of 100 B, valid key", func(i int) string {
			var b strings.Builder
			fmt.Fprintf(&b, "Idempotency-Key: many-%d\r\n", i)
			for j := range 11_000 {
				fmt.Fprintf(&b, "X-H%d: %s\r\n", j, strings.Repeat("v", 90))
			}
			return b.String()
		}, http.StatusRequestHeaderFieldsTooLarge, "", 0},
	}
	for _, c := range cases {
		heads := make([]string, clients)
		for i := range heads {
			heads[i] = head(c.extra(i))
		}
		before := len(keysWith(t, rdb, prefix))
		runsBefore := a.runs.Load()
		results := make([]rawResult, clients)
		total, retained := allocated(func() {
			var wg sync.WaitGroup
			for i := range clients {
				wg.Go(func() { results[i] = rawExchange(addr, heads[i], strings.NewReader("{}"), 20*time.Second) })
			}
			wg.Wait()
		})
		headerBytes := len(heads[0])
		var slowest time.Duration
		errs := map[string]int{}
		for i, r := range results {
			slowest = max(slowest, r.elapsed)
			switch {
			case r.err != nil:
				errs["transport"]++
			case r.status >= 400:
				errs[fmt.Sprint(r.status)]++
			}
			switch {
			case r.err != nil:
				t.Errorf("%s, client %d: %v", c.name, i, r.err)
			case r.status != c.status:
				t.Errorf("%s, client %d: status %d, want %d (%.200s)", c.name, i, r.status, c.status, r.body)
			case c.problem != "" && !strings.Contains(r.body, c.problem):
				t.Errorf("%s, client %d: body %.200q, want problem %s", c.name, i, r.body, c.problem)
			}
		}
		if slowest > 10*time.Second {
			t.Errorf("%s: slowest answer after %v, want well under 10s", c.name, slowest)
		}
		keys := keysWith(t, rdb, prefix)
		if got, want := len(keys)-before, c.stored*clients; got != want {
			t.Errorf("%s: %d records written, want %d", c.name, got, want)
		}
		if got, want := a.runs.Load()-runsBefore, int64(c.stored*clients); got != want {
			t.Errorf("%s: handler ran %d times, want %d", c.name, got, want)
		}
		// The header itself never reaches the store: records stay small.
		var largest int
		for _, k := range keys {
			n, err := rdb.Do("STRLEN", k)
			if err != nil {
				t.Fatal(err)
			}
			var l int
			fmt.Sscan(n, &l)
			largest = max(largest, l)
		}
		if largest > 1024 {
			t.Errorf("%s: a record of %d bytes: the header got into the store", c.name, largest)
		}
		// Bounded: a request's header is buffered a few times over by
		// net/http (bufio, textproto, the Header map), never without bound.
		perReq := total / int64(clients)
		if limit := int64(12 * headerBytes); perReq > limit {
			t.Errorf("%s: %s allocated per request for a %s header, want under %s", c.name, mib(perReq), mib(int64(headerBytes)), mib(limit))
		}
		if retained > 16<<20 {
			t.Errorf("%s: live heap grew by %s after the requests and a GC", c.name, mib(retained))
		}
		reltest.Report(t, reltest.Row{
			Scenario: "hostile: " + c.name, Store: "redis (single)", Fault: fmt.Sprintf("%d concurrent clients, %s of header each", clients, mib(int64(headerBytes))),
			Requests: clients, Keys: c.stored * clients, ClientErrors: errs,
			Notes: fmt.Sprintf("answer %d in ≤%v; %d records written; allocated %s per request, live heap %+.2f MiB after GC",
				c.status, slowest.Round(time.Millisecond), len(keys)-before, mib(perReq), float64(retained)/(1<<20)),
		})
	}
}
