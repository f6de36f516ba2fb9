package idem

import (
	"context"
	"errors"
	"slices"
	"sync"
	"time"
)

// The Guard over a batch: Begin, and Complete or Release, for many keys,
// in one store step each when the store is a BatchStore.

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
			out[i].Attempt = g.newAttempt(ctx, r.Lease, reqs[i].Fingerprint, sent)
		case r.Outcome == Replay:
			out[i].Err = g.openReplay(reqs[i].Key, reqs[i].Fingerprint, &out[i].Acquisition)
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
// failed is released, best effort (after the retries of the guard's
// CompleteRetry, made for the failed completions together: see
// Config.CompleteRetry). A response whose body is omitted or
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
		stored, err := a.sealStored(f.Response)
		if err != nil {
			out[i] = err
			forgets = append(forgets, a.lease)
			continue
		}
		if cs == nil { // room for every one, the usual case
			cs, csAt = make([]Completion, 0, len(fs)), make([]int, 0, len(fs))
		}
		cs = append(cs, Completion{Lease: a.lease, Response: stored, Retention: g.cfg.Retention})
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
		start := time.Now()
		errs := CompleteMany(ctx, g.ops, cs)
		if g.cfg.CompleteRetry > 0 {
			g.retryCompleteMany(ctx, start, cs, func(j int) *Attempt { return fs[csAt[j]].Attempt }, errs)
		}
		for j, err := range errs {
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

// retryCompleteMany is Attempt.retryComplete for the completions cs of
// FinishMany, whose answers are errs (updated in place): the ones that
// failed with a retryable error are tried again together, each until its
// own attempt's retryUntil.
func (g *Guard) retryCompleteMany(ctx context.Context, start time.Time, cs []Completion, att func(j int) *Attempt, errs []error) {
	var (
		left []int       // indexes in cs still to try
		ends []time.Time // by index in cs, for those in left
	)
	for j, err := range errs {
		// (retryableComplete allocates, even for nil: most answers are.)
		if err != nil && retryableComplete(err) {
			if ends == nil {
				ends = make([]time.Time, len(cs))
			}
			left = append(left, j)
			ends[j] = att(j).retryUntil(start)
		}
	}
	if len(left) == 0 {
		return // nothing to retry: the loop below would return at once
	}
	sub := make([]Completion, 0, len(left))
	for n := 0; len(left) > 0; n++ {
		// Each waits as on its own; the group goes when the first is due.
		backoff := completeBackoff(n)
		wait := backoff
		left = slices.DeleteFunc(left, func(j int) bool {
			w := min(backoff, time.Until(ends[j])-completeRetryMin)
			if w < 0 {
				return true
			}
			wait = min(wait, w)
			return false
		})
		if len(left) == 0 || !sleepCtx(ctx, wait) {
			return
		}
		sub = sub[:0]
		end := ends[left[0]]
		for _, j := range left {
			sub = append(sub, cs[j])
			if ends[j].Before(end) {
				end = ends[j]
			}
		}
		// Bounded by the earliest end: the others, cut short, go on at the
		// next round.
		rctx, cancel := context.WithDeadline(ctx, end)
		for k, err := range CompleteMany(rctx, g.ops, sub) {
			errs[left[k]] = err
		}
		cancel()
		left = slices.DeleteFunc(left, func(j int) bool { return !retryableComplete(errs[j]) })
	}
}
