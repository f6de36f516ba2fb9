// Package failover tests idem on Redis while the Redis topology changes
// under load: a manual CLUSTER FAILOVER, resharding of hot slots, and a
// Sentinel failover (with and without redisstore's WAIT option), with both
// client libraries. Every scenario reports one row of RELIABILITY.md.
package failover

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/reltest"
	"github.com/idemkit/idem/redisstore"
)

// lease is the lease the load's Guard takes: short, so that a key whose
// acquisition reply was lost frees up quickly, long against the work.
const lease = 3 * time.Second

// ledger runs load through a Guard and keeps what happened per key: how
// often the work ran, what was acknowledged, and what the clients saw.
type ledger struct {
	g     *idem.Guard
	store idem.Store

	mu        sync.Mutex
	execs     map[idem.Key]int    // runs of the work
	acked     map[idem.Key][]byte // the first completion Do acknowledged
	pending   map[idem.Key]bool   // keys whose last send did not succeed
	sent      map[idem.Key]bool   // every key sent
	rerunAck  map[idem.Key]bool   // the work ran again after an acknowledged completion
	unacked   int                 // runs whose result Do did not acknowledge (Complete failed)
	badReplay map[idem.Key]bool   // replayed another body than the acknowledged one
	requests  int
	replays   int
	errs      map[string]int
	samples   map[string]string
	phase     int // 0 before the fault, 1 during, 2 after
	okAfter   int // successes after the fault
	sentAfter int // sends after the fault
	lastErrs  []string

	// acks are the acknowledged runs per key, in order; sameToken the
	// keys with an acknowledged run missing from the store, which holds
	// another run under the same token (see verify).
	acks      map[idem.Key][]*runInfo
	sameToken map[idem.Key]bool

	// Diagnostics, logged per key when the accounting does not add up.
	t0       time.Time
	runs     map[idem.Key][]*runInfo // every run of the work
	history  map[idem.Key][]string   // every send's outcome
	verified map[idem.Key]string     // what verify read back
	missing  map[idem.Key]bool       // keys verify counted as lost
	loadSent int                     // sends by the load (not settle or verify)
	faultAt  time.Duration           // the fault's start and end, since t0
	faultEnd time.Duration
}

// runInfo is one run of the work.
type runInfo struct {
	n          int
	via        string // load, settle or verify
	token      uint64 // the lease's fencing token
	lease      idem.LeaseID
	start, end time.Duration // since the ledger began: the run, Do's return
	outcome    string        // acked, unacked: the error, or running
	body       []byte        // the body it returned
}

func newLedger(t *testing.T, store idem.Store) *ledger {
	g, err := idem.New(store, idem.Config{Lease: lease})
	if err != nil {
		t.Fatal(err)
	}
	return &ledger{g: g, store: store,
		execs: map[idem.Key]int{}, acked: map[idem.Key][]byte{}, pending: map[idem.Key]bool{}, sent: map[idem.Key]bool{},
		rerunAck: map[idem.Key]bool{}, badReplay: map[idem.Key]bool{}, errs: map[string]int{}, samples: map[string]string{},
		acks: map[idem.Key][]*runInfo{}, sameToken: map[idem.Key]bool{},
		t0: time.Now(), runs: map[idem.Key][]*runInfo{}, history: map[idem.Key][]string{}, verified: map[idem.Key]string{}}
}

func (l *ledger) since() time.Duration { return time.Since(l.t0) }

// send runs one request for key: the work records its run and returns a
// body naming the run.
func (l *ledger) send(ctx context.Context, key idem.Key, via string) bool {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	start := l.since()
	var ran *runInfo
	res, err := l.g.Do(ctx, key, idem.Fingerprint{1}, func(ctx context.Context) (*idem.Response, error) {
		l.mu.Lock()
		defer l.mu.Unlock()
		l.execs[key]++
		if l.acked[key] != nil {
			l.rerunAck[key] = true
		}
		ls, _ := idem.LeaseFromContext(ctx)
		body := fmt.Appendf(nil, "%s#%d", key, l.execs[key])
		ran = &runInfo{n: l.execs[key], via: via, token: ls.Token, lease: ls.ID, start: l.since(), outcome: "running", body: body}
		l.runs[key] = append(l.runs[key], ran)
		return &idem.Response{Status: 200, Body: body}, nil
	})
	l.mu.Lock()
	defer l.mu.Unlock()
	end := l.since()
	h := fmt.Sprintf("%v..%v %s: ", ms(start), ms(end), via)
	switch {
	case ran != nil && err != nil:
		ran.end, ran.outcome = end, "unacked: "+err.Error()
		h += fmt.Sprintf("ran #%d (token %d), not acknowledged: %v", ran.n, ran.token, err)
	case ran != nil:
		ran.end, ran.outcome = end, "acked"
		l.acks[key] = append(l.acks[key], ran)
		h += fmt.Sprintf("ran #%d (token %d), acknowledged", ran.n, ran.token)
	case err != nil:
		h += fmt.Sprintf("error (did not run): %v", err)
	case res.Replayed:
		h += fmt.Sprintf("replayed %q", bodyRun(res.Response.Body))
	}
	l.history[key] = append(l.history[key], h)
	l.requests++
	if via == "load" {
		l.loadSent++
	}
	l.sent[key] = true
	if l.phase == 2 {
		l.sentAfter++
	}
	if err != nil {
		if res.Response != nil {
			l.unacked++ // ran, result not (confirmed) stored: may run again
		}
		c := classify(err)
		l.errs[c]++
		if _, ok := l.samples[c]; !ok {
			l.samples[c] = err.Error()
		}
		if l.phase == 2 && c != "in_flight" {
			l.lastErrs = append(l.lastErrs, err.Error())
		}
		l.pending[key] = true
		return false
	}
	delete(l.pending, key)
	if l.phase == 2 {
		l.okAfter++
	}
	if res.Replayed {
		l.replays++
		if a := l.acked[key]; a != nil && !bytes.Equal(a, res.Response.Body) {
			l.badReplay[key] = true // the record was lost and redone
		}
		return true
	}
	if l.acked[key] == nil {
		l.acked[key] = res.Response.Body
	}
	return true
}

// classify names the kind of a failed Do, as a client sees it.
func classify(err error) string {
	switch {
	case errors.Is(err, idem.ErrInFlight):
		return "in_flight"
	case errors.Is(err, redisstore.ErrNotReplicated):
		return "not_replicated"
	case errors.Is(err, idem.ErrLeaseLost):
		return "lease_lost"
	case errors.Is(err, idem.ErrMismatch):
		return "mismatch"
	}
	s := err.Error()
	for _, p := range []string{"CROSSSLOT", "MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN", "READONLY", "LOADING", "NOSCRIPT", "MASTERDOWN", "UNBLOCKED"} {
		if strings.Contains(s, ": "+p+" ") || strings.HasPrefix(s, p+" ") || strings.Contains(s, " "+p+" ") {
			return p
		}
	}
	switch {
	case errors.Is(err, context.DeadlineExceeded) || strings.Contains(s, "timeout") || strings.Contains(s, "deadline"):
		return "timeout"
	case strings.Contains(s, "refused"):
		return "conn_refused"
	case strings.Contains(s, "EOF") || strings.Contains(s, "reset") || strings.Contains(s, "broken pipe") || strings.Contains(s, "closed"):
		return "conn_lost"
	}
	return "other"
}

func (l *ledger) setPhase(p int) {
	l.mu.Lock()
	l.phase = p
	l.mu.Unlock()
}

// loadSpec shapes the load: key(i) is the i-th key; each key is sent
// copies times in a row by different workers (so repeats race).
type loadSpec struct {
	workers int
	copies  int
	key     func(i int) idem.Key
}

// load sends until stop is closed.
func (l *ledger) load(ctx context.Context, spec loadSpec, stop <-chan struct{}) (wait func()) {
	var n atomic.Int64
	var wg sync.WaitGroup
	for range spec.workers {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				i := n.Add(1) - 1
				l.send(ctx, spec.key(int(i)/spec.copies), "load")
			}
		})
	}
	return wg.Wait
}

// settle retries every key whose last send failed, until it succeeds or
// the lease plus a grace period has passed; what stays failing is stuck.
func (l *ledger) settle(ctx context.Context) (stuck int) {
	deadline := time.Now().Add(lease + 5*time.Second)
	for {
		l.mu.Lock()
		keys := make([]idem.Key, 0, len(l.pending))
		for k := range l.pending {
			keys = append(keys, k)
		}
		l.mu.Unlock()
		if len(keys) == 0 || time.Now().After(deadline) {
			return len(keys)
		}
		parallel(keys, func(k idem.Key) { l.send(ctx, k, "settle") })
		time.Sleep(50 * time.Millisecond)
	}
}

// verify reads every acknowledged key back, sends it once more (a lost
// record runs the work again, which counts as a duplicate), and returns
// the keys whose acknowledged completion is gone.
//
// Every acknowledged run of a key counts, not only the first. A failover
// that loses a lease record lets a second holder take the key on the new
// primary while the first still completes on the old one, and both are
// acknowledged: the second run needs no unacknowledged run, and which of
// the two completions survives is a matter of timing. If the one that
// does not survive was acknowledged first, the first check catches it;
// if it was acknowledged later, only checking every acknowledged run
// does. Without this, the invariant in run failed about one run in eight
// of rueidis/wait=0.
func (l *ledger) verify(t *testing.T, ctx context.Context) (lost int) {
	l.mu.Lock()
	acks := make(map[idem.Key][]*runInfo, len(l.acks))
	for k, v := range l.acks {
		acks[k] = slices.Clone(v)
	}
	l.mu.Unlock()
	keys := make([]idem.Key, 0, len(acks))
	for k := range acks {
		keys = append(keys, k)
	}
	var mu sync.Mutex
	missing := map[idem.Key]bool{}
	parallel(keys, func(k idem.Key) {
		rec, ok, err := l.store.Get(ctx, k)
		if err != nil {
			t.Errorf("verify: get %v: %v", k, err)
			return
		}
		completed := ok && rec.State == idem.StateCompleted && rec.Response != nil
		found := "no record"
		if ok {
			found = fmt.Sprintf("state %v, token %d", rec.State, rec.Token)
			if rec.Response != nil {
				found += fmt.Sprintf(", body %q", bodyRun(rec.Response.Body))
			}
		}
		gone, same := false, false
		for _, a := range acks[k] {
			if completed && bytes.Equal(rec.Response.Body, a.body) {
				continue
			}
			gone = true
			// The store holds another run under this run's token, and
			// that run had started before this one's Do returned: its
			// completion may have been written before this one's
			// Complete ran, which redisstore then takes for its own (a
			// false acknowledgement; see the notes in run).
			if completed && rec.Token == a.token && l.startedBefore(k, rec.Response.Body, a.end) {
				same = true
			}
		}
		l.mu.Lock()
		l.verified[k] = fmt.Sprintf("%s (acknowledged %q)", found, bodyRun(acks[k][0].body))
		if same {
			l.sameToken[k] = true
		}
		l.mu.Unlock()
		if gone {
			mu.Lock()
			missing[k] = true
			mu.Unlock()
		}
		if !completed || !bytes.Equal(rec.Response.Body, acks[k][0].body) {
			l.send(ctx, k, "verify") // a client's retry
		}
	})
	l.mu.Lock()
	defer l.mu.Unlock()
	for k := range l.rerunAck {
		missing[k] = true
	}
	for k := range l.badReplay {
		missing[k] = true
	}
	l.missing = missing
	return len(missing)
}

// startedBefore reports whether the run of key that returned body started
// before at.
func (l *ledger) startedBefore(key idem.Key, body []byte, at time.Duration) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, r := range l.runs[key] {
		if bytes.Equal(r.body, body) {
			return r.start < at
		}
	}
	return false
}

// ms rounds d for the diagnostics.
func ms(d time.Duration) time.Duration { return d.Round(time.Millisecond) }

// bodyRun is the run a body names ("#3"), short for the diagnostics.
func bodyRun(b []byte) string {
	if i := bytes.LastIndexByte(b, '#'); i >= 0 {
		return string(b[i:])
	}
	return string(b)
}

// explain logs, for every key whose runs the accounting does not
// explain or that verify found under the same token, what the ledger saw
// of it:
// each run (its lease, token, when it ran, what Do returned) and each
// send.
func (l *ledger) explain(t *testing.T) {
	l.mu.Lock()
	defer l.mu.Unlock()
	t.Logf("the fault ran from %v to %v", ms(l.faultAt), ms(l.faultEnd))
	for k, n := range l.execs {
		unacked := 0
		for _, r := range l.runs[k] {
			if strings.HasPrefix(r.outcome, "unacked") {
				unacked++
			}
		}
		lost := 0
		if l.missing[k] {
			lost = 1
		}
		if n-1 <= unacked+lost && !l.sameToken[k] {
			continue
		}
		var b strings.Builder
		fmt.Fprintf(&b, "key %v: %d runs, %d unacknowledged, lost %v, rerun after ack %v, bad replay %v, same token %v; verify found %s\n",
			k, n, unacked, l.missing[k], l.rerunAck[k], l.badReplay[k], l.sameToken[k], l.verified[k])
		for _, r := range l.runs[k] {
			fmt.Fprintf(&b, "  run #%d via %s, token %d, lease %x, ran at %v, Do returned at %v: %s\n", r.n, r.via, r.token, r.lease[:4], ms(r.start), ms(r.end), r.outcome)
		}
		for _, h := range l.history[k] {
			fmt.Fprintf(&b, "  send %s\n", h)
		}
		t.Log(b.String())
	}
}

// logSends logs every send in the order they started.
func (l *ledger) logSends(t *testing.T) {
	l.mu.Lock()
	defer l.mu.Unlock()
	var all []string
	for k, hs := range l.history {
		for _, h := range hs {
			all = append(all, h+" key "+k.String()[:6])
		}
	}
	slices.SortFunc(all, func(a, b string) int {
		da, _ := time.ParseDuration(a[:strings.Index(a, "..")])
		db, _ := time.ParseDuration(b[:strings.Index(b, "..")])
		return int(da - db)
	})
	t.Logf("the fault ran from %v to %v; sends:\n%s", ms(l.faultAt), ms(l.faultEnd), strings.Join(all, "\n"))
}

// parallel runs fn over keys with a few goroutines.
func parallel(keys []idem.Key, fn func(idem.Key)) { reltest.Parallel(keys, 8, fn) }

// result is what a scenario found.
type result struct {
	requests, keys, duplicates, unacked, lost, stuck, badReplay, replays int
	loadSent, sameToken                                                  int
	okAfter, sentAfter                                                   int
	errs                                                                 map[string]int
	samples                                                              map[string]string
	lastErrs                                                             []string
}

func (l *ledger) result() result {
	l.mu.Lock()
	defer l.mu.Unlock()
	r := result{requests: l.requests, keys: len(l.sent), unacked: l.unacked,
		badReplay: len(l.badReplay), replays: l.replays, okAfter: l.okAfter, sentAfter: l.sentAfter,
		loadSent: l.loadSent, sameToken: len(l.sameToken),
		errs: map[string]int{}, samples: l.samples, lastErrs: l.lastErrs}
	for _, n := range l.execs {
		r.duplicates += max(n-1, 0)
	}
	for k, v := range l.errs {
		r.errs[k] = v
	}
	return r
}

// scenario is one run: load, the fault in the middle, settle, verify,
// report.
type scenario struct {
	name, store, fault string
	spec               loadSpec
	warmup, after      time.Duration
	notes              string
	// extra, if set, adds to the notes what the fault found out.
	extra func() string
}

// run drives the scenario; fault performs the fault and returns when the
// topology is stable again.
func (sc scenario) run(t *testing.T, store idem.Store, fault func(t *testing.T)) result {
	ctx := context.Background()
	l := newLedger(t, store)
	stop := make(chan struct{})
	wait := l.load(ctx, sc.spec, stop)
	time.Sleep(sc.warmup)
	l.setPhase(1)
	start := time.Now()
	l.mu.Lock()
	l.faultAt = l.since()
	l.mu.Unlock()
	func() {
		defer func() {
			if t.Failed() {
				close(stop)
				wait()
			}
		}()
		fault(t)
	}()
	if t.Failed() {
		t.FailNow()
	}
	faultTook := time.Since(start)
	l.mu.Lock()
	l.faultEnd = l.since()
	l.mu.Unlock()
	l.setPhase(2)
	time.Sleep(sc.after)
	close(stop)
	wait()
	stuck := l.settle(ctx)
	lost := l.verify(t, ctx)
	r := l.result()
	r.lost, r.stuck = lost, stuck
	for c, s := range r.samples {
		t.Logf("first %s error: %s", c, s)
	}
	notes := fmt.Sprintf("%s; fault took %v; %d replays (%d keys replayed another run's result); %d runs not acknowledged; %d of %d sends after the fault succeeded",
		sc.notes, faultTook.Round(10*time.Millisecond), r.replays, r.badReplay, r.unacked, r.okAfter, r.sentAfter)
	if sc.extra != nil {
		notes += "; " + sc.extra()
	}
	reltest.Report(t, reltest.Row{Scenario: sc.name, Store: sc.store, Fault: sc.fault,
		Requests: r.requests, Keys: r.keys, Duplicates: r.duplicates, Lost: r.lost, Stuck: r.stuck,
		ClientErrors: r.errs, Notes: strings.TrimPrefix(notes, "; ")})

	// What must hold whatever the fault.
	if r.errs["CROSSSLOT"] > 0 || r.errs["mismatch"] > 0 {
		t.Errorf("CROSSSLOT %d, mismatch %d: want 0", r.errs["CROSSSLOT"], r.errs["mismatch"])
	}
	// A duplicate needs a run whose result was not acknowledged, or a
	// lost record (verify counts a key lost when any of its acknowledged
	// runs is gone, not only the first).
	if r.duplicates > r.unacked+r.lost {
		t.Errorf("%d duplicates, but only %d unacknowledged runs and %d lost records", r.duplicates, r.unacked, r.lost)
		l.explain(t)
	}
	// An acknowledged run missing from the store, which holds another run
	// under the same fencing token (the two leases were taken in the same
	// millisecond, on the old and on the new primary), is a completion
	// written on the old primary and lost with it; it counts as lost.
	// (Before complete.lua compared the response too, it could also be a
	// Complete answered as a repeat over the other lease's record and
	// never written: seen in the servers' command logs.)
	if r.sameToken > 0 {
		t.Logf("%d keys with an acknowledged run missing from the store, which holds another run under its token (lost on the old primary, or acknowledged unwritten)", r.sameToken)
	}
	if r.stuck > 0 {
		t.Errorf("%d keys stuck after lease + grace", r.stuck)
	}
	if r.okAfter == 0 {
		t.Errorf("no send succeeded after the fault (%d sent); last errors: %q", r.sentAfter, tail(r.lastErrs, 3))
	}
	// The load ran: it sent at least copies rounds per worker. A healthy
	// run sends thousands; on a loaded machine with WaitReplicas, where a
	// completion can wait its whole WaitTimeout, fewer than 100 have been
	// seen (93). A load that does not run at all (each worker stuck in its
	// first send until the 5s timeout) stays at one or two per worker.
	// Settle's and verify's sends do not count: they run whatever the load
	// did.
	if floor := sc.spec.workers * sc.spec.copies; r.loadSent < floor {
		t.Errorf("only %d requests from the load (%d in all), fewer than %d: the load did not run", r.loadSent, r.requests, floor)
		l.logSends(t)
	}
	return r
}

func tail(s []string, n int) []string { return s[max(len(s)-n, 0):] }

// randomKey is a fresh key, as Scope.Key would derive it.
func randomKey() idem.Key {
	var k idem.Key
	rand.Read(k[:])
	return k
}

// prefix is a fresh key prefix, so scenarios on one server do not meet.
func prefix(name string) string {
	return fmt.Sprintf("fo-%s-%d:", name, time.Now().UnixNano()%1e9)
}

func TestMain(m *testing.M) {
	code := m.Run()
	stopCluster()
	os.Exit(code)
}
