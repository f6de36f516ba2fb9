package msgtest

import (
	"context"
	"sync"
	"testing"
	"time"
)

// Start runs run (a consumer's Run loop) in the background until the test
// ends, and returns a function that cancels its context, waits at most
// limit for it to return, runs after (when set; e.g. closing the
// consumer's channel), and returns Run's error. Calling stop again returns
// the same error.
func Start(t testing.TB, name string, limit time.Duration, run func(ctx context.Context) error, after func()) (stop func() error) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- run(ctx) }()
	var once sync.Once
	var err error
	stop = func() error {
		once.Do(func() {
			cancel()
			select {
			case err = <-done:
			case <-time.After(limit):
				t.Errorf("consumer %s did not stop within %v", name, limit)
			}
			if after != nil {
				after()
			}
		})
		return err
	}
	t.Cleanup(func() { stop() })
	return stop
}

// WaitFor polls cond until it holds, failing the test after limit.
func WaitFor(t testing.TB, what string, limit time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", limit, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
