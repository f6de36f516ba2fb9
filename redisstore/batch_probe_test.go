package redisstore_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/redis/rueidis"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/idemkit/idem/redisstore"
)

// TestBatchProbeBounded: the first batch call of a PathAuto store asks
// the server for its path; Options.Timeout bounds that question too.
// The server is stopped (SIGSTOP) after the client connected, so nothing
// but the store's bound ends the call.
func TestBatchProbeBounded(t *testing.T) {
	srv := privateServer(t)
	c, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: []string{srv.Addr()}, DisableCache: true})
	if err != nil {
		t.Fatal(err)
	}
	s, err := redisstore.NewRueidis(c, redisstore.Options{Prefix: redistest.Prefix("probe"), Timeout: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if err := srv.Pause(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		srv.Resume()
		c.Close()
	})
	done := make(chan []idem.AcquireResult, 1)
	go func() {
		done <- s.AcquireMany(context.Background(), []idem.AcquireRequest{{Key: cacheKey(t), Fingerprint: cacheFP, LeaseID: idem.NewLeaseID(), TTL: time.Second}})
	}()
	select {
	case res := <-done:
		if err := res[0].Err; !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("AcquireMany on a stopped server: got %v, want an error wrapping context.DeadlineExceeded (Options.Timeout)", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("AcquireMany on a stopped server still waiting after 5s with Options.Timeout 200ms: the path probe is not bounded")
	}
}
