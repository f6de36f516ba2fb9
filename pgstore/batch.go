package pgstore

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
)

// Batched transitions (idem.BatchStore): one statement per batch, over
// arrays (acquireManySQL, completeManySQL, releaseManySQL in sql.go), and
// one round trip. A key that appears k times in a batch takes k
// statements, its i-th appearance in the i-th, so that its calls run in
// order; a batch without repeated keys is one statement.
//
// Concurrent batches that share keys: acquisitions insert in key order
// and never deadlock among themselves. Completions and releases lock the
// rows they update in the order the plan visits them; a deadlock needs
// two batches that each hold a key the other updates, which for leases
// means a holder racing the takeover of its own expired lease, and
// PostgreSQL then fails one of the statements (every key of it gets a
// *StoreError; the caller may repeat it).

var _ idem.BatchStore = (*Store)(nil)

// passes splits the valid indexes of a batch of n into statements of
// distinct keys, each key's appearances in order.
func passes(n int, key func(int) idem.Key, valid func(int) bool) [][]int {
	seen := make(map[idem.Key]int, n)
	var out [][]int
	for i := range n {
		if !valid(i) {
			continue
		}
		k := key(i)
		p := seen[k]
		seen[k] = p + 1
		if p == len(out) {
			out = append(out, make([]int, 0, n))
		}
		out[p] = append(out[p], i)
	}
	return out
}

// AcquireMany implements idem.BatchStore.
func (s *Store) AcquireMany(ctx context.Context, reqs []idem.AcquireRequest) []idem.AcquireResult {
	out := make([]idem.AcquireResult, len(reqs))
	if err := ctx.Err(); err != nil {
		for i, r := range reqs {
			out[i].Err = &idem.StoreError{Op: "acquire", Key: r.Key, Err: err}
		}
		return out
	}
	for i, r := range reqs {
		out[i].Err = r.Validate()
	}
	for _, pass := range passes(len(reqs), func(i int) idem.Key { return reqs[i].Key }, func(i int) bool { return out[i].Err == nil }) {
		keys, fps, ids := make([][]byte, len(pass)), make([][]byte, len(pass)), make([][]byte, len(pass))
		ttls := make([]time.Duration, len(pass))
		for j, i := range pass {
			r := &reqs[i]
			keys[j], fps[j], ids[j], ttls[j] = r.Key[:], r.Fingerprint[:], r.LeaseID[:], interval(r.TTL)
		}
		answered := 0
		err := s.each(ctx, pass, s.sql.acquireMany, []any{s.ns, keys, fps, ids, ttls}, func(rows pgx.Rows, at func(int64) (int, error)) error {
			var r row
			var ord int64
			var leftNow time.Duration
			if err := rows.Scan(append([]any{&ord}, append(r.dest(), &leftNow)...)...); err != nil {
				return err
			}
			i, err := at(ord)
			if err != nil {
				return err
			}
			answered++
			out[i].Acquisition, out[i].Err = acquisition(reqs[i], &r, leftNow)
			return nil
		})
		if err == nil && answered != len(pass) {
			err = fmt.Errorf("the statement answered %d of %d keys", answered, len(pass))
		}
		if err != nil {
			for _, i := range pass {
				out[i] = idem.AcquireResult{Err: &idem.StoreError{Op: "acquire", Key: reqs[i].Key, Err: err}}
			}
		}
	}
	return out
}

// CompleteMany implements idem.BatchStore.
func (s *Store) CompleteMany(ctx context.Context, cs []idem.Completion) []error {
	out := make([]error, len(cs))
	encs := make([][]byte, len(cs))
	for i, c := range cs {
		encs[i], out[i] = s.encode(ctx, "complete", c.Lease, c.Response, c.Retention)
	}
	for _, pass := range passes(len(cs), func(i int) idem.Key { return cs[i].Lease.Key }, func(i int) bool { return out[i] == nil }) {
		keys, ids, resps := make([][]byte, len(pass)), make([][]byte, len(pass)), make([][]byte, len(pass))
		rets, tokens := make([]time.Duration, len(pass)), make([]int64, len(pass))
		for j, i := range pass {
			l := &cs[i].Lease
			keys[j], ids[j], resps[j], rets[j], tokens[j] = l.Key[:], l.ID[:], encs[i], interval(cs[i].Retention), int64(l.Token)
		}
		s.verdicts(ctx, "complete", pass, s.sql.completeMany, []any{s.ns, keys, ids, resps, rets, tokens},
			func(i int) idem.Key { return cs[i].Lease.Key }, out)
	}
	return out
}

// ReleaseMany implements idem.BatchStore.
func (s *Store) ReleaseMany(ctx context.Context, leases []idem.Lease) []error {
	out := make([]error, len(leases))
	if err := ctx.Err(); err != nil {
		for i, l := range leases {
			out[i] = &idem.StoreError{Op: "release", Key: l.Key, Err: err}
		}
		return out
	}
	for _, pass := range passes(len(leases), func(i int) idem.Key { return leases[i].Key }, func(int) bool { return true }) {
		keys, ids := make([][]byte, len(pass)), make([][]byte, len(pass))
		ttls, tokens := make([]time.Duration, len(pass)), make([]int64, len(pass))
		for j, i := range pass {
			l := &leases[i]
			keys[j], ids[j], ttls[j], tokens[j] = l.Key[:], l.ID[:], interval(max(l.TTL, time.Millisecond)), int64(l.Token)
		}
		s.verdicts(ctx, "release", pass, s.sql.releaseMany, []any{s.ns, keys, ids, ttls, tokens},
			func(i int) idem.Key { return leases[i].Key }, out)
	}
	return out
}

// verdicts runs a statement that answers (ordinal, ok) per key of pass
// and sets out: nil, ErrLeaseLost, or a *StoreError for every key of a
// failed statement.
func (s *Store) verdicts(ctx context.Context, op string, pass []int, sql string, args []any, key func(int) idem.Key, out []error) {
	answered := 0
	err := s.each(ctx, pass, sql, args, func(rows pgx.Rows, at func(int64) (int, error)) error {
		var ord int64
		var ok bool
		if err := rows.Scan(&ord, &ok); err != nil {
			return err
		}
		i, err := at(ord)
		if err != nil {
			return err
		}
		answered++
		out[i] = lost(ok)
		return nil
	})
	if err == nil && answered != len(pass) {
		err = fmt.Errorf("the statement answered %d of %d keys", answered, len(pass))
	}
	if err != nil {
		for _, i := range pass {
			out[i] = &idem.StoreError{Op: op, Key: key(i), Err: err}
		}
	}
}

// each runs a batched statement and calls row for each row, with at,
// which maps the row's ordinal (1-based over pass) to its index into the
// batch.
func (s *Store) each(ctx context.Context, pass []int, sql string, args []any, row func(rows pgx.Rows, at func(ord int64) (int, error)) error) error {
	rows, err := s.pool.Query(ctx, sql, args...)
	if err != nil {
		return err
	}
	defer rows.Close()
	at := func(ord int64) (int, error) {
		if ord < 1 || ord > int64(len(pass)) {
			return 0, fmt.Errorf("unexpected ordinal %d", ord)
		}
		return pass[ord-1], nil
	}
	for rows.Next() {
		if err := row(rows, at); err != nil {
			return err
		}
	}
	return rows.Err()
}
