package loop

import (
	"errors"
	"sync/atomic"
	"testing"
	"time"
)

// TestOverlap: a batch with other keys starts while the one before
// finishes; one with a shared key waits for it.
func TestOverlap(t *testing.T) {
	var p Pipeline
	release := make(chan struct{})
	var firstDone atomic.Bool
	if err := p.Run([]string{"a", "b"}, func(handled func()) error {
		handled()
		<-release // the last group, still being recorded
		firstDone.Store(true)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	started := make(chan bool, 1)
	go func() {
		time.Sleep(50 * time.Millisecond)
		close(release)
	}()
	if err := p.Run([]string{"c"}, func(handled func()) error {
		started <- firstDone.Load()
		handled()
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if overlapped := !<-started; !overlapped {
		t.Error("a batch with other keys waited for the one before")
	}
	if !firstDone.Load() {
		t.Error("Run returned with two batches before it still running")
	}
	release2 := make(chan struct{})
	var secondDone atomic.Bool
	p.Run([]string{"x"}, func(handled func()) error {
		handled()
		<-release2
		secondDone.Store(true)
		return nil
	})
	go func() {
		time.Sleep(50 * time.Millisecond)
		close(release2)
	}()
	p.Run([]string{"x", "y"}, func(handled func()) error {
		started <- secondDone.Load()
		handled()
		return nil
	})
	if waited := <-started; !waited {
		t.Error("a batch with a shared key started before the one before returned")
	}
	if err := p.Wait(); err != nil {
		t.Fatal(err)
	}
}

// TestErrorAndPanic: the error of a batch comes back from the next Run
// (which does not run its batch if the error was there already) or from
// Wait; a panic goes on there.
func TestErrorAndPanic(t *testing.T) {
	var p Pipeline
	crash := errors.New("crash")
	p.Run([]string{"a"}, func(func()) error { return crash })
	time.Sleep(10 * time.Millisecond) // returned by now
	ran := false
	if err := p.Run([]string{"b"}, func(h func()) error { ran = true; h(); return nil }); !errors.Is(err, crash) {
		t.Errorf("Run after a failed batch: got %v, want its error", err)
	}
	if err := p.Wait(); err != nil || ran {
		t.Errorf("Wait: got %v (ran %t), want nil and the batch not run", err, ran)
	}

	p.Run([]string{"a"}, func(func()) error { panic("boom") })
	defer func() {
		if v := recover(); v != "boom" {
			t.Errorf("recovered %v, want boom", v)
		}
	}()
	p.Wait()
}
