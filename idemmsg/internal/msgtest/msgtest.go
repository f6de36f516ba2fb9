// Package msgtest holds what the tests of the idemmsg adapters share: a
// ledger standing for a consumer's system of record.
package msgtest

import (
	"context"
	"errors"
	"maps"
	"sync"
	"testing"

	"github.com/idemkit/idem"
)

// Ledger counts effects per key, and refuses a fencing token lower than
// the last one it accepted for the key, as a system of record should.
type Ledger struct {
	mu      sync.Mutex
	effects map[string]int
	tokens  map[string]uint64
	stale   int
}

// NewLedger returns an empty ledger.
func NewLedger() *Ledger {
	return &Ledger{effects: map[string]int{}, tokens: map[string]uint64{}}
}

// Apply records one effect for key, with the fencing token of the lease in
// ctx; a stale token is refused with an error.
func (l *Ledger) Apply(ctx context.Context, key string) error {
	lease, ok := idem.LeaseFromContext(ctx)
	if !ok {
		return errors.New("no lease in the handler's context")
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if lease.Token < l.tokens[key] {
		l.stale++
		return errors.New("stale fencing token")
	}
	l.tokens[key] = lease.Token
	l.effects[key]++
	return nil
}

// Snapshot returns the effects per key.
func (l *Ledger) Snapshot() map[string]int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return maps.Clone(l.effects)
}

// WantOneEach checks that the ledger holds exactly one effect for each
// distinct key of keys, no other, and refused no stale token.
func (l *Ledger) WantOneEach(t testing.TB, keys []string) {
	t.Helper()
	l.WantOneEachBut(t, keys, nil)
}

// WantOneEachBut is WantOneEach, except that a key of again may hold a
// second effect (one more run, as after a crash between its effect and
// the record of its result).
func (l *Ledger) WantOneEachBut(t testing.TB, keys []string, again map[string]int) {
	t.Helper()
	want := map[string]int{}
	for _, k := range keys {
		want[k] = 1
	}
	got := l.Snapshot()
	if len(got) != len(want) {
		t.Errorf("ledger holds %d keys, want %d: %v", len(got), len(want), got)
	}
	for k := range want {
		switch {
		case again[k] > 0 && (got[k] < 1 || got[k] > 2):
			t.Errorf("key %s: got %d effects, want 1, or 2 (its first run's record may have been cut by a crash)", k, got[k])
		case again[k] == 0 && got[k] != 1:
			t.Errorf("key %s: got %d effects, want 1", k, got[k])
		}
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.stale != 0 {
		t.Errorf("ledger refused %d stale fencing tokens, want 0", l.stale)
	}
}
