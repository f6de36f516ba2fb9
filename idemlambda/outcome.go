package idemlambda

import (
	"context"

	"github.com/idemkit/idem/internal/engine"
	"github.com/idemkit/idem/internal/telemetry"
)

// Outcome is what Wrap's handler did with an invocation, or WrapSQS's with
// a record: Config.OnOutcome, SQSConfig.OnOutcome, and the counter
// idem.outcomes (layer "lambda"). idemhttp's and idemgrpc's Outcome have
// the same names and values.
type Outcome string

const (
	OutcomePassedThrough = Outcome(engine.OutcomePassedThrough) // "passed_through": no key, AllowMissingKey: the handler ran unprotected
	OutcomeExecuted      = Outcome(engine.OutcomeExecuted)      // "executed": the handler ran under a lease; its result was stored (a failure to store it is logged)
	OutcomeReplayed      = Outcome(engine.OutcomeReplayed)      // "replayed": the stored result was returned (or ErrResultOmitted, when it was not kept); an SQS record done before, or by an earlier record of its batch
	OutcomeInFlight      = Outcome(engine.OutcomeInFlight)      // "in_flight": *idem.InFlightError (after the wait, if any); an SQS record in flight elsewhere, or whose earlier copy in the batch failed
	OutcomeMismatch      = Outcome(engine.OutcomeMismatch)      // "mismatch": *MismatchError
	OutcomeRejected      = Outcome(engine.OutcomeRejected)      // "rejected": *KeyError (key missing or invalid), *AnonymousError or its 401 (RefuseAnonymous), a Payload that does not encode
	OutcomeStoreError    = Outcome(engine.OutcomeStoreError)    // "store_error": the store failed before the handler ran (*idem.StoreError), or a stored result does not decode as O
	// OutcomeReleased ("released"): the handler ran under a lease and the
	// key was released rather than completed: it returned an error, it
	// panicked, or its result does not encode as JSON. A retry runs the
	// handler again. For WrapSQS, also a record of a FIFO batch that was
	// not run because an earlier record failed.
	OutcomeReleased = Outcome(engine.OutcomeReleased)
	// OutcomeUnsealable ("unsealable"): the key is completed but its
	// stored result is sealed and cannot be opened (idem.ErrUnsealable,
	// logged at ERROR with the key id): the 500 problem
	// ProblemResponseUnreadable or an *idem.SealError; nothing ran,
	// nothing was replayed.
	OutcomeUnsealable = Outcome(engine.OutcomeUnsealable)
)

// layer is idemlambda's idem.layer in telemetry.
const layer = "lambda"

// report counts o in tel (nil: nothing) and calls on (nil: nothing).
func report(ctx context.Context, tel *telemetry.T, on func(context.Context, Outcome), o Outcome) {
	tel.Outcome(ctx, layer, string(o))
	if on != nil {
		on(ctx, o)
	}
}
