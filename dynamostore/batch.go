package dynamostore

import (
	"context"
	"sync"

	"github.com/idemkit/idem"
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
	perKey(len(reqs), func(i int) idem.Key { return reqs[i].Key }, func(i int) {
		out[i].Acquisition, out[i].Err = s.Acquire(ctx, reqs[i])
	})
	return out
}

// CompleteMany implements idem.BatchStore as AcquireMany does: Complete
// for each completion, different keys side by side.
func (s *Store) CompleteMany(ctx context.Context, cs []idem.Completion) []error {
	out := make([]error, len(cs))
	perKey(len(cs), func(i int) idem.Key { return cs[i].Lease.Key }, func(i int) {
		out[i] = s.Complete(ctx, cs[i].Lease, cs[i].Response, cs[i].Retention)
	})
	return out
}

// ReleaseMany implements idem.BatchStore as AcquireMany does: Release for
// each lease, different keys side by side.
func (s *Store) ReleaseMany(ctx context.Context, leases []idem.Lease) []error {
	out := make([]error, len(leases))
	perKey(len(leases), func(i int) idem.Key { return leases[i].Key }, func(i int) {
		out[i] = s.Release(ctx, leases[i])
	})
	return out
}

// perKey calls call(i) for i in [0, n): the indexes of one key one after
// the other in order, different keys side by side, at most
// BatchParallelism at a time. It returns when every call has.
func perKey(n int, key func(int) idem.Key, call func(int)) {
	if n == 1 {
		call(0)
		return
	}
	groups := make(map[idem.Key][]int, n)
	order := make([]idem.Key, 0, n)
	for i := range n {
		k := key(i)
		if _, ok := groups[k]; !ok {
			order = append(order, k)
		}
		groups[k] = append(groups[k], i)
	}
	sem := make(chan struct{}, BatchParallelism)
	var wg sync.WaitGroup
	for _, k := range order {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			for _, i := range groups[k] {
				call(i)
			}
		})
	}
	wg.Wait()
}
