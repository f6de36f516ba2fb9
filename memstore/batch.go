package memstore

import (
	"context"
	"fmt"
	"time"

	"github.com/idemkit/idem"
)

var _ idem.BatchStore = (*Store)(nil)

// AcquireMany implements idem.BatchStore: one pass over reqs, each key in
// its own critical section, in input order. Replayed responses are
// decoded outside the locks. With Options.MaxBytes, each request is
// admitted or refused (ErrFull) as Acquire would.
func (s *Store) AcquireMany(ctx context.Context, reqs []idem.AcquireRequest) []idem.AcquireResult {
	out := make([]idem.AcquireResult, len(reqs))
	if err := ctx.Err(); err != nil {
		for i, req := range reqs {
			out[i].Err = &idem.StoreError{Op: "acquire", Key: req.Key, Err: err}
		}
		return out
	}
	encs := make([][]byte, len(reqs))
	for i, req := range reqs {
		if err := req.Validate(); err != nil {
			out[i].Err = err
			continue
		}
		out[i].Acquisition, encs[i], out[i].Err = s.acquireRoom(req)
	}
	for i, enc := range encs {
		if out[i].Outcome != idem.Replay {
			continue
		}
		resp, err := decode(enc)
		if err != nil {
			out[i] = idem.AcquireResult{Err: &idem.StoreError{Op: "acquire", Key: reqs[i].Key, Err: err}}
			continue
		}
		out[i].Response = resp
	}
	return out
}

// CompleteMany implements idem.BatchStore: the responses are encoded
// first, unlocked, then one pass completes the keys in input order.
func (s *Store) CompleteMany(ctx context.Context, cs []idem.Completion) []error {
	out := make([]error, len(cs))
	if err := ctx.Err(); err != nil {
		for i, c := range cs {
			out[i] = &idem.StoreError{Op: "complete", Key: c.Lease.Key, Err: err}
		}
		return out
	}
	encs := make([][]byte, len(cs))
	for i, c := range cs {
		if c.Retention < time.Millisecond {
			out[i] = fmt.Errorf("memstore: complete: retention %v is shorter than 1ms", c.Retention)
			continue
		}
		enc, err := encode(c.Response)
		if err != nil {
			out[i] = &idem.StoreError{Op: "complete", Key: c.Lease.Key, Err: err}
			continue
		}
		encs[i] = enc
	}
	for i, c := range cs {
		if out[i] == nil {
			out[i] = s.complete(c.Lease, encs[i], c.Retention)
		}
	}
	return out
}

// ReleaseMany implements idem.BatchStore: one pass, in input order.
func (s *Store) ReleaseMany(ctx context.Context, leases []idem.Lease) []error {
	out := make([]error, len(leases))
	for i, l := range leases {
		if err := ctxErr(ctx, "release", l.Key); err != nil {
			out[i] = err
			continue
		}
		out[i] = s.release(l)
	}
	return out
}
