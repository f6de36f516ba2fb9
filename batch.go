package idem

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
)

// BatchStore is an optional extension of Store: Acquire, Complete and
// Release for many keys in one step (one Redis script per node or hash
// slot, one SQL statement, one pass in memory) and, for a remote store,
// one round trip. Use it through the package functions AcquireMany,
// CompleteMany and ReleaseMany, which fall back to the single-key calls
// for a store that does not implement it.
//
// The contract, besides Store's:
//
//   - Answers per key. Each method returns one answer per input, in input
//     order, and each answer is the one the single-key call would have
//     given (Acquisition or error, ErrLeaseLost, *StoreError; mismatch, in
//     flight, takeover, replay and the repeated call after a lost reply
//     included).
//   - Atomic per key, not across keys. Each key's transition is atomic as
//     the single-key call's is; the batch is not a transaction. Other
//     callers may see some keys of a batch changed and others not yet.
//   - Order. The answers are those of the single-key calls made one after
//     the other in input order, so a key that appears twice in one batch
//     is handled twice, the second time after the first: an AcquireMany
//     with two requests for one key gives the second one InFlight (or
//     Acquired again with the same LeaseID, or Mismatch), as two calls in
//     a row would. (Keys in different Redis Cluster slots go out in
//     parallel; their relative order does not change any answer.)
//   - Partial failures. A failure may affect some keys and not others (on
//     Redis Cluster, one node's group can fail alone): each failed key
//     gets its own *StoreError, with the key and the single call's Op
//     ("acquire", "complete", "release"). A key whose answer is an error
//     may have been changed anyway (a lost reply), exactly as with a
//     single call, and repeating the same batch (or the same request
//     alone) is safe. An invalid request (Validate, a nil Response, a
//     retention under a millisecond) fails alone and changes nothing.
//   - A cancelled context fails every key with a *StoreError wrapping the
//     context's error, and nothing is sent.
//   - An empty batch returns an empty answer and sends nothing.
type BatchStore interface {
	Store

	// AcquireMany is Acquire for each request. The answer has
	// len(reqs) entries.
	AcquireMany(ctx context.Context, reqs []AcquireRequest) []AcquireResult

	// CompleteMany is Complete for each completion: the answer has
	// len(cs) entries, nil where the key was completed (now, or by this
	// lease before).
	CompleteMany(ctx context.Context, cs []Completion) []error

	// ReleaseMany is Release for each lease: the answer has len(leases)
	// entries, nil where the key was released (now, or by this lease
	// before).
	ReleaseMany(ctx context.Context, leases []Lease) []error
}

// AcquireResult is one answer of AcquireMany: what Acquire would have
// returned.
type AcquireResult struct {
	Acquisition
	Err error
}

// Completion is one input of CompleteMany: Complete's arguments.
type Completion struct {
	Lease     Lease
	Response  *Response
	Retention time.Duration
}

// AcquireMany acquires every request of reqs on s: in one step when s is a
// BatchStore, else with one Acquire per request, in order. See BatchStore
// for the contract.
func AcquireMany(ctx context.Context, s Store, reqs []AcquireRequest) []AcquireResult {
	if len(reqs) == 0 {
		return []AcquireResult{}
	}
	if b, ok := s.(BatchStore); ok {
		out := b.AcquireMany(ctx, reqs)
		if len(out) != len(reqs) {
			return acquireFailed(reqs, fmt.Errorf("%T.AcquireMany answered %d of %d requests", s, len(out), len(reqs)))
		}
		return out
	}
	out := make([]AcquireResult, len(reqs))
	for i, req := range reqs {
		out[i].Acquisition, out[i].Err = s.Acquire(ctx, req)
	}
	return out
}

// CompleteMany completes every completion of cs on s: in one step when s
// is a BatchStore, else with one Complete per completion, in order. The
// answer holds nil where the key was completed. See BatchStore for the
// contract.
func CompleteMany(ctx context.Context, s Store, cs []Completion) []error {
	if len(cs) == 0 {
		return []error{}
	}
	if b, ok := s.(BatchStore); ok {
		out := b.CompleteMany(ctx, cs)
		if len(out) != len(cs) {
			err := fmt.Errorf("%T.CompleteMany answered %d of %d completions", s, len(out), len(cs))
			out = make([]error, len(cs))
			for i, c := range cs {
				out[i] = &StoreError{Op: "complete", Key: c.Lease.Key, Err: err}
			}
		}
		return out
	}
	out := make([]error, len(cs))
	for i, c := range cs {
		out[i] = s.Complete(ctx, c.Lease, c.Response, c.Retention)
	}
	return out
}

// ReleaseMany releases every lease of leases on s: in one step when s is
// a BatchStore, else with one Release per lease, in order. The answer
// holds nil where the key was released. See BatchStore for the contract.
func ReleaseMany(ctx context.Context, s Store, leases []Lease) []error {
	if len(leases) == 0 {
		return []error{}
	}
	if b, ok := s.(BatchStore); ok {
		out := b.ReleaseMany(ctx, leases)
		if len(out) != len(leases) {
			err := fmt.Errorf("%T.ReleaseMany answered %d of %d leases", s, len(out), len(leases))
			out = make([]error, len(leases))
			for i, l := range leases {
				out[i] = &StoreError{Op: "release", Key: l.Key, Err: err}
			}
		}
		return out
	}
	out := make([]error, len(leases))
	for i, l := range leases {
		out[i] = s.Release(ctx, l)
	}
	return out
}

func acquireFailed(reqs []AcquireRequest, err error) []AcquireResult {
	out := make([]AcquireResult, len(reqs))
	for i, r := range reqs {
		out[i].Err = &StoreError{Op: "acquire", Key: r.Key, Err: err}
	}
	return out
}

// ---- The Guard over a batch ----

// BeginRequest is one key of Guard.BeginMany.
type BeginRequest struct {
	Key         Key
	Fingerprint Fingerprint
}

// Begun is one answer of Guard.BeginMany: what Begin would have returned.
type Begun struct {
	// Attempt is set when Acquisition.Outcome is Acquired; finish it with
	// Complete, Release or Guard.FinishMany.
	Attempt     *Attempt
	Acquisition Acquisition
	Err         error
}

// BeginMany is Begin for many keys, acquired in one store step when the
// store is a BatchStore (see AcquireMany). Each answer is what Begin would
// have returned for its key; every Attempt is renewed in the background
// on its own until it is finished. A key that appears twice gets, the
// second time, what a second Begin would get while the first holds it:
// InFlight.
func (g *Guard) BeginMany(ctx context.Context, reqs []BeginRequest) []Begun {
	out := make([]Begun, len(reqs))
	if err := ctx.Err(); err != nil {
		for i, r := range reqs {
			out[i].Err = &StoreError{Op: "acquire", Key: r.Key, Err: err}
		}
		return out
	}
	sent := time.Now()
	areqs := make([]AcquireRequest, len(reqs))
	for i, r := range reqs {
		areqs[i] = AcquireRequest{Key: r.Key, Fingerprint: r.Fingerprint, LeaseID: NewLeaseID(), TTL: g.cfg.Lease}
	}
	var forget []Lease
	for i, r := range AcquireMany(ctx, g.ops, areqs) {
		out[i].Acquisition = r.Acquisition
		switch {
		case r.Err != nil:
			// Applied with its reply lost, perhaps: release in the
			// background (see Begin).
			out[i].Err = r.Err
			out[i].Acquisition = Acquisition{}
			forget = append(forget, Lease{Key: areqs[i].Key, ID: areqs[i].LeaseID, TTL: areqs[i].TTL})
		case r.Outcome == Acquired:
			out[i].Attempt = g.newAttempt(ctx, r.Lease, sent)
		}
	}
	if len(forget) > 0 {
		select {
		case g.forgets <- struct{}{}:
			go func() {
				defer func() { <-g.forgets }()
				g.forgetMany(context.Background(), forget)
			}()
		default:
		}
	}
	return out
}

// forgetMany is forget for many leases, in one step on a BatchStore.
func (g *Guard) forgetMany(ctx context.Context, leases []Lease) {
	if len(leases) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, forgetTimeout)
	defer cancel()
	ReleaseMany(ctx, g.ops, leases)
}

// Finish is one input of Guard.FinishMany: an attempt and its result. A
// nil Response releases the key (Attempt.Release); any other completes it
// (Attempt.Complete).
type Finish struct {
	Attempt  *Attempt
	Response *Response
}

// FinishMany finishes many attempts: the completions in one store step
// and the releases in another when the store is a BatchStore (see
// CompleteMany). Each answer is what Attempt.Complete or Attempt.Release
// would have returned, with the same effects: an attempt whose lease was
// lost writes nothing and gets ErrLeaseLost, and a key whose completion
// failed is released, best effort. A response whose body is omitted or
// larger than the guard's MaxResponseSize is completed on its own, by
// Attempt.Complete. Use a context that is not cancelled with the request
// (context.WithoutCancel).
func (g *Guard) FinishMany(ctx context.Context, fs []Finish) []error {
	out := make([]error, len(fs))
	var (
		cs      []Completion
		csAt    []int
		rels    []Lease
		relsAt  []int // -1: a release whose answer is ErrLeaseLost already
		single  []int
		forgets []Lease
	)
	for i, f := range fs {
		a := f.Attempt
		if f.Response == nil {
			err := a.finish()
			if err != nil && !errors.Is(err, ErrLeaseLost) {
				out[i] = err
				continue
			}
			out[i] = err // ErrLeaseLost stays the answer; the store is asked anyway
			rels = append(rels, a.lease)
			if err != nil {
				relsAt = append(relsAt, -1)
			} else {
				relsAt = append(relsAt, i)
			}
			continue
		}
		if f.Response.BodyOmitted || len(f.Response.Body) > g.cfg.MaxResponseSize {
			single = append(single, i)
			continue
		}
		if err := f.Response.validate(); err != nil {
			out[i] = err
			continue
		}
		if err := a.finish(); err != nil {
			out[i] = err
			if errors.Is(err, ErrLeaseLost) {
				forgets = append(forgets, a.lease)
			}
			continue
		}
		cs = append(cs, Completion{Lease: a.lease, Response: f.Response, Retention: g.cfg.Retention})
		csAt = append(csAt, i)
	}

	var wg sync.WaitGroup
	for _, i := range single {
		wg.Go(func() { out[i] = fs[i].Attempt.Complete(ctx, fs[i].Response) })
	}
	if len(rels) > 0 {
		wg.Go(func() {
			for j, err := range ReleaseMany(ctx, g.ops, rels) {
				if at := relsAt[j]; at >= 0 {
					out[at] = err
				}
			}
		})
	}
	if len(cs) > 0 {
		for j, err := range CompleteMany(ctx, g.ops, cs) {
			out[csAt[j]] = err
			if err != nil && !errors.Is(err, ErrLeaseLost) && !errors.Is(err, ErrNotReplicated) {
				forgets = append(forgets, cs[j].Lease)
			}
		}
	}
	g.forgetMany(ctx, forgets)
	wg.Wait()
	return out
}

// ---- Telemetry ----

// The observed store does batches in one step whenever the store under it
// does, with one span and one histogram point per batch.

func (s *observedStore) AcquireMany(ctx context.Context, reqs []AcquireRequest) []AcquireResult {
	if len(reqs) == 0 {
		return []AcquireResult{}
	}
	ctx, op := s.t.StartOp(ctx, "acquire_many", s.kind, reqs[0].Key.String())
	out := AcquireMany(ctx, s.Store, reqs)
	res, err := "ok", error(nil)
	for _, r := range out {
		if r.Err != nil {
			res, err = "error", r.Err
			break
		}
	}
	op.End(ctx, res, err, batchSize(len(reqs)))
	return out
}

func (s *observedStore) CompleteMany(ctx context.Context, cs []Completion) []error {
	if len(cs) == 0 {
		return []error{}
	}
	ctx, op := s.t.StartOp(ctx, "complete_many", s.kind, cs[0].Lease.Key.String())
	out := CompleteMany(ctx, s.Store, cs)
	res, err := batchResult(out)
	op.End(ctx, res, err, batchSize(len(cs)))
	return out
}

func (s *observedStore) ReleaseMany(ctx context.Context, leases []Lease) []error {
	if len(leases) == 0 {
		return []error{}
	}
	ctx, op := s.t.StartOp(ctx, "release_many", s.kind, leases[0].Key.String())
	out := ReleaseMany(ctx, s.Store, leases)
	res, err := batchResult(out)
	op.End(ctx, res, err, batchSize(len(leases)))
	return out
}

func batchSize(n int) attribute.KeyValue { return attribute.Int("idem.batch.size", n) }

// batchResult names a batch's result: the first that is not "ok", by
// the single call's names, or "ok".
func batchResult(errs []error) (string, error) {
	for _, err := range errs {
		if err != nil {
			return result(err), err
		}
	}
	return "ok", nil
}

var _ BatchStore = (*observedStore)(nil)
