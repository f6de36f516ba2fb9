package telemetry

import (
	"fmt"
	"sync"
	"testing"
)

// Each name is first once, and the set stops at MaxOnce names.
func TestOnce(t *testing.T) {
	var s Once
	var wg sync.WaitGroup
	firsts := make(chan string, 10*MaxOnce)
	for g := range 4 {
		wg.Go(func() {
			for i := range 2 * MaxOnce {
				if name := fmt.Sprint("r", (i+g)%(2*MaxOnce)); s.First(name) {
					firsts <- name
				}
			}
		})
	}
	wg.Wait()
	close(firsts)
	seen := map[string]bool{}
	for name := range firsts {
		if seen[name] {
			t.Fatalf("%s was first twice", name)
		}
		seen[name] = true
	}
	if len(seen) > MaxOnce {
		t.Fatalf("%d names were first, want at most %d", len(seen), MaxOnce)
	}
}
