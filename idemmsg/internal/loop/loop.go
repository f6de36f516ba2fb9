// Package loop holds what the adapters' Run loops share: their pauses,
// and the Pipeline that overlaps their batches.
package loop

import (
	"context"
	"time"
)

// Backoff is the pause after the n-th failure in a row of a Run loop's
// broker call: 100ms, doubling, at most 5s.
func Backoff(n int) time.Duration {
	return min(100*time.Millisecond<<min(max(n, 1)-1, 6), 5*time.Second)
}

// Sleep waits for d, or until ctx ends.
func Sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}
