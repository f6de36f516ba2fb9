package reaper

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"
)

// TestLoop checks the loop: a pass at each tick, a failed pass logged with
// the store's name and attributes and reported, a pass cut short by Stop
// not reported, and a Config that cannot run refused.
func TestLoop(t *testing.T) {
	var mu sync.Mutex
	var logBuf bytes.Buffer
	var reports []error
	calls := 0
	started := make(chan struct{}, 1)
	r, err := Start(t.Context(), Config{Every: 5 * time.Millisecond, Batch: 7, Name: "teststore",
		Attrs:  []slog.Attr{slog.String("table", "t1")},
		Logger: slog.New(slog.NewTextHandler(&syncWriter{mu: &mu, w: &logBuf}, nil)),
		Reap: func(ctx context.Context, batch int) (int, error) {
			mu.Lock()
			calls++
			n := calls
			mu.Unlock()
			if batch != 7 {
				t.Errorf("Reap got batch %d, want 7", batch)
			}
			switch n {
			case 1:
				return 3, nil
			case 2:
				return 0, errors.New("boom")
			}
			select { // the third pass runs until Stop
			case started <- struct{}{}:
			default:
			}
			<-ctx.Done()
			return 0, ctx.Err()
		},
		OnReap: func(deleted int, took time.Duration, err error) {
			mu.Lock()
			reports = append(reports, err)
			mu.Unlock()
		}})
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-started:
	case <-time.After(5 * time.Second):
		t.Fatal("no third pass within 5s")
	}
	r.Stop()
	r.Stop() // a second Stop does nothing
	mu.Lock()
	defer mu.Unlock()
	if len(reports) != 2 || reports[0] != nil || reports[1] == nil {
		t.Errorf("OnReap got %v, want a pass that finished and one that failed (not the one Stop cut short)", reports)
	}
	if l := logBuf.String(); strings.Count(l, "teststore: reap failed") != 1 || !strings.Contains(l, "table=t1") || !strings.Contains(l, "boom") {
		t.Errorf("log %q, want one warning naming the store, its table and the error", l)
	}
	if _, err := Start(t.Context(), Config{Every: 0, Batch: 1, Reap: func(context.Context, int) (int, error) { return 0, nil }}); err == nil {
		t.Error("Start with Every 0: no error")
	}
	if err := Run(t.Context(), Config{Every: time.Second, Batch: 0, Reap: func(context.Context, int) (int, error) { return 0, nil }}); err == nil {
		t.Error("Run with Batch 0: no error")
	}
	if _, err := Start(t.Context(), Config{Every: time.Second, Batch: 1}); err == nil {
		t.Error("Start without Reap: no error")
	}
	var never *Reaper
	never.Stop() // a nil Reaper: nothing to stop
}

type syncWriter struct {
	mu *sync.Mutex
	w  *bytes.Buffer
}

func (s *syncWriter) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.w.Write(p)
}
