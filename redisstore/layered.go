package redisstore

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/idemkit/idem"
)

// The methods in this file are for stores layered on this one, such as
// tieredstore, which keeps leases on Redis and completions in PostgreSQL.
// Each is one script and one round trip, like the methods of idem.Store,
// and safe to send again after a lost reply.

// Hold checks that l is the key's live lease and extends it to ttl from
// now, as Renew does, and returns the fingerprint its record holds. It
// returns idem.ErrLeaseLost, and changes nothing, when the lease has
// expired, was taken over, released or completed.
func (s *Store) Hold(ctx context.Context, l idem.Lease, ttl time.Duration) (idem.Fingerprint, error) {
	ms, err := millis("lease TTL", ttl)
	if err != nil {
		return idem.Fingerprint{}, err
	}
	r, err := s.run(ctx, "renew", l.Key, scriptHold, string(l.ID[:]), strconv.FormatInt(ms, 10))
	if err != nil {
		return idem.Fingerprint{}, err
	}
	if r.n[0] != 1 {
		return idem.Fingerprint{}, idem.ErrLeaseLost
	}
	var fp idem.Fingerprint
	if len(r.blob) != len(fp) || uint64(r.n[1]) != l.Token {
		return fp, &idem.StoreError{Op: "renew", Key: l.Key, Err: fmt.Errorf("%w: the in-flight record at %s does not match its lease", idem.ErrCorrupt, s.KeyName(l.Key))}
	}
	copy(fp[:], r.blob)
	return fp, nil
}

// Fill is a completed record to write with Store.Fill: a copy of a
// completion that a durable store holds.
type Fill struct {
	Key   idem.Key
	Token uint64 // the completion's fencing token
	// Fingerprint is the completion's fingerprint. With
	// FingerprintFromLease, the fingerprint of Lease's in-flight record is
	// used instead, and nothing is written unless that record is there.
	Fingerprint          idem.Fingerprint
	FingerprintFromLease bool
	Lease                idem.LeaseID // the lease that completed, if known
	// TTL is the time the completion has left in the durable store; the
	// record expires then, but never before the clock has passed the
	// largest token the key had (so that later tokens stay larger).
	TTL time.Duration
	// Response is the encoded response (idem.Response.AppendBinary).
	Response []byte
}

// FillResult is what Store.Fill did.
type FillResult uint8

const (
	// FillRefused: the key holds a completion with a larger token (a newer
	// one), or the TTL is not positive: nothing was written.
	FillRefused FillResult = iota
	// Filled: the completed record was written over what was there
	// (nothing, a released record, an in-flight one of any lease, an
	// older completion, or a value that is not a record).
	Filled
	// FillPresent: the key holds this completion already (same token).
	FillPresent
	// FillNoFingerprint: FingerprintFromLease was set and the key does not
	// hold Lease's in-flight record, so the fingerprint is unknown.
	FillNoFingerprint
)

func (r FillResult) String() string {
	switch r {
	case FillRefused:
		return "refused"
	case Filled:
		return "filled"
	case FillPresent:
		return "present"
	case FillNoFingerprint:
		return "no_fingerprint"
	}
	return "fill(" + strconv.Itoa(int(r)) + ")"
}

// Fill writes a completed record copied from a durable store, unless the
// key holds a newer completion: see Fill and FillResult. An in-flight
// record of another lease is overwritten, since the key is completed in
// the durable store and that lease can never complete it; its holder's
// next Renew returns idem.ErrLeaseLost. The record's token is f.Token.
func (s *Store) Fill(ctx context.Context, f Fill) (FillResult, error) {
	if f.Token == 0 || f.Token >= 1<<48 {
		return FillRefused, fmt.Errorf("redisstore: fill: token %d outside 1..2^48-1", f.Token)
	}
	fp, lease := string(f.Fingerprint[:]), ""
	if f.FingerprintFromLease {
		fp = ""
	}
	if f.Lease != (idem.LeaseID{}) {
		lease = string(f.Lease[:])
	}
	if f.TTL <= 0 {
		return FillRefused, nil
	}
	ms := max(f.TTL.Milliseconds(), 1)
	s.cache.forget(s.KeyName(f.Key)) // the record is overwritten
	r, err := s.run(ctx, "fill", f.Key, scriptFill, packToken(f.Token), fp, strconv.FormatInt(ms, 10), string(f.Response), lease)
	s.cache.forget(s.KeyName(f.Key)) // and any hint a call in flight set, as Delete does
	if err != nil {
		return FillRefused, err
	}
	switch r.n[0] {
	case 0, 1, 2, 3:
		return [...]FillResult{FillRefused, Filled, FillPresent, FillNoFingerprint}[r.n[0]], nil
	}
	return FillRefused, &idem.StoreError{Op: "fill", Key: f.Key, Err: fmt.Errorf("unexpected fill reply %d", r.n[0])}
}

// RaiseToken makes the token of l, a lease just granted, larger than
// floor, and returns l with its token as it now is. The record keeps its
// lease and its expiry. It returns idem.ErrLeaseLost, and changes nothing,
// when l is no longer the key's live lease.
func (s *Store) RaiseToken(ctx context.Context, l idem.Lease, floor uint64) (idem.Lease, error) {
	if floor >= 1<<48-1 {
		return l, fmt.Errorf("redisstore: raise: floor %d too large for a token", floor)
	}
	r, err := s.run(ctx, "acquire", l.Key, scriptRaise, string(l.ID[:]), strconv.FormatUint(floor, 10))
	if err != nil {
		return l, err
	}
	if r.n[0] != 1 {
		return l, idem.ErrLeaseLost
	}
	l.Token = uint64(r.n[1])
	return l, nil
}
