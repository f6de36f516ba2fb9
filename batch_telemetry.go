package idem

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
)

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
