// Package memstore is an in-memory idem.Store for a single process: the
// embedded default of idem, and a reference for the other stores.
//
// # Semantics
//
// The store follows the state machine of package idem with the same rules
// as the Redis store, so code tested against one behaves alike on the
// other:
//
//   - An in-flight record expires when its lease ends, a completed one when
//     its retention ends, and a released one (a tombstone that only keeps
//     the token) one lease after the release. An expired record is absent.
//   - A new lease's fencing token is the larger of the previous token plus
//     one (only a released tombstone has one) and the clock in
//     milliseconds. Every expiry is at least one millisecond past the
//     record's token, so once a record is gone the clock has passed its
//     token, and tokens keep increasing across expiry even when they ran
//     ahead of the clock.
//   - Completed responses are stored encoded (idem.Response.AppendBinary):
//     the caller may reuse its Response afterwards, and Record.Size is the
//     encoded length plus the fixed fields.
//   - Delete is an operator's purge: it drops the key's token history, so
//     the next lease on the key may get a token no larger than before.
//
// # Design
//
// Records live in a fixed number of shards, each a mutex, a map from key to
// record, and a min-heap of the same records ordered by expiry. Keys are
// SHA-256 digests, so their bytes pick the shard evenly. Every method is one
// critical section on one shard and reads the clock inside it, so the
// operations on a key are linearizable. (An Acquire that finds a bounded
// store full takes two, with the sweep of expired records between them;
// the second decides.)
//
// Expiry needs no background goroutine and nothing to close. A method that
// meets an expired record treats it as absent and drops it, and every
// method first drops up to 16 expired records from the top of its shard's
// heap. As each method adds at most one record, expired records are
// reclaimed much faster than a flood of distinct, never-repeated keys adds
// them: memory follows the live records, not the history. Two limits: a
// shard that is not used keeps its expired records until it is, and, Go
// maps never shrinking, a shard keeps the capacity of its largest
// population.
//
// # Bound
//
// With Options.MaxBytes, the store holds at most about that many bytes of
// records, and refuses new work rather than grow past it: it never evicts
// a record to make room. Each record counts RecordOverhead bytes plus the
// capacity of its encoded response; Stats reports the total, kept in an
// atomic counter. The bound is checked only where a lease would be
// granted: an Acquire of a key that holds no live in-flight or completed
// record (absent, expired or released). When one more record's overhead
// does not fit, the store first drops the expired records of every shard
// (until there is room), and if there is still none, the Acquire fails
// with a *idem.StoreError matching ErrFull and writes nothing. Everything
// else always works, full or not: repeats of in-flight and completed keys
// (in flight, replay, mismatch, the same lease again), and Renew,
// Complete, Release, Get and Delete. A Complete never fails because the
// store is full, since the work has run by then, so the response of a
// record in flight is added whatever the total: the store exceeds
// MaxBytes by at most the responses of the records in flight when it
// filled (with idemhttp, at most the requests in flight times
// Config.MaxResponseSize plus their headers). The overheads of admitted
// records never exceed the bound: a new record reserves its overhead with
// a compare-and-swap.
package memstore

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"math"
	"math/bits"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem"
)

const (
	// DefaultShards is the number of shards when Options.Shards is zero.
	DefaultShards = 64
	// MaxShards bounds Options.Shards.
	MaxShards = 1 << 16
)

// Options configures a Store. The zero value means the defaults.
type Options struct {
	// Clock is the store's clock: leases, retention and fencing tokens are
	// measured on it. Default time.Now.
	Clock func() time.Time

	// Shards is the number of independently locked partitions, rounded up
	// to a power of two and capped at MaxShards. Default DefaultShards.
	Shards int

	// MaxBytes bounds the memory the records hold, approximately: each
	// counts RecordOverhead plus its encoded response. When a new key's
	// record does not fit, and dropping the expired records does not make
	// room, Acquire fails with ErrFull; records are never evicted, and
	// nothing but the grant of a new lease is refused (see Bound in the
	// package documentation). Default 0 (or negative): no bound, as
	// before the option existed; an embedding program that takes keys
	// from its clients should set one.
	MaxBytes int64
}

// RecordOverhead is what a record counts for in Options.MaxBytes and
// Stats.Bytes besides its encoded response: the record itself (key,
// fingerprint, lease id, token, expiry: 96 bytes), its map entry and its
// expiry heap entry. It was measured on linux/amd64 with Go 1.26 as the
// growth of the live heap per record, responses apart: 149 to 171 bytes
// over 10,000 to 1,500,000 records, depending on how full the map is
// (TestRecordOverhead checks that Stats.Bytes stays within 25% of the
// heap's growth). The process's resident memory is larger: Go's collector
// lets the heap grow to about twice the live data (GOGC=100) before it
// collects.
const RecordOverhead = 160

// ErrFull is idem.ErrStoreFull: an Acquire refused because the records
// would exceed Options.MaxBytes. It arrives wrapped in a *idem.StoreError.
var ErrFull = idem.ErrStoreFull

// Stats describes what a Store holds.
type Stats struct {
	// Records is the number of records held: the live ones and the
	// expired ones not dropped yet (as Len, without taking the locks).
	Records int64
	// Bytes is their approximate size: RecordOverhead each plus their
	// encoded responses.
	Bytes int64
	// MaxBytes is Options.MaxBytes; 0 when there is no bound.
	MaxBytes int64
	// Refused counts the Acquires refused with ErrFull since New.
	Refused int64
}

// Store is an in-memory idem.Store. It is safe for concurrent use. The zero
// value is not usable: create one with New.
type Store struct {
	clock  func() time.Time
	shards []shard
	mask   uint64
	max    int64  // Options.MaxBytes; 0: none
	u      *usage // written by every shard: its own cache lines
	ns     string // Namespace
}

// usage is what the store holds, kept up to date by the shards' critical
// sections.
type usage struct {
	_       [64]byte
	bytes   atomic.Int64
	records atomic.Int64
	refused atomic.Int64
	_       [64]byte
}

var (
	_ idem.Store      = (*Store)(nil)
	_ idem.Namespacer = (*Store)(nil)
)

// Namespace implements idem.Namespacer: "memstore " and 16 random hex
// digits, drawn by New. A memory store's records are its own and die with
// it, so no other Store (another process's, or this process's after a
// restart) may judge the blobs it names: two proxies on memory sharing a
// blob store each leave the other's blobs alone (and a restarted one's
// blobs are left for a lifecycle rule or a hand).
func (s *Store) Namespace() string { return s.ns }

// New returns an empty Store.
func New(opts Options) *Store {
	if opts.Clock == nil {
		opts.Clock = time.Now
	}
	n := DefaultShards
	if opts.Shards > 0 {
		n = 1 << bits.Len(uint(min(opts.Shards, MaxShards)-1))
	}
	var id [8]byte
	rand.Read(id[:]) // never fails (crypto/rand)
	s := &Store{clock: opts.Clock, shards: make([]shard, n), mask: uint64(n - 1), max: max(opts.MaxBytes, 0), u: new(usage),
		ns: "memstore " + hex.EncodeToString(id[:])}
	for i := range s.shards {
		sh := &s.shards[i]
		sh.recs = make(map[idem.Key]*record)
		sh.u = s.u
		sh.next.Store(math.MaxInt64)
	}
	return s
}

// Stats returns what the store holds. It reads counters, takes no lock,
// and may be called at any rate.
func (s *Store) Stats() Stats {
	return Stats{Records: s.u.records.Load(), Bytes: s.u.bytes.Load(), MaxBytes: s.max, Refused: s.u.refused.Load()}
}

// Acquire implements idem.Store. A request that fails Validate is an error
// and writes nothing.
func (s *Store) Acquire(ctx context.Context, req idem.AcquireRequest) (idem.Acquisition, error) {
	if err := ctxErr(ctx, "acquire", req.Key); err != nil {
		return idem.Acquisition{}, err
	}
	if err := req.Validate(); err != nil {
		return idem.Acquisition{}, err
	}
	acq, enc, err := s.acquireRoom(req)
	if err != nil || acq.Outcome != idem.Replay {
		return acq, err
	}
	// Stored bytes are never modified, so they are decoded unlocked.
	resp, err := decode(enc)
	if err != nil {
		return idem.Acquisition{}, &idem.StoreError{Op: "acquire", Key: req.Key, Err: err}
	}
	acq.Response = resp
	return acq, nil
}

// acquireRoom is acquire; when the store is full, it drops the expired
// records of every shard and tries once more, and then refuses.
func (s *Store) acquireRoom(req idem.AcquireRequest) (idem.Acquisition, []byte, error) {
	acq, enc, full := s.acquire(req)
	if !full {
		return acq, enc, nil
	}
	s.sweepExpired()
	if acq, enc, full = s.acquire(req); !full {
		return acq, enc, nil
	}
	s.u.refused.Add(1)
	return idem.Acquisition{}, nil, &idem.StoreError{Op: "acquire", Key: req.Key,
		Err: fmt.Errorf("memstore: the records hold %d bytes of MaxBytes %d and none has expired; new keys are refused until some expire: %w",
			s.u.bytes.Load(), s.max, ErrFull)}
}

// acquire is the critical section of Acquire. For a replay it returns the
// encoded response instead of setting acq.Response. It reports full, and
// changes nothing, when a lease would be granted but the store has no room
// for one more record.
func (s *Store) acquire(req idem.AcquireRequest) (acq idem.Acquisition, enc []byte, full bool) {
	sh, now := s.lock(req.Key)
	defer sh.unlock()
	r := sh.live(req.Key, now)
	switch {
	case r == nil:
		if !s.admit() {
			return idem.Acquisition{}, nil, true
		}
		r = &record{key: req.Key, index: -1}
	case r.state == idem.StateReleased:
		// Absent to Acquire; only its token counts. Its overhead is
		// counted already, but its response would not be.
		if !s.fits() {
			return idem.Acquisition{}, nil, true
		}
	case r.state == idem.StateInFlight && r.lease == req.LeaseID:
		// The same call again, after a lost reply.
		l := idem.Lease{Key: req.Key, ID: r.lease, Token: r.token, TTL: time.Duration(r.expires - now)}
		return idem.Acquisition{Outcome: idem.Acquired, Lease: l}, nil, false
	case r.fp != req.Fingerprint:
		return idem.Acquisition{Outcome: idem.Mismatch}, nil, false
	case r.state == idem.StateInFlight:
		return idem.Acquisition{Outcome: idem.InFlight, RetryAfter: time.Duration(r.expires - now)}, nil, false
	default: // completed
		return idem.Acquisition{Outcome: idem.Replay}, r.resp, false
	}
	r.state, r.token, r.fp, r.lease = idem.StateInFlight, nextToken(r.token, now), req.Fingerprint, req.LeaseID
	sh.setExpiry(r, expiry(now, req.TTL, r.token))
	l := idem.Lease{Key: req.Key, ID: req.LeaseID, Token: r.token, TTL: req.TTL}
	return idem.Acquisition{Outcome: idem.Acquired, Lease: l}, nil, false
}

// admit counts a new record, unless Options.MaxBytes is set and the
// record's overhead does not fit; then it reports false and counts
// nothing. The compare-and-swap makes the check and the count one step, so
// concurrent acquirers never take the overheads past the bound together.
func (s *Store) admit() bool {
	if s.max == 0 {
		s.u.bytes.Add(RecordOverhead)
		s.u.records.Add(1)
		return true
	}
	for {
		b := s.u.bytes.Load()
		if b+RecordOverhead > s.max {
			return false
		}
		if s.u.bytes.CompareAndSwap(b, b+RecordOverhead) {
			s.u.records.Add(1)
			return true
		}
	}
}

// fits reports whether one more record's overhead fits in MaxBytes.
func (s *Store) fits() bool {
	return s.max == 0 || s.u.bytes.Load()+RecordOverhead <= s.max
}

// sweepChunk is how many expired records sweepExpired drops from a shard
// per critical section.
const sweepChunk = 1024

// sweepExpired drops expired records, shard after shard, until there is
// room for one more record or no shard has an expired record left. It
// locks only the shards whose heap's top has expired, and holds a lock for
// at most sweepChunk records.
func (s *Store) sweepExpired() {
	now := s.clock().UnixNano()
	for i := range s.shards {
		sh := &s.shards[i]
		for sh.next.Load() <= now {
			if s.fits() {
				return
			}
			sh.mu.Lock()
			sh.sweepN(now, sweepChunk)
			sh.unlock()
		}
	}
}

// Renew implements idem.Store. A ttl shorter than a millisecond is an
// error and changes nothing.
func (s *Store) Renew(ctx context.Context, l idem.Lease, ttl time.Duration) error {
	if err := ctxErr(ctx, "renew", l.Key); err != nil {
		return err
	}
	if ttl < time.Millisecond {
		return fmt.Errorf("memstore: renew: lease TTL %v is shorter than 1ms", ttl)
	}
	sh, now := s.lock(l.Key)
	defer sh.unlock()
	r := sh.live(l.Key, now)
	if r == nil || r.state != idem.StateInFlight || r.lease != l.ID {
		return idem.ErrLeaseLost
	}
	sh.setExpiry(r, expiry(now, ttl, r.token))
	return nil
}

// Complete implements idem.Store. resp is encoded before the call returns
// and not retained; a nil resp is an error. A retention shorter than a
// millisecond is an error and changes nothing.
func (s *Store) Complete(ctx context.Context, l idem.Lease, resp *idem.Response, retention time.Duration) error {
	if err := ctxErr(ctx, "complete", l.Key); err != nil {
		return err
	}
	if retention < time.Millisecond {
		return fmt.Errorf("memstore: complete: retention %v is shorter than 1ms", retention)
	}
	// Encoding may compress: do it before taking the lock.
	enc, err := encode(resp)
	if err != nil {
		return &idem.StoreError{Op: "complete", Key: l.Key, Err: err}
	}
	return s.complete(l, enc, retention)
}

// complete is the critical section of Complete.
func (s *Store) complete(l idem.Lease, enc []byte, retention time.Duration) error {
	sh, now := s.lock(l.Key)
	defer sh.unlock()
	r := sh.live(l.Key, now)
	switch {
	case r == nil:
	case r.state == idem.StateInFlight && r.lease == l.ID:
		// Never refused, whatever MaxBytes: the work has run.
		r.state, r.lease, r.resp = idem.StateCompleted, idem.LeaseID{}, enc
		s.u.bytes.Add(int64(cap(enc)))
		sh.setExpiry(r, expiry(now, retention, r.token))
		return nil
	case r.state == idem.StateCompleted && r.token == l.Token:
		return nil // the same call again, after a lost reply
	}
	return idem.ErrLeaseLost
}

// Release implements idem.Store. The tombstone left behind keeps the token
// for l.TTL.
func (s *Store) Release(ctx context.Context, l idem.Lease) error {
	if err := ctxErr(ctx, "release", l.Key); err != nil {
		return err
	}
	return s.release(l)
}

// release is the critical section of Release.
func (s *Store) release(l idem.Lease) error {
	sh, now := s.lock(l.Key)
	defer sh.unlock()
	r := sh.live(l.Key, now)
	switch {
	case r == nil:
	case r.state == idem.StateInFlight && r.lease == l.ID:
		r.state, r.fp, r.lease = idem.StateReleased, idem.Fingerprint{}, idem.LeaseID{}
		sh.setExpiry(r, expiry(now, l.TTL, r.token))
		return nil
	case r.state == idem.StateReleased && r.token == l.Token:
		return nil // the same call again, after a lost reply
	}
	return idem.ErrLeaseLost
}

// Get implements idem.Store. Record.Size is the length of the encoded
// response plus the fixed fields.
func (s *Store) Get(ctx context.Context, key idem.Key) (idem.Record, bool, error) {
	if err := ctxErr(ctx, "get", key); err != nil {
		return idem.Record{}, false, err
	}
	rec, enc, ok := s.get(key)
	if !ok || rec.State != idem.StateCompleted {
		return rec, ok, nil
	}
	resp, err := decode(enc)
	if err != nil {
		return idem.Record{}, false, &idem.StoreError{Op: "get", Key: key, Err: err}
	}
	rec.Response = resp
	return rec, true, nil
}

// get is the critical section of Get. It returns the encoded response
// instead of setting Record.Response.
func (s *Store) get(key idem.Key) (rec idem.Record, enc []byte, ok bool) {
	sh, now := s.lock(key)
	defer sh.unlock()
	r := sh.live(key, now)
	if r == nil {
		return idem.Record{}, nil, false
	}
	rec = idem.Record{
		State:       r.state,
		Token:       r.token,
		Fingerprint: r.fp,
		LeaseID:     r.lease,
		TTL:         time.Duration(r.expires - now),
		Size:        fixedSize + len(r.resp),
	}
	return rec, r.resp, true
}

// Delete implements idem.Store. It drops the key's token history too.
func (s *Store) Delete(ctx context.Context, key idem.Key) (bool, error) {
	if err := ctxErr(ctx, "delete", key); err != nil {
		return false, err
	}
	sh, now := s.lock(key)
	defer sh.unlock()
	r := sh.live(key, now)
	if r == nil {
		return false, nil
	}
	sh.remove(r)
	return true, nil
}

// Len returns the number of records held: the live ones and the expired
// ones not yet dropped.
func (s *Store) Len() int {
	n := 0
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		n += len(sh.recs)
		sh.unlock()
	}
	return n
}

// lock locks key's shard, reads the clock (Unix nanoseconds) and sweeps
// the shard. The caller unlocks it with sh.unlock.
func (s *Store) lock(key idem.Key) (sh *shard, now int64) {
	sh = &s.shards[s.shardIndex(key)]
	sh.mu.Lock()
	now = s.clock().UnixNano()
	sh.sweep(now)
	return sh, now
}

// shardIndex returns the index of key's shard.
func (s *Store) shardIndex(key idem.Key) uint64 {
	return (binary.LittleEndian.Uint64(key[:8]) ^ binary.LittleEndian.Uint64(key[8:])) & s.mask
}

func ctxErr(ctx context.Context, op string, key idem.Key) error {
	if err := ctx.Err(); err != nil {
		return &idem.StoreError{Op: op, Key: key, Err: err}
	}
	return nil
}

// nextToken returns the fencing token following prev at now (Unix
// nanoseconds): the larger of prev+1 and the clock in milliseconds.
func nextToken(prev uint64, now int64) uint64 {
	return max(prev+1, uint64(max(now/int64(time.Millisecond), 0)))
}

// expiry returns when a record written at now (Unix nanoseconds) for ttl
// expires: never before the millisecond after its token, so that once the
// record is gone, fresh tokens (the clock in milliseconds) exceed it.
func expiry(now int64, ttl time.Duration, token uint64) int64 {
	end := now + int64(ttl)
	if ttl > 0 && end < now {
		end = 1<<63 - 1 // overflow: never
	}
	return max(end, int64(token+1)*int64(time.Millisecond))
}

// maxPooledBuf is the largest encoding buffer kept for reuse.
const maxPooledBuf = 64 << 10

var encodeBufs = sync.Pool{New: func() any { return new([]byte) }}

// encode returns resp's encoding in a slice of its own.
func encode(resp *idem.Response) ([]byte, error) {
	bp := encodeBufs.Get().(*[]byte)
	b, err := resp.AppendBinary((*bp)[:0])
	var enc []byte
	if err == nil {
		enc = bytes.Clone(b)
	}
	if cap(b) <= maxPooledBuf {
		*bp = b
		encodeBufs.Put(bp)
	}
	return enc, err
}

func decode(enc []byte) (*idem.Response, error) {
	resp := new(idem.Response)
	if err := resp.UnmarshalBinary(enc); err != nil {
		return nil, err
	}
	return resp, nil
}
