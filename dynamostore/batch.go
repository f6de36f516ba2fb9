package dynamostore

import (
	"context"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/perkey"
)

// BatchParallelism is how many of a batch's keys a BatchStore method has
// in flight at once: each key's transition is its own conditional write,
// and up to this many go out side by side.
const BatchParallelism = 32

var _ idem.BatchStore = (*Store)(nil)

// AcquireMany implements idem.BatchStore: one conditional write per key,
// as Acquire makes, with different keys side by side (up to
// BatchParallelism at a time) and the requests for one key one after the
// other in input order. DynamoDB has no batch write with a condition per
// item: BatchWriteItem takes no conditions, and TransactWriteItems fails
// every item when one condition fails, which would turn one key in flight
// into a failure for the whole batch. So a batch costs the requests of its
// keys, not one; it saves their round trips' wait, which is what a batched
// consumer spends its time on.
func (s *Store) AcquireMany(ctx context.Context, reqs []idem.AcquireRequest) []idem.AcquireResult {
	out := make([]idem.AcquireResult, len(reqs))
	perkey.Run(len(reqs), func(i int) idem.Key { return reqs[i].Key }, BatchParallelism, func(i int) {
		out[i].Acquisition, out[i].Err = s.Acquire(ctx, reqs[i])
	})
	return out
}

// CompleteMany implements idem.BatchStore as AcquireMany does: Complete
// for each completion, different keys side by side.
func (s *Store) CompleteMany(ctx context.Context, cs []idem.Completion) []error {
	out := make([]error, len(cs))
	perkey.Run(len(cs), func(i int) idem.Key { return cs[i].Lease.Key }, BatchParallelism, func(i int) {
		out[i] = s.Complete(ctx, cs[i].Lease, cs[i].Response, cs[i].Retention)
	})
	return out
}

// ReleaseMany implements idem.BatchStore as AcquireMany does: Release for
// each lease, different keys side by side.
func (s *Store) ReleaseMany(ctx context.Context, leases []idem.Lease) []error {
	out := make([]error, len(leases))
	perkey.Run(len(leases), func(i int) idem.Key { return leases[i].Key }, BatchParallelism, func(i int) {
		out[i] = s.Release(ctx, leases[i])
	})
	return out
}
