package hostile

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/proctest"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/idemkit/idem/internal/reltest"
)

// peakRSS is the proxy process's VmHWM (peak resident set) in bytes.
func peakRSS(t *testing.T, p *proctest.Proxy) int64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", p.Cmd.Process.Pid))
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.Lines(string(b)) {
		if rest, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			var kb int64
			fmt.Sscanf(strings.TrimSpace(rest), "%d kB", &kb)
			return kb << 10
		}
	}
	t.Fatal("no VmHWM in /proc/PID/status")
	return 0
}

// TestProxyHostile runs the hostile-input scenarios against the `idem
// proxy` sidecar (its own process, on Redis): slowloris connections are
// cut at its ReadHeaderTimeout (5s, fixed) and --read-timeout while normal
// keyed requests pass; huge headers get 431 or 400 and huge bodies 413
// without the proxy's peak memory growing much; nothing refused reaches
// the upstream or the store; Set-Cookie is not replayed and tenants do not
// share replays.
func TestProxyHostile(t *testing.T) {
	t.Parallel()
	up := &app{}
	upstream, _ := startServer(t, up.handler(), nil)
	prefix := redistest.Prefix("proxy")
	const readTimeout = 3 * time.Second
	const headerTimeout = 5 * time.Second // cmd/idem's readHeaderTimeout
	p := proctest.StartProxy(t, "--upstream", upstream.URL, "--store", "redis://"+rdb.Addr(), "--prefix", prefix,
		"--read-timeout", readTimeout.String())
	base := "http://" + p.Addr
	client := newClient(10 * time.Second)
	if a := mustPost(t, client, base+"/charges", "proxy-warm-up", "{}", nil); a.status != http.StatusCreated {
		t.Fatalf("warm-up through the proxy: %d %s", a.status, a.body)
	}
	rssStart := peakRSS(t, p)

	// Slowloris, with normal traffic meanwhile.
	n := reltest.Scale(15, 300)
	ctx, cancel := context.WithCancel(context.Background())
	var tr traffic
	var wg sync.WaitGroup
	wg.Go(func() { tr.run(ctx, client, base+"/charges", "proxy") })
	cuts := attack(p.Addr, n, []slowKind{slowHeader, silent, slowBody}, "proxy", 20*time.Second)
	cancel()
	wg.Wait()
	var notes []string
	for _, kind := range []slowKind{slowHeader, silent, slowBody} {
		limit := headerTimeout
		if kind == slowBody {
			limit = readTimeout
		}
		open, first, last := cutStats(cuts[kind])
		if open > 0 {
			t.Errorf("proxy, %s: %d of %d connections still open after 20s", kindName[kind], open, len(cuts[kind]))
		}
		if first < limit*8/10 || last > limit+4*time.Second {
			t.Errorf("proxy, %s: cut after %v–%v, want about %v", kindName[kind], first, last, limit)
		}
		notes = append(notes, fmt.Sprintf("%d %s cut after %v–%v", len(cuts[kind]), kindName[kind], first.Round(time.Millisecond), last.Round(time.Millisecond)))
	}
	if tr.failed.Load() > 0 || tr.ok.Load() == 0 {
		t.Errorf("proxy: normal keyed requests during the attack: %d ok, %d failed (%v)", tr.ok.Load(), tr.failed.Load(), tr.errors)
	}
	reltest.Report(t, reltest.Row{
		Scenario: "hostile: slowloris (idem proxy)", Store: "redis (single)",
		Fault:    fmt.Sprintf("%d slow connections; proxy ReadHeaderTimeout 5s, --read-timeout 3s", n),
		Requests: n + int(tr.ok.Load()+tr.failed.Load()), Keys: int(tr.ok.Load()+tr.failed.Load()) / 2, ClientErrors: tr.errors,
		Notes: fmt.Sprintf("%s; meanwhile %d normal keyed requests ok, slowest %v", joinNotes(notes), tr.ok.Load(),
			time.Duration(tr.slowest.Load()).Round(time.Millisecond)),
	})

	// Huge headers and bodies.
	runsBefore := up.runs.Load()
	recordsBefore := len(keysWith(t, rdb, prefix))
	head := func(extra string) string {
		return "POST /charges HTTP/1.1\r\nHost: hostile\r\nContent-Type: application/json\r\n" + extra + "\r\n"
	}
	const size = 100_000_000
	cases := []struct {
		name   string
		head   string
		body   func() io.Reader
		status int
	}{
		{"1 MiB Idempotency-Key", head("Content-Length: 2\r\nIdempotency-Key: " + strings.Repeat("k", 1<<20) + "\r\n"),
			func() io.Reader { return strings.NewReader("{}") }, http.StatusBadRequest},
		{"1 MiB + 16 KiB Idempotency-Key", head("Content-Length: 2\r\nIdempotency-Key: " + strings.Repeat("k", 1<<20+16<<10) + "\r\n"),
			func() io.Reader { return strings.NewReader("{}") }, http.StatusRequestHeaderFieldsTooLarge},
		{"100 MB body, declared", head(fmt.Sprintf("Content-Length: %d\r\nIdempotency-Key: proxy-huge-1\r\n", size)),
			func() io.Reader { return io.LimitReader(zeros{}, size) }, http.StatusRequestEntityTooLarge},
		{"100 MB body, chunked", head("Transfer-Encoding: chunked\r\nIdempotency-Key: proxy-huge-2\r\n"),
			func() io.Reader { return chunked(size) }, http.StatusRequestEntityTooLarge},
	}
	errs := map[string]int{}
	var details []string
	for _, c := range cases {
		res := rawExchange(p.Addr, c.head, c.body(), 30*time.Second)
		if res.err != nil {
			errs["transport"]++
			t.Errorf("proxy, %s: %v", c.name, res.err)
			continue
		}
		errs[fmt.Sprint(res.status)]++
		if res.status != c.status || res.elapsed > 10*time.Second {
			t.Errorf("proxy, %s: %d after %v (%.200q), want %d within seconds", c.name, res.status, res.elapsed, res.body, c.status)
		}
		details = append(details, fmt.Sprintf("%s → %d in %v", c.name, res.status, res.elapsed.Round(time.Millisecond)))
	}
	if got := up.runs.Load() - runsBefore; got != 0 {
		t.Errorf("proxy: the upstream ran %d times for refused requests", got)
	}
	if got := len(keysWith(t, rdb, prefix)) - recordsBefore; got != 0 {
		t.Errorf("proxy: %d records written for refused requests", got)
	}
	// The keys of the refused bodies are free.
	for _, key := range []string{"proxy-huge-1", "proxy-huge-2"} {
		if a := mustPost(t, client, base+"/charges", key, "{}", nil); a.status != http.StatusCreated || a.header.Get(idemhttp.HeaderReplayed) != "" {
			t.Errorf("proxy: key %s after its 413: %d %q, want a first execution", key, a.status, a.body)
		}
	}
	rssEnd := peakRSS(t, p)
	if growth := rssEnd - rssStart; growth > 64<<20 {
		t.Errorf("proxy: peak RSS grew by %s during the attacks", mib(growth))
	}
	reltest.Report(t, reltest.Row{
		Scenario: "hostile: huge headers and bodies (idem proxy)", Store: "redis (single)",
		Fault:    "1 MiB and 1 MiB + 16 KiB Idempotency-Key; 100 MB bodies declared and chunked",
		Requests: len(cases) + 2, Keys: 2, ClientErrors: errs,
		Notes: fmt.Sprintf("%s; upstream never reached, 0 records; proxy peak RSS %s → %s (%+.1f MiB, slowloris included)",
			joinNotes(details), mib(rssStart), mib(rssEnd), float64(rssEnd-rssStart)/(1<<20)),
	})

	// Set-Cookie and tenants through the proxy.
	alice := map[string]string{"Authorization": "Bearer alice"}
	bob := map[string]string{"Authorization": "Bearer bob"}
	first := mustPost(t, client, base+"/charges", "proxy-shared", `{"amount":7}`, alice)
	replay := mustPost(t, client, base+"/charges", "proxy-shared", `{"amount":7}`, alice)
	other := mustPost(t, client, base+"/charges", "proxy-shared", `{"amount":7}`, bob)
	switch {
	case first.status != http.StatusCreated || first.header.Get("Set-Cookie") == "":
		t.Errorf("proxy: first answer %d with Set-Cookie %q, want 201 with a cookie", first.status, first.header.Get("Set-Cookie"))
	case replay.header.Get(idemhttp.HeaderReplayed) != "true" || replay.body != first.body:
		t.Errorf("proxy: repeat %d %q (replayed %q), want the replay of %q", replay.status, replay.body, replay.header.Get(idemhttp.HeaderReplayed), first.body)
	case len(replay.header.Values("Set-Cookie")) != 0:
		t.Errorf("proxy: the replay carries Set-Cookie %q", replay.header.Values("Set-Cookie"))
	case other.header.Get(idemhttp.HeaderReplayed) != "" || other.body == first.body || !strings.Contains(other.body, "Bearer bob"):
		t.Errorf("proxy: another tenant with the same key and body got %q (replayed %q); want its own execution", other.body, other.header.Get(idemhttp.HeaderReplayed))
	}
	reltest.Report(t, reltest.Row{
		Scenario: "hostile: Set-Cookie and cross-tenant replay (idem proxy)", Store: "redis (single)",
		Fault:    "same key and body from two Authorization headers; repeat of a response that set a cookie",
		Requests: 3, Keys: 2,
		Notes: "replay without Set-Cookie; the other tenant ran its own request",
	})
}
