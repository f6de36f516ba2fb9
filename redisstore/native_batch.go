package redisstore

import (
	"context"
	"fmt"
	"slices"
	"sync"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/perkey"
)

// Batches on the native path.
//
// On a single node (or Sentinel's primary: nconn.oneNode) a batch sends
// the first appearance of each key in one pipeline:
//
//   - AcquireMany: SET key claim NX GET PX px for each key, then one TIME,
//     which runs after every claim, so that it proves each claim's token
//     as the single acquire's TIME does. A key whose claim took it, with
//     a token that stands, for a lease longer than 2*maxAhead, is granted
//     there, as the single acquire grants it; every other claim (a
//     record was there, a short lease, a token that does not stand) goes
//     on along the single acquire's path from that claim, on its own
//     (claimLoop). A claim answered with an error reply other than
//     WRONGTYPE was not written: that key takes the single acquire from
//     the start.
//   - CompleteMany and ReleaseMany: the one SET IFEQ of each lease this
//     runner granted (fastCmd); a lease it did not grant, and one whose
//     SET was answered nil or with an error reply, takes the read,
//     compare-and-set path on its own.
//
// The later appearances of a key take their single transition after its
// first one has its answer, one after the other in batch order, as on
// the Lua path (where a key's appearances run in one script call, in
// order). The keys that go on on their own, and the keys of a batch on
// Cluster (where the keys of a batch are on different slots and nodes,
// and pipe is a transaction on one slot), run side by side (execEach).
//
// A failed pipeline (the connection) fails the first appearances it
// carried, as a failed single call fails its key: their claims or
// completions may or may not have been made.

// maxEachInFlight bounds the keys of one batch whose transitions run at
// once on their own on the native path.
const maxEachInFlight = 64

// eachTask is an entry of a batch that takes its key's single transition:
// its index in the batch, and, when not nil, how it goes on from the
// batch's pipeline (instead of the single transition from the start).
type eachTask struct {
	i    int
	cont func(ctx context.Context) (reply, error)
}

// execNative runs a batch on the native runner r (the entries idx of the
// batch; see exec for the rest).
func (s *Store) execNative(ctx context.Context, r *nativeRunner, bs *batchScript, idx []int, key func(int) idem.Key, names []string,
	args func(i int, dst []string) []string, answer func(i int, r reply), fail func(i int, err error)) {
	var rest []eachTask
	switch {
	case len(idx) > 1 && r.c.oneNode() && bs.single == scriptAcquire:
		rest = s.acquireBatch(ctx, r, idx, key, names, args, answer, fail)
	case len(idx) > 1 && r.c.oneNode() && (bs.single == scriptComplete || bs.single == scriptRelease):
		rest = s.fastBatch(ctx, r, bs.single, idx, key, names, args, answer, fail)
	default:
		rest = tasksOf(idx)
	}
	s.execEach(ctx, r, bs, rest, key, names, args, answer, fail)
}

// tasksOf returns the entries idx, each to take its single transition.
func tasksOf(idx []int) []eachTask {
	out := make([]eachTask, len(idx))
	for j, i := range idx {
		out[j] = eachTask{i: i}
	}
	return out
}

// firstsScan is the largest batch firsts scans instead of making a map.
const firstsScan = 32

// firsts returns, for each entry of idx, whether it is its key's first
// appearance in the batch.
func firsts(idx []int, key func(int) idem.Key) []bool {
	out := make([]bool, len(idx))
	if len(idx) <= firstsScan {
		// A small batch: each key compared with the keys before it,
		// without a map.
		var ks [firstsScan]idem.Key
		for j, i := range idx {
			ks[j] = key(i)
			out[j] = !slices.Contains(ks[:j], ks[j])
		}
		return out
	}
	seen := make(map[idem.Key]struct{}, len(idx))
	for j, i := range idx {
		k := key(i)
		if _, dup := seen[k]; !dup {
			seen[k] = struct{}{}
			out[j] = true
		}
	}
	return out
}

// pipeFailed checks a batch pipeline's reply: its error, or one for a
// reply of the wrong length.
func pipeFailed(res []nval, err error, n int) error {
	if err == nil && len(res) != n {
		err = fmt.Errorf("unexpected reply of %d elements to a pipeline of %d commands", len(res), n)
	}
	return err
}

// acquireBatch sends the claims of a batch in one pipeline, answers the
// keys it settles, and returns the entries left, in batch order.
func (s *Store) acquireBatch(ctx context.Context, r *nativeRunner, idx []int, key func(int) idem.Key, names []string,
	args func(i int, dst []string) []string, answer func(i int, r reply), fail func(i int, err error)) []eachTask {
	c := r.c
	first := firsts(idx, key)
	type sent struct {
		j  int // position in idx
		a  acq
		cl claim
	}
	claims := make([]sent, 0, len(idx))
	cmds := make([][]string, 0, len(idx)+1)
	var buf [3]string
	for j, i := range idx {
		if !first[j] {
			continue
		}
		a0 := args(i, buf[:0])
		a, err := newAcq(names[i], a0[0], a0[1], a0[2])
		if err != nil {
			continue // the single acquire, which fails the same way
		}
		cl, cmd := r.nextClaim(&a)
		claims = append(claims, sent{j: j, a: a, cl: cl})
		cmds = append(cmds, cmd)
	}
	if len(claims) == 0 {
		return tasksOf(idx)
	}
	cmds = append(cmds, []string{"TIME"})
	res, err := c.pipe(ctx, cmds...)
	err = pipeFailed(res, err, len(cmds))
	var us int64
	if err == nil {
		if us, err = timeMicros(res[len(cmds)-1]); err == nil {
			r.observe(us)
		}
	}
	if err != nil {
		err = s.explainACL(err)
	}
	// What each entry takes after the pipeline: its single acquire from
	// the start (nil), from its claim, or nothing (answered).
	next := make([]func(ctx context.Context) (reply, error), len(idx))
	done := make([]bool, len(idx))
	for n := range claims {
		p := &claims[n]
		switch {
		case err != nil:
			fail(idx[p.j], err)
			done[p.j] = true
			continue
		case decodeValue(res[n], &p.cl.st) != nil:
			continue // an error reply: not written; the single acquire
		}
		p.cl.st.now = us / 1000
		if rep, ok := r.settled(&p.a, &p.cl); ok {
			answer(idx[p.j], rep)
			done[p.j] = true
			continue
		}
		next[p.j] = func(ctx context.Context) (reply, error) { return r.claimLoop(ctx, c, &p.a, &p.cl) }
	}
	rest := make([]eachTask, 0, len(idx))
	for j, i := range idx {
		if !done[j] {
			rest = append(rest, eachTask{i: i, cont: next[j]})
		}
	}
	return rest
}

// fastBatch sends the one SET IFEQ of each lease of a batch this runner
// granted (fastCmd) in one pipeline, answers the keys it completes or
// releases, and returns the entries left, in batch order.
func (s *Store) fastBatch(ctx context.Context, r *nativeRunner, script int, idx []int, key func(int) idem.Key, names []string,
	args func(i int, dst []string) []string, answer func(i int, r reply), fail func(i int, err error)) []eachTask {
	first := firsts(idx, key)
	at := make([]int, 0, len(idx)) // positions in idx of the commands in cmds
	cmds := make([][]string, 0, len(idx))
	var buf [5]string
	for j, i := range idx {
		if !first[j] {
			continue
		}
		if cmd := r.fastCmd(script, names[i], args(i, buf[:0])); cmd != nil {
			at = append(at, j)
			cmds = append(cmds, cmd)
		}
	}
	done := make([]bool, len(idx))
	if len(cmds) > 0 {
		res, err := r.c.pipe(ctx, cmds...)
		if err = pipeFailed(res, err, len(cmds)); err != nil {
			err = s.explainACL(err)
		}
		for n, j := range at {
			if err != nil {
				fail(idx[j], err)
				done[j] = true
				continue
			}
			// nil or an error reply: the read, compare-and-set path (the
			// lease is forgotten, so the single transition takes it).
			if rep, ok, _ := fastDone(res[n]); ok {
				answer(idx[j], rep)
				done[j] = true
			}
		}
	}
	rest := make([]eachTask, 0, len(idx)-len(cmds))
	for j, i := range idx {
		if !done[j] {
			rest = append(rest, eachTask{i: i})
		}
	}
	return rest
}

// execEach runs the tasks, each its key's single transition (or its
// continuation), the keys side by side (the client pipelines them), the
// entries of one key one after the other in batch order.
func (s *Store) execEach(ctx context.Context, run runner, bs *batchScript, tasks []eachTask, key func(int) idem.Key, names []string,
	args func(i int, dst []string) []string, answer func(i int, r reply), fail func(i int, err error)) {
	if len(tasks) == 0 {
		return
	}
	var mu sync.Mutex // answer and fail are not safe for concurrent use
	perkey.Run(len(tasks), func(j int) idem.Key { return key(tasks[j].i) }, maxEachInFlight, func(j int) {
		t := tasks[j]
		var (
			r   reply
			err error
		)
		if t.cont != nil {
			r, err = t.cont(ctx)
		} else {
			r, err = run.run(ctx, bs.single, names[t.i], args(t.i, nil)...)
		}
		mu.Lock()
		defer mu.Unlock()
		if err != nil {
			fail(t.i, s.explainACL(err))
		} else {
			answer(t.i, r)
		}
	})
}
