package idem

import (
	"context"
	"time"
)

// BatchStore is an optional extension of Store: Acquire, Complete and
// Release for many keys at once, in fewer round trips, or less waiting,
// than one call per key (each store's batch methods say how: one script,
// statement or pipeline for the batch, or its keys' calls side by side).
// Use it through the package functions AcquireMany, CompleteMany and
// ReleaseMany, which fall back to the single-key calls for a store that
// does not implement it.
//
// The contract, besides Store's:
//
//   - Answers per key. Each method returns one answer per input, in input
//     order, and each answer is the one the single-key call would have
//     given (Acquisition or error, ErrLeaseLost, *StoreError; mismatch, in
//     flight, takeover, replay and the repeated call after a lost reply
//     included).
//   - Atomic per key, not across keys. Each key's transition is atomic as
//     the single-key call's is; the batch is not a transaction. Other
//     callers may see some keys of a batch changed and others not yet.
//   - Order. The answers are those of the single-key calls made one after
//     the other in input order, so a key that appears twice in one batch
//     is handled twice, the second time after the first: an AcquireMany
//     with two requests for one key gives the second one InFlight (or
//     Acquired again with the same LeaseID, or Mismatch), as two calls in
//     a row would. (Keys in different Redis Cluster slots go out in
//     parallel; their relative order does not change any answer.)
//   - Partial failures. A failure may affect some keys and not others (on
//     Redis Cluster, one node's group can fail alone): each failed key
//     gets its own *StoreError, with the key and the single call's Op
//     ("acquire", "complete", "release"). A key whose answer is an error
//     may have been changed anyway (a lost reply), exactly as with a
//     single call, and repeating the same batch (or the same request
//     alone) is safe. An invalid request (Validate, a nil Response, a
//     retention under a millisecond) fails alone and changes nothing.
//   - A cancelled context fails every key with a *StoreError wrapping the
//     context's error, and nothing is sent.
//   - An empty batch returns an empty answer and sends nothing.
type BatchStore interface {
	Store

	// AcquireMany is Acquire for each request. The answer has
	// len(reqs) entries.
	AcquireMany(ctx context.Context, reqs []AcquireRequest) []AcquireResult

	// CompleteMany is Complete for each completion: the answer has
	// len(cs) entries, nil where the key was completed (now, or by this
	// lease before).
	CompleteMany(ctx context.Context, cs []Completion) []error

	// ReleaseMany is Release for each lease: the answer has len(leases)
	// entries, nil where the key was released (now, or by this lease
	// before).
	ReleaseMany(ctx context.Context, leases []Lease) []error
}

// AcquireResult is one answer of AcquireMany: what Acquire would have
// returned.
type AcquireResult struct {
	Acquisition
	Err error
}

// Completion is one input of CompleteMany: Complete's arguments.
type Completion struct {
	Lease     Lease
	Response  *Response
	Retention time.Duration
}
