package idem

import (
	"errors"
	"fmt"
	"time"
)

// Sentinel errors. Callers branch on them with errors.Is; the messages are
// not part of the API.
var (
	// ErrInvalidKey reports a client key that is empty, longer than 255
	// bytes, or holds bytes outside printable ASCII.
	ErrInvalidKey = errors.New("idem: invalid idempotency key")

	// ErrMissingKey reports a request that carries no idempotency key:
	// idemhttp.ParseKey and idemgrpc.ParseKey return it, wrapped, when no
	// key was sent. It is not an ErrInvalidKey.
	ErrMissingKey = errors.New("idem: no idempotency key")

	// ErrLeaseLost reports that a lease is no longer the current one: it
	// expired, was taken over, or was already released. The store changed
	// nothing.
	ErrLeaseLost = errors.New("idem: lease lost")

	// ErrInFlight reports that another holder has the key. Errors of type
	// *InFlightError match it and carry the time until that lease ends.
	ErrInFlight = errors.New("idem: operation in flight")

	// ErrMismatch reports that the key was used before with a different
	// fingerprint (a different request under the same key).
	ErrMismatch = errors.New("idem: idempotency key reused with a different request")

	// ErrCorrupt reports a stored record that cannot be decoded. It arrives
	// wrapped in a *StoreError.
	ErrCorrupt = errors.New("idem: corrupt record")

	// ErrNotReplicated reports a completion that the store wrote but could
	// not confirm as durable as asked (redisstore's Options.WaitReplicas:
	// fewer replicas acknowledged it in time). The record is completed and
	// replays; only its survival of a failover is in doubt. It arrives
	// wrapped in a *StoreError.
	ErrNotReplicated = errors.New("idem: completion written but not acknowledged by enough replicas")

	// ErrStoreFull reports an Acquire that the store refused because it
	// holds as much as it is allowed to (memstore's Options.MaxBytes). It
	// is refused only where a lease would be granted; nothing was written
	// and the work has not run. Keys that are in flight or completed still
	// answer as usual: their repeats are replayed, and their holders renew,
	// complete and release. It arrives wrapped in a *StoreError.
	ErrStoreFull = errors.New("idem: store full")

	// ErrMaxExecution is the cause (context.Cause) with which idemhttp and
	// idemgrpc cancel a handler's context once it has run for their
	// Config.MaxExecution.
	ErrMaxExecution = errors.New("idem: the handler ran past Config.MaxExecution")

	// ErrStopped is the cause (context.Cause) with which idemhttp and
	// idemgrpc cancel a handler's context when their Config.StopContext is
	// done: the server is stopping.
	ErrStopped = errors.New("idem: the server stopped (Config.StopContext)")
)

// StoreError is a failure of the backing store: a network error, a timeout,
// a server error or a corrupt record. When Acquire fails with a StoreError,
// the work has not been run.
type StoreError struct {
	Op  string // "acquire", "renew", "complete", "release", "get" or "delete"
	Key Key
	Err error
}

func (e *StoreError) Error() string {
	return fmt.Sprintf("idem: store %s %s: %v", e.Op, e.Key, e.Err)
}

func (e *StoreError) Unwrap() error { return e.Err }

// InFlightError is returned by Guard.Do when another holder has the key.
type InFlightError struct {
	// RetryAfter is the time until the current holder's lease ends, as the
	// store saw it: an upper bound (Acquisition.RetryAfter). The holder may
	// complete, renew or release before then, usually long before; retry
	// sooner (the HTTP layer says Retry-After: 1) and give up after it.
	RetryAfter time.Duration
}

func (e *InFlightError) Error() string {
	return fmt.Sprintf("idem: operation in flight, lease ends in %v", e.RetryAfter)
}

// Is makes errors.Is(err, ErrInFlight) true.
func (e *InFlightError) Is(target error) bool { return target == ErrInFlight }
