package redisstore

import "context"

// SkewClock moves s's estimate of the server's clock by ms (native path
// only; it has no effect before the first call): the claims that follow
// carry tokens that far off, which the store must notice and fix.
func SkewClock(s *Store, ms int64) {
	if p, ok := s.r.(*pathRunner); ok {
		if c := p.native.clock.Load(); c != nil {
			p.native.clock.Store(&clockSample{off: c.off + ms*1000, local: c.local})
		}
	}
}

// LeaseMemos is how many leases s's native path remembers.
func LeaseMemos(s *Store) int {
	p, ok := s.r.(*pathRunner)
	if !ok {
		return 0
	}
	p.native.mu.Lock()
	defer p.native.mu.Unlock()
	return len(p.native.leases)
}

// TraceNative makes s's native path call f with the commands of each round
// trip it sends, once the server has answered (before the store reads the
// answer): f may change the record through another client between two
// round trips of a transition. Call it after the store's first call (which
// picks the path) and before any other call is under way. f may be called
// from several goroutines at once (the keys of a batch that take their own
// path run side by side).
func TraceNative(s *Store, f func(cmds [][]string)) {
	p := s.r.(*pathRunner)
	p.native.c = tracingConn{c: p.native.c, f: f}
}

type tracingConn struct {
	c nconn
	f func(cmds [][]string)
}

func (t tracingConn) tx(ctx context.Context, cmds ...[]string) ([]nval, error) {
	res, err := t.c.tx(ctx, cmds...)
	t.f(cmds)
	return res, err
}

func (t tracingConn) pipe(ctx context.Context, cmds ...[]string) ([]nval, error) {
	res, err := t.c.pipe(ctx, cmds...)
	t.f(cmds)
	return res, err
}

func (t tracingConn) one(ctx context.Context, cmd ...string) (nval, error) {
	res, err := t.c.one(ctx, cmd...)
	t.f([][]string{cmd})
	return res, err
}

func (t tracingConn) oneNode() bool { return t.c.oneNode() }
