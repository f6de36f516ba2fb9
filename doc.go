// Package idem gives HTTP APIs and message consumers exactly-once effects on
// top of at-least-once delivery, within the limits stated below.
//
// Retries (clients, proxies, gateways) and at-least-once brokers deliver the
// same operation more than once. idem recognises the repeat by an
// idempotency key, makes sure the work runs once, and replays the stored
// result to every repeat.
//
// # The state machine
//
// Each scoped key (Scope.Key: tenant, method, route and client key hashed
// into a Key) has one record, which moves through these states. Every arrow
// is one atomic step on the store (each store's package doc says what the
// step is there and how many round trips it takes: mostly one).
//
//	absent ──Acquire──▶ in_flight(lease id, token, fingerprint)   [expires after the lease]
//	in_flight ──Complete(lease)──▶ completed(response, token, fingerprint)  [expires after retention]
//	in_flight ──Release(lease)───▶ released(token)    (absent to Acquire; keeps the last token)
//	in_flight ──Renew(lease)─────▶ in_flight          (lease extended from now)
//	in_flight, lease expired ──Acquire──▶ in_flight(new lease id, larger token)   [takeover]
//
// Acquire answers with exactly one Outcome: Acquired (with a Lease),
// Replay (with the stored Response), InFlight (with the time until the
// holder's lease ends) or Mismatch (the key was used with a different
// Fingerprint). Renew, Complete and Release check the lease id (and, for a
// repeated call, the token): a holder whose lease ended can never extend,
// overwrite or release the record of the holder after it; it gets
// ErrLeaseLost and the store changes nothing.
//
// # Fencing tokens
//
// Every acquisition gets a fencing token, readable in the work's context
// with LeaseFromContext. It strictly increases per key across takeovers and
// releases, and keeps increasing after the record has expired. Each store
// draws it in its own way (its package doc says how): from the clock and
// the key's last token (Redis, memory: the larger of the previous token
// plus one and the store clock in milliseconds, so that it also survives a
// Redis failover that lost the record, as long as the clock does not step
// back), or from a counter in the database (the SQL stores, DynamoDB).
// Tokens of different stores are not comparable. Pass it to the system of
// record and have it refuse a token lower than the last one it accepted:
// that stops a paused or partitioned holder whose lease ended (Kleppmann's
// fencing).
//
// # Leases and retention
//
// Two clocks: a short lease (Config.Lease, default 30s) bounds how long a
// crashed holder blocks its key; Guard renews it every third of the lease
// while work runs (short work pays no renewal), and cancels the work's
// context with cause ErrLeaseLost if renewal finds the lease gone. A long
// retention (Config.Retention, default 24h) bounds how long a completed
// result is replayed. Both are measured on the store's clock.
//
// # Guarantees and their limits
//
//   - At most one live lease per key at any moment of the store's clock, on
//     every store (on DynamoDB, where that clock is each caller's, up to
//     the skew between the callers' clocks). Work that finishes within its
//     lease and completes is run once, and its result is replayed to every
//     repeat with the same fingerprint until retention ends.
//   - Work whose holder crashes, or loses its lease, before Complete may run
//     again after the lease ends: that is at-least-once with fencing, not
//     exactly-once. Only an effect committed in the same transaction as the
//     completion (the CompleteTx of the stores that have one) is
//     exactly-once; any other effect should check the fencing token.
//   - Redis replicates asynchronously: a failover can lose a record written
//     just before it, and the operation may then run again.
//   - After retention ends, the key is new again.
//   - When the store is unreachable, Acquire fails and the work is not run
//     (fail closed).
//
// # Stored responses
//
// Responses are stored in a compact binary form (Response.AppendBinary);
// bodies of at least 1 KiB are compressed with zstd when that saves an
// eighth. Bodies over Config.MaxResponseSize (default 1 MiB) are not
// stored: the key is still completed, and repeats get the status and
// headers with Response.BodyOmitted set, never a second execution.
//
// A body too large for the record can live in a BlobStore instead
// (idemhttp.Config.Blobs streams it there as the handler writes it). The
// blob is written whole before Complete, under a name that holds the
// store's namespace (Namespacer), the record key's digest and the fencing
// token (NewBlobName), and the record keeps a BlobRef: name, size and
// SHA-256. Stores keep the reference as part of the encoded response;
// none of them reads blobs. OpenBlob checks size and digest as a replay
// reads, so a missing or corrupt blob is an error, never an empty or
// short body. Blobs whose attempt never completed, and blobs of expired
// records, are removed by a sweep (blobstore.Sweep), which judges only the
// blobs of its own store's namespace.
//
// # Sealed records
//
// With Config.Seal (a Sealer: seal.Ring, or KMS data keys), the Guard seals
// every response it stores: status, headers and body (or blob reference)
// are encrypted and authenticated, bound by the associated data
// "idem/record/v1\x00" ‖ the 16-byte Key ‖ the 16-byte Fingerprint, so a
// record copied under another key, or given another fingerprint, does not
// open. Stores never see a key: they keep the sealed value (first byte
// SealedMark) as they keep any encoding, and read it back as a carrier
// (Response.Sealed) that the Guard opens in Begin, BeginMany and Do, and
// OpenResponse opens for readers of Store.Get. A sealed record that does
// not open (altered, under a key id the Sealer no longer holds, or read
// without a Sealer) is never replayed and never run again: a *SealError
// (ErrUnsealable), outcome "unsealable". Clear records written before
// sealing was turned on still replay; Config.SealOpenOnly stores new records
// in clear while sealed ones still open.
package idem
