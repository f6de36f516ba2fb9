package memstore_test

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"math/rand/v2"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/storetest"
)

// The bounded store passes the conformance suite: a bound far above what
// the suite writes changes nothing.
func TestConformanceBounded(t *testing.T) {
	t.Parallel()
	storetest.Run(t, func(t *testing.T, _ string) storetest.Fixture {
		c := newFakeClock()
		s := memstore.New(memstore.Options{Clock: c.Now, MaxBytes: 1 << 30})
		return storetest.Fixture{Store: s, Sleep: c.Sleep, Corrupt: s.Corrupt}
	})
}

// hkey returns a distinct key for each i, spread over the shards as real
// keys (SHA-256 digests) are.
func hkey(i uint64) idem.Key {
	sum := sha256.Sum256(binary.LittleEndian.AppendUint64(nil, i))
	return idem.Key(sum[:16])
}

func wantFull(t *testing.T, what string, err error) {
	t.Helper()
	var se *idem.StoreError
	if !errors.Is(err, memstore.ErrFull) || !errors.Is(err, idem.ErrStoreFull) || !errors.As(err, &se) || se.Op != "acquire" {
		t.Fatalf("%s: got %v, want a *idem.StoreError (acquire) matching ErrFull", what, err)
	}
}

// TestMaxBytes fills a bounded store and checks that only the grant of a
// new lease is refused: the records of held and completed keys keep
// answering, and a Complete succeeds although it takes the store past
// its bound.
func TestMaxBytes(t *testing.T) {
	c := newFakeClock()
	const fit = 10
	s := memstore.New(memstore.Options{Clock: c.Now, MaxBytes: fit * memstore.RecordOverhead})
	ctx := context.Background()
	var held []idem.Lease
	for i := range uint64(fit) {
		acq := acquire(t, s, key(i), time.Minute)
		if acq.Outcome != idem.Acquired {
			t.Fatalf("key %d of %d: got %v, want acquired", i, fit, acq.Outcome)
		}
		held = append(held, acq.Lease)
	}
	if st := s.Stats(); st.Records != fit || st.Bytes != fit*memstore.RecordOverhead || st.Refused != 0 || st.MaxBytes != fit*memstore.RecordOverhead {
		t.Fatalf("full: got %+v, want %d records of %d bytes, none refused", st, fit, memstore.RecordOverhead)
	}
	_, err := s.Acquire(ctx, idem.AcquireRequest{Key: key(100), LeaseID: idem.NewLeaseID(), TTL: time.Minute})
	wantFull(t, "a new key in a full store", err)
	if st := s.Stats(); st.Refused != 1 || st.Records != fit {
		t.Fatalf("after the refusal: got %+v, want 1 refused and %d records", st, fit)
	}
	if _, ok, _ := s.Get(ctx, key(100)); ok {
		t.Fatal("the refused key has a record")
	}
	// AcquireMany refuses alike, request by request.
	res := s.AcquireMany(ctx, []idem.AcquireRequest{
		{Key: key(101), LeaseID: idem.NewLeaseID(), TTL: time.Minute},
		{Key: key(0), LeaseID: held[0].ID, TTL: time.Minute},
	})
	wantFull(t, "AcquireMany of a new key", res[0].Err)
	if res[1].Err != nil || res[1].Outcome != idem.Acquired || res[1].Lease.Token != held[0].Token {
		t.Fatalf("AcquireMany repeating a held lease: got %+v, want the same lease", res[1])
	}

	// Held keys: the same lease again, in flight to others, renew.
	acq, err := s.Acquire(ctx, idem.AcquireRequest{Key: key(1), LeaseID: held[1].ID, TTL: time.Minute})
	if err != nil || acq.Outcome != idem.Acquired {
		t.Fatalf("repeated Acquire of a held lease: got %v, %v; want acquired", acq.Outcome, err)
	}
	if acq := acquire(t, s, key(1), time.Minute); acq.Outcome != idem.InFlight {
		t.Fatalf("Acquire of a held key: got %v, want in flight", acq.Outcome)
	}
	if err := s.Renew(ctx, held[1], time.Minute); err != nil {
		t.Fatalf("Renew in a full store: %v", err)
	}
	// Complete takes the store past its bound: never refused.
	resp := &idem.Response{Status: 201, Body: []byte(`{"id":1}`)}
	for _, l := range held[:5] {
		if err := s.Complete(ctx, l, resp, time.Hour); err != nil {
			t.Fatalf("Complete in a full store: %v", err)
		}
	}
	if st := s.Stats(); st.Bytes <= st.MaxBytes {
		t.Fatalf("after 5 completions: got %d bytes, want more than MaxBytes %d", st.Bytes, st.MaxBytes)
	}
	if errs := s.CompleteMany(ctx, []idem.Completion{{Lease: held[5], Response: resp, Retention: time.Hour}}); errs[0] != nil {
		t.Fatalf("CompleteMany in a full store: %v", errs[0])
	}
	// Completed keys replay; another request under one is a mismatch.
	acq, err = s.Acquire(ctx, idem.AcquireRequest{Key: key(2), LeaseID: idem.NewLeaseID(), TTL: time.Minute})
	if err != nil || acq.Outcome != idem.Replay || string(acq.Response.Body) != `{"id":1}` {
		t.Fatalf("Acquire of a completed key: got %v, %v; want the replay", acq.Outcome, err)
	}
	acq, err = s.Acquire(ctx, idem.AcquireRequest{Key: key(2), Fingerprint: idem.Fingerprint{1}, LeaseID: idem.NewLeaseID(), TTL: time.Minute})
	if err != nil || acq.Outcome != idem.Mismatch {
		t.Fatalf("Acquire of a completed key with another fingerprint: got %v, %v; want mismatch", acq.Outcome, err)
	}
	// Release works; the released key is not taken again while full: a
	// new lease would add a response.
	if err := s.Release(ctx, held[6]); err != nil {
		t.Fatalf("Release in a full store: %v", err)
	}
	_, err = s.Acquire(ctx, idem.AcquireRequest{Key: key(6), LeaseID: idem.NewLeaseID(), TTL: time.Minute})
	wantFull(t, "a released key in a full store", err)
	if st := s.Stats(); st.Refused != 3 {
		t.Fatalf("refusals: got %d, want 3", st.Refused)
	}
	// Room comes back as records go: deleting the completed ones brings
	// the store under its bound, and a new key is taken.
	for i := range uint64(6) {
		if ok, err := s.Delete(ctx, key(i)); !ok || err != nil {
			t.Fatalf("Delete key %d: got %t, %v", i, ok, err)
		}
	}
	if acq := acquire(t, s, key(100), time.Minute); acq.Outcome != idem.Acquired {
		t.Fatalf("a new key after deletes: got %v, want acquired", acq.Outcome)
	}
	if st, n := s.Stats(), s.Len(); st.Records != int64(n) || st.Records != fit-6+1 || st.Bytes != st.Records*memstore.RecordOverhead {
		t.Fatalf("after deletes: got %+v, Len %d; want %d records without responses", st, n, fit-6+1)
	}
}

// TestMaxBytesSweepsExpiredFirst fills a bounded store with records that
// then expire, in shards other than the new key's: the Acquire that finds
// the store full drops them (as many as it needs) and is granted. Live
// records are never dropped to make room.
func TestMaxBytesSweepsExpiredFirst(t *testing.T) {
	c := newFakeClock()
	const fit = 40
	s := memstore.New(memstore.Options{Clock: c.Now, Shards: 4, MaxBytes: fit * memstore.RecordOverhead})
	ctx := context.Background()
	newKey := hkey(1 << 20)
	// Fill with records outside newKey's shard: its own sweep (of up to
	// 16 records, at every call) cannot be what makes room.
	var i uint64
	var expiring, live []idem.Key
	for len(expiring)+len(live) < fit {
		k := hkey(i)
		i++
		if s.ShardOf(k) == s.ShardOf(newKey) {
			continue
		}
		ttl := time.Second
		if len(live) < fit/4 && i%4 == 0 {
			ttl = time.Hour
			live = append(live, k)
		} else {
			expiring = append(expiring, k)
		}
		if acq := acquire(t, s, k, ttl); acq.Outcome != idem.Acquired {
			t.Fatalf("filling: got %v, want acquired", acq.Outcome)
		}
	}
	_, err := s.Acquire(ctx, idem.AcquireRequest{Key: newKey, LeaseID: idem.NewLeaseID(), TTL: time.Minute})
	wantFull(t, "full, nothing expired", err)

	c.Sleep(2 * time.Second)
	if n := s.Len(); n != fit {
		t.Fatalf("before the Acquire: got Len %d, want %d (nothing dropped yet)", n, fit)
	}
	if acq := acquire(t, s, newKey, time.Minute); acq.Outcome != idem.Acquired {
		t.Fatalf("full of expired records: got %v, want acquired", acq.Outcome)
	}
	st := s.Stats()
	if st.Refused != 1 {
		t.Errorf("refusals: got %d, want 1 (the one before expiry)", st.Refused)
	}
	if st.Records >= fit || st.Records != int64(s.Len()) {
		t.Errorf("after the Acquire: got %d records (Len %d), want fewer than %d: expired ones dropped", st.Records, s.Len(), fit)
	}
	for _, k := range live {
		if _, ok, err := s.Get(ctx, k); !ok || err != nil {
			t.Fatalf("a live record after the sweep: got %t, %v; want it kept", ok, err)
		}
	}
	// Every expired record can go: the store takes as many new keys as
	// there were expired records, and then refuses again.
	for j := range uint64(len(expiring) - 1) {
		if acq := acquire(t, s, hkey(1<<21+j), time.Hour); acq.Outcome != idem.Acquired {
			t.Fatalf("new key %d: got %v, want acquired", j, acq.Outcome)
		}
	}
	_, err = s.Acquire(ctx, idem.AcquireRequest{Key: hkey(1 << 22), LeaseID: idem.NewLeaseID(), TTL: time.Minute})
	wantFull(t, "full of live records again", err)
	if st := s.Stats(); st.Records != fit || st.Refused != 2 {
		t.Errorf("at the end: got %+v, want %d records and 2 refusals", st, fit)
	}
}

// TestMaxBytesConcurrent runs acquirers of new keys against a small bound
// while the clock moves, so records expire, are swept and the store fills
// again and again. Each worker holds at most one lease at a time, so the
// store may exceed its bound by at most one response per worker; the
// counters must match the records at the end.
func TestMaxBytesConcurrent(t *testing.T) {
	c := newFakeClock()
	const (
		workers  = 8
		ops      = 3000
		maxBytes = 64 << 10
		body     = 300
	)
	s := memstore.New(memstore.Options{Clock: c.Now, Shards: 8, MaxBytes: maxBytes})
	ctx := context.Background()
	resp := &idem.Response{Status: 201, Body: make([]byte, body)}
	// The bytes one completed response adds, measured on a store of its own.
	probe := memstore.New(memstore.Options{})
	if err := probe.Complete(ctx, acquire(t, probe, key(0), time.Minute).Lease, resp, time.Hour); err != nil {
		t.Fatal(err)
	}
	respBytes := probe.Stats().Bytes - memstore.RecordOverhead
	bound := int64(maxBytes + workers*respBytes)

	var acquired, refused, over atomic.Int64
	var peak atomic.Int64
	check := func() {
		b := s.Stats().Bytes
		for p := peak.Load(); b > p && !peak.CompareAndSwap(p, b); p = peak.Load() {
		}
		if b > bound {
			over.Add(1)
		}
	}
	var wg sync.WaitGroup
	for w := range uint64(workers) {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(w, 2))
			for i := range uint64(ops) {
				k := key(w<<32 | i)
				acq, err := s.Acquire(ctx, idem.AcquireRequest{Key: k, LeaseID: idem.NewLeaseID(), TTL: time.Duration(1+rng.IntN(20)) * time.Millisecond})
				check()
				switch {
				case errors.Is(err, memstore.ErrFull):
					refused.Add(1)
				case err != nil:
					t.Errorf("Acquire: %v", err)
					return
				case acq.Outcome != idem.Acquired:
					t.Errorf("Acquire of a new key: got %v, want acquired", acq.Outcome)
					return
				default:
					acquired.Add(1)
					switch rng.IntN(4) {
					case 0:
						err = s.Release(ctx, acq.Lease)
					default:
						err = s.Complete(ctx, acq.Lease, resp, time.Duration(1+rng.IntN(30))*time.Millisecond)
					}
					if err != nil && !errors.Is(err, idem.ErrLeaseLost) {
						t.Errorf("Complete or Release: %v", err)
						return
					}
					check()
				}
				if rng.IntN(8) == 0 {
					c.Sleep(time.Millisecond)
				}
			}
		})
	}
	wg.Wait()
	st := s.Stats()
	t.Logf("acquired %d, refused %d, peak %d bytes (MaxBytes %d, bound %d)", acquired.Load(), refused.Load(), peak.Load(), maxBytes, bound)
	if n := over.Load(); n > 0 {
		t.Errorf("the store held more than MaxBytes + %d workers × %d bytes %d times (peak %d, bound %d)", workers, respBytes, n, peak.Load(), bound)
	}
	if refused.Load() == 0 || acquired.Load() <= maxBytes/memstore.RecordOverhead {
		t.Errorf("got %d acquired, %d refused; want both, the store filling and emptying", acquired.Load(), refused.Load())
	}
	if st.Refused != refused.Load() {
		t.Errorf("Stats.Refused: got %d, want %d", st.Refused, refused.Load())
	}
	if n := s.Len(); st.Records != int64(n) {
		t.Errorf("Stats.Records: got %d, want Len %d", st.Records, n)
	}
	// Once every record has expired and been dropped, nothing is counted.
	c.Sleep(time.Hour)
	for w := range uint64(workers) {
		for i := range uint64(ops) {
			s.Get(ctx, key(w<<32|i))
		}
	}
	if st := s.Stats(); st.Records != 0 || st.Bytes != 0 {
		t.Errorf("after every record expired and was dropped: got %+v, want nothing counted", st)
	}
}

// TestRecordOverhead checks that Stats.Bytes follows the memory the
// records take: within 25% of the growth of the live heap.
func TestRecordOverhead(t *testing.T) {
	ctx := context.Background()
	for _, body := range []int{0, 200} {
		const n = 50_000
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		s := memstore.New(memstore.Options{})
		resp := &idem.Response{Status: 200, Body: make([]byte, body)}
		for i := range uint64(n) {
			acq := acquire(t, s, key(i), time.Minute)
			if err := s.Complete(ctx, acq.Lease, resp, time.Hour); err != nil {
				t.Fatal(err)
			}
		}
		runtime.GC()
		runtime.ReadMemStats(&after)
		grew := int64(after.HeapAlloc) - int64(before.HeapAlloc)
		counted := s.Stats().Bytes
		t.Logf("body %d: %d records: heap grew %d bytes (%d a record), Stats.Bytes %d (%d a record)", body, n, grew, grew/n, counted, counted/n)
		if ratio := float64(counted) / float64(grew); ratio < 0.8 || ratio > 1.25 {
			t.Errorf("body %d: Stats.Bytes %d is %.2f times the heap's growth %d, want 0.8 to 1.25", body, counted, ratio, grew)
		}
		runtime.KeepAlive(s)
	}
}
