package memstore

import (
	"math"
	"sync"
	"sync/atomic"

	"github.com/idemkit/idem"
)

const (
	// sweepBatch is how many expired records each method drops at most
	// from its shard's heap.
	sweepBatch = 16
	// fixedSize is the size of a record's fixed fields, as counted in
	// Record.Size: state, token, fingerprint and lease id.
	fixedSize = 1 + 8 + 16 + 16
)

// record is one key's state. Only its shard's critical sections touch it.
type record struct {
	key     idem.Key
	fp      idem.Fingerprint
	lease   idem.LeaseID // when in flight
	token   uint64
	expires int64  // Unix nanoseconds
	resp    []byte // encoded response, when completed; never modified
	index   int32  // position in the shard's heap, -1 when not stored
	state   idem.State
}

// shard is one independently locked partition of the store. Every record
// in recs is in heap exactly once, and nothing else is.
type shard struct {
	mu   sync.Mutex
	recs map[idem.Key]*record
	heap expiryHeap
	u    *usage // the store's counters
	// next is the earliest expiry in heap (math.MaxInt64 when empty), as
	// of the last unlock: sweepExpired reads it without the lock.
	next atomic.Int64
	_    [64]byte // keeps neighbouring shards' hot fields off one cache line
}

// unlock publishes the earliest expiry and unlocks the shard.
func (sh *shard) unlock() {
	next := int64(math.MaxInt64)
	if len(sh.heap) > 0 {
		next = sh.heap[0].expires
	}
	if sh.next.Load() != next {
		sh.next.Store(next)
	}
	sh.mu.Unlock()
}

// live returns key's record, or nil when there is none or it has expired
// (and then drops it).
func (sh *shard) live(key idem.Key, now int64) *record {
	r := sh.recs[key]
	if r != nil && r.expires <= now {
		sh.remove(r)
		return nil
	}
	return r
}

// sweep drops up to sweepBatch expired records.
func (sh *shard) sweep(now int64) { sh.sweepN(now, sweepBatch) }

// sweepN drops up to n expired records.
func (sh *shard) sweepN(now int64, n int) {
	for i := 0; i < n && len(sh.heap) > 0 && sh.heap[0].expires <= now; i++ {
		sh.remove(sh.heap[0].r)
	}
}

// setExpiry sets r's expiry and stores r if it is new.
func (sh *shard) setExpiry(r *record, expires int64) {
	r.expires = expires
	if r.index < 0 {
		sh.recs[r.key] = r
		sh.heap.push(r)
		return
	}
	sh.heap.fix(int(r.index))
}

// remove drops r and uncounts it.
func (sh *shard) remove(r *record) {
	delete(sh.recs, r.key)
	sh.heap.remove(int(r.index))
	sh.u.bytes.Add(-int64(RecordOverhead + cap(r.resp)))
	sh.u.records.Add(-1)
}

// expiryHeap is a binary min-heap of records ordered by expiry. Entries
// carry a copy of the expiry, so ordering them reads only the heap's own
// memory. Records know their index, so a changed expiry is fixed in place
// and a removed record leaves no stale entry behind.
type expiryHeap []heapEntry

type heapEntry struct {
	expires int64 // r.expires
	r       *record
}

func (h *expiryHeap) push(r *record) {
	r.index = int32(len(*h))
	*h = append(*h, heapEntry{r.expires, r})
	h.up(len(*h) - 1)
}

func (h *expiryHeap) remove(i int) {
	s := *h
	last := len(s) - 1
	s[i].r.index = -1
	if i != last {
		s[i] = s[last]
		s[i].r.index = int32(i)
	}
	s[last] = heapEntry{}
	*h = s[:last]
	if i != last {
		h.fix(i)
	}
}

// fix restores the order after the expiry of the record at i changed.
func (h expiryHeap) fix(i int) {
	h[i].expires = h[i].r.expires
	if !h.down(i) {
		h.up(i)
	}
}

func (h expiryHeap) up(i int) {
	for i > 0 {
		p := (i - 1) / 2
		if h[p].expires <= h[i].expires {
			return
		}
		h.swap(i, p)
		i = p
	}
}

// down moves the entry at i towards the leaves and reports whether it
// moved.
func (h expiryHeap) down(i int) bool {
	start := i
	for {
		c := 2*i + 1
		if c >= len(h) {
			break
		}
		if r := c + 1; r < len(h) && h[r].expires < h[c].expires {
			c = r
		}
		if h[i].expires <= h[c].expires {
			break
		}
		h.swap(i, c)
		i = c
	}
	return i > start
}

func (h expiryHeap) swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].r.index = int32(i)
	h[j].r.index = int32(j)
}
