// Package quota counts, per tenant, what the keyed requests of one process
// hold in its idempotency store, and refuses a new key to a tenant that
// holds its share: the keys it has in flight, the records it has stored
// and their bytes. idemhttp asks it before a new key is claimed; idem
// proxy and the Caddy handler get it by configuring idemhttp.
//
// A request's life, as idemhttp drives it:
//
//	t, over, _ := set.Admit(tenant, now) // over == "": admitted, t counts one key in flight
//	... acquire the key; if it was not newly claimed: t.Release()
//	... run the work; then t.Stored(bytes, retention), or t.Release()
//
// What it is, and where it stops:
//   - Per process. It counts what this process claimed, not what the store
//     holds: several processes in front of one store each count their own,
//     and a restart forgets the counts (the records stay).
//   - A key in flight counts from Admit until Stored or Release: until the
//     work ends, not its lease.
//   - A stored record counts its bytes and one record until its retention
//     ends, rounded up to a sixteenth of that retention (the counts are
//     kept in buckets by expiry): a tenant gets its share back at most that
//     much later than the store drops the record, never sooner. A record
//     the store drops early (an operator's purge) still counts until then.
//   - A tenant over its bytes keeps the responses it has in flight: each
//     completes and is counted (the work has run), so a tenant exceeds
//     Bytes by at most the responses of InFlight requests.
//   - A tenant is its tenant string: a client that rotates credentials is
//     many tenants. At most Limits.Tenants are tracked (about: the table
//     has shards); a tenant past them is counted with every other such
//     tenant in one overflow count that no limit applies to, until
//     tracked tenants have nothing left counted and give up their place:
//     a flood of made-up tenants that fills the table must not lock every
//     new client out for a retention (the store's own bound still holds
//     them: a full store answers store-full).
package quota

import (
	"hash/maphash"
	"sync"
	"time"
)

// Limit names a limit: the word of metrics, logs and problem details.
type Limit string

const (
	LimitInFlight Limit = "in_flight" // keys in flight at once
	LimitRecords  Limit = "records"   // records stored, in flight ones included
	LimitBytes    Limit = "bytes"     // bytes of stored records
)

// Limits are one tenant's limits; a zero or negative limit is none.
type Limits struct {
	InFlight int
	Records  int64
	Bytes    int64
	// Tenants bounds the tenants tracked (DefaultTenants when zero or
	// negative).
	Tenants int
}

// DefaultTenants is Limits.Tenants's default.
const DefaultTenants = 10000

// On reports whether l limits anything.
func (l Limits) On() bool { return l.InFlight > 0 || l.Records > 0 || l.Bytes > 0 }

const (
	shards = 16
	// maxBuckets bounds the expiry buckets of one tenant: 17 cover one
	// retention (a sixteenth each); a tenant whose records have several
	// retentions merges the later ones.
	maxBuckets = 24
	// sweepEvery is the least time between two sweeps of a full shard.
	sweepEvery = time.Second
)

// Set counts the usage of every tenant. It is safe for concurrent use.
type Set struct {
	lim       Limits
	perShard  int
	seed      maphash.Seed
	now       func() time.Time
	shards    [shards]shard
	overflow  usage // the tenants past the table's bound
	overflowM sync.Mutex
}

type shard struct {
	mu        sync.Mutex
	tenants   map[uint64]*usage
	lastSweep int64
	_         [32]byte
}

// usage is one tenant's count, under mu (its shard's, or the overflow's).
type usage struct {
	mu       *sync.Mutex
	inFlight int
	records  int64    // in flight and stored
	bytes    int64    // stored
	buckets  []bucket // by end, ascending
}

// bucket holds the records that expire by end (Unix ns).
type bucket struct {
	end     int64
	records int64
	bytes   int64
}

// New returns a Set with limits lim; now is its clock (time.Now when nil).
func New(lim Limits, now func() time.Time) *Set {
	if lim.Tenants <= 0 {
		lim.Tenants = DefaultTenants
	}
	if now == nil {
		now = time.Now
	}
	s := &Set{lim: lim, perShard: max(1, (lim.Tenants+shards-1)/shards), seed: maphash.MakeSeed(), now: now}
	for i := range s.shards {
		s.shards[i].tenants = map[uint64]*usage{}
	}
	s.overflow.mu = &s.overflowM
	return s
}

// Limits returns the set's limits.
func (s *Set) Limits() Limits { return s.lim }

// Ticket is one admitted request's key in flight. The zero Ticket counts
// nothing. Release or Stored ends it, once.
type Ticket struct {
	s *Set
	u *usage
}

// Admit counts one more key in flight for tenant, unless that would take
// the tenant past a limit: then it counts nothing and names the limit,
// with how long until the tenant may have room (at least a second). now
// is the time of the request (the set's clock when zero): the caller
// usually has it, and a clock read is not free.
func (s *Set) Admit(tenant string, now time.Time) (t Ticket, over Limit, retryAfter time.Duration) {
	if now.IsZero() {
		now = s.now()
	}
	return s.admit(tenant, now.UnixNano())
}

func (s *Set) admit(tenant string, now int64) (t Ticket, over Limit, retryAfter time.Duration) {
	u := s.lookup(tenant, now)
	defer u.mu.Unlock()
	u.prune(now)
	switch {
	case u == &s.overflow:
		// Past the table's bound: counted, not limited (see the package
		// doc).
	case s.lim.InFlight > 0 && u.inFlight >= s.lim.InFlight:
		return Ticket{}, LimitInFlight, time.Second
	case s.lim.Records > 0 && u.records >= s.lim.Records:
		return Ticket{}, LimitRecords, u.freeIn(now)
	case s.lim.Bytes > 0 && u.bytes >= s.lim.Bytes:
		return Ticket{}, LimitBytes, u.freeIn(now)
	}
	u.inFlight++
	u.records++
	return Ticket{s, u}, "", 0
}

// Force counts one more key in flight for tenant whatever its limits: for
// a key that had a record already (a retry that takes over or re-claims
// it), which is not a new key.
func (s *Set) Force(tenant string) Ticket {
	now := s.now().UnixNano()
	u := s.lookup(tenant, now)
	defer u.mu.Unlock()
	u.inFlight++
	u.records++
	return Ticket{s, u}
}

// Release ends t without a stored record: the key was not claimed, or was
// released.
func (t Ticket) Release() {
	if t.u == nil {
		return
	}
	t.u.mu.Lock()
	t.u.inFlight--
	t.u.records--
	t.u.mu.Unlock()
}

// Stored ends t with a record of size bytes, counted until retention from
// now (rounded up to a sixteenth of it).
func (t Ticket) Stored(size int64, retention time.Duration) {
	if t.u == nil {
		return
	}
	now := t.s.now().UnixNano()
	w := max(int64(retention/16), int64(time.Millisecond))
	end := (now + int64(retention) + w - 1) / w * w
	u := t.u
	u.mu.Lock()
	defer u.mu.Unlock()
	u.inFlight--
	u.bytes += size
	u.add(bucket{end: end, records: 1, bytes: size})
}

// add puts b among u's buckets, merged into the first that ends at or
// after it when u has maxBuckets already (or, if none does, into the last,
// which then ends at b's end): a record is never counted as expiring
// sooner than it does.
func (u *usage) add(b bucket) {
	i := len(u.buckets)
	for i > 0 && u.buckets[i-1].end >= b.end {
		i--
	}
	switch {
	case i < len(u.buckets) && u.buckets[i].end == b.end:
	case len(u.buckets) < maxBuckets:
		u.buckets = append(u.buckets, bucket{})
		copy(u.buckets[i+1:], u.buckets[i:])
		u.buckets[i] = bucket{end: b.end}
	case i == len(u.buckets):
		i--
		u.buckets[i].end = b.end
	}
	u.buckets[i].records += b.records
	u.buckets[i].bytes += b.bytes
}

// prune drops the buckets that ended by now.
func (u *usage) prune(now int64) {
	n := 0
	for n < len(u.buckets) && u.buckets[n].end <= now {
		u.records -= u.buckets[n].records
		u.bytes -= u.buckets[n].bytes
		n++
	}
	if n > 0 {
		u.buckets = append(u.buckets[:0], u.buckets[n:]...)
	}
}

// freeIn is the time until u's first bucket ends: when some of its share
// comes back (at least a second).
func (u *usage) freeIn(now int64) time.Duration {
	if len(u.buckets) == 0 {
		return time.Second // only keys in flight: they end with their work
	}
	return max(time.Duration(u.buckets[0].end-now), time.Second)
}

func (u *usage) empty() bool { return u.inFlight == 0 && u.records == 0 && len(u.buckets) == 0 }

// lookup returns tenant's usage, locked: its own, a new one, or, with the
// table full, the overflow's.
func (s *Set) lookup(tenant string, now int64) *usage {
	h := maphash.String(s.seed, tenant)
	sh := &s.shards[h%shards]
	sh.mu.Lock()
	if u, ok := sh.tenants[h]; ok {
		return u
	}
	if len(sh.tenants) >= s.perShard && now-sh.lastSweep >= int64(sweepEvery) {
		sh.lastSweep = now
		for k, u := range sh.tenants {
			if u.prune(now); u.empty() {
				delete(sh.tenants, k)
			}
		}
	}
	if len(sh.tenants) < s.perShard {
		u := &usage{mu: &sh.mu}
		sh.tenants[h] = u
		return u
	}
	sh.mu.Unlock()
	s.overflowM.Lock()
	return &s.overflow
}

// Stats is what a Set tracks.
type Stats struct {
	Tenants  int  // tenants with a count of their own
	Overflow bool // tenants past the bound are counted together now
}

// Stats returns what s tracks. It takes each shard's lock in turn.
func (s *Set) Stats() Stats {
	var st Stats
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		st.Tenants += len(sh.tenants)
		sh.mu.Unlock()
	}
	s.overflowM.Lock()
	st.Overflow = !s.overflow.empty()
	s.overflowM.Unlock()
	return st
}
