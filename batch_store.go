package idem

import (
	"context"
	"fmt"
)

// The package functions over a BatchStore: one step when the store is one,
// else the single-key calls, in order.

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
