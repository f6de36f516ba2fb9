package perkey

import (
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// One key's entries run in order and never at once; different keys run
// side by side, at most limit at a time.
func TestRun(t *testing.T) {
	keys := []string{"a", "b", "a", "c", "b", "a", "d", "e"}
	var (
		mu       sync.Mutex
		seen     = map[string][]int{}
		inFlight atomic.Int32
		peak     atomic.Int32
		perKey   sync.Map // key -> *atomic.Int32, entries of the key running now
	)
	Run(len(keys), func(j int) string { return keys[j] }, 2, func(j int) {
		c, _ := perKey.LoadOrStore(keys[j], new(atomic.Int32))
		if c.(*atomic.Int32).Add(1) > 1 {
			t.Errorf("two entries of key %q ran at once", keys[j])
		}
		n := inFlight.Add(1)
		for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
		}
		time.Sleep(5 * time.Millisecond)
		mu.Lock()
		seen[keys[j]] = append(seen[keys[j]], j)
		mu.Unlock()
		inFlight.Add(-1)
		c.(*atomic.Int32).Add(-1)
	})
	want := map[string][]int{"a": {0, 2, 5}, "b": {1, 4}, "c": {3}, "d": {6}, "e": {7}}
	for k, w := range want {
		if !slices.Equal(seen[k], w) {
			t.Errorf("key %q: entries ran in order %v, want %v", k, seen[k], w)
		}
	}
	if p := peak.Load(); p != 2 {
		t.Errorf("at most %d keys ran at once, want 2 (the limit)", p)
	}
}
