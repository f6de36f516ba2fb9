package idemhttp

import "github.com/idemkit/idem/internal/engine"

// Outcome is what the middleware did with a request of a covered method.
// idemgrpc's Outcome has the same names and values.
type Outcome string

const (
	OutcomePassedThrough = Outcome(engine.OutcomePassedThrough) // "passed_through": no key, none required: handler ran unprotected
	OutcomeExecuted      = Outcome(engine.OutcomeExecuted)      // "executed": the handler ran under a lease; its response was stored (a failure to store it is logged)
	OutcomeReplayed      = Outcome(engine.OutcomeReplayed)      // "replayed": the stored response was replayed
	OutcomeInFlight      = Outcome(engine.OutcomeInFlight)      // "in_flight": 409: in flight (after the wait, if any)
	OutcomeMismatch      = Outcome(engine.OutcomeMismatch)      // "mismatch": 422
	OutcomeRejected      = Outcome(engine.OutcomeRejected)      // "rejected": 400, 401 or 413: key missing, invalid or unverified, caller refused, body too large or unreadable
	OutcomeStoreError    = Outcome(engine.OutcomeStoreError)    // "store_error": the store failed or is full (idem.ErrStoreFull): 503, or the handler ran unprotected (FailOpen)
	OutcomeGone          = Outcome(engine.OutcomeGone)          // "gone": the client left before the key was acquired: nothing ran
	// OutcomeReleased ("released"): the handler ran under a lease, and
	// the key was released rather than completed: ShouldStore refused its
	// status (by default a 5xx, 408, 409, 425 or 429), it panicked, or it
	// hijacked the connection. A retry runs the handler again.
	OutcomeReleased = Outcome(engine.OutcomeReleased)
	// OutcomeReplayFailed ("replay_failed"): the key is completed but its
	// stored body could not be read from the blob store: 503 (or an
	// aborted response, when the blob broke off after the header was
	// sent); nothing ran.
	OutcomeReplayFailed = Outcome(engine.OutcomeReplayFailed)
	// OutcomeQuotaExceeded ("quota_exceeded"): a new key past its
	// tenant's Config.Quota: 429 ProblemQuotaExceeded with Retry-After;
	// nothing was claimed and the handler did not run.
	OutcomeQuotaExceeded = Outcome(engine.OutcomeQuotaExceeded)
	// OutcomeUnsealable ("unsealable"): the key is completed but its
	// stored response is sealed and cannot be opened (idem.ErrUnsealable,
	// logged at ERROR with the key id): 500 ProblemResponseUnreadable;
	// nothing ran, nothing was replayed.
	OutcomeUnsealable = Outcome(engine.OutcomeUnsealable)
)
