package linearize

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"

	"github.com/idemkit/idem"
)

// recorder collects a history. Timestamps are nanoseconds on the monotonic
// clock since start.
type recorder struct {
	start time.Time

	mu      sync.Mutex
	ops     []porcupine.Operation
	unknown int
	errs    map[string]int // indeterminate calls by kind of error
	samples []string       // the first error of each kind
}

func newRecorder() *recorder {
	return &recorder{start: time.Now(), errs: map[string]int{}}
}

func (r *recorder) now() int64 { return int64(time.Since(r.start)) }

func (r *recorder) add(client int, in input, call int64, out output, ret int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.ops = append(r.ops, porcupine.Operation{ClientId: client, Input: in, Call: call, Output: out, Return: ret})
}

// history returns the recorded operations with every indeterminate one's
// return moved past the last event of the history: it may have taken
// effect at any moment after its invocation, or never.
func (r *recorder) history() []porcupine.Operation {
	r.mu.Lock()
	defer r.mu.Unlock()
	var end int64
	for _, op := range r.ops {
		end = max(end, op.Return, op.Call)
	}
	h := make([]porcupine.Operation, len(r.ops))
	for i, op := range r.ops {
		if op.Output.(output).unknown {
			op.Return = end + 1
		}
		h[i] = op
	}
	return h
}

// errKind names an indeterminate error for the report.
func errKind(err error) string {
	s := err.Error()
	switch {
	case errors.Is(err, context.DeadlineExceeded) || strings.Contains(s, "timeout") || strings.Contains(s, "deadline"):
		return "timeout"
	case strings.Contains(s, "reset"):
		return "conn reset"
	case strings.Contains(s, "EOF"):
		return "EOF"
	case strings.Contains(s, "refused"):
		return "conn refused"
	case strings.Contains(s, "closed"):
		return "conn closed"
	}
	return "other store error"
}

// workload drives a store from many clients and records the history.
type workload struct {
	store    idem.Store
	keys     []idem.Key
	fps      [2]idem.Fingerprint
	clients  int
	cycles   int           // per client: acquire cycles
	leaseTTL time.Duration // acquire and renew
	retain   time.Duration // complete's retention
	callTTL  time.Duration // per-call context timeout (0: none)
	// retries: how many times an indeterminate call is repeated with the
	// same arguments (as a real client would after a lost reply).
	retries    int
	retryPause time.Duration
	// pCompleteP: probability that a holder completes rather than releases.
	pComplete float64
	// pause between cycles (0: none); in timed runs, lets the clock run.
	pause time.Duration
	// timed: the store runs on a test clock; ticks are recorded by the
	// caller through rec.
	rec *recorder
	// window and stride: clients pick one of window consecutive keys, and
	// the window moves one key ahead every stride cycles (over all
	// clients), so that every key sees contention, releases, takeovers and
	// completion, and then retires with a bounded history.
	window, stride int
	progress       atomic.Int64

	// stop, when set, ends the run instead of cycles (bounded by the keys:
	// a client stops when the window reaches the last key).
	stop atomic.Bool
	// holdPause: a holder sometimes sleeps up to this long before it
	// completes or releases (timed runs: its lease may expire).
	holdPause time.Duration
	// untilStop: run until stop is set rather than for cycles.
	untilStop bool

	bad   error // first unexpected (non-store) error
	badMu sync.Mutex
}

// keysFor returns how many keys a workload needs.
func keysFor(clients, cycles, window, stride int) int {
	return clients*cycles/stride + window
}

func (w *workload) fail(err error) {
	w.badMu.Lock()
	defer w.badMu.Unlock()
	if w.bad == nil {
		w.bad = err
	}
}

// call runs one operation, records it and returns its output. A
// *idem.StoreError is indeterminate; ErrLeaseLost is a definite "lost";
// any other error is a test failure (recorded as unknown to keep going).
func (w *workload) call(client int, in input, f func(ctx context.Context) (output, error)) output {
	ctx := context.Background()
	var cancel context.CancelFunc = func() {}
	if w.callTTL > 0 {
		ctx, cancel = context.WithTimeout(ctx, w.callTTL)
	}
	call := w.rec.now()
	out, err := f(ctx)
	ret := w.rec.now()
	cancel()
	if err != nil {
		var se *idem.StoreError
		switch {
		case errors.Is(err, idem.ErrLeaseLost) && (in.kind == opComplete || in.kind == opRelease || in.kind == opRenew):
			out = output{ok: false}
		case errors.As(err, &se):
			if errors.Is(err, idem.ErrCorrupt) {
				w.fail(fmt.Errorf("%s: %w", in.kind, err))
			}
			out = output{unknown: true}
			w.rec.mu.Lock()
			w.rec.unknown++
			kind := errKind(err)
			if w.rec.errs[kind] == 0 {
				w.rec.samples = append(w.rec.samples, err.Error())
			}
			w.rec.errs[kind]++
			w.rec.mu.Unlock()
		default:
			w.fail(fmt.Errorf("%s: unexpected error: %w", in.kind, err))
			out = output{unknown: true}
		}
	}
	w.rec.add(client, in, call, out, ret)
	return out
}

// callRetry repeats an indeterminate call with the same input, up to
// w.retries times.
func (w *workload) callRetry(client int, in input, f func(ctx context.Context) (output, error)) output {
	out := w.call(client, in, f)
	for i := 0; out.unknown && i < w.retries; i++ {
		time.Sleep(w.retryPause + rand.N(w.retryPause+1))
		out = w.call(client, in, f)
	}
	return out
}

func (w *workload) fpIndex(fp idem.Fingerprint) uint8 {
	for i, f := range w.fps {
		if f == fp {
			return uint8(i)
		}
	}
	return fpNone
}

func (w *workload) acquire(client, k int, fp uint8, id idem.LeaseID) (output, idem.Lease) {
	var lease idem.Lease
	in := input{kind: opAcquire, key: k, fp: fp, lease: id, ttl: w.leaseTTL}
	out := w.callRetry(client, in, func(ctx context.Context) (output, error) {
		a, err := w.store.Acquire(ctx, idem.AcquireRequest{Key: w.keys[k], Fingerprint: w.fps[fp], LeaseID: id, TTL: w.leaseTTL})
		if err != nil {
			return output{}, err
		}
		o := output{outcome: a.Outcome}
		switch a.Outcome {
		case idem.Acquired:
			o.token, o.ttl = a.Lease.Token, a.Lease.TTL
			if a.Lease.ID != id || a.Lease.Key != w.keys[k] {
				w.fail(fmt.Errorf("acquire: lease %+v for id %v", a.Lease, id))
			}
			lease = a.Lease
		case idem.Replay:
			o.resp = canon(a.Response)
		case idem.InFlight:
			o.ttl = a.RetryAfter
		}
		return o, nil
	})
	return out, lease
}

func (w *workload) leaseOp(client int, kind opKind, l idem.Lease, k int, resp *idem.Response) output {
	in := input{kind: kind, key: k, lease: l.ID, token: l.Token}
	switch kind {
	case opComplete:
		in.resp, in.ttl = canon(resp), w.retain
	case opRelease:
		in.ttl = l.TTL
	case opRenew:
		in.ttl = w.leaseTTL
	}
	return w.callRetry(client, in, func(ctx context.Context) (output, error) {
		var err error
		switch kind {
		case opComplete:
			err = w.store.Complete(ctx, l, resp, w.retain)
		case opRelease:
			err = w.store.Release(ctx, l)
		case opRenew:
			err = w.store.Renew(ctx, l, w.leaseTTL)
		}
		return output{ok: err == nil}, err
	})
}

func (w *workload) get(client, k int) output {
	in := input{kind: opGet, key: k}
	return w.call(client, in, func(ctx context.Context) (output, error) {
		rec, found, err := w.store.Get(ctx, w.keys[k])
		if err != nil {
			return output{}, err
		}
		o := output{found: found}
		if found {
			o.state, o.token, o.fp, o.lease, o.ttl = rec.State, rec.Token, w.fpIndex(rec.Fingerprint), rec.LeaseID, rec.TTL
			if rec.State == idem.StateCompleted {
				o.resp = canon(rec.Response)
			}
		}
		return o, nil
	})
}

// response returns a response unique to a lease: its status, a header
// naming the lease and a body of random bytes, sometimes large and
// compressible (stored zstd-compressed).
func response(r *rand.Rand, l idem.Lease) *idem.Response {
	var body []byte
	switch r.IntN(4) {
	case 0: // empty
	case 1: // large, compressible
		body = []byte(strings.Repeat(fmt.Sprintf("lease %s token %d; ", l.ID, l.Token), 100))
	default: // random binary
		body = make([]byte, 1+r.IntN(96))
		for i := range body {
			body[i] = byte(r.UintN(256))
		}
	}
	h := http.Header{"X-Lease": {l.ID.String()}, "X-Token": {fmt.Sprint(l.Token)}}
	if r.IntN(2) == 0 {
		h = http.Header{"Content-Type": {"application/json"}, "X-Lease": {l.ID.String()}}
	}
	return &idem.Response{Status: 200 + r.IntN(3), Header: h, Body: body}
}

// run starts the clients and waits for them.
func (w *workload) run(seed uint64) {
	var wg sync.WaitGroup
	for c := range w.clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			w.client(c, rand.New(rand.NewPCG(seed, uint64(c))))
		}()
	}
	wg.Wait()
}

// client runs w.cycles acquire cycles on random keys. A holder may read,
// renew, repeat its Acquire, then completes or releases, may repeat that
// (a repeat after a lost reply must give the same answer), and may later
// act as a zombie with a lease that ended.
func (w *workload) client(c int, r *rand.Rand) {
	var old []idem.Lease // leases that ended, with their keys
	var oldKeys []int
	for i := 0; ; i++ {
		if (w.untilStop && w.stop.Load()) || (!w.untilStop && i >= w.cycles) {
			return
		}
		base := int(w.progress.Add(1)) / w.stride
		if base+w.window > len(w.keys) {
			return // out of keys
		}
		k := base + r.IntN(w.window)
		fp := uint8(0)
		if r.IntN(10) == 0 {
			fp = 1
		}
		if r.IntN(8) == 0 {
			w.get(c, k)
		}
		out, l := w.acquire(c, k, fp, idem.NewLeaseID())
		if !out.unknown && out.outcome == idem.Acquired {
			if r.IntN(4) == 0 {
				w.get(c, k)
			}
			if r.IntN(4) == 0 {
				w.leaseOp(c, opRenew, l, k, nil)
			}
			if r.IntN(6) == 0 {
				w.acquire(c, k, fp, l.ID) // a repeat
			}
			if w.holdPause > 0 && r.IntN(3) == 0 {
				time.Sleep(rand.N(w.holdPause))
			}
			kind := opRelease
			var resp *idem.Response
			if r.Float64() < w.pComplete {
				kind, resp = opComplete, response(r, l)
			}
			if o := w.leaseOp(c, kind, l, k, resp); !o.unknown && r.IntN(4) == 0 {
				w.leaseOp(c, kind, l, k, resp) // a repeat
			}
			old, oldKeys = append(old, l), append(oldKeys, k)
		}
		if len(old) > 0 && r.IntN(6) == 0 { // a zombie
			i := r.IntN(len(old))
			switch r.IntN(3) {
			case 0:
				w.leaseOp(c, opComplete, old[i], oldKeys[i], response(r, old[i]))
			case 1:
				w.leaseOp(c, opRelease, old[i], oldKeys[i], nil)
			default:
				w.leaseOp(c, opRenew, old[i], oldKeys[i], nil)
			}
		}
		if r.IntN(20) == 0 { // a lease that never existed
			l := idem.Lease{Key: w.keys[k], ID: idem.NewLeaseID(), Token: 1 + r.Uint64N(1<<40), TTL: w.leaseTTL}
			w.leaseOp(c, []opKind{opComplete, opRelease, opRenew}[r.IntN(3)], l, k, response(r, l))
		}
		if w.pause > 0 {
			time.Sleep(rand.N(w.pause))
		}
	}
}

// newKeys returns n fresh keys (a random tenant, so that runs on a shared
// Redis never meet).
func newKeys(t testing.TB, n int) []idem.Key {
	t.Helper()
	tenant := idem.NewLeaseID().String()
	keys := make([]idem.Key, n)
	for i := range keys {
		k, err := idem.Scope{Tenant: tenant, Method: "POST", Route: "/linearize"}.Key(fmt.Sprintf("key-%d", i))
		if err != nil {
			t.Fatal(err)
		}
		keys[i] = k
	}
	return keys
}

func fingerprints() [2]idem.Fingerprint {
	return [2]idem.Fingerprint{idem.SumFingerprint([]byte("a"), "POST", "/linearize"), idem.SumFingerprint([]byte("b"), "POST", "/linearize")}
}

// checkTimeout bounds one porcupine check.
var checkTimeout = 30 * time.Second

// check runs porcupine on h and returns its verdict; on anything but Ok it
// writes the visualization to a file and names it in the log, and logs the
// first illegal partition. Self-tests, which expect Illegal, write into
// t.TempDir() and log no partition; the real runs write into
// $IDEM_LINEARIZE_DIR or the system's temporary directory, to be kept.
func check(t testing.TB, model porcupine.Model, h []porcupine.Operation, name string, selftest bool) porcupine.CheckResult {
	t.Helper()
	start := time.Now()
	res, info := porcupine.CheckOperationsVerbose(model, h, checkTimeout)
	t.Logf("%s: porcupine %s on %d operations in %v", name, res, len(h), time.Since(start).Round(time.Millisecond))
	if res != porcupine.Ok {
		dir := os.Getenv("IDEM_LINEARIZE_DIR")
		if selftest {
			dir = t.TempDir()
		} else if dir == "" {
			dir = os.TempDir()
		}
		writeVisualization(t, model, info, dir, name)
		if !selftest {
			dumpIllegal(t, model, h)
		}
	}
	return res
}

// dumpIllegal logs the operations of the first partition that fails, in
// invocation order, with their times in µs (indeterminate ones end at
// "end").
func dumpIllegal(t testing.TB, model porcupine.Model, h []porcupine.Operation) {
	t.Helper()
	one := model
	one.Partition = nil
	for _, p := range model.Partition(h) {
		if porcupine.CheckOperationsTimeout(one, p, checkTimeout) != porcupine.Illegal {
			continue
		}
		p = slices.Clone(p)
		slices.SortFunc(p, func(a, b porcupine.Operation) int { return cmp.Compare(a.Call, b.Call) })
		var b strings.Builder
		for _, op := range p {
			end := fmt.Sprint(op.Return / 1000)
			if op.Output.(output).unknown {
				end = "end"
			}
			fmt.Fprintf(&b, "  c%-3d [%d, %s] %s\n", op.ClientId, op.Call/1000, end, describeOp(op.Input, op.Output))
		}
		t.Logf("first illegal partition (%d operations):\n%s", len(p), b.String())
		return
	}
}

func writeVisualization(t testing.TB, model porcupine.Model, info porcupine.LinearizationInfo, dir, name string) {
	t.Helper()
	path := filepath.Join(dir, fmt.Sprintf("idem-linearize-%s-%d.html", strings.NewReplacer("/", "_", " ", "_", ":", "", "(", "", ")", "").Replace(name), time.Now().UnixNano()))
	if err := porcupine.VisualizePath(model, info, path); err != nil {
		t.Logf("%s: visualization: %v", name, err)
		return
	}
	t.Logf("%s: porcupine visualization: %s", name, path)
}

// stats summarises a history.
type stats struct {
	ops, unknown, keys, perKeyMax int
	outcomes                      map[string]int
}

func summarize(h []porcupine.Operation) stats {
	s := stats{ops: len(h), outcomes: map[string]int{}}
	perKey := map[int]int{}
	for _, op := range h {
		in, out := op.Input.(input), op.Output.(output)
		if in.kind == opTick {
			s.ops--
			continue
		}
		perKey[in.key]++
		switch {
		case out.unknown:
			s.unknown++
			s.outcomes[in.kind.String()+" unknown"]++
		case in.kind == opAcquire:
			s.outcomes[out.outcome.String()]++
		case in.kind == opGet:
			s.outcomes["get"]++
		case out.ok:
			s.outcomes[in.kind.String()+" ok"]++
		default:
			s.outcomes[in.kind.String()+" lost"]++
		}
	}
	s.keys = len(perKey)
	for _, n := range perKey {
		s.perKeyMax = max(s.perKeyMax, n)
	}
	return s
}
