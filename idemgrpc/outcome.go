package idemgrpc

import "github.com/idemkit/idem/internal/engine"

// Outcome is what the interceptor did with a call of a covered method.
// idemhttp's Outcome has the same names and values.
type Outcome string

const (
	OutcomePassedThrough = Outcome(engine.OutcomePassedThrough) // "passed_through": no key, none required: handler ran unprotected
	OutcomeExecuted      = Outcome(engine.OutcomeExecuted)      // "executed": the handler ran under a lease; its outcome was stored (a failure to store it is logged)
	OutcomeReplayed      = Outcome(engine.OutcomeReplayed)      // "replayed": the stored outcome was replayed
	OutcomeInFlight      = Outcome(engine.OutcomeInFlight)      // "in_flight": Aborted: in flight (after the wait, if any)
	OutcomeMismatch      = Outcome(engine.OutcomeMismatch)      // "mismatch": FailedPrecondition
	OutcomeRejected      = Outcome(engine.OutcomeRejected)      // "rejected": InvalidArgument (key missing or invalid), or Internal (no fingerprint)
	OutcomeStoreError    = Outcome(engine.OutcomeStoreError)    // "store_error": the store failed: Unavailable, or the handler ran unprotected (FailOpen); or a stored outcome could not be decoded
	OutcomeGone          = Outcome(engine.OutcomeGone)          // "gone": the client left before the key was acquired: nothing ran
	// OutcomeReleased ("released"): the handler ran under a lease, and
	// the key was released rather than completed: ShouldStore refused its
	// code (by default a transient one), it panicked, or its outcome could
	// not be encoded. A retry runs the handler again.
	OutcomeReleased = Outcome(engine.OutcomeReleased)
	// OutcomeUnsealable ("unsealable"): the key is completed but its
	// stored outcome is sealed and cannot be opened (idem.ErrUnsealable,
	// logged at ERROR with the key id): DataLoss, reason
	// ReasonUnsealable; nothing ran, nothing was replayed.
	OutcomeUnsealable = Outcome(engine.OutcomeUnsealable)
)
