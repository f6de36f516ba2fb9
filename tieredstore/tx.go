package tieredstore

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/pgstore"
)

// ErrAlreadyCompleted is matched by *AlreadyCompletedError.
var ErrAlreadyCompleted = errors.New("tieredstore: the key was completed already")

// ErrStaleToken is matched by *StaleTokenError.
var ErrStaleToken = errors.New("tieredstore: a completion with a token at least as large was committed")

// AlreadyCompletedError is CompleteTx's (and Complete's) answer when
// PostgreSQL holds a live completion of the key already: the first commit
// stays the only one. Roll the transaction back; the first commit's
// response is the answer to give, as a replay (BeginFunc does both).
//
// It happens when Redis lost the key's record after the first commit (a
// failover, a restart without persistence, FLUSHALL, an eviction) and the
// work ran again, or when the first commit has not been copied to Redis
// yet and the lease after it was granted. Before returning it, the store
// has put the first completion back into Redis, so the next repeat is a
// replay from Redis.
//
// It matches ErrAlreadyCompleted and idem.ErrLeaseLost (the lease can no
// longer complete the key: code written for any store treats it as a lost
// lease and stores nothing), and idem.ErrMismatch when Mismatch is set.
type AlreadyCompletedError struct {
	Key idem.Key
	// Token is the fencing token of the completion that committed.
	Token uint64
	// Response is that completion's response, the replay. It is nil when
	// Mismatch is set.
	Response *idem.Response
	// Mismatch reports that the completion has another fingerprint than
	// the lease's: the key was used with a different request.
	Mismatch bool
	// ByLease reports that the completion is this very lease's, committed
	// by an earlier call (CompleteTx must not be repeated in a second
	// transaction: its business writes would be a second copy).
	ByLease bool
}

func (e *AlreadyCompletedError) Error() string {
	what := "replay its response"
	if e.Mismatch {
		what = "with a different request (mismatch)"
	}
	return fmt.Sprintf("tieredstore: key %s was completed already (token %d): roll back and %s", e.Key, e.Token, what)
}

// Is makes errors.Is match ErrAlreadyCompleted, idem.ErrLeaseLost, and
// idem.ErrMismatch when Mismatch is set.
func (e *AlreadyCompletedError) Is(target error) bool {
	return target == ErrAlreadyCompleted || target == idem.ErrLeaseLost || e.Mismatch && target == idem.ErrMismatch
}

// StaleTokenError is CompleteTx's (and Complete's) answer when the key's
// last completion has expired but carries a token at least as large as
// the lease's: committed tokens per key only grow. It can only happen
// after Redis lost the key and issued a token from a clock that is behind
// (see the package documentation). The store has raised the lease's token
// in Redis above the committed one, so that the lease after a Release gets
// a larger token. Roll back and release. It matches ErrStaleToken and
// idem.ErrLeaseLost.
type StaleTokenError struct {
	Key       idem.Key
	Token     uint64 // the lease's
	Committed uint64 // the last completion's
}

func (e *StaleTokenError) Error() string {
	return fmt.Sprintf("tieredstore: key %s: lease token %d is not larger than the committed token %d: roll back and release", e.Key, e.Token, e.Committed)
}

// Is makes errors.Is match ErrStaleToken and idem.ErrLeaseLost.
func (e *StaleTokenError) Is(target error) bool {
	return target == ErrStaleToken || target == idem.ErrLeaseLost
}

// CompleteTx completes l's key in the caller's transaction tx, so that the
// completion commits, or not, with the business writes made in tx. It
// checks on Redis that l is still the key's live lease and extends it by
// l.TTL (so that no takeover happens before the commit), then runs one
// statement on tx. After the commit, call Relay (BeginFunc does it all).
//
// It returns nil when tx now holds the completion, and on any error tx
// must be rolled back:
//   - idem.ErrLeaseLost: the lease ended (another caller may hold the key);
//   - *AlreadyCompletedError: PostgreSQL holds a completion of the key
//     already, the first commit; its response is the answer (a replay),
//     or it is a mismatch;
//   - *StaleTokenError: an expired completion of the key has a token at
//     least as large as l's; release and try again;
//   - a *idem.StoreError: Redis or the statement failed.
//
// It never waits for Redis inside the statement, and the statement does
// not depend on Redis: whatever Redis has lost or says, PostgreSQL commits
// at most one live completion per key. Use READ COMMITTED (PostgreSQL's
// default). With idem.Guard.Begin, call Attempt.StopRenewal before it and
// Attempt.Stop after the commit (Release after a rollback, unless the
// error is an *AlreadyCompletedError: the key is completed in Redis then).
func (s *Store) CompleteTx(ctx context.Context, tx pgx.Tx, l idem.Lease, resp *idem.Response, retention time.Duration) error {
	_, _, err := s.completeTx(ctx, tx, l, resp, retention)
	return err
}

// completeTx is CompleteTx, returning the lease's fingerprint and the
// encoded response for the relay.
func (s *Store) completeTx(ctx context.Context, tx pgx.Tx, l idem.Lease, resp *idem.Response, retention time.Duration) (idem.Fingerprint, []byte, error) {
	enc, err := s.encode(ctx, l, resp, retention)
	if err != nil {
		return idem.Fingerprint{}, nil, err
	}
	fp, err := s.redis.Hold(ctx, l, max(l.TTL, time.Millisecond))
	if err != nil {
		return fp, nil, storeErr("complete", l.Key, err)
	}
	tag, err := tx.Exec(ctx, s.sql.complete, s.ns, l.Key[:], int64(l.Token), l.ID[:], fp[:], enc, interval(retention))
	if err != nil {
		return fp, nil, storeErr("complete", l.Key, err)
	}
	if tag.RowsAffected() == 1 {
		return fp, enc, nil
	}
	return fp, nil, s.lost(ctx, tx, l, fp)
}

// Relay copies l's completion, committed with CompleteTx, to Redis, and
// marks it relayed. Call it after the commit with CompleteTx's arguments;
// BeginFunc does. It is one Redis script (and, if Redis lost the lease's
// record meanwhile, one PostgreSQL read). If it fails, or is never called,
// the background relay copies the completion within about
// Options.RelayDelay + Options.RelayInterval; until then repeats find the
// key in flight, and after the lease a repeat that runs the work again
// gets an *AlreadyCompletedError from CompleteTx. Its error is for logs
// only: the completion is committed either way.
func (s *Store) Relay(ctx context.Context, l idem.Lease, resp *idem.Response, retention time.Duration) error {
	enc, err := resp.AppendBinary(nil)
	if err != nil {
		return err
	}
	return s.relayFromLease(ctx, l, enc, retention)
}

// BeginFunc is pgx.BeginFunc for a held key: it runs fn in a new
// transaction of db and completes att's key in that same transaction with
// the response fn returns, so that fn's writes and the completion commit
// together, or neither does. db is a *pgxpool.Pool, a *pgx.Conn or a
// pgx.Tx (pgstore.Beginner, the same as pgstore's BeginFunc takes). The
// steps:
//
//  1. Begin a transaction on db.
//  2. Run fn with att.Context() (which carries the lease and its fencing
//     token) and the transaction.
//  3. Stop the lease's renewal (Attempt.StopRenewal): a renewal after the
//     relay would find the lease completed and cancel the context.
//  4. CompleteTx: the lease checked and extended on Redis, one statement
//     in the transaction.
//  5. Commit, finish the attempt (Attempt.Stop), and Relay to Redis.
//
// The statements after fn, the commit, the relay and the release run with
// ctx without its cancellation.
//
// When the key was completed already (Redis had lost it; see
// AlreadyCompletedError), the transaction is rolled back, so fn's writes
// are undone, and BeginFunc returns the first commit's response with
// Replayed set and a nil error; or, when that completion had another
// fingerprint, an error matching idem.ErrMismatch. On any other failure
// (fn's error or panic, a lost lease, a stale token, a failed commit) the
// transaction is rolled back, the key is released so that a retry may run
// fn again, and the error (or panic) is passed on. A commit whose outcome
// is unknown (the connection broke during COMMIT) is released too: if it
// did commit, the next run's CompleteTx finds it. The attempt is finished
// in every case.
func (s *Store) BeginFunc(ctx context.Context, db pgstore.Beginner, att *idem.Attempt,
	fn func(ctx context.Context, tx pgx.Tx) (*idem.Response, error)) (idem.Result, error) {
	finish := context.WithoutCancel(ctx)
	tx, err := db.Begin(finish)
	if err != nil {
		return idem.Result{}, errors.Join(err, att.Release(finish))
	}
	done := false
	defer func() {
		if !done {
			tx.Rollback(finish)
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
	l := att.Lease()
	_, enc, err := s.completeTx(finish, tx, l, att.Stored(resp), att.Retention())
	var ace *AlreadyCompletedError
	if errors.As(err, &ace) {
		done = true
		tx.Rollback(finish)
		att.Stop() // Redis holds the completion now: nothing to release
		if ace.Mismatch {
			return idem.Result{}, err
		}
		opened, err := att.Open(ace.Response) // sealed when the Guard seals
		if err != nil {
			return idem.Result{}, err
		}
		return idem.Result{Response: opened, Replayed: true}, nil
	}
	if err != nil {
		return idem.Result{}, err
	}
	if err := tx.Commit(finish); err != nil {
		return idem.Result{}, err
	}
	done = true
	att.Stop()
	if err := s.relayFromLease(finish, l, enc, att.Retention()); err != nil {
		s.log.LogAttrs(finish, slogWarn, "tieredstore: relay to Redis failed; the background relay will copy the completion",
			slogKey(l.Key), slogErr(err))
	}
	return idem.Result{Response: resp}, nil
}
