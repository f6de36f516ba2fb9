// Package idemmsg gives message consumers at-most-once handling of each
// completed message key on top of a broker's at-least-once delivery (the
// effects themselves are at-least-once with fencing; see below). It is
// broker-neutral: a Deduplicator decides, per delivery, what the consumer
// should tell its broker; the sub-packages (redisstream, ...) wire it to one
// broker.
//
// A delivery is identified by a key: the broker's message id (an AMQP
// message-id, a Nats-Msg-Id, a stream entry id, a Kafka header) or the
// result of a user function. Keys are scoped by Config.Namespace (the
// stream or queue, and the consumer group) and derived with
// idem.Scope{Method: "msg", Route: Namespace}.Key. Content is not hashed by
// default, since two identical messages can be two legitimate operations;
// set Config.Fingerprint to refuse a key reused for other content.
//
// # Outcomes and broker actions
//
//	Outcome       meaning                                       broker action
//	Executed      the handler ran and its success is recorded   ack
//	Replayed      the key already completed; handler not run    ack
//	InFlight      another consumer holds the key's lease        nack / requeue after Result.RetryAfter
//	Released      the handler returned an error; key released   nack with backoff (redelivery retries it)
//	DeadLettered  the handler failed on the MaxFailures-th      ack, or route to the broker's
//	              delivery, or an earlier delivery of the key   dead-letter destination
//	              was dead-lettered; the error is kept
//
// Handle returns an error with NoOutcome (the zero Outcome) when it could
// not decide: an invalid key (idem.ErrInvalidKey), a key reused with
// another fingerprint (idem.ErrMismatch), a completed key whose sealed
// result cannot be opened (*idem.SealError, idem.ErrUnsealable: see
// Sealed results), all three permanent, or a store failure
// (*idem.StoreError: the handler did not run; leave the message for
// redelivery). The adapters settle the permanent ones as DeadLettered:
// acknowledged, or routed to their dead-letter destination with the
// error's text. It returns an error with an Outcome when the outcome holds
// but the store could not record it (for example Executed, with the
// completion lost): act on the Outcome and log the error.
//
// # Stored outcomes
//
// The completed record of a key holds an idem.Response. An executed key
// stores Status 200 (StatusExecuted) and nothing else. A dead-lettered key
// stores Status 500 (StatusDeadLettered), the header
// "Idem-Outcome: dead-lettered" and the handler's error text as the body
// (at most MaxErrorText bytes), so a later delivery tells DeadLettered
// (with the kept error in Result.Err) from Replayed.
//
// # Sealed results
//
// With Config.Seal the stored results are sealed at rest (see idem's doc,
// Sealed records). A completed key whose sealed result cannot be opened
// (altered in the store, under a key id no longer in the ring, read
// without a Sealer) is never handled again, and is not left to be
// redelivered for ever either: Handle (and HandleBatch) log it at ERROR
// to Config.Logger, with the key and the key id, never content, count it
// as the outcome "unsealable", and return NoOutcome with the
// *idem.SealError. Whether the key executed or was dead-lettered cannot
// be read; the adapters settle it as DeadLettered (permanent, as a
// mismatch): it reaches the dead-letter destination, when there is one,
// for an operator to look at, and is acknowledged otherwise. With
// HandleBatch InOrder it does not stop the batch.
//
// # Failure counting
//
// Failures are counted by the broker: Delivery.Attempt is its delivery
// count (1 for the first delivery). When the handler fails and Attempt is
// at least Config.MaxFailures, the failure is recorded as the key's result.
// Nothing is counted in the store, so an adapter without a delivery count
// must supply its own (or pass 1, and messages are then never
// dead-lettered unless MaxFailures is 1).
//
// # Guarantees and their limits
//
//   - The handler runs at most once per completed key within the
//     retention (Config.Retention, default 24h): every later delivery of
//     the key is Replayed (or DeadLettered).
//   - While the handler runs, its lease is renewed (idem.Guard does it),
//     and no other consumer runs the handler for the same key. The
//     handler's context carries the lease and its fencing token
//     (idem.LeaseFromContext) and is cancelled if the lease is lost.
//   - A consumer that crashes after its handler's side effect but before
//     the result is recorded leaves the key to be taken over after the
//     lease: the handler may run again. Effects are therefore
//     at-least-once with fencing, not exactly-once: have the system of
//     record refuse a fencing token lower than the last one it accepted.
//     (Committing the effect in the same transaction as the completion,
//     pgstore.CompleteTx or tieredstore.CompleteTx, is exactly-once; Handle does not offer it: use
//     idem.Guard.Begin for that.)
//   - A consumer that crashes after the result is recorded but before the
//     ack causes a redelivery, which is answered Replayed and acked.
//   - When the store is unreachable the handler is not run (fail closed).
//     When it becomes unreachable after a handler ran, the result is
//     recorded once it answers again, within the lease left
//     (Config.CompleteRetry, default the lease): the message is
//     acknowledged then, and the handler does not run again. Only an
//     outage longer than that leaves the key to be taken over, as after a
//     crash.
//   - After retention ends, the key is new again.
//
// # Batches
//
// A broker hands a consumer several messages per fetch. HandleBatch takes
// them in one call: with a store that implements idem.BatchStore, their
// keys are acquired in one store step, the handlers run one at a time or
// Concurrency at a time, as with Handle, and the results of finished
// handlers are recorded in one step per group, then handed to the adapter
// to acknowledge together. A group is flushed when the whole batch is
// decided or after FlushInterval (default 2ms), so a slow handler never
// holds up the others. Each delivery's outcome is the one Handle would give
// it, except for a key repeated within a batch: its later deliveries are
// decided once the first is recorded (Replayed, usually), where Handle run
// concurrently would answer InFlight. The leases of a whole batch are taken
// at once, so a consumer that crashes holds all of them until they expire.
// Every adapter has a Batch setting that uses it.
//
// # Adapters and their shared tests
//
// The adapters, one sub-package per broker, each run a consumer loop
// with their broker's own client and acknowledgement rules. Their Run
// loops handle one message at a time, in delivery order, unless a
// Concurrency setting (all but kafka, which keeps per-partition order)
// lets several handlers run at once. Package adaptertest holds the
// scenarios every adapter must pass against its real broker; a new adapter
// runs them through an adaptertest.Harness.
package idemmsg
