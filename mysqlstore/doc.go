// Package mysqlstore is an idem.Store on MySQL 8 or MariaDB (InnoDB,
// database/sql with github.com/go-sql-driver/mysql), whose completion can
// commit in the caller's own transaction.
//
// # Exactly-once effects inside the database
//
// CompleteTx stores a key's result with the same transaction as the
// business writes it answers for. With idem.Guard, BeginFunc takes every
// step in order:
//
//	att, acq, err := g.Begin(ctx, key, fp)          // acq.Outcome == idem.Acquired
//	res, err := store.BeginFunc(ctx, db, att, func(ctx context.Context, tx *sql.Tx) (*idem.Response, error) {
//		_, err := tx.ExecContext(ctx, "INSERT INTO charges ...") // the effect
//		return &idem.Response{Status: 201}, err
//	}) // begin, fn, StopRenewal, CompleteTx, commit: both, or neither
//
// Both commit, or neither does. A crash, a lost connection or a rollback
// before the commit leaves no business writes and the key in flight, so it
// runs again once the lease ends (or at once, after Release); after the
// commit, every repeat is a replay. Effects outside the database remain
// at-least-once with fencing, as on every store.
//
// CompleteTx's UPDATE locks the record until the transaction ends, so no
// other caller can take the key over between the completion and the
// commit, even if the lease runs out meanwhile: Acquire reads the record
// first without locking it, and answers in flight while the lease lives;
// after that, it waits for the transaction (up to the server's
// innodb_lock_wait_timeout, then tries again), and finds the record
// completed (a replay) or, after a rollback, takes the key over. With
// idem.Guard.Begin, call Attempt.StopRenewal before CompleteTx and
// Attempt.Stop after the commit (BeginFunc does both). If CompleteTx
// returns ErrLeaseLost, roll back. InnoDB's UPDATE reads the latest
// committed version of the row whatever the isolation level, so CompleteTx
// works under REPEATABLE READ (InnoDB's default) as under READ COMMITTED
// (BeginFunc's).
//
// # Schema
//
// One table (default "idem_records"), created by Migrate or New with
// Options.Migrate:
//
//	namespace   VARBINARY(255)  Options.Namespace; PRIMARY KEY (namespace, `key`)
//	key         BINARY(16)      the 16-byte idem.Key
//	state       TINYINT         idem.State: 1 in flight, 2 completed, 3 released
//	token       BIGINT          the fencing token
//	fingerprint BINARY(16)      idem.Fingerprint (NULL once released)
//	lease_id    BINARY(16)      the idem.LeaseID of the holder, or of the lease that completed or released it
//	expires_at  DATETIME(6)     UTC: lease end, retention end or tombstone end; indexed
//	response    LONGBLOB        idem.Response.AppendBinary (NULL unless completed)
//
// a counter table, <table>_token, of one row, for fencing tokens, and a
// table of one row, <table>_store_id, for the store id (Store.Namespace).
// Every statement is in sql.go, with its reasoning; all of them run on
// MySQL 8 and MariaDB alike (the reaper's SKIP LOCKED needs MySQL 8.0.1 or
// MariaDB 10.6). The tests run on MariaDB 10.11.
//
// # Semantics
//
// The store follows the state machine of package idem with the same rules
// as pgstore. Time is the server's clock (UTC_TIMESTAMP(6)), never the
// caller's, whatever the session's time zone. A record whose expires_at
// has passed is absent to every method, whether or not it has been
// deleted yet: the reaper (Options.ReapInterval) and Reap only reclaim
// space.
//
// Renew, Complete, Release and Get are one statement and one round trip
// each. Acquire reads the record first: a repeat (in flight, replay,
// mismatch) is one round trip and takes no lock. A new key or a takeover
// takes two more: the draw of a token from the counter, then one
// INSERT ... ON DUPLICATE KEY UPDATE that inserts the record or takes a
// dead one over and leaves a live one as it is; concurrent acquirers of a
// key serialise on its row lock, so exactly one of them gets it, and the
// others read the record to answer. Delete is one statement for a live
// record, two otherwise.
//
// The verdicts do not depend on the connection's CLIENT_FOUND_ROWS flag
// (go-sql-driver's clientFoundRows): set it or not. The store's
// statements set token = LAST_INSERT_ID(token) on the rows they change
// and read the value back from the result (Result.LastInsertId), so they
// change the LAST_INSERT_ID() of the pooled sessions they run on;
// CompleteTx, which runs on the caller's transaction, does not.
//
// A statement of the store run in autocommit mode (every method but
// CompleteTx) that fails with a deadlock (1213) or a lock wait timeout
// (1205) has been rolled back whole and is run again, up to ten times.
// CompleteTx and BeginFunc never retry: a deadlock rolls back the caller's
// whole transaction.
//
// Responses of up to idem's 64 MiB are stored and replayed whole, also
// over the server's max_allowed_packet (the driver splits what it sends
// into packets); checked on MariaDB 10.11 with its 16 MiB default.
//
// # Fencing tokens
//
// Tokens come from the counter row (UPDATE ... SET v = LAST_INSERT_ID(v +
// 1)), with no clock involved, each drawn in a statement of its own that
// commits at once, so the row is locked for that statement only. Every
// token a record carries was drawn from the counter, for that grant alone:
// none is above the counter, and no two leases share one. A takeover
// (after a release or an expiry) happens only with a drawn token larger
// than the record's; when the draw was overtaken (another Acquire drew
// later and was granted the key first), the record is left as it is and
// Acquire draws again. So tokens strictly increase per key across
// takeovers, releases and expiry, whatever any clock does. A repeated
// Complete or Release is accepted only from the lease that completed or
// released the record (its lease id and token), never from another.
//
// A brand-new record carries the token drawn just before its insert: a
// record of the same key created, expired and deleted entirely between
// that draw and the insert could have had a larger one. The reaper deletes
// only records expired for Options.ReapGrace (a minute), so with it this
// needs an Acquire stalled that long; an operator's Delete can cause it
// directly (Delete drops a key's history on every store). Tokens have
// gaps, are shared by all keys and namespaces of a table, and are not
// comparable with those of another store.
//
// # Not implemented
//
// The store does not implement idem.BatchStore: MySQL 8 has no arrays to
// pass a batch in one statement, and a multi-row INSERT ... ON DUPLICATE
// KEY UPDATE cannot say which rows it inserted, took over or left.
// idem.AcquireMany and the other batch functions fall back to one call
// per key.
package mysqlstore
