package storetest

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// testBatch checks idem.BatchStore, for stores that implement it: per key,
// the same answers as the single-key calls.
func (s *suite) testBatch(t *testing.T) {
	probe := s.env(t)
	if _, ok := probe.Store.(idem.BatchStore); !ok {
		t.Skip("the store does not implement idem.BatchStore")
	}
	for _, tt := range []struct {
		name string
		fn   func(*suite, *testing.T)
	}{
		{"Outcomes", (*suite).testBatchOutcomes},
		{"Takeover", (*suite).testBatchTakeover},
		{"RepeatedCalls", (*suite).testBatchRepeated},
		{"DuplicateKeys", (*suite).testBatchDuplicates},
		{"Invalid", (*suite).testBatchInvalid},
		{"CancelledContext", (*suite).testBatchCancelled},
		{"Empty", (*suite).testBatchEmpty},
		{"SameAsSingle", (*suite).testBatchSameAsSingle},
		{"Large", (*suite).testBatchLarge},
		{"Concurrency", (*suite).testBatchConcurrency},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			tt.fn(s, t)
		})
	}
}

func (e *env) batch() idem.BatchStore { return e.Store.(idem.BatchStore) }

// acquireMany calls AcquireMany and checks the answer's length.
func (e *env) acquireMany(reqs ...idem.AcquireRequest) []idem.AcquireResult {
	e.t.Helper()
	out := e.batch().AcquireMany(e.ctx, reqs)
	if len(out) != len(reqs) {
		e.t.Fatalf("AcquireMany: got %d answers for %d requests", len(out), len(reqs))
	}
	return out
}

func (e *env) completeMany(cs ...idem.Completion) []error {
	e.t.Helper()
	out := e.batch().CompleteMany(e.ctx, cs)
	if len(out) != len(cs) {
		e.t.Fatalf("CompleteMany: got %d answers for %d completions", len(out), len(cs))
	}
	return out
}

func (e *env) releaseMany(ls ...idem.Lease) []error {
	e.t.Helper()
	out := e.batch().ReleaseMany(e.ctx, ls)
	if len(out) != len(ls) {
		e.t.Fatalf("ReleaseMany: got %d answers for %d leases", len(out), len(ls))
	}
	return out
}

func req(key idem.Key, fp idem.Fingerprint, id idem.LeaseID, ttl time.Duration) idem.AcquireRequest {
	return idem.AcquireRequest{Key: key, Fingerprint: fp, LeaseID: id, TTL: ttl}
}

// wantOutcomes checks each answer's outcome (and that it has no error).
func (e *env) wantOutcomes(what string, got []idem.AcquireResult, want ...idem.Outcome) {
	e.t.Helper()
	for i, r := range got {
		if r.Err != nil {
			e.t.Fatalf("%s: answer %d: got error %v, want outcome %v", what, i, r.Err, want[i])
		}
		if r.Outcome != want[i] {
			e.t.Fatalf("%s: answer %d: got outcome %v, want %v", what, i, r.Outcome, want[i])
		}
	}
}

// wantErrs checks each error answer: nil, or matching want with errors.Is.
func (e *env) wantErrs(what string, got []error, want ...error) {
	e.t.Helper()
	for i, err := range got {
		switch {
		case want[i] == nil && err != nil:
			e.t.Errorf("%s: answer %d: got error %v, want none", what, i, err)
		case want[i] != nil && !errors.Is(err, want[i]):
			e.t.Errorf("%s: answer %d: got error %v, want %v", what, i, err, want[i])
		}
	}
}

// wantNilOrLeaseLost checks that every answer is nil or ErrLeaseLost: a
// Complete of a lease that completed the key with another response (see
// idem.Store's Complete).
func (e *env) wantNilOrLeaseLost(what string, got []error) {
	e.t.Helper()
	for i, err := range got {
		if err != nil && !errors.Is(err, idem.ErrLeaseLost) {
			e.t.Errorf("%s: answer %d: got error %v, want nil or ErrLeaseLost", what, i, err)
		}
	}
}

// testBatchOutcomes: every outcome, in mixed batches.
func (s *suite) testBatchOutcomes(t *testing.T) {
	e := s.env(t)
	k1, k2, k3 := newKey(), newKey(), newKey()
	id1, id2 := idem.NewLeaseID(), idem.NewLeaseID()
	first := e.acquireMany(req(k1, fpA, id1, longTTL), req(k2, fpA, id2, longTTL))
	e.wantOutcomes("first AcquireMany", first, idem.Acquired, idem.Acquired)
	l1, l2 := first[0].Lease, first[1].Lease
	for i, l := range []idem.Lease{l1, l2} {
		want := []idem.AcquireRequest{req(k1, fpA, id1, 0), req(k2, fpA, id2, 0)}[i]
		if l.Key != want.Key || l.ID != want.LeaseID || l.Token == 0 || l.TTL > longTTL || l.TTL < longTTL-time.Second {
			t.Errorf("first AcquireMany: lease %d: got %+v, want key %v, lease id %v, a token and TTL in (%v, %v]",
				i, l, want.Key, want.LeaseID, longTTL-time.Second, longTTL)
		}
	}
	e.wantRecord("k1 in flight", k1, inFlight(l1, fpA), longTTL/2)
	e.wantRecord("k2 in flight", k2, inFlight(l2, fpA), longTTL/2)

	second := e.acquireMany(req(k1, fpA, idem.NewLeaseID(), longTTL), req(k2, fpB, idem.NewLeaseID(), longTTL), req(k3, fpA, idem.NewLeaseID(), longTTL))
	e.wantOutcomes("second AcquireMany", second, idem.InFlight, idem.Mismatch, idem.Acquired)
	if ra := second[0].RetryAfter; ra <= 0 || ra > longTTL {
		t.Errorf("second AcquireMany: InFlight RetryAfter %v, want in (0, %v]", ra, longTTL)
	}
	l3 := second[2].Lease

	r1 := &idem.Response{Status: 201, Header: jsonHeader, Body: []byte(`{"id":1}`)}
	r3 := &idem.Response{Status: 200, Body: []byte("three")}
	want1, want3 := cloneResponse(r1), cloneResponse(r3)
	e.wantErrs("CompleteMany", e.completeMany(
		idem.Completion{Lease: l1, Response: r1, Retention: retention},
		idem.Completion{Lease: l3, Response: r3, Retention: retention},
	), nil, nil)
	r1.Body[1] = 'X' // the store must have taken a copy
	e.wantRecord("k1 completed", k1, completed(l1, fpA, want1, retention), retention/2)
	e.wantRecord("k3 completed", k3, completed(l3, fpA, want3, retention), retention/2)

	third := e.acquireMany(req(k1, fpA, idem.NewLeaseID(), longTTL), req(k1, fpB, idem.NewLeaseID(), longTTL),
		req(k2, fpA, idem.NewLeaseID(), longTTL), req(k3, fpA, idem.NewLeaseID(), longTTL))
	e.wantOutcomes("third AcquireMany", third, idem.Replay, idem.Mismatch, idem.InFlight, idem.Replay)
	if d := diffResponse(third[0].Response, want1); d != "" {
		t.Errorf("replay of k1: %s", d)
	}
	if d := diffResponse(third[3].Response, want3); d != "" {
		t.Errorf("replay of k3: %s", d)
	}

	e.wantErrs("ReleaseMany", e.releaseMany(l2, l1), nil, idem.ErrLeaseLost)
	e.wantRecord("k2 released", k2, idem.Record{State: idem.StateReleased, Token: l2.Token, TTL: l2.TTL}, longTTL/2)
	next := e.acquireMany(req(k2, fpB, idem.NewLeaseID(), longTTL))
	e.wantOutcomes("AcquireMany after ReleaseMany", next, idem.Acquired)
	if next[0].Lease.Token <= l2.Token {
		t.Errorf("AcquireMany after ReleaseMany: got token %d, want more than %d", next[0].Lease.Token, l2.Token)
	}
}

// testBatchTakeover: leases that expired are taken over in a batch, and
// their holders' batched calls get ErrLeaseLost and change nothing.
func (s *suite) testBatchTakeover(t *testing.T) {
	e := s.env(t)
	k1, k2 := newKey(), newKey()
	old := e.acquireMany(req(k1, fpA, idem.NewLeaseID(), shortTTL), req(k2, fpA, idem.NewLeaseID(), shortTTL))
	e.wantOutcomes("AcquireMany", old, idem.Acquired, idem.Acquired)
	e.Sleep(pastShort)
	cur := e.acquireMany(req(k1, fpA, idem.NewLeaseID(), longTTL), req(k2, fpB, idem.NewLeaseID(), longTTL))
	e.wantOutcomes("takeover", cur, idem.Acquired, idem.Acquired)
	for i := range cur {
		if cur[i].Lease.Token <= old[i].Lease.Token {
			t.Errorf("takeover of key %d: got token %d, want more than %d", i, cur[i].Lease.Token, old[i].Lease.Token)
		}
	}
	before1 := e.wantRecord("k1 after takeover", k1, inFlight(cur[0].Lease, fpA), longTTL/2)
	before2 := e.wantRecord("k2 after takeover", k2, inFlight(cur[1].Lease, fpB), longTTL/2)
	resp := &idem.Response{Status: 200}
	e.wantErrs("CompleteMany by the old leases", e.completeMany(
		idem.Completion{Lease: old[0].Lease, Response: resp, Retention: retention},
		idem.Completion{Lease: old[1].Lease, Response: resp, Retention: retention},
	), idem.ErrLeaseLost, idem.ErrLeaseLost)
	e.wantErrs("ReleaseMany by the old leases", e.releaseMany(old[0].Lease, old[1].Lease), idem.ErrLeaseLost, idem.ErrLeaseLost)
	e.wantUnchanged("k1 after the old leases' calls", k1, before1)
	e.wantUnchanged("k2 after the old leases' calls", k2, before2)

	// An expired lease nobody took over: lost, and the key stays absent.
	k3 := newKey()
	l := e.acquireMany(req(k3, fpA, idem.NewLeaseID(), shortTTL))[0].Lease
	e.Sleep(pastShort)
	e.wantErrs("CompleteMany after the lease ended", e.completeMany(idem.Completion{Lease: l, Response: resp, Retention: retention}), idem.ErrLeaseLost)
	e.wantErrs("ReleaseMany after the lease ended", e.releaseMany(l), idem.ErrLeaseLost)
	e.wantMiss("after the late calls", k3)
}

// testBatchRepeated repeats every batch, as a client does after a lost
// reply: the same answers, nothing changed.
func (s *suite) testBatchRepeated(t *testing.T) {
	e := s.env(t)
	keys := []idem.Key{newKey(), newKey(), newKey()}
	reqs := make([]idem.AcquireRequest, len(keys))
	for i, k := range keys {
		reqs[i] = req(k, fpA, idem.NewLeaseID(), longTTL)
	}
	first := e.acquireMany(reqs...)
	e.wantOutcomes("AcquireMany", first, idem.Acquired, idem.Acquired, idem.Acquired)
	again := e.acquireMany(reqs...)
	e.wantOutcomes("repeated AcquireMany", again, idem.Acquired, idem.Acquired, idem.Acquired)
	for i := range first {
		a, b := first[i].Lease, again[i].Lease
		if a.Key != b.Key || a.ID != b.ID || a.Token != b.Token || b.TTL <= 0 || b.TTL > longTTL {
			t.Errorf("repeated AcquireMany: lease %d: got %+v, want %+v with TTL in (0, %v]", i, b, a, longTTL)
		}
	}
	resp := &idem.Response{Status: 200, Body: []byte("first")}
	cs := []idem.Completion{
		{Lease: first[0].Lease, Response: resp, Retention: retention},
		{Lease: first[1].Lease, Response: resp, Retention: retention},
	}
	e.wantErrs("CompleteMany", e.completeMany(cs...), nil, nil)
	before0 := e.wantRecord("k0 completed", keys[0], completed(first[0].Lease, fpA, resp, retention), retention/2)
	before1 := e.wantRecord("k1 completed", keys[1], completed(first[1].Lease, fpA, resp, retention), retention/2)
	e.wantErrs("repeated CompleteMany", e.completeMany(cs...), nil, nil)
	e.wantUnchanged("k0 after the repeated CompleteMany", keys[0], before0)
	e.wantUnchanged("k1 after the repeated CompleteMany", keys[1], before1)
	other := &idem.Response{Status: 500, Body: []byte("second")}
	e.wantNilOrLeaseLost("CompleteMany again with another response", e.completeMany(
		idem.Completion{Lease: first[0].Lease, Response: other, Retention: retention},
		idem.Completion{Lease: first[1].Lease, Response: other, Retention: retention},
	))
	e.wantUnchanged("k0 after CompleteMany again with another response", keys[0], before0)
	e.wantUnchanged("k1 after CompleteMany again with another response", keys[1], before1)

	l := first[2].Lease
	e.wantErrs("ReleaseMany", e.releaseMany(l), nil)
	before2 := e.wantRecord("k2 released", keys[2], idem.Record{State: idem.StateReleased, Token: l.Token, TTL: l.TTL}, longTTL/2)
	e.wantErrs("repeated ReleaseMany", e.releaseMany(l), nil)
	e.wantUnchanged("k2 after the repeated ReleaseMany", keys[2], before2)
}

// testBatchDuplicates: a key twice in one batch is handled twice, in
// order, as two calls in a row.
func (s *suite) testBatchDuplicates(t *testing.T) {
	e := s.env(t)
	k, other := newKey(), newKey()
	a, b := idem.NewLeaseID(), idem.NewLeaseID()
	got := e.acquireMany(req(k, fpA, a, longTTL), req(k, fpA, b, longTTL), req(other, fpA, idem.NewLeaseID(), longTTL),
		req(k, fpA, a, longTTL), req(k, fpB, b, longTTL))
	e.wantOutcomes("AcquireMany with a key four times", got, idem.Acquired, idem.InFlight, idem.Acquired, idem.Acquired, idem.Mismatch)
	if got[3].Lease.Token != got[0].Lease.Token {
		t.Errorf("the same request twice in a batch: got tokens %d and %d, want the same", got[0].Lease.Token, got[3].Lease.Token)
	}
	l := got[0].Lease
	r1 := &idem.Response{Status: 200, Body: []byte("one")}
	r2 := &idem.Response{Status: 200, Body: []byte("two")}
	twice := e.completeMany(
		idem.Completion{Lease: l, Response: r1, Retention: retention},
		idem.Completion{Lease: l, Response: r2, Retention: retention},
	)
	e.wantErrs("CompleteMany with a lease twice", twice[:1], nil)
	e.wantNilOrLeaseLost("CompleteMany with a lease twice, the second", twice[1:])
	e.wantRecord("completed once", k, completed(l, fpA, r1, retention), retention/2)

	// Release then acquire in one batch cannot be: a batch is of one
	// kind. Release twice: both nil (the second is the repeat).
	l2 := got[2].Lease
	e.wantErrs("ReleaseMany with a lease twice", e.releaseMany(l2, l2), nil, nil)
	e.wantRecord("released once", other, idem.Record{State: idem.StateReleased, Token: l2.Token, TTL: l2.TTL}, longTTL/2)

	// The acquire after the release takes it, the next one finds it held.
	again := e.acquireMany(req(other, fpA, idem.NewLeaseID(), longTTL), req(other, fpA, idem.NewLeaseID(), longTTL))
	e.wantOutcomes("AcquireMany twice after a release", again, idem.Acquired, idem.InFlight)
	if again[0].Lease.Token <= l2.Token {
		t.Errorf("token after the release: got %d, want more than %d", again[0].Lease.Token, l2.Token)
	}
}

// testBatchInvalid: invalid entries fail alone and change nothing.
func (s *suite) testBatchInvalid(t *testing.T) {
	e := s.env(t)
	bad1, good, bad2 := newKey(), newKey(), newKey()
	got := e.acquireMany(req(bad1, fpA, idem.NewLeaseID(), 0), req(good, fpA, idem.NewLeaseID(), longTTL),
		req(bad2, fpA, idem.LeaseID{}, longTTL))
	if got[0].Err == nil || got[2].Err == nil {
		t.Errorf("AcquireMany: invalid requests: got errors %v and %v, want both set", got[0].Err, got[2].Err)
	}
	if got[1].Err != nil || got[1].Outcome != idem.Acquired {
		t.Fatalf("AcquireMany: the valid request: got %v, %v; want Acquired", got[1].Outcome, got[1].Err)
	}
	e.wantMiss("after an invalid request", bad1)
	e.wantMiss("after an invalid request", bad2)
	l := got[1].Lease
	errs := e.completeMany(
		idem.Completion{Lease: l, Response: &idem.Response{Status: 200}, Retention: 0},
		idem.Completion{Lease: l, Response: &idem.Response{Status: 200}, Retention: retention},
	)
	if errs[0] == nil {
		t.Error("CompleteMany with retention 0: got no error, want one")
	}
	if errs[1] != nil {
		t.Errorf("CompleteMany: the valid completion: got error %v, want none", errs[1])
	}
	e.wantRecord("completed", good, completed(l, fpA, &idem.Response{Status: 200}, retention), retention/2)
}

// testBatchCancelled: a cancelled context fails every key, and nothing
// is written.
func (s *suite) testBatchCancelled(t *testing.T) {
	e := s.env(t)
	cancelled, cancel := context.WithCancel(e.ctx)
	cancel()
	k1, k2 := newKey(), newKey()
	got := e.batch().AcquireMany(cancelled, []idem.AcquireRequest{req(k1, fpA, idem.NewLeaseID(), longTTL), req(k2, fpA, idem.NewLeaseID(), longTTL)})
	wantCancelled(t, "acquire", k1, got[0].Err)
	wantCancelled(t, "acquire", k2, got[1].Err)
	e.wantMiss("after AcquireMany with a cancelled context", k1)
	e.wantMiss("after AcquireMany with a cancelled context", k2)

	ls := e.acquireMany(req(k1, fpA, idem.NewLeaseID(), longTTL), req(k2, fpA, idem.NewLeaseID(), longTTL))
	before1 := e.wantRecord("k1 in flight", k1, inFlight(ls[0].Lease, fpA), longTTL/2)
	before2 := e.wantRecord("k2 in flight", k2, inFlight(ls[1].Lease, fpA), longTTL/2)
	errs := e.batch().CompleteMany(cancelled, []idem.Completion{
		{Lease: ls[0].Lease, Response: &idem.Response{Status: 200}, Retention: retention},
		{Lease: ls[1].Lease, Response: &idem.Response{Status: 200}, Retention: retention},
	})
	wantCancelled(t, "complete", k1, errs[0])
	wantCancelled(t, "complete", k2, errs[1])
	errs = e.batch().ReleaseMany(cancelled, []idem.Lease{ls[0].Lease, ls[1].Lease})
	wantCancelled(t, "release", k1, errs[0])
	wantCancelled(t, "release", k2, errs[1])
	e.wantUnchanged("k1 after calls with a cancelled context", k1, before1)
	e.wantUnchanged("k2 after calls with a cancelled context", k2, before2)
}

// testBatchEmpty: empty batches answer empty.
func (s *suite) testBatchEmpty(t *testing.T) {
	e := s.env(t)
	if got := e.batch().AcquireMany(e.ctx, nil); len(got) != 0 {
		t.Errorf("AcquireMany(nil): got %d answers", len(got))
	}
	if got := e.batch().CompleteMany(e.ctx, nil); len(got) != 0 {
		t.Errorf("CompleteMany(nil): got %d answers", len(got))
	}
	if got := e.batch().ReleaseMany(e.ctx, nil); len(got) != 0 {
		t.Errorf("ReleaseMany(nil): got %d answers", len(got))
	}
}

// testBatchSameAsSingle runs one random program of mixed batches twice,
// on two stores: in batches on one, as single calls in the same order on
// the other, and compares every answer (outcome or error, replayed
// response, and the order of tokens).
func (s *suite) testBatchSameAsSingle(t *testing.T) {
	single, batched := s.env(t), s.env(t)
	rng := rand.New(rand.NewPCG(1, 2))
	keys := make([]idem.Key, 12)
	for i := range keys {
		keys[i] = newKey()
	}
	fps := []idem.Fingerprint{fpA, fpB}
	// Leases per side, by the index of the request that granted them.
	type pair struct{ single, batched idem.Lease }
	var leases []pair
	var trace []string
	for round := range 30 {
		switch op := rng.IntN(3); {
		case op == 0 || len(leases) == 0:
			n := 1 + rng.IntN(8)
			reqs := make([]idem.AcquireRequest, n)
			for i := range reqs {
				reqs[i] = req(keys[rng.IntN(len(keys))], fps[rng.IntN(2)], idem.NewLeaseID(), longTTL)
				if len(leases) > 0 && rng.IntN(5) == 0 { // a repeat of an acquired lease's request
					p := leases[rng.IntN(len(leases))]
					reqs[i].Key, reqs[i].LeaseID = p.batched.Key, p.batched.ID
					rec, _ := batched.get(p.batched.Key)
					reqs[i].Fingerprint = rec.Fingerprint
				}
			}
			got := batched.acquireMany(reqs...)
			for i, r := range reqs {
				acq, err := single.Store.Acquire(single.ctx, r)
				b := got[i]
				line := fmt.Sprintf("round %d acquire %d: single %v %v, batched %v %v", round, i, acq.Outcome, err, b.Outcome, b.Err)
				trace = append(trace, line)
				if (err == nil) != (b.Err == nil) || acq.Outcome != b.Outcome {
					t.Fatalf("%s\n%s", line, strings.Join(trace, "\n"))
				}
				if acq.Outcome == idem.Replay {
					if d := diffResponse(b.Response, acq.Response); d != "" {
						t.Fatalf("%s: replay differs: %s", line, d)
					}
				}
				if acq.Outcome == idem.Acquired && !slices.ContainsFunc(leases, func(p pair) bool { return p.batched.ID == b.Lease.ID }) {
					leases = append(leases, pair{acq.Lease, b.Lease})
				}
			}
		case op == 1:
			n := 1 + rng.IntN(6)
			var cs, cb []idem.Completion
			for range n {
				p := leases[rng.IntN(len(leases))]
				resp := &idem.Response{Status: 200 + rng.IntN(5), Body: []byte(fmt.Sprint(round))}
				cs = append(cs, idem.Completion{Lease: p.single, Response: resp, Retention: retention})
				cb = append(cb, idem.Completion{Lease: p.batched, Response: resp, Retention: retention})
			}
			got := batched.completeMany(cb...)
			for i, c := range cs {
				err := single.Store.Complete(single.ctx, c.Lease, c.Response, c.Retention)
				line := fmt.Sprintf("round %d complete %d: single %v, batched %v", round, i, err, got[i])
				trace = append(trace, line)
				if !sameErr(err, got[i]) {
					t.Fatalf("%s\n%s", line, strings.Join(trace, "\n"))
				}
			}
		default:
			n := 1 + rng.IntN(6)
			var ls, lb []idem.Lease
			for range n {
				p := leases[rng.IntN(len(leases))]
				ls, lb = append(ls, p.single), append(lb, p.batched)
			}
			got := batched.releaseMany(lb...)
			for i, l := range ls {
				err := single.Store.Release(single.ctx, l)
				line := fmt.Sprintf("round %d release %d: single %v, batched %v", round, i, err, got[i])
				trace = append(trace, line)
				if !sameErr(err, got[i]) {
					t.Fatalf("%s\n%s", line, strings.Join(trace, "\n"))
				}
			}
		}
	}
	// The records agree too.
	for i, k := range keys {
		a, okA := single.get(k)
		b, okB := batched.get(k)
		if okA != okB || a.State != b.State || a.Fingerprint != b.Fingerprint || diffResponse(a.Response, b.Response) != "" {
			t.Errorf("key %d: single %v %+v, batched %v %+v", i, okA, a, okB, b)
		}
	}
}

func sameErr(a, b error) bool {
	switch {
	case a == nil || b == nil:
		return a == nil && b == nil
	case errors.Is(a, idem.ErrLeaseLost):
		return errors.Is(b, idem.ErrLeaseLost)
	}
	return !errors.Is(b, idem.ErrLeaseLost)
}

// testBatchLarge: a batch of 300 keys, more than a store may send in one
// call.
func (s *suite) testBatchLarge(t *testing.T) {
	e := s.env(t)
	const n = 300
	reqs := make([]idem.AcquireRequest, n)
	for i := range reqs {
		reqs[i] = req(newKey(), fpA, idem.NewLeaseID(), longTTL)
	}
	// The first key again at the end, with its own lease id (a repeat) and
	// with another: far apart, in whatever calls the store splits the batch.
	again := append(reqs, reqs[0], req(reqs[1].Key, fpA, idem.NewLeaseID(), longTTL))
	all := e.acquireMany(again...)
	if r := all[n]; r.Err != nil || r.Outcome != idem.Acquired || r.Lease.Token != all[0].Lease.Token {
		t.Fatalf("AcquireMany of %d keys: the first request repeated at the end: got %+v, want its lease again", n, r)
	}
	if r := all[n+1]; r.Err != nil || r.Outcome != idem.InFlight {
		t.Fatalf("AcquireMany of %d keys: the second key again at the end: got %+v, want InFlight", n, r)
	}
	got := all[:n]
	cs := make([]idem.Completion, n)
	for i, r := range got {
		if r.Err != nil || r.Outcome != idem.Acquired {
			t.Fatalf("AcquireMany of %d keys: answer %d: %v %v", n, i, r.Outcome, r.Err)
		}
		cs[i] = idem.Completion{Lease: r.Lease, Response: &idem.Response{Status: 200, Body: []byte(fmt.Sprint(i))}, Retention: retention}
	}
	for i, err := range e.completeMany(cs...) {
		if err != nil {
			t.Fatalf("CompleteMany of %d keys: answer %d: %v", n, i, err)
		}
	}
	for i, r := range e.acquireMany(reqs...) {
		if r.Err != nil || r.Outcome != idem.Replay || string(r.Response.Body) != fmt.Sprint(i) {
			t.Fatalf("AcquireMany of %d completed keys: answer %d: %v %v %v", n, i, r.Outcome, r.Response, r.Err)
		}
	}
}

// testBatchConcurrency: 16 callers acquire the same 32 keys at once, each
// in its own order: exactly one lease per key.
func (s *suite) testBatchConcurrency(t *testing.T) {
	e := s.env(t)
	keys := make([]idem.Key, 32)
	for i := range keys {
		keys[i] = newKey()
	}
	const callers = 16
	results := make([][]idem.AcquireResult, callers)
	orders := make([][]int, callers)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for c := range callers {
		orders[c] = rand.Perm(len(keys))
		wg.Go(func() {
			reqs := make([]idem.AcquireRequest, len(keys))
			for i, k := range orders[c] {
				reqs[i] = req(keys[k], fpA, idem.NewLeaseID(), longTTL)
			}
			<-start
			results[c] = e.batch().AcquireMany(e.ctx, reqs)
		})
	}
	close(start)
	wg.Wait()
	acquired := make([]int, len(keys))
	for c, res := range results {
		for i, r := range res {
			if r.Err != nil {
				t.Fatalf("caller %d, key %d: %v", c, orders[c][i], r.Err)
			}
			switch r.Outcome {
			case idem.Acquired:
				acquired[orders[c][i]]++
			case idem.InFlight:
			default:
				t.Errorf("caller %d, key %d: got %v, want Acquired or InFlight", c, orders[c][i], r.Outcome)
			}
		}
	}
	for k, n := range acquired {
		if n != 1 {
			t.Errorf("key %d: %d leases granted, want 1", k, n)
		}
	}
}
