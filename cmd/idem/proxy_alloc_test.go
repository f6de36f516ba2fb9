package main

import (
	"testing"
)

// TestBufferPool: the copy buffers are copyBufferSize long, one put back
// is handed out again whole, and Put costs no allocation.
func TestBufferPool(t *testing.T) {
	var p bufferPool
	buf := p.Get()
	if len(buf) != copyBufferSize {
		t.Fatalf("Get: %d bytes, want %d", len(buf), copyBufferSize)
	}
	if n := testing.AllocsPerRun(100, func() { p.Put(p.Get()) }); n != 0 {
		t.Errorf("Get and Put: %v allocations, want 0", n)
	}
	other := make([]byte, 10)
	p.Put(other)
	for range 3 {
		if got := p.Get(); len(got) != copyBufferSize && len(got) != len(other) {
			t.Fatalf("Get after Put of a short buffer: %d bytes", len(got))
		}
	}
}
