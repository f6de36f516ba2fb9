package telemetry

import (
	"sync"
	"sync/atomic"
)

// MaxOnce bounds the names a Once remembers; past it, nothing more is
// logged (the metrics still count every event).
const MaxOnce = 1000

// Once says which names (routes, methods) a warning was logged for: once
// each, for at most MaxOnce names, since a name may come from a client (a
// path): the set stays bounded. The zero Once is empty and ready to use.
type Once struct {
	names sync.Map
	n     atomic.Int64
}

// First reports whether name is new to the set, and adds it.
func (s *Once) First(name string) bool {
	if _, seen := s.names.Load(name); seen || s.n.Load() >= MaxOnce {
		return false
	}
	if _, seen := s.names.LoadOrStore(name, true); seen {
		return false
	}
	return s.n.Add(1) <= MaxOnce
}
