package idem

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"
)

// Store keeps one record per Key and moves it through the state machine
// described in the package documentation. Every method is one atomic step on
// the store: the record changes in one indivisible operation (a script, a
// statement, a compare-and-set, a conditional write, a critical section),
// whatever reads the store makes before it; each store's doc says what the
// step is and how many round trips it takes. Time is the store's clock: the
// server's where the backend has one, never the caller's; a backend without
// one (DynamoDB) makes the store use the caller's clock, and its doc says
// what that costs.
//
// Implementations are safe for concurrent use. Renew, Complete and Release
// succeed only for the current lease; otherwise they return ErrLeaseLost
// and change nothing. Every method but Delete may be called again with the
// same arguments after a lost reply and then gives the same answer (a
// repeated Delete reports false), as long as nobody else acquired the key
// in between: a Release repeated after another holder took the released
// key answers ErrLeaseLost, although the first call released it (found
// by the linearizability suite, reliability/linearize; the key is
// released either way). Backend failures are returned as *StoreError.
type Store interface {
	// Acquire takes the key when it is absent, released, or its lease has
	// expired, and otherwise reports why not. See Outcome. A store with a
	// bound on what it holds may refuse to take a key: a *StoreError
	// matching ErrStoreFull, with nothing written.
	Acquire(ctx context.Context, req AcquireRequest) (Acquisition, error)

	// Renew extends the lease to ttl from now (store clock).
	Renew(ctx context.Context, l Lease, ttl time.Duration) error

	// Complete stores resp as the key's result, kept for retention, and
	// ends the lease. Repeating a successful Complete with the same resp
	// returns nil; with another resp it returns nil or ErrLeaseLost (the
	// Redis store's answer: its completed record keeps the token, not the
	// lease id, and two leases can share a token after a failover, so it
	// takes a Complete for a repeat only when the record holds that very
	// response) and changes nothing. The
	// whole of resp is kept, Blob included (Response.AppendBinary keeps
	// it, and the stores of this module store that encoding): a store that
	// kept responses in a format of its own and dropped Blob would replay
	// an empty body, so it must not be used with a blob store
	// (idemhttp.Config.Blobs); without one, large bodies are not stored.
	Complete(ctx context.Context, l Lease, resp *Response, retention time.Duration) error

	// Release ends the lease without a result: the key becomes absent, and
	// the next Acquire gets a larger fencing token.
	Release(ctx context.Context, l Lease) error

	// Get returns the record for key. A missing or expired record is
	// (Record{}, false, nil): a miss is not an error.
	Get(ctx context.Context, key Key) (Record, bool, error)

	// Delete removes the record whatever its state (an operator's purge).
	// It reports whether a record was there. It drops the key's token
	// history: the next token is again based on the clock alone.
	Delete(ctx context.Context, key Key) (bool, error)
}

// AcquireRequest is the input of Store.Acquire.
type AcquireRequest struct {
	Key         Key
	Fingerprint Fingerprint
	// LeaseID is chosen by the caller with NewLeaseID; the zero LeaseID is
	// refused. Repeating Acquire with the same LeaseID while that lease
	// lives returns the same lease (with the time it has left).
	LeaseID LeaseID
	// TTL is the lease duration. It must be at least one millisecond.
	TTL time.Duration
}

// Validate reports a request no store accepts: a TTL under a millisecond
// or the zero LeaseID. Stores call it before doing anything.
func (r AcquireRequest) Validate() error {
	if r.TTL < time.Millisecond {
		return fmt.Errorf("idem: lease TTL %v is shorter than 1ms", r.TTL)
	}
	if r.LeaseID == (LeaseID{}) {
		return errors.New("idem: zero LeaseID; use NewLeaseID")
	}
	return nil
}

// Outcome is the answer of Acquire.
type Outcome uint8

const (
	// NoOutcome is the zero Outcome: no answer, as in the Acquisition
	// that comes with an error. It prints as "none".
	NoOutcome Outcome = iota
	// Acquired: the caller holds the key and must Complete or Release it.
	Acquired
	// Replay: the key completed with the same fingerprint; the stored
	// response is returned.
	Replay
	// InFlight: another holder has a live lease on the key.
	InFlight
	// Mismatch: the key is in flight or completed with another fingerprint.
	Mismatch
)

func (o Outcome) String() string {
	switch o {
	case NoOutcome:
		return "none"
	case Acquired:
		return "acquired"
	case Replay:
		return "replay"
	case InFlight:
		return "in_flight"
	case Mismatch:
		return "mismatch"
	}
	return "outcome(" + strconv.Itoa(int(o)) + ")"
}

// Acquisition is the result of Store.Acquire.
type Acquisition struct {
	Outcome Outcome
	// Lease is set when Outcome is Acquired.
	Lease Lease
	// Response is set when Outcome is Replay.
	Response *Response
	// RetryAfter is set when Outcome is InFlight: the time until the
	// current lease ends on the store's clock. It is an upper bound, the
	// wait for a holder that crashed (the lease, 30s by default): a live
	// holder usually completes or releases long before, and its renewals
	// push the end further. Callers that retry should poll sooner and use
	// RetryAfter as a limit; idemhttp and idemgrpc answer Retry-After: 1
	// (and, with Config.Wait, poll 5 ms to 250 ms apart).
	RetryAfter time.Duration
}

// Lease is a held key. Token is the fencing token: it strictly increases
// per key across every acquisition, takeover and release, so a system of
// record that remembers the largest token it has seen can refuse writes from
// a holder that outlived its lease.
type Lease struct {
	Key   Key
	ID    LeaseID
	Token uint64
	// TTL is the lease time left when the store answered: the full
	// duration for a new lease (a little less where the store measures it at
	// the end of its step, as PostgreSQL does after waiting on a lock), the
	// time left for a repeated Acquire.
	TTL time.Duration
}

// State is the state of a stored record. The zero State, of no record
// (the zero Record), prints as "none".
type State uint8

const (
	// StateInFlight: a holder has a live lease.
	StateInFlight State = iota + 1
	// StateCompleted: a response is stored and is replayed until retention
	// ends.
	StateCompleted
	// StateReleased: the last holder released the key without a result.
	// For Acquire this is the same as absent; the record only keeps the
	// last fencing token, for a short while.
	StateReleased
)

func (s State) String() string {
	switch s {
	case 0:
		return "none"
	case StateInFlight:
		return "in_flight"
	case StateCompleted:
		return "completed"
	case StateReleased:
		return "released"
	}
	return "state(" + strconv.Itoa(int(s)) + ")"
}

// Record is a stored record as Store.Get returns it.
type Record struct {
	State       State
	Token       uint64
	Fingerprint Fingerprint
	// LeaseID is the holder's lease id when State is StateInFlight.
	LeaseID LeaseID
	// TTL is the time until the record expires: the lease for an in-flight
	// record, the retention for a completed one.
	TTL time.Duration
	// Response is the stored response when State is StateCompleted.
	Response *Response
	// Size is the stored size of the record's value in bytes, when the
	// store knows it.
	Size int
}
