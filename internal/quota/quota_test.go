package quota

import (
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

type clock struct{ ns atomic.Int64 }

func (c *clock) now() time.Time          { return time.Unix(0, c.ns.Load()) }
func (c *clock) advance(d time.Duration) { c.ns.Add(int64(d)) }

func newClock() *clock {
	c := &clock{}
	c.ns.Store(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC).UnixNano())
	return c
}

// Each limit refuses the next key and counts nothing for it; a released
// key gives its place back at once; a stored record gives its share back
// once its retention (rounded up to a sixteenth) has passed, never before.
func TestLimits(t *testing.T) {
	c := newClock()
	s := New(Limits{InFlight: 2, Records: 3, Bytes: 1000}, c.now)

	a, over, _ := s.Admit("alice", time.Time{})
	b, _, _ := s.Admit("alice", time.Time{})
	if over != "" {
		t.Fatalf("first key: over %q", over)
	}
	if _, over, ra := s.Admit("alice", time.Time{}); over != LimitInFlight || ra != time.Second {
		t.Fatalf("third key in flight: got %q %v, want in_flight 1s", over, ra)
	}
	if _, over, _ := s.Admit("bob", time.Time{}); over != "" {
		t.Fatalf("another tenant: got %q, want admitted", over)
	}
	a.Release()
	c1, over, _ := s.Admit("alice", time.Time{})
	if over != "" {
		t.Fatalf("after a release: got %q, want admitted", over)
	}
	b.Stored(100, time.Hour)
	c1.Stored(100, time.Hour)
	d, _, _ := s.Admit("alice", time.Time{})
	d.Stored(900, time.Hour) // past Bytes: the work has run, it counts
	if _, over, ra := s.Admit("alice", time.Time{}); over != LimitRecords || ra < time.Hour || ra > time.Hour+time.Hour/16 {
		t.Fatalf("three records: got %q %v, want records, about an hour", over, ra)
	}
	c.advance(time.Hour - time.Second)
	if _, over, _ := s.Admit("alice", time.Time{}); over != LimitRecords {
		t.Fatalf("before retention: got %q, want records", over)
	}
	c.advance(time.Hour/16 + time.Second)
	e, over, _ := s.Admit("alice", time.Time{})
	if over != "" {
		t.Fatalf("after retention: got %q, want admitted", over)
	}
	e.Stored(1000, time.Minute)
	if _, over, _ := s.Admit("alice", time.Time{}); over != LimitBytes {
		t.Fatalf("1000 bytes: got %q, want bytes", over)
	}
}

// The table holds about Limits.Tenants tenants; the ones past it share
// the overflow's count, and a tenant with nothing counted gives its place
// up at the next sweep.
func TestTenantsBounded(t *testing.T) {
	c := newClock()
	s := New(Limits{InFlight: 1, Tenants: 64}, c.now)
	var held []Ticket
	for i := range 1000 {
		tk, over, _ := s.Admit(fmt.Sprint("t", i), time.Time{})
		if over == "" {
			held = append(held, tk)
		}
	}
	st := s.Stats()
	if st.Tenants > 64 || !st.Overflow {
		t.Fatalf("1000 tenants: got %+v, want at most 64 tracked and the overflow in use", st)
	}
	// The tracked tenants are limited, the overflow is not: a flood of
	// made-up tenants that fills the table does not lock new clients out.
	if len(held) != 1000 {
		t.Fatalf("admitted %d keys in flight of 1000 tenants, want all (64 tracked at their limit of 1, the rest in the overflow, unlimited)", len(held))
	}
	if _, over, _ := s.Admit("t0", time.Time{}); over != LimitInFlight {
		t.Fatalf("a tracked tenant at its limit: got %q, want %q", over, LimitInFlight)
	}
	for _, tk := range held {
		tk.Release()
	}
	c.advance(2 * sweepEvery)
	for i := range 1000 {
		tk, over, _ := s.Admit(fmt.Sprint("u", i), time.Time{})
		if over == "" {
			defer tk.Release()
		}
	}
	if st := s.Stats(); st.Tenants > 64 {
		t.Fatalf("after a sweep: %d tenants tracked, want at most 64", st.Tenants)
	}
}

// Concurrent admissions never take a tenant past InFlight (under -race).
func TestConcurrentInFlight(t *testing.T) {
	s := New(Limits{InFlight: 5}, nil)
	var cur, peak atomic.Int64
	var wg sync.WaitGroup
	for range 32 {
		wg.Go(func() {
			for range 200 {
				tk, over, _ := s.Admit("x", time.Time{})
				if over != "" {
					continue
				}
				n := cur.Add(1)
				for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
				}
				cur.Add(-1)
				tk.Stored(10, time.Millisecond)
			}
		})
	}
	wg.Wait()
	if p := peak.Load(); p > 5 || p == 0 {
		t.Fatalf("peak in flight: got %d, want 1 to 5", p)
	}
}

// BenchmarkAdmitStored is what the quota adds to a keyed request that is
// executed and stored: one Admit and one Stored, 64 tenants, in parallel.
func BenchmarkAdmitStored(b *testing.B) {
	s := New(Limits{InFlight: 1 << 20, Records: 1 << 40, Bytes: 1 << 60}, nil)
	tenants := make([]string, 64)
	for i := range tenants {
		tenants[i] = fmt.Sprintf("auth:%040d", i)
	}
	var seq atomic.Int64
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			tk, over, _ := s.Admit(tenants[seq.Add(1)%64], time.Now())
			if over != "" {
				b.Fatal(over)
			}
			tk.Stored(400, 24*time.Hour)
		}
	})
}
