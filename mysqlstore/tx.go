package mysqlstore

import (
	"context"
	"database/sql"
	"errors"

	"github.com/idemkit/idem"
)

// Beginner starts a transaction: a *sql.DB or a *sql.Conn.
type Beginner interface {
	BeginTx(ctx context.Context, opts *sql.TxOptions) (*sql.Tx, error)
}

// BeginFunc runs fn in a new transaction of db and completes att's key in
// that same transaction with the response fn returns, so that fn's writes
// and the completion commit together, or neither does. It takes the steps
// in the order CompleteTx needs:
//
//  1. Begin a transaction on db, READ COMMITTED (InnoDB's default,
//     REPEATABLE READ, locks gaps on the caller's reads too, and makes
//     deadlocks between concurrent callers more likely).
//  2. Run fn with att.Context(), which carries the lease (and its fencing
//     token) and is cancelled if the lease is lost, and the transaction.
//  3. Stop the lease's renewal (Attempt.StopRenewal): a renewal sent now
//     would wait on the row CompleteTx locks, find it completed once the
//     transaction commits, and cancel the attempt's context.
//  4. CompleteTx with att's lease and retention, in the transaction, and
//     the response as the Guard stores it (Attempt.Stored: sealed when
//     the Guard seals).
//  5. Commit, and finish the attempt (Attempt.Stop).
//
// The transaction's statements after fn, the commit and the release run
// with ctx without its cancellation: a caller that leaves must not cut the
// transaction short between the completion and the commit. (database/sql
// rolls a transaction back when the context given to BeginTx ends, so the
// transaction is begun with that context too.)
//
// On any failure (fn's error or panic, CompleteTx's ErrLeaseLost, which
// means another caller may hold the key, a deadlock, a failed commit) the
// transaction is rolled back, the key is released so that a retry may run
// fn again, and the error (or panic) is passed on. A commit whose outcome
// is unknown (the connection broke during COMMIT) is released too: if it
// did commit, the record is completed and the store refuses the release.
// BeginFunc does not run fn again after a deadlock: the caller may (the
// key is released).
//
// When the transaction committed, BeginFunc returns fn's response (an
// empty one if fn returned nil) as an idem.Result; its Replayed is always
// false on this store.
func (s *Store) BeginFunc(ctx context.Context, db Beginner, att *idem.Attempt,
	fn func(ctx context.Context, tx *sql.Tx) (*idem.Response, error)) (idem.Result, error) {
	finish := context.WithoutCancel(ctx)
	tx, err := db.BeginTx(finish, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return idem.Result{}, errors.Join(err, att.Release(finish))
	}
	committed := false
	defer func() {
		if !committed {
			tx.Rollback()
			att.Release(finish) // a panic, or a commit that failed
		}
	}()
	resp, err := fn(att.Context(), tx)
	if err != nil {
		return idem.Result{}, err
	}
	if resp == nil {
		resp = &idem.Response{}
	}
	att.StopRenewal()
	if err := s.CompleteTx(finish, tx, att.Lease(), att.Stored(resp), att.Retention()); err != nil {
		return idem.Result{}, err
	}
	if err := tx.Commit(); err != nil {
		return idem.Result{}, err
	}
	committed = true
	att.Stop()
	return idem.Result{Response: resp}, nil
}
