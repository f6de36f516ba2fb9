package pgstore

// The statements of the store. Each transition is one statement, so one
// round trip (pgx prepares each statement once per connection and then
// sends Bind+Execute only). {table}, {index} and {seq} stand for the quoted
// names of the table, its expiry index and its token sequence.
//
// Time is the database's: statement_timestamp(), read once per statement,
// so that the check of a lease and the expiry written by the same
// statement agree. Inside a caller's transaction (CompleteTx) it is the
// start of the statement, not of the transaction (now()), which may be
// long before. A record whose expires_at is not after it is absent to
// every statement; the reaper only reclaims the space.
//
// The state column holds idem.State: 1 in flight, 2 completed, 3 released.

// migrateSQL creates the table, its expiry index and the token sequence.
// It runs as one simple-protocol query, hence in one implicit transaction,
// under a transaction-level advisory lock, so that concurrent migrations
// (several processes starting at once) wait for each other instead of
// failing on the catalog's unique indexes.
//
// The sequence keeps CACHE 1 (the default, written out): with a larger
// cache, each session would hand out values from its own range, and a
// value drawn later could be smaller than one drawn earlier, which the
// fencing argument in the package documentation rules out.
const migrateSQL = `
SELECT pg_advisory_xact_lock(7306316441219102001);
CREATE TABLE IF NOT EXISTS {table} (
	namespace   text        NOT NULL,
	key         bytea       NOT NULL,
	state       smallint    NOT NULL,
	token       bigint      NOT NULL,
	fingerprint bytea,
	lease_id    bytea,
	expires_at  timestamptz NOT NULL,
	response    bytea,
	PRIMARY KEY (namespace, key)
);
CREATE INDEX IF NOT EXISTS {index} ON {table} (expires_at);
CREATE SEQUENCE IF NOT EXISTS {seq} AS bigint CACHE 1;
` + storeIDTableSQL

// storeIDTableSQL creates the table of the store id (Store.Namespace): one
// row at most (the primary key is a column that can only be true), so that
// stores opening a new database at once agree on one id (insertIDSQL).
// Migrate runs it with migrateSQL, or alone, under the same lock, on a
// database migrated by v1.0: then it does not wait for the records
// table's lock as CREATE INDEX IF NOT EXISTS would.
const storeIDTableSQL = `
SELECT pg_advisory_xact_lock(7306316441219102001);
CREATE TABLE IF NOT EXISTS {store_id} (
	one boolean PRIMARY KEY DEFAULT true CHECK (one),
	id  text    NOT NULL
);
`

// migratedSQL reports whether the table, its expiry index and its token
// sequence all exist, and whether the store id's table does.
const migratedSQL = `
SELECT to_regclass({table_lit}) IS NOT NULL AND to_regclass({index_lit}) IS NOT NULL
	AND to_regclass({seq_lit}) IS NOT NULL, to_regclass({store_id_lit}) IS NOT NULL`

// insertIDSQL stores $1 as the store id unless the database has one:
// the first store to open a database chooses it, and every later one
// (another process, another address, a replica promoted) reads it.
const insertIDSQL = `INSERT INTO {store_id} (id) VALUES ($1) ON CONFLICT DO NOTHING`

// selectIDSQL reads the store id.
const selectIDSQL = `SELECT id FROM {store_id}`

// acquireSQL takes the key or reports why not.
//
// $1 namespace, $2 key, $3 fingerprint, $4 lease id, $5 lease TTL.
//
// It returns exactly one row: the record as it is after the statement
// (state, token, fingerprint, lease_id, time left, response), and the time
// left at the statement's end. The caller took the key when the row is in
// flight with its own lease id, whether this statement took it (then the
// time left is exactly $5) or an earlier one with the same lease id did (a
// repeat after a lost reply). The time left at the end is for in-flight
// answers: a statement that waited for the row lock of an acquirer that
// started after it would otherwise report more time left than that
// acquirer's whole lease.
//
// cur reads the live, unreleased record from the statement's snapshot.
// When there is one, nothing is written: in flight, replay and mismatch
// (the common answers to a repeat) cost a read only when the record was
// already visible at the statement's start (a racing acquirer that reaches
// the ON CONFLICT branch instead writes a row version), and answer as of the
// snapshot, which is taken during the statement.
//
// Otherwise ins inserts a new in-flight record. When a record appeared
// meanwhile or is there but dead (expired or released), the insert
// conflicts, and the ON CONFLICT branch, which locks the row and sees its
// latest committed version, whatever the snapshot, takes it over if it is
// dead and leaves it as it is if it is live. The unconditional DO UPDATE
// (with CASE, not DO UPDATE ... WHERE) is what makes RETURNING give the
// row in both cases: a row left out by WHERE would have to be read again,
// and the snapshot may not show it. Concurrent acquirers of one key
// serialise on the row lock, so exactly one of them takes it.
//
// A takeover may have waited for the row lock (a CompleteTx in progress):
// its lease starts when it writes (clock_timestamp()), not when the
// statement started, so it is not granted already spent. The caller
// reports the time left at the statement's end.
//
// Tokens: the inserted row's token is drawn when the insert is tried; a
// takeover draws a fresh one under the row lock, after the token it
// replaces was drawn, so it is larger. Values drawn by an insert that
// conflicts are lost: tokens have gaps, and only tokens of leases granted
// are ever returned.
const acquireSQL = `
WITH cur AS (
	SELECT state, token, fingerprint, lease_id, expires_at, response
	FROM {table}
	WHERE namespace = $1 AND key = $2 AND state <> 3 AND expires_at > statement_timestamp()
), ins AS (
	INSERT INTO {table} AS r (namespace, key, state, token, fingerprint, lease_id, expires_at)
	SELECT $1, $2, 1, nextval('{seq}'), $3, $4, statement_timestamp() + $5::interval
	WHERE NOT EXISTS (SELECT FROM cur)
	ON CONFLICT (namespace, key) DO UPDATE SET
		state       = CASE WHEN r.state = 3 OR r.expires_at <= statement_timestamp() THEN 1 ELSE r.state END,
		token       = CASE WHEN r.state = 3 OR r.expires_at <= statement_timestamp() THEN nextval('{seq}') ELSE r.token END,
		fingerprint = CASE WHEN r.state = 3 OR r.expires_at <= statement_timestamp() THEN excluded.fingerprint ELSE r.fingerprint END,
		lease_id    = CASE WHEN r.state = 3 OR r.expires_at <= statement_timestamp() THEN excluded.lease_id ELSE r.lease_id END,
		response    = CASE WHEN r.state = 3 OR r.expires_at <= statement_timestamp() THEN NULL ELSE r.response END,
		expires_at  = CASE WHEN r.state = 3 OR r.expires_at <= statement_timestamp() THEN clock_timestamp() + $5::interval ELSE r.expires_at END
	RETURNING r.state, r.token, r.fingerprint, r.lease_id, r.expires_at, r.response
)
SELECT state, token, fingerprint, lease_id, expires_at - statement_timestamp(), response, expires_at - clock_timestamp() FROM ins
UNION ALL
SELECT state, token, fingerprint, lease_id, expires_at - statement_timestamp(), response, expires_at - clock_timestamp() FROM cur`

// renewSQL extends a live lease. $1 namespace, $2 key, $3 lease id, $4 TTL.
// One row affected: renewed; none: lease lost.
const renewSQL = `
UPDATE {table} SET expires_at = statement_timestamp() + $4::interval
WHERE namespace = $1 AND key = $2 AND state = 1 AND lease_id = $3
	AND expires_at > statement_timestamp()`

// completeTxSQL stores the response of a live lease. $1 namespace, $2 key,
// $3 lease id, $4 encoded response, $5 retention. One row affected:
// completed; none: lease lost. It is CompleteTx's statement, and the first
// half of completeSQL.
const completeTxSQL = `
UPDATE {table} SET state = 2, lease_id = NULL, response = $4,
	expires_at = statement_timestamp() + $5::interval
WHERE namespace = $1 AND key = $2 AND state = 1 AND lease_id = $3
	AND expires_at > statement_timestamp()`

// completeSQL is completeTxSQL ($1 to $5) that also accepts, as a repeat
// after a lost reply, a record this lease completed already: the same
// token ($6), which is unique per key. It returns one boolean: true for
// completed (now or before), false for lease lost.
const completeSQL = `
WITH done AS (` + completeTxSQL + `
	RETURNING true
)
SELECT EXISTS (SELECT FROM done) OR EXISTS (
	SELECT FROM {table}
	WHERE namespace = $1 AND key = $2 AND state = 2 AND token = $6
		AND expires_at > statement_timestamp())`

// releaseSQL ends a live lease without a result, leaving a tombstone
// (state 3) that keeps the token for the given time. $1 namespace, $2 key,
// $3 lease id, $4 tombstone TTL, $5 the lease's token for a repeat. It
// returns true for released (now or before), false for lease lost.
const releaseSQL = `
WITH done AS (
	UPDATE {table} SET state = 3, fingerprint = NULL, lease_id = NULL,
		expires_at = statement_timestamp() + $4::interval
	WHERE namespace = $1 AND key = $2 AND state = 1 AND lease_id = $3
		AND expires_at > statement_timestamp()
	RETURNING true
)
SELECT EXISTS (SELECT FROM done) OR EXISTS (
	SELECT FROM {table}
	WHERE namespace = $1 AND key = $2 AND state = 3 AND token = $5
		AND expires_at > statement_timestamp())`

// getSQL reads a live record. $1 namespace, $2 key.
const getSQL = `
SELECT state, token, fingerprint, lease_id, expires_at - statement_timestamp(), response
FROM {table}
WHERE namespace = $1 AND key = $2 AND expires_at > statement_timestamp()`

// deleteSQL removes a record, expired or not, and returns whether it was
// live. $1 namespace, $2 key.
const deleteSQL = `
DELETE FROM {table} WHERE namespace = $1 AND key = $2
RETURNING expires_at > statement_timestamp()`

// reapSQL deletes up to $1 records of every namespace expired for at least
// $2 (the grace: an insert that drew its token before waiting on a row
// this deletes would otherwise carry a smaller token than a lease granted
// meanwhile). It looks
// them up on the expiry index and deletes them by ctid (a TID scan, not a
// join). FOR UPDATE locks them, and rechecks the expiry on a version
// changed since the snapshot; SKIP LOCKED passes over records a
// transaction holds (a CompleteTx not yet committed), so the reaper never
// waits for the application's transactions, nor they for it.
const reapSQL = `
DELETE FROM {table} WHERE ctid = ANY (ARRAY(
	SELECT ctid FROM {table}
	WHERE expires_at <= statement_timestamp() - $2::interval
	LIMIT $1
	FOR UPDATE SKIP LOCKED))`

// The batched statements (idem.BatchStore): each is its single-key
// counterpart above over the rows of unnest($2, ...) WITH ORDINALITY, one
// row per key, and returns one row per key with its ordinal. The keys of
// one statement are distinct: the store sends a key that appears twice in
// a batch in a second statement, after the first (an INSERT ... ON
// CONFLICT cannot touch one row twice, and the order of a key's calls
// must hold).

// acquireManySQL is acquireSQL for many keys. $1 namespace, $2 keys, $3
// fingerprints, $4 lease ids, $5 TTLs. It returns, per key, its ordinal
// and the columns acquireSQL returns.
//
// The insert goes in key order, so that two batches over the same keys
// wait for each other's rows in one order and never deadlock. A takeover's
// lease is measured from its write, as in acquireSQL: the ON CONFLICT
// branch reads the TTL back from excluded.expires_at.
const acquireManySQL = `
WITH req AS (
	SELECT * FROM unnest($2::bytea[], $3::bytea[], $4::bytea[], $5::interval[]) WITH ORDINALITY AS q(key, fingerprint, lease_id, ttl, ord)
), cur AS (
	SELECT q.ord, r.state, r.token, r.fingerprint, r.lease_id, r.expires_at, r.response
	FROM req q JOIN {table} r ON r.namespace = $1 AND r.key = q.key
	WHERE r.state <> 3 AND r.expires_at > statement_timestamp()
), ins AS (
	INSERT INTO {table} AS r (namespace, key, state, token, fingerprint, lease_id, expires_at)
	SELECT $1, q.key, 1, nextval('{seq}'), q.fingerprint, q.lease_id, statement_timestamp() + q.ttl
	FROM req q
	WHERE NOT EXISTS (SELECT FROM cur WHERE cur.ord = q.ord)
	ORDER BY q.key
	ON CONFLICT (namespace, key) DO UPDATE SET
		state       = CASE WHEN r.state = 3 OR r.expires_at <= statement_timestamp() THEN 1 ELSE r.state END,
		token       = CASE WHEN r.state = 3 OR r.expires_at <= statement_timestamp() THEN nextval('{seq}') ELSE r.token END,
		fingerprint = CASE WHEN r.state = 3 OR r.expires_at <= statement_timestamp() THEN excluded.fingerprint ELSE r.fingerprint END,
		lease_id    = CASE WHEN r.state = 3 OR r.expires_at <= statement_timestamp() THEN excluded.lease_id ELSE r.lease_id END,
		response    = CASE WHEN r.state = 3 OR r.expires_at <= statement_timestamp() THEN NULL ELSE r.response END,
		expires_at  = CASE WHEN r.state = 3 OR r.expires_at <= statement_timestamp()
			THEN clock_timestamp() + (excluded.expires_at - statement_timestamp()) ELSE r.expires_at END
	RETURNING r.key, r.state, r.token, r.fingerprint, r.lease_id, r.expires_at, r.response
)
SELECT q.ord, i.state, i.token, i.fingerprint, i.lease_id, i.expires_at - statement_timestamp(), i.response, i.expires_at - clock_timestamp()
FROM ins i JOIN req q ON q.key = i.key
UNION ALL
SELECT ord, state, token, fingerprint, lease_id, expires_at - statement_timestamp(), response, expires_at - clock_timestamp() FROM cur`

// completeManySQL is completeSQL for many keys. $1 namespace, $2 keys, $3
// lease ids, $4 encoded responses, $5 retentions, $6 tokens. It returns,
// per key, its ordinal and completeSQL's boolean.
const completeManySQL = `
WITH req AS (
	SELECT * FROM unnest($2::bytea[], $3::bytea[], $4::bytea[], $5::interval[], $6::bigint[]) WITH ORDINALITY AS q(key, lease_id, response, retention, token, ord)
), done AS (
	UPDATE {table} r SET state = 2, lease_id = NULL, response = q.response,
		expires_at = statement_timestamp() + q.retention
	FROM req q
	WHERE r.namespace = $1 AND r.key = q.key AND r.state = 1 AND r.lease_id = q.lease_id
		AND r.expires_at > statement_timestamp()
	RETURNING q.ord
)
SELECT q.ord, EXISTS (SELECT FROM done d WHERE d.ord = q.ord) OR EXISTS (
	SELECT FROM {table} r
	WHERE r.namespace = $1 AND r.key = q.key AND r.state = 2 AND r.token = q.token
		AND r.expires_at > statement_timestamp())
FROM req q`

// releaseManySQL is releaseSQL for many keys. $1 namespace, $2 keys, $3
// lease ids, $4 tombstone TTLs, $5 tokens. It returns, per key, its
// ordinal and releaseSQL's boolean.
const releaseManySQL = `
WITH req AS (
	SELECT * FROM unnest($2::bytea[], $3::bytea[], $4::interval[], $5::bigint[]) WITH ORDINALITY AS q(key, lease_id, ttl, token, ord)
), done AS (
	UPDATE {table} r SET state = 3, fingerprint = NULL, lease_id = NULL,
		expires_at = statement_timestamp() + q.ttl
	FROM req q
	WHERE r.namespace = $1 AND r.key = q.key AND r.state = 1 AND r.lease_id = q.lease_id
		AND r.expires_at > statement_timestamp()
	RETURNING q.ord
)
SELECT q.ord, EXISTS (SELECT FROM done d WHERE d.ord = q.ord) OR EXISTS (
	SELECT FROM {table} r
	WHERE r.namespace = $1 AND r.key = q.key AND r.state = 3 AND r.token = q.token
		AND r.expires_at > statement_timestamp())
FROM req q`
