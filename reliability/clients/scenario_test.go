package clients

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/reltest"
)

// scenario is one way clients meet idem.
type scenario struct {
	name     string // for the report
	short    string // in keys
	path     string // the upstream route: /pay, /stream or /flaky
	fault    string // for the report
	timeout  time.Duration
	attempts int
	clients  []client
	// sameKey: every client sends the same key (a storm of copies); else
	// each client has a key of its own.
	sameKey bool
	// ownAnswer: one final 201 per key may be the execution's own answer;
	// else every final 201 must be a replay (the execution's own client
	// had left).
	ownAnswer bool
}

// runScenario runs sc on the six targets (idem proxy, the middleware and
// Caddy, on memory and on Redis) at once, one subtest each.
func runScenario(t *testing.T, sc scenario) {
	for _, c := range sc.clients {
		if c.tool != "" {
			toolPath(t, c.tool)
		}
	}
	e := newEnv(t)
	for _, tg := range e.targets {
		t.Run(tg.short, func(t *testing.T) {
			t.Parallel()
			row, _ := runOn(t, e.up, tg, sc)
			reltest.Report(t, row)
		})
	}
}

// runOn runs every client of sc at once against tg, then checks each key;
// it returns the report's row and the keys.
func runOn(t *testing.T, up *upstream, tg *target, sc scenario) (reltest.Row, []string) {
	if !sc.sameKey { // the long run: each client on 4 keys at once
		sc.clients = slices.Repeat(sc.clients, reltest.Scale(1, 4))
	}
	body := fmt.Sprintf(`{"amount":%d,"currency":"eur"}`, 100+bodySeq.Add(1))
	keys := make([]string, len(sc.clients))
	for i := range keys {
		keys[i] = fmt.Sprintf("%s-%s-%d-%s", sc.short, tg.short, i, runID)
		if sc.sameKey {
			keys[i] = fmt.Sprintf("%s-%s-%s", sc.short, tg.short, runID)
		}
	}
	results := make([]result, len(sc.clients))
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i, c := range sc.clients {
		wg.Go(func() {
			<-start
			results[i] = c.run(context.Background(), call{url: tg.url + sc.path, key: keys[i], body: body,
				timeout: cmp.Or(c.timeout, sc.timeout), attempts: sc.attempts})
			results[i].Client, results[i].key = c.name, keys[i]
		})
	}
	close(start)
	wg.Wait()

	tl := newTally()
	keys = slices.Compact(keys)
	for _, key := range keys {
		var rs []result
		for _, r := range results {
			if r.key == key {
				rs = append(rs, r)
			}
		}
		checkKey(t, up, tg, sc, key, body, rs, tl)
	}
	var paths []string
	if len(results) <= 6 { // the attempts of each client, in the short run
		for _, r := range results {
			paths = append(paths, fmt.Sprintf("%s: %s", r.Client, strings.Join(r.Seen, "→")))
		}
	}
	return reltest.Row{
		Scenario: fmt.Sprintf("clients: %s (%s)", sc.name, tg.name), Store: tg.store, Fault: sc.fault,
		Requests: tl.requests, Keys: tl.keys, Duplicates: tl.duplicates, Lost: tl.lost, ClientErrors: tl.seen,
		Notes: tl.notes(tg, paths),
	}, keys
}

// tally adds up the checks of a scenario's keys for its row.
type tally struct {
	requests, keys, duplicates, lost int
	seen                             map[string]int // what attempts saw besides the final 201s
	outcomes                         map[string]int // what idem did with them
	calls, effects                   []int          // per key
}

func newTally() *tally { return &tally{seen: map[string]int{}, outcomes: map[string]int{}} }

func (tl *tally) notes(tg *target, paths []string) string {
	what := "middleware outcomes"
	switch {
	case tg.caddies != nil:
		what = "Caddy access log outcome→status"
	case tg.mw == nil:
		what = "proxy log outcome→status"
	}
	n := fmt.Sprintf("effects per key %v, upstream calls per key %v; %s: %s", tl.effects, tl.calls, what, reltest.FormatErrors(tl.outcomes))
	if len(paths) > 0 {
		n += "; attempts: " + strings.Join(paths, "; ")
	}
	return n
}

// checkKey asserts, once the upstream is done with key, that it had
// exactly one effect; that every client's final answer (rs) is 201 with
// that effect's body (a replay, marked Idempotent-Replayed: true, except
// at most one execution's own answer when sc.ownAnswer), or a documented
// 409 (in flight, Retry-After) or 422; that a later request with the key
// gets the same replay; and that idem did not let go of the key because a
// client left (no upstream_aborted or 502 in the proxy's log, no handler
// context cancelled in the middleware).
func checkKey(t *testing.T, up *upstream, tg *target, sc scenario, key, body string, rs []result, tl *tally) {
	t.Helper()
	if !waitFor(15*time.Second, func() bool { return up.snapshot(key).running == 0 }) {
		t.Errorf("key %s: got the upstream still working after 15s, want it done", key)
	}
	// The check's own client: it retries a 409 until the stored answer.
	later := runGo(context.Background(), call{url: tg.url + sc.path, key: key, body: body, timeout: 5 * time.Second, attempts: 6})
	l := up.snapshot(key)
	tl.keys++
	tl.calls = append(tl.calls, l.calls)
	tl.effects = append(tl.effects, len(l.effects))
	tl.duplicates += max(0, len(l.effects)-1)
	if len(l.effects) != 1 {
		t.Errorf("key %s: got %d effects (%d upstream calls), want 1", key, len(l.effects), l.calls)
	}
	want := ""
	if len(l.effects) > 0 {
		want = l.effects[0]
	}
	lost, own := false, 0
	var wrong []result // final 201s with another body
	for _, r := range rs {
		tl.requests += len(r.Seen)
		for i, s := range r.Seen {
			if i < len(r.Seen)-1 || r.Status != 201 {
				tl.seen[s]++
			}
		}
		switch r.Status {
		case 201:
			if r.Body != want {
				wrong = append(wrong, r)
			}
			if r.Replayed != "true" {
				own++
			}
		case 409:
			tl.seen["final 409"]++
			if r.RetryAfter == "" || !strings.Contains(r.Body, idemhttp.ProblemInFlight) {
				t.Errorf("%s, key %s: got a final 409 with Retry-After %q and body %.120q, want the in-flight problem with Retry-After", r.Client, key, r.RetryAfter, r.Body)
			}
		case 422:
			tl.seen["final 422"]++
		default:
			tl.seen[fmt.Sprintf("final %d", r.Status)]++
			t.Errorf("%s, key %s: got a final %d %.120q (error %q; attempts saw %v), want 201 or a documented 409 or 422",
				r.Client, key, r.Status, r.Body, r.Error, r.Seen)
		}
	}
	if len(wrong) > 0 {
		r := wrong[0]
		t.Errorf("key %s: got %d of %d clients ending with a 201 whose body is not the first effect's, e.g. %s: %d bytes %.90q, want %d bytes %.90q",
			key, len(wrong), len(rs), r.Client, len(r.Body), r.Body, len(want), want)
		lost = true
	}
	if maxOwn := map[bool]int{true: 1}[sc.ownAnswer]; own > maxOwn {
		t.Errorf("key %s: got %d final 201s without %s: true, want at most %d (every other one is a replay)", key, own, idemhttp.HeaderReplayed, maxOwn)
	}
	if later.Status != 201 || later.Replayed != "true" || later.Body != want {
		t.Errorf("key %s: a later request got %d (replayed %q, %d bytes %.90q, error %q), want the replay of %d bytes %.90q",
			key, later.Status, later.Replayed, len(later.Body), later.Body, later.Error, len(want), want)
		lost = true
	}
	if lost {
		tl.lost++
	}
	// The proxy logs a request after answering it: give the last lines a
	// moment to arrive (one per attempt that reached it, at least).
	sent := len(later.Seen)
	for _, r := range rs {
		sent += len(r.Seen)
	}
	waitFor(2*time.Second, func() bool { return len(tg.outcomesOf(key, sc.path)) >= sent })
	outs := tg.outcomesOf(key, sc.path)
	for _, o := range outs {
		tl.outcomes[o]++
	}
	if bad := slices.DeleteFunc(outs, func(o string) bool {
		return !strings.HasPrefix(o, "upstream_aborted") && !strings.HasSuffix(o, "→502")
	}); len(bad) > 0 {
		t.Errorf("key %s: got proxy log outcomes %v (the client's departure taken for an upstream failure: the upstream request cut, the key released), want none", key, bad)
	}
	if n := tg.cancelledHandlers(key); n > 0 {
		t.Errorf("key %s: got %d handler contexts cancelled while the work ran (the client's departure), want 0", key, n)
	}
}

// waitFor polls cond every 20ms until it holds or d passes.
func waitFor(d time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(20 * time.Millisecond)
	}
	return true
}

// clientTimeout is the timeout per attempt of the clients that give up
// during the work (workTime, 1 s).
const clientTimeout = 300 * time.Millisecond

// TestTimeoutDuringWork: each client sends a POST whose work takes 1 s,
// times out after 0.3 s, and retries with its own logic; the retry meets
// the key in flight (409, Retry-After: 1) and then the replay.
func TestTimeoutDuringWork(t *testing.T) {
	runScenario(t, scenario{
		name: "client times out during the work, retries", short: "during", path: "/pay",
		fault:   "1 s of work; clients time out after 0.3 s per attempt (python read timeout, AbortSignal.timeout, curl -m, http.Client.Timeout, Transport.AttemptTimeout) and retry",
		timeout: clientTimeout, attempts: 8,
		clients: []client{pythonClient, nodeClient, curlClient, goClient, goTransportClient},
	})
}

// TestTimeoutMidBody: the upstream sends 201 and half its body at once and
// the rest 1 s later; clients time out (0.3 s) or close the connection
// while reading the body, and retry.
func TestTimeoutMidBody(t *testing.T) {
	runScenario(t, scenario{
		name: "client leaves during the response body, retries", short: "midbody", path: "/stream",
		fault:   "upstream sends 201 and half a 4 KiB body, the rest 1 s later; clients time out after 0.3 s or close the connection after 64 bytes, and retry",
		timeout: clientTimeout, attempts: 8,
		clients: []client{pythonClient, nodeClient, curlClient, goClient, goDropClient},
	})
}

// TestServerErrorFirst: the upstream answers the first request of each key
// 503 without acting; idem releases the key and the client's retry runs
// it. That is two upstream calls but one effect (a 201): effects are what
// is counted.
func TestServerErrorFirst(t *testing.T) {
	runScenario(t, scenario{
		name: "5xx first, then a retry", short: "5xx", path: "/flaky",
		fault:   "the upstream answers the first request of each key 503 without an effect; clients retry (5 s timeouts)",
		timeout: 5 * time.Second, attempts: 5, ownAnswer: true,
		clients: []client{pythonClient, nodeClient, curlClient, goClient, goTransportClient},
	})
}

// TestStorm: 20 Go copies of one request at once (100 in the long run),
// half of them with a 0.3 s timeout, and 3 Python processes (10) with the
// same key, all retrying.
func TestStorm(t *testing.T) {
	copies, processes := reltest.Scale(20, 100), reltest.Scale(3, 10)
	var clients []client
	for i := range copies {
		c := goClient
		c.name = fmt.Sprintf("Go #%d", i)
		if i%2 == 0 {
			c.timeout = 5 * time.Second
		}
		clients = append(clients, c)
	}
	for i := range processes {
		c := pythonClient
		c.name = fmt.Sprintf("python #%d", i)
		clients = append(clients, c)
	}
	runScenario(t, scenario{
		name: "storm of copies of one key", short: "storm", path: "/pay", sameKey: true, ownAnswer: true,
		fault: fmt.Sprintf("%d Go copies at once (half with a 0.3 s timeout, half 5 s) and %d python processes (0.3 s read timeout), one key, 1 s of work, all retrying",
			copies, processes),
		timeout: clientTimeout, attempts: 10, clients: clients,
	})
}
