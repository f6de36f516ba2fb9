package memstore

import (
	"time"

	"github.com/idemkit/idem"
)

// Corrupt overwrites key's record with a completed record, kept for an
// hour, whose stored response cannot be decoded. It keeps the record's
// token and fingerprint (zero when there was no record), so an Acquire
// with the original fingerprint meets the bad bytes. It is
// storetest.Fixture.Corrupt for this store.
func (s *Store) Corrupt(key idem.Key) error {
	sh, now := s.lock(key)
	defer sh.unlock()
	r := sh.live(key, now)
	if r == nil {
		r = &record{key: key, index: -1}
		s.u.bytes.Add(RecordOverhead)
		s.u.records.Add(1)
	}
	// 0xC0 sets the version bits of the response encoding to version 7: no such version (0xFF would start a sealed value).
	bad := []byte{0xC0}
	s.u.bytes.Add(int64(cap(bad) - cap(r.resp)))
	r.state, r.lease, r.resp = idem.StateCompleted, idem.LeaseID{}, bad
	sh.setExpiry(r, expiry(now, time.Hour, r.token))
	return nil
}

// ShardOf returns the index of key's shard.
func (s *Store) ShardOf(key idem.Key) int { return int(s.shardIndex(key)) }
