package redisstore

import (
	"bytes"
	"context"
	"hash/maphash"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/rueidis"

	"github.com/idemkit/idem"
)

// DefaultCacheSize is Options.CacheSize's default: the bytes of records
// each connection of the client Open creates may keep in memory.
const DefaultCacheSize = 16 << 20

// CacheStats counts what the replay cache answered. See Options.CacheSize.
type CacheStats struct {
	// Enabled reports whether the store reads replays through the cache.
	Enabled bool
	// Hits counts the acquires answered from memory: replays that cost no
	// round trip.
	Hits uint64
	// Misses counts the acquires that Redis answered while the cache was
	// on: first requests, replays of records not (or no longer) in memory,
	// and everything that is not a replay.
	Misses uint64
}

// CacheStats returns the replay cache's counters since the store was made.
func (s *Store) CacheStats() CacheStats {
	if s.cache == nil {
		return CacheStats{}
	}
	return CacheStats{Enabled: true, Hits: s.cache.hits.Load(), Misses: s.cache.misses.Load()}
}

// replayCache answers Acquire on a completed record from the rueidis
// client's server-assisted client-side cache (RESP3 CLIENT TRACKING): a
// cached GET of the record key, which Redis invalidates when the key
// changes, is deleted or expires, and which rueidis drops with the
// connection it was read on (a lost connection, a failover, a FLUSHALL's
// invalidation). Only a completed record whose fingerprint equals the
// request's is answered from it; anything else goes to the acquire
// script, which decides as it always has.
//
// To keep first requests at one round trip, the cache is read only for
// keys this process has seen completed (hints: its own Complete, or an
// acquire script that answered replay), and only until the record's
// expiry as then known; every other Acquire runs the script directly.
// A hint is never an answer: a replay is served only from a value read
// through the tracked cache.
type replayCache struct {
	c    rueidis.Client
	seed maphash.Seed
	base time.Time // hints count from it, on the monotonic clock

	mu    sync.Mutex
	hints map[uint64]int64 // hash of the record key -> expiry, ns since base
	max   int              // hints kept at most
	// gens counts, per shard of key hashes, the forgets of records this
	// store deleted or overwrote. A call that may learn of a completion
	// notes its shard's count before it is sent (mark); completed drops
	// the hint when the count moved, as the record it learned of may be
	// gone. Written under mu.
	gens [genShards]atomic.Uint64

	hintHook   func() // tests: runs when completed is called
	forgetHook func() // tests: runs at the end of forget

	hits, misses atomic.Uint64
	off          atomic.Bool // the server refused the cached read (ACL): use the script only
}

// genShards is how many generation counters a replayCache keeps: a
// Delete or Fill voids the hints only of the calls in flight on keys of
// its shard.
const genShards = 256

// cacheMark is what a call that may learn of a completion notes before
// it is sent: the time (so that a hint's bound never exceeds the
// record's expiry on the server) and the generation of the key's shard.
type cacheMark struct {
	at  int64 // ns since base
	gen uint64
}

// hintBytes is the cache memory per hint allowed: a hint costs about 40
// bytes, a cached completed record (rueidis's entry included) several
// hundred, so this keeps hints for more keys than the cache can hold.
const hintBytes = 256

func newReplayCache(c rueidis.Client, size int) *replayCache {
	if size <= 0 {
		size = DefaultCacheSize
	}
	return &replayCache{c: c, seed: maphash.MakeSeed(), base: time.Now(), hints: make(map[uint64]int64),
		max: min(max(size/hintBytes, 1024), 1<<20)}
}

// now is the time since base on the monotonic clock, which a change of
// the wall clock does not move.
func (rc *replayCache) now() int64 { return int64(time.Since(rc.base)) }

// mark returns the note to pass to completed, taken before the call that
// may learn that name is completed. A nil rc gives the zero mark.
func (rc *replayCache) mark(name string) cacheMark {
	if rc == nil {
		return cacheMark{}
	}
	h := maphash.String(rc.seed, name)
	return cacheMark{at: rc.now(), gen: rc.gens[h%genShards].Load()}
}

// completed notes that name holds a completed record until at least
// m.at+left, m being the mark taken before the call that learned it (so
// that the bound never exceeds the record's expiry on the server). It
// notes nothing when this store forgot a record of name's shard since
// the mark (Delete, Fill): the completion may be gone, and the tracked
// copy of it not yet invalidated (see forget).
func (rc *replayCache) completed(name string, m cacheMark, left time.Duration) {
	if rc == nil || left < time.Millisecond {
		return
	}
	if rc.hintHook != nil {
		rc.hintHook()
	}
	h := maphash.String(rc.seed, name)
	until := m.at + int64(left)
	rc.mu.Lock()
	defer rc.mu.Unlock()
	if rc.gens[h%genShards].Load() != m.gen {
		return
	}
	if len(rc.hints) >= rc.max {
		rc.trim()
	}
	rc.hints[h] = until
}

// trim drops expired hints, then arbitrary ones (Go's map order) down to
// three quarters of max. rc.mu is held.
func (rc *replayCache) trim() {
	now := rc.now()
	for h, until := range rc.hints {
		if until <= now {
			delete(rc.hints, h)
		}
	}
	for h := range rc.hints {
		if len(rc.hints) <= rc.max*3/4 {
			break
		}
		delete(rc.hints, h)
	}
}

// forget drops name's hint because the store deletes or overwrites the
// record, and voids the hints of the calls in flight on its shard (see
// completed). Call it before and after the change: Redis sends the
// invalidation of a change with its reply only on the connection the
// change went out on, and rueidis may read the cache on another, so the
// tracked copy may outlive the change's reply for a moment; without a
// hint it is not read.
func (rc *replayCache) forget(name string) {
	if rc == nil {
		return
	}
	h := maphash.String(rc.seed, name)
	rc.mu.Lock()
	rc.gens[h%genShards].Add(1)
	delete(rc.hints, h)
	rc.mu.Unlock()
	if rc.forgetHook != nil {
		rc.forgetHook()
	}
}

// drop drops name's hint (the cached read found no replay there).
func (rc *replayCache) drop(name string) {
	h := maphash.String(rc.seed, name)
	rc.mu.Lock()
	delete(rc.hints, h)
	rc.mu.Unlock()
}

// ttl returns how long a cached read of name may be kept: until the
// hinted expiry, or 0 when there is no live hint.
func (rc *replayCache) ttl(name string) time.Duration {
	h := maphash.String(rc.seed, name)
	rc.mu.Lock()
	until, ok := rc.hints[h]
	rc.mu.Unlock()
	if !ok {
		return 0
	}
	left := time.Duration(until - rc.now())
	if left < time.Millisecond {
		rc.drop(name)
		return 0
	}
	return left
}

// replay answers req from the cache when the record is completed with
// req's fingerprint: ok reports an answer. Otherwise the caller runs the
// acquire script (a read error included: the script reports it).
func (rc *replayCache) replay(ctx context.Context, name string, req idem.AcquireRequest) (acq idem.Acquisition, ok bool) {
	if rc.off.Load() {
		return acq, false
	}
	ttl := rc.ttl(name)
	if ttl == 0 {
		return acq, false
	}
	// The local copy never outlives ttl, nor the PTTL rueidis reads with
	// it (measured on arrival, so a little later than the server's).
	res := rc.c.DoCache(ctx, rc.c.B().Get().Key(name).Cache(), ttl)
	v, err := res.AsBytes() // the cached string's own memory: read only (decodeRecord copies)
	if err != nil {
		if _, isRedisErr := rueidis.IsRedisErr(err); isRedisErr && !rueidis.IsRedisNil(err) && permissionError(err) {
			rc.off.Store(true) // an ACL without CLIENT CACHING, MULTI or PTTL: never try again
		}
		rc.drop(name)
		return acq, false
	}
	resp, match := completedResponse(v, req.Fingerprint)
	if !match {
		// In flight, released, not a record, or another fingerprint
		// (mismatch is the script's to decide).
		rc.drop(name)
		return acq, false
	}
	if res.IsCacheHit() {
		rc.hits.Add(1)
	} else {
		rc.misses.Add(1)
	}
	return idem.Acquisition{Outcome: idem.Replay, Response: resp}, true
}

// completedResponse decodes v when it is a completed record of
// fingerprint fp: the test acquire.lua makes before it answers replay
// (kind 'C', the fingerprint's 16 bytes after the token).
func completedResponse(v []byte, fp idem.Fingerprint) (*idem.Response, bool) {
	if len(v) <= fpEnd || v[0] != 'C' || !bytes.Equal(v[tokenEnd:fpEnd], fp[:]) {
		return nil, false
	}
	rec, err := decodeRecord(v)
	if err != nil {
		return nil, false // the script reports the corrupt record
	}
	return rec.Response, true
}

// acquireCached is Acquire with the cache on.
func (s *Store) acquireCached(ctx context.Context, req idem.AcquireRequest) (idem.Acquisition, error) {
	if err := ctx.Err(); err != nil { // send nothing for a cancelled call
		return idem.Acquisition{}, &idem.StoreError{Op: "acquire", Key: req.Key, Err: err}
	}
	ctx, cancel := s.bound(ctx) // one bound for the cached read and the script
	defer cancel()
	name := s.KeyName(req.Key)
	if acq, ok := s.cache.replay(ctx, name, req); ok {
		return acq, nil
	}
	s.cache.misses.Add(1)
	return s.acquire(ctx, req, name, s.cache.mark(name))
}
