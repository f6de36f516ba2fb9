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
// operations on a key are linearizable.
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
package memstore

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"math/bits"
	"sync"
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
}

// Store is an in-memory idem.Store. It is safe for concurrent use. The zero
// value is not usable: create one with New.
type Store struct {
	clock  func() time.Time
	shards []shard
	mask   uint64
}

var (
	_ idem.Store      = (*Store)(nil)
	_ idem.Namespacer = (*Store)(nil)
)

// Namespace implements idem.Namespacer: "memstore", for every Store. A
// memory store's records die with its process, so two processes' stores
// sharing a blob store (and prefix) each take the other's blobs for
// orphans: give each its own blob prefix.
func (s *Store) Namespace() string { return "memstore" }

// New returns an empty Store.
func New(opts Options) *Store {
	if opts.Clock == nil {
		opts.Clock = time.Now
	}
	n := DefaultShards
	if opts.Shards > 0 {
		n = 1 << bits.Len(uint(min(opts.Shards, MaxShards)-1))
	}
	s := &Store{clock: opts.Clock, shards: make([]shard, n), mask: uint64(n - 1)}
	for i := range s.shards {
		s.shards[i].recs = make(map[idem.Key]*record)
	}
	return s
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
	acq, enc := s.acquire(req)
	if acq.Outcome != idem.Replay {
		return acq, nil
	}
	// Stored bytes are never modified, so they are decoded unlocked.
	resp, err := decode(enc)
	if err != nil {
		return idem.Acquisition{}, &idem.StoreError{Op: "acquire", Key: req.Key, Err: err}
	}
	acq.Response = resp
	return acq, nil
}

// acquire is the critical section of Acquire. For a replay it returns the
// encoded response instead of setting acq.Response.
func (s *Store) acquire(req idem.AcquireRequest) (acq idem.Acquisition, enc []byte) {
	sh, now := s.lock(req.Key)
	defer sh.mu.Unlock()
	r := sh.live(req.Key, now)
	switch {
	case r == nil:
		r = &record{key: req.Key, index: -1}
	case r.state == idem.StateReleased:
		// Absent to Acquire; only its token counts.
	case r.state == idem.StateInFlight && r.lease == req.LeaseID:
		// The same call again, after a lost reply.
		l := idem.Lease{Key: req.Key, ID: r.lease, Token: r.token, TTL: time.Duration(r.expires - now)}
		return idem.Acquisition{Outcome: idem.Acquired, Lease: l}, nil
	case r.fp != req.Fingerprint:
		return idem.Acquisition{Outcome: idem.Mismatch}, nil
	case r.state == idem.StateInFlight:
		return idem.Acquisition{Outcome: idem.InFlight, RetryAfter: time.Duration(r.expires - now)}, nil
	default: // completed
		return idem.Acquisition{Outcome: idem.Replay}, r.resp
	}
	r.state, r.token, r.fp, r.lease = idem.StateInFlight, nextToken(r.token, now), req.Fingerprint, req.LeaseID
	sh.setExpiry(r, expiry(now, req.TTL, r.token))
	l := idem.Lease{Key: req.Key, ID: req.LeaseID, Token: r.token, TTL: req.TTL}
	return idem.Acquisition{Outcome: idem.Acquired, Lease: l}, nil
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
	defer sh.mu.Unlock()
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
	defer sh.mu.Unlock()
	r := sh.live(l.Key, now)
	switch {
	case r == nil:
	case r.state == idem.StateInFlight && r.lease == l.ID:
		r.state, r.lease, r.resp = idem.StateCompleted, idem.LeaseID{}, enc
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
	defer sh.mu.Unlock()
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
	defer sh.mu.Unlock()
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
	defer sh.mu.Unlock()
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
		sh.mu.Unlock()
	}
	return n
}

// lock locks key's shard, reads the clock (Unix nanoseconds) and sweeps
// the shard. The caller unlocks sh.mu.
func (s *Store) lock(key idem.Key) (sh *shard, now int64) {
	h := binary.LittleEndian.Uint64(key[:8]) ^ binary.LittleEndian.Uint64(key[8:])
	sh = &s.shards[h&s.mask]
	sh.mu.Lock()
	now = s.clock().UnixNano()
	sh.sweep(now)
	return sh, now
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
