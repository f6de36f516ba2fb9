package tieredstore

// The statements of the store. {table}, {pkey}, {expiry} and {outbox}
// stand for the quoted names of the table and its indexes. Time is the
// database's: statement_timestamp(), read once per statement.
//
// One row per key and namespace: the key's completion, the truth about it.
// A row stays after it expires (its token is the floor for the key's next
// completion) until the reaper deletes it, Options.ReapGrace later.

// migrateSQL creates the table and its indexes. It runs as one
// simple-protocol query, hence in one implicit transaction, under a
// transaction-level advisory lock, so that processes starting together
// wait for each other instead of failing on the catalog's unique indexes.
//
// The outbox index holds only the rows not yet relayed to Redis: the
// relay's poll reads it, and a row leaves it when the relay marks it.
const migrateSQL = `
SELECT pg_advisory_xact_lock(7306316441219102015);
CREATE TABLE IF NOT EXISTS {table} (
	namespace    text        NOT NULL,
	key          bytea       NOT NULL,
	token        bigint      NOT NULL,
	lease_id     bytea       NOT NULL,
	fingerprint  bytea       NOT NULL,
	response     bytea       NOT NULL,
	completed_at timestamptz NOT NULL,
	expires_at   timestamptz NOT NULL,
	relayed      boolean     NOT NULL DEFAULT false,
	PRIMARY KEY (namespace, key)
);
CREATE INDEX IF NOT EXISTS {expiry} ON {table} (expires_at);
CREATE INDEX IF NOT EXISTS {outbox} ON {table} (namespace, completed_at) WHERE NOT relayed;
` + storeIDTableSQL

// storeIDTableSQL creates the table of the PostgreSQL side's store id
// (Store.Namespace), of one row at most (the primary key can only be
// true), as pgstore's. Migrate runs it with migrateSQL, or alone on a
// database migrated by v1.0, under the same lock.
const storeIDTableSQL = `
SELECT pg_advisory_xact_lock(7306316441219102015);
CREATE TABLE IF NOT EXISTS {store_id} (
	one boolean PRIMARY KEY DEFAULT true CHECK (one),
	id  text    NOT NULL
);
`

// migratedSQL reports whether the table and its indexes all exist (the
// indexes live in the table's schema), and whether the store id's table
// does.
const migratedSQL = `
SELECT to_regclass({table_lit}) IS NOT NULL AND to_regclass({expiry_lit}) IS NOT NULL
	AND to_regclass({outbox_lit}) IS NOT NULL, to_regclass({store_id_lit}) IS NOT NULL`

// insertIDSQL stores $1 as the store id unless the database has one;
// selectIDSQL reads it.
const (
	insertIDSQL = `INSERT INTO {store_id} (id) VALUES ($1) ON CONFLICT DO NOTHING`
	selectIDSQL = `SELECT id FROM {store_id}`
)

// completeSQL commits a completion: CompleteTx's statement, run in the
// caller's transaction, and Complete's, in a transaction of its own.
//
// $1 namespace, $2 key, $3 token, $4 lease id, $5 fingerprint, $6 encoded
// response, $7 retention.
//
// One row affected: this statement completed the key. None: the key has a
// completion already, and it wins:
//   - a live one (the unique key): the first commit stays the only one;
//   - an expired one with a token at least as large as $3: committed
//     tokens only grow, per key, whatever Redis issued.
//
// An expired completion with a smaller token is replaced (the key is new
// again after its retention). When another transaction has inserted the
// key and not yet committed, the insert waits for it: if it commits, this
// statement changes nothing; if it rolls back, this one inserts. So of two
// transactions completing one key, exactly one commits its completion,
// whatever Redis said to their holders. Under READ COMMITTED (the
// default), the caller then reads the winner with rowSQL in a new
// statement, whose snapshot includes it.
const completeSQL = `
INSERT INTO {table} AS r (namespace, key, token, lease_id, fingerprint, response, completed_at, expires_at, relayed)
VALUES ($1, $2, $3, $4, $5, $6, statement_timestamp(), statement_timestamp() + $7::interval, false)
ON CONFLICT (namespace, key) DO UPDATE SET
	token = excluded.token, lease_id = excluded.lease_id, fingerprint = excluded.fingerprint,
	response = excluded.response, completed_at = excluded.completed_at,
	expires_at = excluded.expires_at, relayed = false
WHERE r.expires_at <= statement_timestamp() AND r.token < excluded.token`

// rowSQL reads a key's row, live or expired. $1 namespace, $2 key.
const rowSQL = `
SELECT token, lease_id, fingerprint, response, expires_at - statement_timestamp()
FROM {table} WHERE namespace = $1 AND key = $2`

// deleteSQL removes a key's row and returns whether it was live.
const deleteSQL = `
DELETE FROM {table} WHERE namespace = $1 AND key = $2
RETURNING expires_at > statement_timestamp()`

// pendingSQL reads, and locks, up to $3 rows of namespace $1 not yet
// relayed and completed at least $2 ago (the synchronous relay after the
// commit had its chance). SKIP LOCKED leaves rows another process's relay
// is copying to that relay.
const pendingSQL = `
SELECT key, token, fingerprint, response, expires_at - statement_timestamp()
FROM {table}
WHERE namespace = $1 AND NOT relayed AND completed_at <= statement_timestamp() - $2::interval
ORDER BY completed_at
LIMIT $3
FOR UPDATE SKIP LOCKED`

// countPendingSQL counts the rows pendingSQL would read, without a limit
// or locks: $1 namespace, $2 RelayDelay. It reads the outbox index.
const countPendingSQL = `
SELECT count(*) FROM {table}
WHERE namespace = $1 AND NOT relayed AND completed_at <= statement_timestamp() - $2::interval`

// markSQL marks rows as relayed: $1 namespace, $2 keys, $3 their tokens.
// A row whose token changed since (a newer completion) is left alone.
const markSQL = `
UPDATE {table} AS r SET relayed = true
FROM unnest($2::bytea[], $3::bigint[]) AS m(key, token)
WHERE r.namespace = $1 AND r.key = m.key AND r.token = m.token AND NOT r.relayed`

// reapSQL deletes up to $1 rows, of every namespace, expired for at least
// $2. SKIP LOCKED passes over rows a transaction holds.
const reapSQL = `
DELETE FROM {table} WHERE ctid = ANY (ARRAY(
	SELECT ctid FROM {table}
	WHERE expires_at <= statement_timestamp() - $2::interval
	LIMIT $1
	FOR UPDATE SKIP LOCKED))`
