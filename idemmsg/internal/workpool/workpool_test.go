package workpool

import (
	"sync/atomic"
	"testing"
	"time"
)

func TestBoundedAndWaited(t *testing.T) {
	p := New(3)
	var running, peak, done atomic.Int32
	for range 20 {
		if !p.Go(func() {
			n := running.Add(1)
			for m := peak.Load(); n > m && !peak.CompareAndSwap(m, n); m = peak.Load() {
			}
			time.Sleep(2 * time.Millisecond)
			running.Add(-1)
			done.Add(1)
		}) {
			t.Fatal("Go refused work on a live pool")
		}
	}
	p.Wait()
	if done.Load() != 20 {
		t.Errorf("Wait returned with %d of 20 done", done.Load())
	}
	if m := peak.Load(); m > 3 || m < 2 {
		t.Errorf("peak concurrency %d, want 2 or 3 (bound 3)", m)
	}
}

func TestSequentialRunsInline(t *testing.T) {
	p := New(1)
	var order []int
	for i := range 5 {
		p.Go(func() { order = append(order, i) }) // no race: inline
	}
	p.Wait()
	for i, v := range order {
		if v != i {
			t.Fatalf("order %v, want 0..4", order)
		}
	}
}

func TestPanicPassedToWaitAndStops(t *testing.T) {
	p := New(2)
	p.Go(func() { panic("boom") })
	deadline := time.Now().Add(5 * time.Second)
	for !p.Stopped() {
		if time.Now().After(deadline) {
			t.Fatal("the pool did not stop after a panic")
		}
		time.Sleep(time.Millisecond)
	}
	if p.Go(func() { t.Error("ran after a panic") }) {
		t.Error("Go reported running work after a panic")
	}
	defer func() {
		if v := recover(); v != "boom" {
			t.Errorf("Wait panicked with %v, want boom", v)
		}
	}()
	p.Wait()
	t.Error("Wait returned without the panic")
}

func TestStop(t *testing.T) {
	for _, n := range []int{1, 4} {
		p := New(n)
		p.Stop()
		if p.Go(func() { t.Errorf("n=%d: ran after Stop", n) }) {
			t.Errorf("n=%d: Go reported running work after Stop", n)
		}
		p.Wait()
	}
}

// GoIndex is Go(func() { f(i) }): every index run once, bounded, a panic
// passed to Wait and stopping the pool, nothing run after Stop.
func TestGoIndex(t *testing.T) {
	for _, n := range []int{1, 3} {
		p := New(n)
		var ran [20]atomic.Int32
		var running, peak atomic.Int32
		f := func(i int) {
			r := running.Add(1)
			for m := peak.Load(); r > m && !peak.CompareAndSwap(m, r); m = peak.Load() {
			}
			time.Sleep(time.Millisecond)
			running.Add(-1)
			ran[i].Add(1)
		}
		for i := range ran {
			if !p.GoIndex(f, i) {
				t.Fatalf("n=%d: GoIndex refused work on a live pool", n)
			}
		}
		p.Wait()
		for i := range ran {
			if c := ran[i].Load(); c != 1 {
				t.Errorf("n=%d: index %d ran %d times, want 1", n, i, c)
			}
		}
		if m := peak.Load(); m > int32(n) {
			t.Errorf("n=%d: peak concurrency %d", n, m)
		}

		p = New(n)
		func() {
			defer func() {
				if v := recover(); v != "boom 7" {
					t.Errorf("n=%d: Wait (or GoIndex, inline) panicked with %v, want boom 7", n, v)
				}
			}()
			p.GoIndex(func(i int) { panic("boom " + string(rune('0'+i))) }, 7)
			p.Wait()
			t.Errorf("n=%d: no panic", n)
		}()
		if n > 1 && p.GoIndex(func(int) { t.Errorf("n=%d: ran after a panic", n) }, 0) {
			t.Errorf("n=%d: GoIndex reported running work after a panic", n)
		}

		p = New(n)
		p.Stop()
		if p.GoIndex(func(int) { t.Errorf("n=%d: ran after Stop", n) }, 0) {
			t.Errorf("n=%d: GoIndex reported running work after Stop", n)
		}
		p.Wait()
	}
}
