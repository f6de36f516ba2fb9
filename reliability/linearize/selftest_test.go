package linearize

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
)

// The tests below show that the checker can fail: mutated real histories,
// a broken model and a broken store are all rejected.

// memHistory records a memstore history with at least one InFlight answer
// (the mutations need one).
func memHistory(t *testing.T) []porcupine.Operation {
	t.Helper()
	var h []porcupine.Operation
	for round := range 10 {
		w := newWorkload(t, memstore.New(memstore.Options{}), 16, 100)
		w.run(uint64(5 + round))
		if w.bad != nil {
			t.Fatal(w.bad)
		}
		h = w.rec.history()
		if summarize(h).outcomes["in_flight"] > 0 {
			break
		}
	}
	if res := check(t, newModel(stepper{}), h, "unmutated", true); res != porcupine.Ok {
		t.Fatalf("the unmutated history is %s", res)
	}
	return h
}

func TestCheckerRejectsMutatedHistories(t *testing.T) {
	h := memHistory(t)
	mutations := []struct {
		name string
		// mutate changes one operation of a copy of h; false: none fits.
		mutate func(h []porcupine.Operation) bool
	}{
		{"replay with one byte changed", func(h []porcupine.Operation) bool {
			for i, op := range h {
				if out := op.Output.(output); op.Input.(input).kind == opAcquire && out.outcome == idem.Replay && len(out.resp) > 0 {
					b := []byte(out.resp)
					b[len(b)-1] ^= 1
					out.resp = string(b)
					h[i].Output = out
					return true
				}
			}
			return false
		}},
		{"a fencing token reused", func(h []porcupine.Operation) bool {
			first := map[int]uint64{}
			for i, op := range h {
				in, out := op.Input.(input), op.Output.(output)
				if in.kind != opAcquire || out.outcome != idem.Acquired {
					continue
				}
				if tok, ok := first[in.key]; ok && tok != out.token {
					// Every Acquired output of this lease (a repeat too).
					for j := range h {
						if h[j].Input.(input).kind == opAcquire && h[j].Input.(input).lease == in.lease {
							o := h[j].Output.(output)
							o.token = tok
							h[j].Output = o
						}
					}
					_ = i
					return true
				}
				first[in.key] = out.token
			}
			return false
		}},
		{"a completion lost (get sees the key absent)", func(h []porcupine.Operation) bool {
			for i, op := range h {
				if out := op.Output.(output); op.Input.(input).kind == opGet && out.found && out.state == idem.StateCompleted {
					h[i].Output = output{found: false}
					return true
				}
			}
			return false
		}},
		{"a second live lease (in_flight turned into acquired)", func(h []porcupine.Operation) bool {
			for i, op := range h {
				if out := op.Output.(output); op.Input.(input).kind == opAcquire && out.outcome == idem.InFlight {
					h[i].Output = output{outcome: idem.Acquired, token: 1 << 60}
					return true
				}
			}
			return false
		}},
	}
	model := newModel(stepper{})
	for _, m := range mutations {
		hm := append([]porcupine.Operation(nil), h...)
		if !m.mutate(hm) {
			t.Errorf("%s: no operation to mutate", m.name)
			continue
		}
		res := check(t, model, hm, "mutated: "+m.name, true)
		if res != porcupine.Illegal {
			t.Errorf("%s: porcupine says %s, want Illegal", m.name, res)
		}
	}
}

func TestCheckerRejectsBrokenModel(t *testing.T) {
	h := memHistory(t)
	if res := check(t, newModel(stepper{noRelease: true}), h, "model without release", true); res != porcupine.Illegal {
		t.Errorf("a model in which Release does not free the key accepts the real history: %s", res)
	}
}

// racyStore is the naive check-then-set that idem exists to avoid: its
// Acquire reads the record and writes it in two separate steps.
type racyStore struct {
	idem.Store // memstore, for everything but Acquire
	mu         sync.Mutex
	recs       map[idem.Key]*racyRec
}

type racyRec struct {
	lease idem.LeaseID
	token uint64
	fp    idem.Fingerprint
	done  *idem.Response
}

func (s *racyStore) Acquire(ctx context.Context, req idem.AcquireRequest) (idem.Acquisition, error) {
	s.mu.Lock() // GET
	var r *racyRec
	if cur := s.recs[req.Key]; cur != nil {
		c := *cur
		r = &c
	}
	s.mu.Unlock()
	var prev uint64
	if r != nil {
		prev = r.token
	}
	switch {
	case r == nil || r.lease == (idem.LeaseID{}) && r.done == nil:
	case r.lease == req.LeaseID:
		return idem.Acquisition{Outcome: idem.Acquired, Lease: idem.Lease{Key: req.Key, ID: r.lease, Token: r.token, TTL: req.TTL}}, nil
	case r.fp != req.Fingerprint:
		return idem.Acquisition{Outcome: idem.Mismatch}, nil
	case r.done != nil:
		return idem.Acquisition{Outcome: idem.Replay, Response: r.done}, nil
	default:
		return idem.Acquisition{Outcome: idem.InFlight, RetryAfter: time.Second}, nil
	}
	time.Sleep(50 * time.Microsecond) // the gap between GET and SET
	s.mu.Lock()                       // SET
	defer s.mu.Unlock()
	s.recs[req.Key] = &racyRec{lease: req.LeaseID, token: prev + 1, fp: req.Fingerprint}
	return idem.Acquisition{Outcome: idem.Acquired, Lease: idem.Lease{Key: req.Key, ID: req.LeaseID, Token: prev + 1, TTL: req.TTL}}, nil
}

func (s *racyStore) lease(l idem.Lease) (*racyRec, bool) {
	r := s.recs[l.Key]
	return r, r != nil && r.lease == l.ID
}

func (s *racyStore) Renew(_ context.Context, l idem.Lease, _ time.Duration) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.lease(l); !ok {
		return idem.ErrLeaseLost
	}
	return nil
}

func (s *racyStore) Complete(_ context.Context, l idem.Lease, resp *idem.Response, _ time.Duration) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	r, ok := s.lease(l)
	if !ok {
		if r != nil && r.done != nil && r.token == l.Token {
			return nil
		}
		return idem.ErrLeaseLost
	}
	b, _ := resp.AppendBinary(nil)
	r.done = new(idem.Response)
	if err := r.done.UnmarshalBinary(b); err != nil {
		return err
	}
	r.lease = idem.LeaseID{}
	return nil
}

func (s *racyStore) Release(_ context.Context, l idem.Lease) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	r, ok := s.lease(l)
	if !ok {
		if r != nil && r.lease == (idem.LeaseID{}) && r.done == nil && r.token == l.Token {
			return nil
		}
		return idem.ErrLeaseLost
	}
	r.lease, r.fp = idem.LeaseID{}, idem.Fingerprint{}
	return nil
}

func (s *racyStore) Get(_ context.Context, key idem.Key) (idem.Record, bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.recs[key]
	switch {
	case r == nil:
		return idem.Record{}, false, nil
	case r.done != nil:
		return idem.Record{State: idem.StateCompleted, Token: r.token, Fingerprint: r.fp, Response: r.done}, true, nil
	case r.lease == (idem.LeaseID{}):
		return idem.Record{State: idem.StateReleased, Token: r.token}, true, nil
	}
	return idem.Record{State: idem.StateInFlight, Token: r.token, Fingerprint: r.fp, LeaseID: r.lease}, true, nil
}

// TestCheckerRejectsRacyStore runs the workload on racyStore: two callers
// that both see the key free both get it. The race needs two Acquires in
// the same 50µs, so a few rounds are allowed to find it.
func TestCheckerRejectsRacyStore(t *testing.T) {
	for round := range 5 {
		s := &racyStore{Store: memstore.New(memstore.Options{}), recs: map[idem.Key]*racyRec{}}
		w := newWorkload(t, s, 16, 100)
		w.run(uint64(10 + round))
		if res := check(t, newModel(stepper{}), w.rec.history(), "racy store", true); res == porcupine.Illegal {
			return
		}
	}
	t.Errorf("five runs on a store with a check-then-set race were all accepted")
}

// TestReleaseRetryMergesAnswers documents a finding. A Redis client that
// resends a script after a lost reply (go-redis's retries, rueidis's
// NewLuaScriptRetryable) merges two executions into one call, and the
// caller gets the second one's answer. For Release that answer can differ
// from the first's: the first execution releases the key, another caller
// acquires it, the resend finds the other caller's lease and answers
// ErrLeaseLost, although the call did release the key. One call that
// released the key and answered "lease lost" is not linearizable, and the
// checker says so. (Store's contract says a repeat after a lost reply
// "gives the same answer"; for Release it does not once another caller has
// acquired the key.) The same steps on memstore:
func TestReleaseRetryMergesAnswers(t *testing.T) {
	ctx := context.Background()
	s := memstore.New(memstore.Options{})
	keys, fps := newKeys(t, 1), fingerprints()
	a, err := s.Acquire(ctx, idem.AcquireRequest{Key: keys[0], Fingerprint: fps[0], LeaseID: idem.NewLeaseID(), TTL: long})
	if err != nil || a.Outcome != idem.Acquired {
		t.Fatal(a, err)
	}
	first := s.Release(ctx, a.Lease) // executed; say its reply is lost
	b, err := s.Acquire(ctx, idem.AcquireRequest{Key: keys[0], Fingerprint: fps[0], LeaseID: idem.NewLeaseID(), TTL: long})
	if err != nil || b.Outcome != idem.Acquired {
		t.Fatal(b, err)
	}
	resend := s.Release(ctx, a.Lease) // the client's resend
	if first != nil || !errors.Is(resend, idem.ErrLeaseLost) {
		t.Fatalf("first release %v, resend %v", first, resend)
	}
	t.Logf("release executed twice: first %v, resend %v; the caller sees %v", first, resend, resend)
	// The caller's view: one Release call spanning both executions, with
	// the resend's answer.
	h := []porcupine.Operation{
		{ClientId: 0, Input: input{kind: opAcquire, key: 0, lease: a.Lease.ID, ttl: long}, Call: 0, Output: output{outcome: idem.Acquired, token: a.Lease.Token}, Return: 1},
		{ClientId: 0, Input: input{kind: opRelease, key: 0, lease: a.Lease.ID, token: a.Lease.Token, ttl: a.Lease.TTL}, Call: 2, Output: output{ok: false}, Return: 5},
		{ClientId: 1, Input: input{kind: opAcquire, key: 0, lease: b.Lease.ID, ttl: long}, Call: 3, Output: output{outcome: idem.Acquired, token: b.Lease.Token}, Return: 4},
	}
	if res := check(t, newModel(stepper{}), h, "release resent", true); res != porcupine.Illegal {
		t.Errorf("porcupine says %s, want Illegal", res)
	}
}

// TestProvisionalToken: the first operations on k3 of a native-path run
// that failed (go-redis, Valkey 9.1). The Acquire's claim reached the
// server more than 50ms after the client's estimate of its clock, so its
// token did not stand and the second step replaced it (…240 by …250);
// a Get between the two steps showed the claim, with the provisional
// token (redisstore's package documentation says it may). The strict
// model rejects the history; with provisional it is accepted, and still
// rejected when the Get shows a token above the lease's or a provisional
// one after the holder's Renew (which comes after its Acquire returned).
func TestProvisionalToken(t *testing.T) {
	lease, other := idem.NewLeaseID(), idem.NewLeaseID()
	acquire := porcupine.Operation{ClientId: 0, Input: input{kind: opAcquire, key: 3, lease: lease, ttl: long}, Call: 391, Output: output{outcome: idem.Acquired, token: 250}, Return: 76258}
	inFlight := porcupine.Operation{ClientId: 2, Input: input{kind: opAcquire, key: 3, lease: other, ttl: long}, Call: 429, Output: output{outcome: idem.InFlight}, Return: 71672}
	get := func(call, ret int64, token uint64) porcupine.Operation {
		return porcupine.Operation{ClientId: 5, Input: input{kind: opGet, key: 3}, Call: call, Output: output{found: true, state: idem.StateInFlight, token: token, lease: lease}, Return: ret}
	}
	renew := porcupine.Operation{ClientId: 0, Input: input{kind: opRenew, key: 3, lease: lease, ttl: long}, Call: 76300, Output: output{ok: true}, Return: 76400}
	cases := []struct {
		name        string
		h           []porcupine.Operation
		provisional bool
		want        porcupine.CheckResult
	}{
		{"strict model, provisional token", []porcupine.Operation{acquire, inFlight, get(522, 72446, 240)}, false, porcupine.Illegal},
		{"provisional token", []porcupine.Operation{acquire, inFlight, get(522, 72446, 240)}, true, porcupine.Ok},
		{"the lease's token", []porcupine.Operation{acquire, inFlight, get(522, 72446, 250)}, true, porcupine.Ok},
		{"a token above the lease's", []porcupine.Operation{acquire, inFlight, get(522, 72446, 260)}, true, porcupine.Illegal},
		{"provisional token after the holder's renew", []porcupine.Operation{acquire, inFlight, renew, get(76500, 76600, 240)}, true, porcupine.Illegal},
		{"provisional token after a get showed the lease's", []porcupine.Operation{acquire, inFlight, get(76300, 76400, 250), get(76500, 76600, 240)}, true, porcupine.Illegal},
	}
	for _, c := range cases {
		if res := check(t, newModel(stepper{provisional: c.provisional}), c.h, c.name, true); res != c.want {
			t.Errorf("%s: porcupine says %s, want %s", c.name, res, c.want)
		}
	}
}
