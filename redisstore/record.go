package redisstore

import (
	"encoding/binary"
	"fmt"

	"github.com/idemkit/idem"
)

// Record values, as the scripts write them (see scripts/acquire.lua):
//
//	'F' token(6) fingerprint(16) lease id(16)   in flight
//	'C' token(6) fingerprint(16) response        completed
//	'R' token(6)                                 released
const (
	tokenEnd    = 1 + 6
	fpEnd       = tokenEnd + 16
	inFlightLen = fpEnd + 16
)

func decodeRecord(v []byte) (idem.Record, error) {
	if len(v) < tokenEnd {
		return idem.Record{}, fmt.Errorf("%w: %d-byte value", idem.ErrCorrupt, len(v))
	}
	rec := idem.Record{Token: unpackToken(v[1:tokenEnd]), Size: len(v)}
	switch {
	case v[0] == 'F' && len(v) == inFlightLen:
		rec.State = idem.StateInFlight
		copy(rec.Fingerprint[:], v[tokenEnd:fpEnd])
		copy(rec.LeaseID[:], v[fpEnd:])
	case v[0] == 'C' && len(v) > fpEnd:
		rec.State = idem.StateCompleted
		copy(rec.Fingerprint[:], v[tokenEnd:fpEnd])
		rec.Response = new(idem.Response)
		if err := rec.Response.UnmarshalBinary(v[fpEnd:]); err != nil {
			return idem.Record{}, err
		}
	case v[0] == 'R' && len(v) == tokenEnd:
		rec.State = idem.StateReleased
	default:
		return idem.Record{}, fmt.Errorf("%w: unknown %d-byte value of kind %q", idem.ErrCorrupt, len(v), v[0])
	}
	return rec, nil
}

func unpackToken(b []byte) uint64 {
	var p [8]byte
	copy(p[2:], b)
	return binary.BigEndian.Uint64(p[:])
}
