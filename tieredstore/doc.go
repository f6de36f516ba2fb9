// Package tieredstore is an idem.Store with Redis for speed and PostgreSQL
// for truth: a completion table that is also a transactional outbox.
// Leases, in-flight answers and replays are on Redis (a
// redisstore.Store); a completion commits in PostgreSQL, in the caller's
// own transaction when it uses CompleteTx or BeginFunc, and is then copied
// ("relayed") to Redis.
//
// # The invariant
//
// One committed effect per key in PostgreSQL, whatever Redis does. Redis
// may lose any record (a failover without WAIT, a restart without
// persistence, FLUSHALL, an eviction): then a key that completed may be
// granted again and its work may run again. What cannot happen is that a
// second run commits. The completion is one statement in the business
// transaction:
//
//	INSERT INTO idem_completions (namespace, key, token, lease_id, fingerprint, response, ...)
//	ON CONFLICT (namespace, key) DO UPDATE ... WHERE <the row has expired> AND <its token is smaller>
//
// The primary key (namespace, key) admits one completion per key: a
// second transaction completing the key either waits for the first one's
// commit and then changes nothing, or, if the first rolled back, inserts.
// The statement does not consult Redis; its verdict does not depend on
// what Redis remembers. When it changes nothing, CompleteTx reads the row
// that won (a new statement, whose snapshot includes it) and returns an
// *AlreadyCompletedError carrying its response; the caller rolls back, so
// the second run's business writes are undone, and answers with the first
// commit's response as a replay. BeginFunc does all of that and returns
// an idem.Result with Replayed set. Before returning, the store writes the
// first completion back into Redis ("refill"), so the next repeat is a
// replay from Redis. If the stored completion has another fingerprint,
// the error matches idem.ErrMismatch instead (the key was reused for a
// different request) and carries no response.
//
// An expired completion (its retention over) stays in the table until the
// reaper deletes it, Options.ReapGrace (an hour) later; a new completion
// of the key replaces it only if its fencing token is larger. So committed
// tokens per key strictly increase, whatever Redis issued: a completion
// with a token that is not larger fails with a *StaleTokenError.
//
// This needs READ COMMITTED (PostgreSQL's default) for the business
// transaction: under REPEATABLE READ or SERIALIZABLE the conflict is a
// serialization error instead (still nothing commits twice, but the caller
// gets an error, not the replay).
//
// # The first-execution path
//
// Each Redis step below is one script on the Redis store's Lua path; on
// its native path (redisstore.PathNative) it is the same transition in
// plain commands, at the cost that redisstore's doc gives.
//
// Acquire is one Redis script. CompleteTx is one Redis script (Hold: the
// lease is checked and extended by its TTL, and its fingerprint read, so
// no takeover happens before the commit) and one PostgreSQL statement in
// the caller's transaction. After the commit, one Redis script copies the
// completion to Redis. So the only PostgreSQL work idem adds to a first
// execution is one statement inside the business transaction: no commit,
// no WAL flush of its own. (Sending that statement and the COMMIT in one
// round trip, with a statement that raises an error when it changes
// nothing, was tried: on loopback it made no measurable difference, so the
// store keeps the plain order; on a network it would save one round trip.)
//
// Replays and in-flight answers are Redis alone, as with redisstore.
//
// # The relay and the outbox
//
// Every completion row is written with relayed = false, which puts it in
// the outbox (a partial index over the rows not yet relayed): the
// completions table is its own outbox, written in the business
// transaction. After the commit, BeginFunc (or the caller, with Relay)
// copies the completion to Redis synchronously: one script that turns the
// lease's in-flight record into the completed one. When that works, the
// row is marked relayed in the background, in batches (one UPDATE per 50
// ms, without waiting for its WAL flush: a mark lost in a crash only makes
// the row be copied once more, and copies are idempotent).
//
// When the synchronous copy fails (Redis unreachable), or never happens
// (the process died after COMMIT, or the caller did not call Relay), the
// row stays in the outbox. A background loop (started by New, stopped by
// Close) polls it every Options.RelayInterval (1 s) for rows older than
// Options.RelayDelay (2 s), copies them to Redis, and marks them. Polling,
// not LISTEN/NOTIFY: NOTIFY takes a database-wide lock at the commit of
// every transaction that sends one, which would serialise the commits of
// the hot path, and a listener misses what is sent while it is
// disconnected, so a poll would be needed anyway. The poll reads the
// partial index, so it costs nothing when the outbox is empty; processes
// sharing a table split the outbox with FOR UPDATE SKIP LOCKED. Pending
// counts what the poll has to copy: a backlog that grows means the relay
// cannot reach Redis.
//
// Beside it runs the store's reaper, the same loop as pgstore's and
// mysqlstore's (started by New, stopped by Close): every
// Options.ReapInterval (a minute; negative: never) it deletes the rows, of
// every namespace, expired for Options.ReapGrace, and reports each pass
// to Options.OnReap.
//
// A copy to Redis never moves a key backwards: it writes the completed
// record over nothing, a released record, an in-flight record (of any
// lease: the key is completed, so that holder can never complete it, and
// its next renewal tells it so), or an older completion, but not over a
// completion with a larger token. Its expiry is the completion's, and
// never before Redis's clock has passed the largest token the key had.
//
// Until a completion reaches Redis, a repeat of its key finds the key in
// flight (the lease's record), and after the lease a repeat runs the work
// again, whose CompleteTx then returns the first commit (and refills
// Redis). Nothing commits twice; the price of a slow relay is a rolled-back
// run.
//
// # A Redis miss
//
// When Redis grants a lease for a key that PostgreSQL holds completed
// (Redis lost it, or the relay has not copied it yet), there are two ways
// to find out, and Options.VerifyAcquire chooses:
//
//   - Off (the default): lazily, at CompleteTx. The work runs, its
//     transaction fails at CompleteTx, is rolled back, and the caller gets
//     the first commit's response as a replay; Redis is refilled. The
//     first-execution path has no PostgreSQL read.
//   - On: Acquire reads PostgreSQL (one index lookup, no commit) after
//     Redis grants a lease. A live completion is answered as Replay (or
//     Mismatch), refilled into Redis over the lease just granted, and the
//     work does not run. A first execution pays that read.
//
// With it off, work outside PostgreSQL runs again after a Redis loss (see
// below); turn it on when that matters more than a read per first
// execution. idem proxy turns it on.
//
// # Fencing tokens
//
// Tokens are Redis's: max(previous token + 1, Redis TIME in ms). What
// holds, precisely:
//
//   - While Redis keeps the key's record, tokens strictly increase per key
//     (redisstore's guarantee; a record is kept until Redis's clock has
//     passed its token, and a refill keeps the largest token the key had).
//   - Committed tokens strictly increase per key, always: PostgreSQL
//     refuses a completion whose token is not larger than the key's last
//     committed one, expired or not (until the reaper deletes it).
//   - After Redis loses a key, the next token is Redis's clock in ms. It is
//     larger than every token issued before for that key, committed or
//     not, unless (a) Redis's clock now reads less than it did when those
//     tokens were issued (a clock stepped back, or a failover to a replica
//     whose clock is behind), or (b) the tokens had run ahead of the
//     clock: each acquisition within the same millisecond adds one, so a
//     key acquired n times within a burst can be n−1 ms ahead, and the
//     loss must come later than that lead. For a completed key, the lead
//     is bounded by the acquisitions before its completion, and (b) needs
//     the loss and the new acquisition within that many milliseconds of
//     the last acquisition.
//   - With Options.VerifyAcquire, the exception is closed: Acquire, having
//     read the key's row, raises a new lease's token above the committed
//     one (one more script, only when needed). Without it, a token that
//     falls under a committed one can run work but cannot commit: its
//     CompleteTx fails (*AlreadyCompletedError while the completion is
//     live, *StaleTokenError after), and the store raises the key's token
//     in Redis above the committed one, so the next lease's is larger.
//
// Tokens are not comparable with those of pgstore (a sequence).
//
// # Effects outside PostgreSQL
//
// Exactly once is for what the business transaction writes to the same
// PostgreSQL database as the completions table. Everything else (a card
// network, an email, a message to a broker, writes to another database)
// is at least once with fencing, as on every store, and the tiered store
// adds one way to run twice that the plain Redis store also has: when
// Redis loses a completed key, the work runs again (unless VerifyAcquire
// answers the repeat from PostgreSQL), and only its PostgreSQL writes are
// rolled back. What it guarantees about such an effect: it ran with a
// lease no other holder had at the time (as far as Redis knew), with a
// fencing token, and the key's answer to every client is the first commit's
// response, never the second run's. Pass the token to the other system
// and have it refuse tokens it has already seen superseded; make the
// effect idempotent on its own side (an idempotency key to the card
// network), or record the intent in the business transaction and send it
// from an outbox of your own after the commit.
//
// # Without a transaction: Complete, Guard, idemhttp, idemmsg, idem proxy
//
// The plain idem.Store methods work as on any store, so Guard, idemhttp,
// idemmsg and `idem proxy --store 'redis://… postgres://…'` use it
// unchanged. Complete is Hold on Redis, the completion statement in a
// transaction of its own (so durable once Complete returns), and the relay
// to Redis. It passes storetest. When PostgreSQL holds another completion
// of the key, Complete returns an *AlreadyCompletedError, which matches
// idem.ErrLeaseLost, so Guard.Do reports the work's response with that
// error (the work ran, and is not stored), and the error carries the first
// completion's response for callers that look.
//
// The proxy cannot join its upstream's transaction: what it gets from the
// tiered store is a durable record of every completed request, in
// PostgreSQL, which survives anything Redis loses, and, with
// VerifyAcquire (which the proxy turns on), the replay of that record to a
// repeat after Redis lost it, and the refill of Redis. The upstream's
// effects are at least once, as with every store: a request whose upstream
// answered but whose completion did not commit runs again.
//
// # Schema
//
// One table (default "idem_completions"), created by Migrate or New with
// Options.Migrate:
//
//	namespace    text         Options.Namespace; PRIMARY KEY (namespace, key)
//	key          bytea        the 16-byte idem.Key
//	token        bigint       the fencing token of the completing lease
//	lease_id     bytea        the completing lease (a repeated Complete by it is not a second completion)
//	fingerprint  bytea        the request's fingerprint
//	response     bytea        idem.Response.AppendBinary
//	completed_at timestamptz  when the completion statement ran
//	expires_at   timestamptz  end of retention; indexed (the reaper)
//	relayed      boolean      copied to Redis; the rows where it is false are the outbox (partial index)
//
// and a table of one row, <table>_store_id, for the PostgreSQL side's
// store id (Store.Namespace). Every statement is in sql.go, with its reasoning. Time
// is PostgreSQL's clock for PostgreSQL's decisions (statement_timestamp())
// and Redis's for Redis's.
package tieredstore
