package loop

import (
	"context"
	"testing"
	"time"
)

func TestBackoff(t *testing.T) {
	for n, want := range map[int]time.Duration{0: 100 * time.Millisecond, 1: 100 * time.Millisecond,
		2: 200 * time.Millisecond, 6: 3200 * time.Millisecond, 7: 5 * time.Second, 100: 5 * time.Second} {
		if got := Backoff(n); got != want {
			t.Errorf("Backoff(%d) = %v, want %v", n, got, want)
		}
	}
}

func TestSleepEndsWithContext(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	start := time.Now()
	Sleep(ctx, time.Hour)
	if d := time.Since(start); d > time.Second {
		t.Errorf("Sleep took %v after its context ended", d)
	}
	start = time.Now()
	Sleep(context.Background(), 20*time.Millisecond)
	if d := time.Since(start); d < 20*time.Millisecond {
		t.Errorf("Sleep returned after %v, want at least 20ms", d)
	}
}
