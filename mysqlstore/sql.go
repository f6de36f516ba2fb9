package mysqlstore

// The statements of the store. {table} and {tok} stand for the quoted
// names of the records table and of its token counter; {index} for the
// name of the expiry index.
//
// Time is the server's: UTC_TIMESTAMP(6), which MySQL and MariaDB read
// once per statement (its start), whatever the session's time zone, so the
// check of a lease and the expiry written by the same statement agree. A
// record whose expires_at is not after it is absent to every statement;
// the reaper only reclaims the space. Durations are passed in
// microseconds (INTERVAL ? MICROSECOND), DATETIME(6)'s resolution.
//
// The state column holds idem.State: 1 in flight, 2 completed, 3 released.
//
// Verdicts without ROW_COUNT: the affected-rows count of an UPDATE depends
// on the connection's CLIENT_FOUND_ROWS flag (go-sql-driver's
// clientFoundRows), which belongs to the caller's DSN: with it, a row set
// to the values it had counts 1, without it 0. The store's statements do
// not depend on it: the ones whose verdict the store reads set
// token = LAST_INSERT_ID(token) on the rows they match, and the server
// returns that value in the statement's OK packet (Result.LastInsertId;
// 0 when no row matched, since tokens start at 1). CompleteTx, which runs
// in the caller's session, leaves the session's LAST_INSERT_ID alone and
// reads the affected rows instead: its UPDATE always changes the state
// of the row it matches (1 to 2), so the count is the same either way.
//
// MySQL 8 and MariaDB both accept every statement: no RETURNING, no
// sequences, no VALUES() in ON DUPLICATE KEY UPDATE (deprecated by MySQL
// 8.0.20, whose replacement MariaDB lacks); the arguments are passed
// again instead. SKIP LOCKED (the reaper) needs MySQL 8.0.1 or MariaDB
// 10.6.

// migrateSQL creates the records table, the token counter and the
// counter's one row, and the store id's table (Migrate then stores the
// id). CREATE TABLE IF NOT EXISTS and the upsert of the row
// are safe to run from several processes at once.
//
// namespace is VARBINARY(255): Options.Namespace is compared byte for byte
// and must fit the primary key (InnoDB keys are at most 3072 bytes).
var migrateSQL = []string{`
CREATE TABLE IF NOT EXISTS {table} (
	namespace   VARBINARY(255) NOT NULL,
	` + "`key`" + `       BINARY(16)     NOT NULL,
	state       TINYINT        NOT NULL,
	token       BIGINT         NOT NULL,
	fingerprint BINARY(16),
	lease_id    BINARY(16),
	expires_at  DATETIME(6)    NOT NULL,
	response    LONGBLOB,
	PRIMARY KEY (namespace, ` + "`key`" + `),
	KEY {index} (expires_at)
) ENGINE=InnoDB`, `
CREATE TABLE IF NOT EXISTS {tok} (
	id TINYINT NOT NULL PRIMARY KEY,
	v  BIGINT  NOT NULL
) ENGINE=InnoDB`, `
INSERT INTO {tok} (id, v) VALUES (1, 0) ON DUPLICATE KEY UPDATE v = v`, `
CREATE TABLE IF NOT EXISTS {store_id} (
	one TINYINT     NOT NULL PRIMARY KEY,
	id  VARCHAR(64) NOT NULL
) ENGINE=InnoDB`,
}

// The store id (Store.Namespace) is the one row of {store_id}, whose
// primary key is always 1, so that stores opening a new database at once
// agree on one id. insertIDSQL stores ? as the id unless the database has
// one: the first store to open a database chooses it, and every later one
// (another process, another address, a replica promoted) reads it.
const (
	insertIDSQL = `INSERT INTO {store_id} (one, id) VALUES (1, ?) ON DUPLICATE KEY UPDATE one = one`
	selectIDSQL = `SELECT id FROM {store_id} WHERE one = 1`
)

// drawSQL draws a fencing token from the counter: the new value comes
// back as the statement's LastInsertId. It runs alone in autocommit mode,
// so the counter row is locked for one statement only. Every token in the
// table was drawn from the counter, once: none is larger than the counter,
// and none is held by two leases. A takeover happens only with a token
// larger than the one it replaces (see acquireSQL), so tokens strictly
// increase per key, with no clock involved.
const drawSQL = `UPDATE {tok} SET v = LAST_INSERT_ID(v + 1) WHERE id = 1`

// writeTime is the server's clock as the expression is evaluated, in UTC:
// UTC_TIMESTAMP(6), the statement's start, plus the time since the start,
// SYSDATE(6) - NOW(6) (both in the session's time zone; a negative
// difference, across a change from summer time, counts as none). With
// the server option --sysdate-is-now, it is the statement's start. SYSDATE
// makes the statement unsafe for statement-based binary logging: with
// binlog_format=MIXED the server logs its rows instead; with STATEMENT it
// warns.
const writeTime = `(UTC_TIMESTAMP(6) + INTERVAL GREATEST(0, TIMESTAMPDIFF(MICROSECOND, NOW(6), SYSDATE(6))) MICROSECOND)`

// takeover is acquireSQL's test for taking a record over, on the row as
// found: the record is dead (released, or its expires_at has passed) and
// the token just drawn (the ?) is larger than the record's. A dead record
// with a larger token was granted after the draw (the draw was
// overtaken): it is left as it is, and Acquire draws again.
const takeover = `(state = 3 OR expires_at <= UTC_TIMESTAMP(6)) AND ? > token`

// acquireSQL inserts a new in-flight record or takes a dead one over (a
// released record, or one whose expires_at has passed) with the token just
// drawn, in one statement, and leaves a live record as it is, or a dead
// one whose token is not smaller than the one drawn.
//
// ? namespace, key, token (just drawn), fingerprint, lease id, TTL (µs);
// then, for the update: token, fingerprint; token; token, lease id; token,
// token; token, lease id, TTL; token, lease id.
//
// Its LastInsertId tells the answer apart: the token drawn, for a new
// record (the VALUES row calls LAST_INSERT_ID(token)) or a takeover; or 0
// when the record was left as it is (the update branch calls
// LAST_INSERT_ID(0) after the VALUES row set it): live, or dead with a
// token not smaller than the one drawn. The affected-rows count (1 insert,
// 2 takeover, 0 left, or 1 for it with CLIENT_FOUND_ROWS) is not used, so
// the caller's DSN may set that flag or not.
//
// MySQL evaluates the ON DUPLICATE KEY UPDATE assignments from left to
// right, each seeing the columns assigned before it. The takeover test
// reads state, expires_at and token, so fingerprint, response and lease_id
// are assigned first, then token by the test. After it, the record's
// token is the one just drawn, with this lease id, if and only if it was
// taken over (every token is drawn once, so no record held it before):
// expires_at and state are assigned on that.
//
// A new lease starts when it is written (writeTime), not when the
// statement started: a takeover may have waited for the row lock (a
// CompleteTx in progress), and must not be granted already spent. Acquire
// then reports the whole TTL.
//
// The statement locks the row (InnoDB's duplicate-key check takes an
// exclusive lock) until it ends; concurrent acquirers of a key serialise
// on it. It may deadlock with them (error 1213: InnoDB locks the gap
// before a new key as well) or time out on a lock (1205); the store
// retries it then, since a statement rolled back that way wrote nothing.
const acquireSQL = `
INSERT INTO {table} (namespace, ` + "`key`" + `, state, token, fingerprint, lease_id, expires_at)
VALUES (?, ?, 1, LAST_INSERT_ID(?), ?, ?, ` + writeTime + ` + INTERVAL ? MICROSECOND)
ON DUPLICATE KEY UPDATE
	fingerprint = IF(` + takeover + `, ?, fingerprint),
	response    = IF(` + takeover + `, NULL, response),
	lease_id    = IF(` + takeover + `, ?, lease_id),
	token       = IF(` + takeover + `, LAST_INSERT_ID(?), token + LAST_INSERT_ID(0)),
	expires_at  = IF(token = ? AND lease_id <=> ?, ` + writeTime + ` + INTERVAL ? MICROSECOND, expires_at),
	state       = IF(token = ? AND lease_id <=> ?, 1, state)`

// getSQL reads a live record (Get, and Acquire's answer when the key is
// live). ? namespace, key. The time left is measured at the row's
// evaluation (writeTime), not at the statement's start: the read may see a
// lease written after the statement started, whose time left from the
// start would be more than its whole TTL. (Found by the payments example's
// chaos test: an in-flight answer with RetryAfter over the lease.)
const getSQL = `
SELECT state, token, fingerprint, lease_id, TIMESTAMPDIFF(MICROSECOND, ` + writeTime + `, expires_at), response
FROM {table}
WHERE namespace = ? AND ` + "`key`" + ` = ? AND expires_at > UTC_TIMESTAMP(6)`

// renewSQL extends a live lease. ? TTL (µs), namespace, key, lease id.
// LastInsertId: the lease's token when renewed, 0 when the lease is lost.
const renewSQL = `
UPDATE {table} SET token = LAST_INSERT_ID(token), expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND
WHERE namespace = ? AND ` + "`key`" + ` = ? AND state = 1 AND lease_id = ?
	AND expires_at > UTC_TIMESTAMP(6)`

// completeSQL stores the response of a live lease, or accepts, as a
// repeat after a lost reply, a record this lease completed already: the
// record keeps the lease id of the lease that completed it (Get does not
// report it), and the repeat must match it and the token; a repeat
// changes nothing (the assignments test state before state is assigned,
// last). ? response, retention (µs), namespace, key, lease id, token.
// LastInsertId: the token when completed (now or before), 0 when the lease
// is lost.
const completeSQL = `
UPDATE {table} SET token = LAST_INSERT_ID(token),
	response = IF(state = 1, ?, response),
	expires_at = IF(state = 1, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, expires_at),
	state = 2
WHERE namespace = ? AND ` + "`key`" + ` = ? AND expires_at > UTC_TIMESTAMP(6)
	AND lease_id = ? AND (state = 1 OR (state = 2 AND token = ?))`

// completeTxSQL is CompleteTx's statement: it completes a live lease only
// (a repeat would commit the caller's writes twice). ? response, retention
// (µs), namespace, key, lease id. One row affected: completed (the state
// changes, so the count does not depend on CLIENT_FOUND_ROWS); none: lease
// lost. It locks the row until the caller's transaction ends. The record
// keeps the lease id, as with completeSQL.
const completeTxSQL = `
UPDATE {table} SET state = 2, response = ?,
	expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND
WHERE namespace = ? AND ` + "`key`" + ` = ? AND state = 1 AND lease_id = ?
	AND expires_at > UTC_TIMESTAMP(6)`

// releaseSQL ends a live lease without a result, leaving a tombstone
// (state 3) that keeps the token and the lease id for the given time, or
// accepts a repeat (a tombstone with the lease's id and token). ?
// tombstone TTL (µs), namespace, key, lease id, token. LastInsertId: the
// token when released (now or before), 0 when the lease is lost.
const releaseSQL = `
UPDATE {table} SET token = LAST_INSERT_ID(token), fingerprint = NULL,
	expires_at = IF(state = 1, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, expires_at),
	state = 3
WHERE namespace = ? AND ` + "`key`" + ` = ? AND expires_at > UTC_TIMESTAMP(6)
	AND lease_id = ? AND (state = 1 OR (state = 3 AND token = ?))`

// deleteLiveSQL removes a live record; one row affected means there was
// one. deleteDeadSQL then removes an expired one, if any. ? namespace,
// key.
const (
	deleteLiveSQL = "DELETE FROM {table} WHERE namespace = ? AND `key` = ? AND expires_at > UTC_TIMESTAMP(6)"
	deleteDeadSQL = "DELETE FROM {table} WHERE namespace = ? AND `key` = ? AND expires_at <= UTC_TIMESTAMP(6)"
)

// reapSelectSQL picks up to ? records of every namespace expired for at
// least ? µs (the grace), on the expiry index, and locks them; SKIP LOCKED
// passes over records a transaction holds (a CompleteTx not yet
// committed), so the reaper never waits for the application's
// transactions, nor they for it. It runs in a READ COMMITTED transaction,
// which locks the rows it returns and no gaps. reapDeleteSQL then deletes
// them by primary key, checking the expiry again.
const reapSelectSQL = `
SELECT namespace, ` + "`key`" + ` FROM {table}
WHERE expires_at <= UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND
LIMIT ?
FOR UPDATE SKIP LOCKED`

const reapDeleteSQL = `
DELETE FROM {table} WHERE expires_at <= UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND AND (`
