package tieredstore

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/redisstore"
)

// The relay. Every completion row is written with relayed = false, which
// puts it in the outbox (a partial index on the rows not yet relayed).
//
//   - After the commit, the committing call copies the completion to
//     Redis itself (relayFromLease: one script that turns the lease's
//     in-flight record into the completed one). When that succeeds, the
//     row is marked relayed, in batches, by the background loop (one
//     UPDATE per batch, off the request path, without waiting for the WAL
//     flush: a mark lost in a crash only makes the poll copy the row
//     again, which is harmless).
//   - The background loop polls the outbox every RelayInterval for rows
//     older than RelayDelay (the synchronous relay failed, its process
//     died, or its mark was dropped), copies each with a full Fill from
//     the row, and marks them. Copies are idempotent, so several processes
//     polling the same table at worst copy a row twice; FOR UPDATE SKIP
//     LOCKED mostly keeps them apart.
//
// Polling, not LISTEN/NOTIFY: NOTIFY takes a database-wide lock at every
// commit that sends one, which would serialise the commits of the hot
// path, and a listener misses what is sent while it is disconnected, so a
// poll is needed anyway.

// markQueue bounds the marks waiting for the background loop; when it is
// full, marks are dropped (the poll copies those rows again).
const markQueue = 8192

// markBatch is the largest batch of marks one UPDATE writes, and
// markEvery how often the loop writes what it has.
const (
	markBatch = 1024
	markEvery = 50 * time.Millisecond
)

// reapBatch is the number of rows one statement of the background reaper
// deletes at most.
const reapBatch = 1000

// pollBatch is the number of outbox rows one poll transaction copies, and
// pollConcurrency how many of them it copies at once.
const (
	pollBatch       = 256
	pollConcurrency = 32
)

type mark struct {
	key   idem.Key
	token uint64
}

var (
	slogWarn = slog.LevelWarn
	slogKey  = func(k idem.Key) slog.Attr { return slog.String("key", k.String()) }
	slogErr  = func(err error) slog.Attr { return slog.Any("error", err) }
)

// relay copies a completion this process just committed to Redis.
func (s *Store) relay(ctx context.Context, l idem.Lease, fp idem.Fingerprint, enc []byte, retention time.Duration) error {
	res, err := s.redis.Fill(ctx, redisstore.Fill{Key: l.Key, Token: l.Token, Fingerprint: fp, Lease: l.ID, TTL: retention, Response: enc})
	if err != nil {
		return err
	}
	s.marked(l.Key, l.Token, res)
	return nil
}

// relayFromLease is relay without the fingerprint: Redis takes it from
// the lease's in-flight record. If that record is gone (Redis lost it),
// the completion is read back from PostgreSQL and copied from there.
func (s *Store) relayFromLease(ctx context.Context, l idem.Lease, enc []byte, retention time.Duration) error {
	res, err := s.redis.Fill(ctx, redisstore.Fill{Key: l.Key, Token: l.Token, FingerprintFromLease: true, Lease: l.ID, TTL: retention, Response: enc})
	if err != nil {
		return err
	}
	if res == redisstore.FillNoFingerprint {
		r, ok, err := s.readRow(ctx, s.pool, l.Key)
		if err != nil {
			return err
		}
		if !ok || r.token != l.Token {
			return nil // deleted, or replaced by a newer completion since
		}
		_, err = s.fill(ctx, l.Key, r)
		return err
	}
	s.marked(l.Key, l.Token, res)
	return nil
}

// marked queues the mark of a row whose completion Redis now holds (or
// refused as older than what it holds).
func (s *Store) marked(key idem.Key, token uint64, res redisstore.FillResult) {
	if res == redisstore.FillNoFingerprint || s.marks == nil {
		return
	}
	select {
	case s.marks <- mark{key, token}:
	default: // full: the poll will copy it again
	}
}

// background runs the relay's loop until ctx ends: marks and polls. (The
// reaper is a loop of its own, internal/reaper's, started beside it.)
func (s *Store) background(ctx context.Context) {
	defer close(s.done)
	markT := time.NewTicker(markEvery)
	defer markT.Stop()
	pollT := time.NewTicker(s.relayEvery)
	defer pollT.Stop()
	var batch []mark
	flush := func(ctx context.Context) {
		if len(batch) == 0 {
			return
		}
		if err := s.mark(ctx, batch); err != nil && ctx.Err() == nil {
			s.log.LogAttrs(ctx, slogWarn, "tieredstore: marking relayed completions failed; the poll will copy them again",
				slog.Int("rows", len(batch)), slogErr(err))
		}
		batch = batch[:0]
	}
	for {
		select {
		case <-ctx.Done():
			// Write the marks already queued, briefly: otherwise the poll
			// of the next process copies those rows once more.
			final, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
			for len(s.marks) > 0 {
				batch = append(batch, <-s.marks)
			}
			flush(final)
			cancel()
			return
		case m := <-s.marks:
			batch = append(batch, m)
			if len(batch) >= markBatch {
				flush(ctx)
			}
		case <-markT.C:
			flush(ctx)
		case <-pollT.C:
			if _, err := s.RelayPending(ctx); err != nil && ctx.Err() == nil {
				s.log.LogAttrs(ctx, slogWarn, "tieredstore: relay of the outbox failed; retrying at the next poll", slogErr(err))
			}
		}
	}
}

// mark marks the batch's rows relayed, in one transaction that does not
// wait for its WAL flush.
func (s *Store) mark(ctx context.Context, batch []mark) error {
	keys := make([][]byte, len(batch))
	tokens := make([]int64, len(batch))
	for i, m := range batch {
		keys[i], tokens[i] = m.key[:], int64(m.token)
	}
	return pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SET LOCAL synchronous_commit = off"); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, s.sql.mark, s.ns, keys, tokens)
		return err
	})
}

// RelayPending copies to Redis the completions of the store's namespace
// that were committed at least Options.RelayDelay ago and not relayed
// yet (the outbox), and marks them relayed. It returns how many it
// copied; it stops at the first Redis failure (the rest stay in the
// outbox). The background relay calls it every Options.RelayInterval.
func (s *Store) RelayPending(ctx context.Context) (int, error) {
	total := 0
	for {
		n, more, err := s.relayBatch(ctx)
		total += n
		if err != nil || !more {
			return total, err
		}
	}
}

// Pending returns how many completions of the store's namespace are in
// the outbox and due for the background relay: committed at least
// Options.RelayDelay ago and not relayed to Redis yet. (A completion the
// synchronous relay copied leaves the outbox within about 50 ms, when its
// mark is written; until RelayDelay has passed it is not counted.) It
// stays near zero while Redis answers; a number that grows means the
// relay cannot copy to Redis, and until it does, repeats of those keys
// find them in flight or, after their lease, run again and get the first
// completion back from PostgreSQL. It is one count over the outbox's
// partial index: its cost grows with the backlog, not with the table.
func (s *Store) Pending(ctx context.Context) (int, error) {
	var n int
	if err := s.pool.QueryRow(ctx, s.sql.count, s.ns, interval(s.relayDelay)).Scan(&n); err != nil {
		return 0, fmt.Errorf("tieredstore: pending: %w", err)
	}
	return n, nil
}

// relayBatch copies one batch of the outbox in one transaction, which
// holds the rows' locks while it copies them.
func (s *Store) relayBatch(ctx context.Context) (n int, more bool, err error) {
	err = pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		rows, err := tx.Query(ctx, s.sql.pending, s.ns, interval(s.relayDelay), pollBatch)
		if err != nil {
			return err
		}
		type pending struct {
			key idem.Key
			r   row
		}
		var batch []pending
		for rows.Next() {
			var (
				p          pending
				key, fp, e []byte
				token      int64
			)
			if err := rows.Scan(&key, &token, &fp, &e, &p.r.left); err != nil {
				return err
			}
			if len(key) != len(p.key) || len(fp) != len(p.r.fp) || token <= 0 {
				s.log.LogAttrs(ctx, slogWarn, "tieredstore: relay: skipping a corrupt completion row", slog.Int("key_bytes", len(key)))
				continue
			}
			copy(p.key[:], key)
			copy(p.r.fp[:], fp)
			p.r.token, p.r.enc = uint64(token), e
			batch = append(batch, p)
		}
		if err := rows.Err(); err != nil {
			return err
		}
		more = len(batch) == pollBatch
		// Copy the batch concurrently: the client pipelines the scripts.
		done := make([]bool, len(batch))
		errs := make([]error, len(batch))
		var wg sync.WaitGroup
		sem := make(chan struct{}, pollConcurrency)
		for i, p := range batch {
			sem <- struct{}{}
			wg.Go(func() {
				defer func() { <-sem }()
				_, errs[i] = s.redis.Fill(ctx, redisstore.Fill{Key: p.key, Token: p.r.token, Fingerprint: p.r.fp, TTL: p.r.left, Response: p.r.enc})
				done[i] = errs[i] == nil
			})
		}
		wg.Wait()
		var keys [][]byte
		var tokens []int64
		for i, p := range batch {
			if done[i] {
				keys, tokens = append(keys, p.key[:]), append(tokens, int64(p.r.token))
			}
		}
		var ferr error
		if failed := len(batch) - len(keys); failed > 0 {
			for _, err := range errs {
				if err != nil {
					ferr = fmt.Errorf("%d of %d copies failed, the first: %w", failed, len(batch), err)
					break
				}
			}
		}
		n = len(keys)
		if n > 0 {
			if _, err := tx.Exec(ctx, s.sql.mark, s.ns, keys, tokens); err != nil {
				return err
			}
		}
		if ferr != nil {
			more = false
			return errors.Join(commitThen(ctx, tx), fmt.Errorf("tieredstore: relay: %w", ferr))
		}
		return nil
	})
	return n, more, err
}

// commitThen commits tx early, so that the rows copied before a failure
// are marked although the callback then returns an error (which makes
// pgx.BeginFunc roll back what is left: nothing, after the commit).
func commitThen(ctx context.Context, tx pgx.Tx) error {
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("tieredstore: relay: marking the rows copied: %w", err)
	}
	return nil
}

// Reap deletes the table's rows, of every namespace, expired for at least
// Options.ReapGrace, in statements of at most batch rows, until one finds
// fewer. It returns how many it deleted. The store's reaper calls it
// every Options.ReapInterval (unless that, or RelayInterval, is negative).
func (s *Store) Reap(ctx context.Context, batch int) (int, error) {
	if batch < 1 {
		return 0, fmt.Errorf("tieredstore: reap: batch %d is less than 1", batch)
	}
	deleted := 0
	for {
		tag, err := s.pool.Exec(ctx, s.sql.reap, batch, interval(s.reapGrace))
		if err != nil {
			return deleted, fmt.Errorf("tieredstore: reap: %w", err)
		}
		deleted += int(tag.RowsAffected())
		if int(tag.RowsAffected()) < batch {
			return deleted, nil
		}
	}
}
