package idem

import (
	"errors"
	"fmt"
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
