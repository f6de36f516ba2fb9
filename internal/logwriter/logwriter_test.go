package logwriter

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"
)

// dest records the writes it gets; while gate is set, each write waits
// for it to be closed (after telling entered).
type dest struct {
	mu      sync.Mutex
	writes  []string
	gate    chan struct{}
	entered chan struct{}
	err     error
}

func (d *dest) Write(p []byte) (int, error) {
	d.mu.Lock()
	gate, entered := d.gate, d.entered
	d.mu.Unlock()
	if gate != nil {
		entered <- struct{}{}
		<-gate
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.writes = append(d.writes, string(p))
	return len(p), d.err
}

func (d *dest) all() []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]string(nil), d.writes...)
}

// Lines written side by side all arrive, whole, once each, each writer's
// in its order.
func TestConcurrentLinesArriveWholeAndInOrder(t *testing.T) {
	d := &dest{}
	w := New(d)
	const writers, lines = 8, 500
	var wg sync.WaitGroup
	for g := range writers {
		wg.Go(func() {
			for i := range lines {
				fmt.Fprintf(w, "writer=%d line=%d %s\n", g, i, strings.Repeat("x", i%50))
			}
		})
	}
	wg.Wait()
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	next := make([]int, writers)
	for _, line := range strings.Split(strings.TrimSuffix(strings.Join(d.all(), ""), "\n"), "\n") {
		var g, i int
		var pad string
		if _, err := fmt.Sscanf(line, "writer=%d line=%d %s", &g, &i, &pad); err != nil && i%50 != 0 {
			t.Fatalf("line %q: not a whole line (%v)", line, err)
		}
		if i != next[g] {
			t.Fatalf("writer %d: got line %d, want %d (lost, repeated or out of order)", g, i, next[g])
		}
		if len(pad) != i%50 {
			t.Fatalf("line %q: its bytes were split", line)
		}
		next[g]++
	}
	for g, n := range next {
		if n != lines {
			t.Errorf("writer %d: %d lines arrived, want %d", g, n, lines)
		}
	}
}

// A line written while nothing is being written goes out at once, not
// when Close or more lines come; the lines written during a write go out
// together in the next one.
func TestLinesGoAtOnceAndTogetherUnderLoad(t *testing.T) {
	d := &dest{gate: make(chan struct{}), entered: make(chan struct{}, 1)}
	w := New(d)
	fmt.Fprintln(w, "first")
	select {
	case <-d.entered: // written without waiting for anything else
	case <-time.After(10 * time.Second):
		t.Fatal("a lone line was not written")
	}
	for i := range 9 {
		fmt.Fprintln(w, "queued", i)
	}
	d.mu.Lock()
	gate := d.gate
	d.gate = nil
	d.mu.Unlock()
	close(gate)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	got := d.all()
	if len(got) != 2 || got[0] != "first\n" || strings.Count(got[1], "queued") != 9 {
		t.Fatalf("writes: %q; want the first line alone, then the 9 queued ones in one write", got)
	}
}

// With the destination stuck, a writer that finds maxPending bytes
// waiting blocks (it writes them itself, after the write under way)
// instead of growing the queue.
func TestFullQueueBlocksTheWriter(t *testing.T) {
	d := &dest{gate: make(chan struct{}), entered: make(chan struct{}, 4)}
	w := New(d)
	fmt.Fprintln(w, "first")
	<-d.entered
	returned := make(chan struct{})
	go func() {
		w.Write(bytes.Repeat([]byte("y"), maxPending))
		close(returned)
	}()
	select {
	case <-returned:
		t.Fatal("Write returned with maxPending bytes queued behind a stuck destination")
	case <-time.After(100 * time.Millisecond):
	}
	d.mu.Lock()
	gate := d.gate
	d.gate = nil
	d.mu.Unlock()
	close(gate)
	<-returned
	w.Close()
	if got := len(strings.Join(d.all(), "")); got != len("first\n")+maxPending {
		t.Fatalf("%d bytes written, want %d", got, len("first\n")+maxPending)
	}
}

// The destination's error comes back from the next writes and Close;
// after Close, writes go to the destination directly.
func TestErrorsAndWritesAfterClose(t *testing.T) {
	d := &dest{}
	w := New(d)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := fmt.Fprintln(w, "after close"); err != nil {
		t.Fatal(err)
	}
	if got := d.all(); len(got) != 1 || got[0] != "after close\n" {
		t.Fatalf("writes after Close: %q, want the line written directly", got)
	}

	broken := errors.New("disk full")
	d = &dest{err: broken}
	w = New(d)
	fmt.Fprintln(w, "lost")
	if err := w.Close(); !errors.Is(err, broken) {
		t.Fatalf("Close: %v, want the destination's error", err)
	}
	if _, err := fmt.Fprintln(w, "more"); !errors.Is(err, broken) {
		t.Fatalf("Write after the error: %v, want the destination's error", err)
	}

	// A destination that fails once (a disk full for a moment) loses the
	// lines of that write only: the next ones are written.
	d = &dest{err: broken}
	w = New(d)
	fmt.Fprintln(w, "lost")
	w.flush() // the failed write, done now rather than by the goroutine
	d.mu.Lock()
	d.err = nil
	d.mu.Unlock()
	if _, err := fmt.Fprintln(w, "after"); !errors.Is(err, broken) {
		t.Fatalf("the Write after a failed one: %v, want that failure reported once", err)
	}
	if err := w.Close(); err != nil {
		t.Fatalf("Close: %v, want nil (the failure was reported)", err)
	}
	if got := strings.Join(d.all(), ""); !strings.HasSuffix(got, "after\n") {
		t.Fatalf("written: %q, want the line after the failure", got)
	}
}
