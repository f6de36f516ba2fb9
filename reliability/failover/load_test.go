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
}

func newLedger(t *testing.T, store idem.Store) *ledger {
	g, err := idem.New(store, idem.Config{Lease: lease})
	if err != nil {
		t.Fatal(err)
	}
	return &ledger{g: g, store: store,
		execs: map[idem.Key]int{}, acked: map[idem.Key][]byte{}, pending: map[idem.Key]bool{}, sent: map[idem.Key]bool{},
		rerunAck: map[idem.Key]bool{}, badReplay: map[idem.Key]bool{}, errs: map[string]int{}, samples: map[string]string{}}
}

// send runs one request for key: the work records its run and returns a
// body naming the run.
func (l *ledger) send(ctx context.Context, key idem.Key) bool {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	res, err := l.g.Do(ctx, key, idem.Fingerprint{1}, func(context.Context) (*idem.Response, error) {
		l.mu.Lock()
		defer l.mu.Unlock()
		l.execs[key]++
		if l.acked[key] != nil {
			l.rerunAck[key] = true
		}
		return &idem.Response{Status: 200, Body: fmt.Appendf(nil, "%s#%d", key, l.execs[key])}, nil
	})
	l.mu.Lock()
	defer l.mu.Unlock()
	l.requests++
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
				l.send(ctx, spec.key(int(i)/spec.copies))
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
		parallel(keys, func(k idem.Key) { l.send(ctx, k) })
		time.Sleep(50 * time.Millisecond)
	}
}

// verify reads every acknowledged key back, sends it once more (a lost
// record runs the work again, which counts as a duplicate), and returns
// the keys whose acknowledged completion is gone.
func (l *ledger) verify(t *testing.T, ctx context.Context) (lost int) {
	l.mu.Lock()
	acked := make(map[idem.Key][]byte, len(l.acked))
	for k, v := range l.acked {
		acked[k] = v
	}
	l.mu.Unlock()
	keys := make([]idem.Key, 0, len(acked))
	for k := range acked {
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
		if !ok || rec.State != idem.StateCompleted || !bytes.Equal(rec.Response.Body, acked[k]) {
			mu.Lock()
			missing[k] = true
			mu.Unlock()
			l.send(ctx, k) // a client's retry
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
	return len(missing)
}

// parallel runs fn over keys with a few goroutines.
func parallel(keys []idem.Key, fn func(idem.Key)) {
	ch := make(chan idem.Key)
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for k := range ch {
				fn(k)
			}
		})
	}
	for _, k := range keys {
		ch <- k
	}
	close(ch)
	wg.Wait()
}

// result is what a scenario found.
type result struct {
	requests, keys, duplicates, unacked, lost, stuck, badReplay, replays int
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
	// lost record.
	if r.duplicates > r.unacked+r.lost {
		t.Errorf("%d duplicates, but only %d unacknowledged runs and %d lost records", r.duplicates, r.unacked, r.lost)
	}
	if r.stuck > 0 {
		t.Errorf("%d keys stuck after lease + grace", r.stuck)
	}
	if r.okAfter == 0 {
		t.Errorf("no send succeeded after the fault (%d sent); last errors: %q", r.sentAfter, tail(r.lastErrs, 3))
	}
	if r.requests < 100 {
		t.Errorf("only %d requests: the load did not run", r.requests)
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
