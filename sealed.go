package idem

import (
	"bytes"
	"errors"
	"fmt"
	"sync"
)

// Sealer seals stored responses at rest: it encrypts and authenticates
// each one with an AEAD under a key it names, so that whoever reads the
// store (a replica, a backup, MONITOR, a dump) sees no status, header or
// body, and a sealed response altered, or copied under another key, is
// refused. Package seal implements it with a key ring of AES-256-GCM keys
// (seal.Ring); package seal/awskms with data keys from AWS KMS. Set it in
// Config.Seal. Implementations are safe for concurrent use.
type Sealer interface {
	// Seal appends to dst the sealed form of plaintext, bound to the
	// associated data ad, and returns the extended slice. Its first byte
	// must be SealedMark. dst and plaintext do not overlap.
	Seal(dst, plaintext, ad []byte) ([]byte, error)

	// Open appends to dst the plaintext of sealed, a value Seal made with
	// the same ad, and returns the extended slice; any other value (altered,
	// truncated, sealed under another ad, or under a key the Sealer does not
	// hold) is an error, which should name the key id, never key material.
	// dst and sealed do not overlap.
	Open(dst, sealed, ad []byte) ([]byte, error)

	// KeyID returns the id of the key that sealed a value, as the value
	// says it (for logs: a value that does not open names a key all the
	// same), and false when the value does not say one.
	KeyID(sealed []byte) (string, bool)
}

// SealedMark is the first byte of every sealed value. No clear record
// starts with it: the first byte of the response encoding holds its
// version in bits 5-7, and the version that would make it 0xFF is reserved
// (see Response.AppendBinary). A store's value that starts with it is kept
// sealed, as it is, by UnmarshalBinary, and opened by the Guard.
const SealedMark = 0xFF

// ErrUnsealable reports a completed record whose sealed response cannot be
// opened: altered, sealed under a key id the Sealer no longer holds, bound
// to another key, or read by a Guard without a Sealer. The work ran; its
// result cannot be read. It is never replayed and never run again for the
// key: callers answer that the work ran and its result cannot be read
// (idemhttp: problem urn:idem:problem:response-unreadable). Errors of type
// *SealError match it.
var ErrUnsealable = errors.New("idem: sealed response cannot be opened")

// SealError is the error of a completed record whose sealed response does
// not open.
type SealError struct {
	Key Key
	// KeyID is the id of the key the record says sealed it ("" when it
	// says none it can be trusted for).
	KeyID string
	// Err is the Sealer's error (or, without a Sealer, a sentence saying
	// so).
	Err error
}

func (e *SealError) Error() string {
	id := e.KeyID
	if id == "" {
		id = "unknown"
	}
	return fmt.Sprintf("idem: sealed response of %s (key id %s) cannot be opened: %v", e.Key, id, e.Err)
}

func (e *SealError) Unwrap() error { return e.Err }

// Is makes errors.Is(err, ErrUnsealable) true.
func (e *SealError) Is(target error) bool { return target == ErrUnsealable }

// recordADTag starts the associated data of a sealed record: the tag, then
// the record's 16-byte Key and its 16-byte Fingerprint.
const recordADTag = "idem/record/v1\x00"

const recordADLen = len(recordADTag) + len(Key{}) + len(Fingerprint{})

// recordAD returns the associated data that binds a sealed record to its
// key and fingerprint.
func recordAD(key Key, fp Fingerprint) [recordADLen]byte {
	var ad [recordADLen]byte
	n := copy(ad[:], recordADTag)
	n += copy(ad[n:], key[:])
	copy(ad[n:], fp[:])
	return ad
}

// errNoSealer is SealError.Err for a sealed record read by a Guard, or
// given to OpenResponse, without a Sealer.
var errNoSealer = errors.New("the record is sealed and the Guard has no Config.Seal (nil Sealer); set the Sealer, with the key that sealed it, to read it")

// OpenResponse opens resp, a response read with Store.Get for key, whose
// record holds the fingerprint fp: a sealed one (Response.Sealed) is
// opened with s, bound to key and fp as the Guard sealed it; a clear one
// (or nil) is returned as it is. A sealed response that does not open
// (altered, under a key id s does not hold, copied from another key or
// fingerprint, or s nil) is a *SealError (ErrUnsealable). The Guard opens
// what it replays itself; this is for readers of Store.Get (inspect, an
// operator's tools).
func OpenResponse(s Sealer, key Key, fp Fingerprint, resp *Response) (*Response, error) {
	if !resp.Sealed() {
		return resp, nil
	}
	if s == nil {
		return nil, &SealError{Key: key, Err: errNoSealer}
	}
	ad := recordAD(key, fp)
	plain, err := s.Open(nil, resp.sealed, ad[:])
	if err == nil && len(plain) > 0 && plain[0] == SealedMark {
		err = corrupt("an opened record is sealed again")
	}
	var out *Response
	if err == nil {
		out = new(Response)
		err = out.decodeClear(plain, true)
	}
	if err != nil {
		id, _ := s.KeyID(resp.sealed)
		return nil, &SealError{Key: key, KeyID: id, Err: err}
	}
	return out, nil
}

// sealMemoSize is how many (clear encoding, sealed value) pairs an
// attempt's sealing state keeps.
const sealMemoSize = 4

// sealState is the sealing of one attempt's stored responses: the Sealer,
// the record's associated data, and a memo so that the same clear encoding
// seals to the same bytes every time it is encoded (a completion resent by
// CompleteRetry, a store encoding twice, tieredstore's CompleteTx then
// Relay), with random nonces all the same. Responses that share it may be
// encoded concurrently.
type sealState struct {
	s  Sealer
	ad [recordADLen]byte

	mu   sync.Mutex
	memo [sealMemoSize]struct{ clear, sealed []byte }
	next int
	// last is the response sealed last and lastSealed its sealed form:
	// the same *Response encoded again (the store's write after the
	// Guard's own sealing, a completion resent) is not encoded again. A
	// copy of it (a store cutting the body) is another pointer and goes
	// through the memo.
	last       *Response
	lastSealed []byte
}

// sealedAgain returns the sealed form of r when r is the response sealed
// last, nil otherwise.
func (st *sealState) sealedAgain(r *Response) []byte {
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.last == r {
		return st.lastSealed
	}
	return nil
}

// seal returns the sealed form of clear, r's clear encoding (which seal
// may keep). The result is shared: callers copy it.
func (st *sealState) seal(r *Response, clear []byte) ([]byte, error) {
	st.mu.Lock()
	defer st.mu.Unlock()
	for _, m := range st.memo {
		if m.sealed != nil && bytes.Equal(m.clear, clear) {
			st.last, st.lastSealed = r, m.sealed
			return m.sealed, nil
		}
	}
	sealed, err := st.s.Seal(nil, clear, st.ad[:])
	if err != nil {
		return nil, fmt.Errorf("idem: sealing a response: %w", err)
	}
	if len(sealed) == 0 || sealed[0] != SealedMark {
		return nil, fmt.Errorf("idem: sealing a response: the Sealer (%T) made a value that does not start with SealedMark (0x%02X)", st.s, SealedMark)
	}
	st.memo[st.next] = struct{ clear, sealed []byte }{clear, sealed}
	st.next = (st.next + 1) % sealMemoSize
	st.last, st.lastSealed = r, sealed
	return sealed, nil
}
