package redisstore

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
