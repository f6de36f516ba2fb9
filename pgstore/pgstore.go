// Package pgstore is an idem.Store on PostgreSQL (pgx v5), whose
// completion can commit in the caller's own transaction.
//
// # Exactly-once effects inside the database
//
// CompleteTx stores a key's result with the same transaction as the
// business writes it answers for. With idem.Guard, BeginFunc takes every
// step in order:
//
//	att, acq, err := g.Begin(ctx, key, fp)          // acq.Outcome == idem.Acquired
//	res, err := store.BeginFunc(ctx, pool, att, func(ctx context.Context, tx pgx.Tx) (*idem.Response, error) {
//		_, err := tx.Exec(ctx, "INSERT INTO charges ...") // the effect
//		return &idem.Response{Status: 201}, err
//	}) // begin, fn, StopRenewal, CompleteTx, commit: both, or neither
//
// Both commit, or neither does. A crash, a lost connection or a rollback
// before the commit leaves no business writes and the key in flight, so it
// runs again once the lease ends (or at once, after Release); after the
// commit, every repeat is a replay. The work is done exactly once, not at
// least once, for whatever it writes to this database: this is what the
// store is for. Effects outside the database (a call to a card network, an
// email) remain at-least-once with fencing, as on every store.
//
// CompleteTx's UPDATE locks the record until the transaction ends, so no
// other caller can take the key over between the completion and the
// commit, even if the lease runs out meanwhile: an Acquire answers in
// flight while the lease lives, and after that waits for the transaction,
// then finds the record completed (a replay) or, after a rollback, takes
// the key over. With idem.Guard.Begin, call Attempt.StopRenewal before
// CompleteTx and Attempt.Stop after the commit (Release after a
// rollback): a renewal sent meanwhile would wait on that lock, then find
// the record completed and cancel the attempt's context, which the commit
// may be running with. If CompleteTx returns
// ErrLeaseLost, the lease ended and another caller may hold the key (and
// may be writing the same effect): roll back. CompleteTx does not accept a
// record this lease completed already, as Complete does after a lost
// reply: that completion committed with its own business writes, and this
// transaction's would be a second copy. Use READ COMMITTED (PostgreSQL's
// default): under REPEATABLE READ or SERIALIZABLE, a record renewed since
// the transaction's snapshot makes the UPDATE fail with a serialization
// error. The same holds for the pool's own sessions: if the database or
// role defaults to a stricter isolation level, concurrent Acquire calls on
// one key fail with serialization errors instead of answering in flight.
//
// # Schema
//
// One table (default "idem_records"), created by Migrate or New with
// Options.Migrate:
//
//	namespace   text         Options.Namespace: stores sharing a table never see each other's records
//	key         bytea        the 16-byte idem.Key; PRIMARY KEY (namespace, key)
//	state       smallint     idem.State: 1 in flight, 2 completed, 3 released
//	token       bigint       the fencing token
//	fingerprint bytea        idem.Fingerprint (NULL once released)
//	lease_id    bytea        the holder's idem.LeaseID (NULL unless in flight)
//	expires_at  timestamptz  lease end, retention end or tombstone end; indexed
//	response    bytea        idem.Response.AppendBinary (NULL unless completed)
//
// a sequence, <table>_token, for fencing tokens, and a table of one row,
// <table>_store_id, for the store id (Store.Namespace). Every statement
// is in sql.go, with its reasoning.
//
// # Semantics
//
// The store follows the state machine of package idem with the same rules
// as memstore and redisstore. Time is the database's clock
// (statement_timestamp()), never the caller's. A record whose expires_at
// has passed is absent to every method, whether or not it has been
// deleted yet: the reaper (Options.ReapInterval), Reap and RunReaper only
// reclaim space.
//
// Each method is one SQL statement and one round trip. Acquire is one
// INSERT ... ON CONFLICT DO UPDATE that reads the record first and writes
// nothing when the answer is in flight, replay or mismatch; concurrent
// acquirers of a key serialise on its row lock, so exactly one of them
// gets it. Renew, Complete and Release are UPDATEs that match only the
// current, live lease id, and change nothing otherwise (ErrLeaseLost).
//
// # Fencing tokens
//
// Tokens come from the sequence, with no clock involved: every grant of a
// key draws a value from the sequence after the value of the grant before
// it was drawn (a takeover draws it under the record's row lock), so tokens
// strictly increase per key across takeovers, releases, expiry and
// deletion, whatever any clock does. Tokens have gaps and are shared by
// all keys and namespaces of a table. One exception: a brand-new record's
// token is drawn as its INSERT starts, so a record created, expired and
// deleted entirely while one Acquire of the same key was between its start
// and its insert may have had a larger token. The reaper deletes only
// records expired for Options.ReapGrace (a minute), so with it this needs
// an Acquire stalled for that long; an operator's Delete can cause it
// directly (Delete drops a key's history on every store). The tokens are not comparable with those of another store:
// a system of record moving from redisstore (whose tokens are clock-based)
// to pgstore must reset what it remembers.
package pgstore

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/pgurl"
	"github.com/idemkit/idem/internal/reaper"
	"github.com/idemkit/idem/internal/storeid"
	"github.com/idemkit/idem/internal/storeid/pgid"
)

// DefaultReapGrace is Options.ReapGrace's default.
const DefaultReapGrace = time.Minute

// DefaultTable is the table name when Options.Table is empty.
const DefaultTable = "idem_records"

// Options configures a Store. The zero value means the defaults.
type Options struct {
	// Table is the table holding the records, optionally qualified by a
	// schema that exists already ("idem.records"). Each part is an
	// unquoted-identifier-like name of at most 48 bytes: letters, digits
	// and underscores, not starting with a digit. Default DefaultTable.
	Table string

	// Namespace isolates stores sharing a table: each sees only the
	// records of its own namespace. Default "".
	Namespace string

	// Migrate makes New run Migrate for Table first.
	Migrate bool

	// ReapGrace is how long a record must have been expired before Reap
	// deletes it. Deleting a record the instant it expires lets an Acquire
	// that was waiting on it insert a token drawn before a larger one was
	// granted; the grace makes that need an Acquire stalled for this long.
	// Default DefaultReapGrace.
	ReapGrace time.Duration

	// ReapInterval, when positive, makes New and Open start the store's
	// reaper: every ReapInterval it deletes the table's expired records
	// (Reap, in statements of at most DefaultReapBatch rows), until Close
	// stops it. Zero or negative: no reaper, as in v1.0, whose New
	// started nothing (the store does not run goroutines on a pool it
	// was given unless asked; call Reap yourself, or run the reaper in
	// one process per table). tieredstore's ReapInterval, whose zero
	// value means its default, is the exception: its New starts a
	// background relay in any case.
	ReapInterval time.Duration

	// Logger receives the failures of the reaper's passes (ReapInterval,
	// RunReaper). Default slog.Default().
	Logger *slog.Logger

	// OnReap, when set, is called after each pass of the reaper
	// (ReapInterval, RunReaper) with the number of records the pass
	// deleted, how long it took, and its error (nil when it finished; a
	// failure is also logged to Logger). A pass cut short by Close (or
	// because RunReaper's context ended) is not reported. It is called on
	// the reaper's goroutine, which waits for it: it should not block.
	OnReap func(deleted int, took time.Duration, err error)

	// NoStoreID keeps New from storing a store id (see Namespace) in a
	// database that has none: for tools that create nothing (idem inspect,
	// purge and gc). Namespace is then LegacyNamespace, whose blobs no
	// sweep judges. Default false.
	NoStoreID bool
}

// Store is an idem.Store on a PostgreSQL table. It is safe for concurrent
// use. Create one with New, on a pool of yours, or Open, on a URL; Close
// it.
type Store struct {
	pool   *pgxpool.Pool
	owned  bool           // Open made the pool: Close closes it
	reaper *reaper.Reaper // Options.ReapInterval's, or nil
	ns     string
	legacy string          // LegacyNamespace
	id     *storeid.Holder // the store id (Namespace)
	grace  time.Duration
	log    *slog.Logger
	onReap func(deleted int, took time.Duration, err error)
	names  names
	sql    statements

	closeOnce sync.Once
}

var (
	_ idem.Store      = (*Store)(nil)
	_ idem.Namespacer = (*Store)(nil)
)

// Namespace implements idem.Namespacer: the table, Options.Namespace and
// the store id, as in: postgres table idem_records namespace "" store
// 3f0c…. The store id is 32 random hex digits kept in the database
// itself, in the one-row table <Table>_store_id, which Migrate creates;
// the first store that opens the database stores it. So two stores have
// one Namespace exactly when they read the same records: the same table
// and namespace in the same database, whatever address reaches it (a
// replica promoted, or a database restored from a backup, has the
// table's id). Another database, schema or server has another id. The
// names of the blobs of large responses (idem.NewBlobName) carry its
// digest, so that a sweep (blobstore.Sweep, idem gc) judges only its own
// records' blobs.
//
// A database without the id (its table created by v1.0's Migrate or by
// hand, and not migrated since; or opened with Options.NoStoreID) gives
// LegacyNamespace, v1.0's, and so does one that has not answered yet (it
// is asked again at the next call): blobs named with it are never judged
// by a sweep, since that namespace is the same for every database.
func (s *Store) Namespace() string {
	if id := s.id.Get(); id != "" {
		return s.legacy + " store " + id
	}
	return s.legacy
}

// LegacyNamespace is the Namespace of v1.0, the table and
// Options.Namespace, as in: postgres table idem_records namespace "". The
// blobs written by v1.0 carry its digest. It cannot tell two databases
// apart, so a sweep leaves those blobs alone (blobstore.LegacyNamespacer);
// their replays read them as before.
func (s *Store) LegacyNamespace() string { return s.legacy }

// statements are the SQL texts with the table's names filled in.
type statements struct {
	acquire, renew, complete, completeTx, release, get, del, reap string

	acquireMany, completeMany, releaseMany string // batch.go
}

// names are the quoted identifiers of the table and the objects it owns.
type names struct {
	table, index, seq, storeID string
	// The same names as SQL string literals, for to_regclass.
	tableLit, indexLit, seqLit, storeIDLit string
}

var identPart = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,47}$`)

// tableNames validates table and returns the quoted names of the table,
// its expiry index (unqualified: an index lives in its table's schema) and
// its token sequence.
func tableNames(table string) (names, error) {
	if table == "" {
		table = DefaultTable
	}
	parts := strings.Split(table, ".")
	if len(parts) > 2 {
		return names{}, fmt.Errorf("pgstore: table name %q: want name or schema.name", table)
	}
	for _, p := range parts {
		if !identPart.MatchString(p) {
			return names{}, fmt.Errorf("pgstore: table name %q: each part must be 1 to 48 letters, digits or underscores, not starting with a digit", table)
		}
	}
	name := parts[len(parts)-1]
	seq := slices.Clone(parts)
	seq[len(seq)-1] = name + "_token"
	index := slices.Clone(parts) // to_regclass needs the schema too
	index[len(index)-1] = name + "_expires_at"
	storeID := slices.Clone(parts)
	storeID[len(storeID)-1] = name + "_store_id"
	lit := func(id pgx.Identifier) string { return "'" + strings.ReplaceAll(id.Sanitize(), "'", "''") + "'" }
	return names{
		table:      pgx.Identifier(parts).Sanitize(),
		index:      pgx.Identifier{name + "_expires_at"}.Sanitize(),
		seq:        pgx.Identifier(seq).Sanitize(),
		storeID:    pgx.Identifier(storeID).Sanitize(),
		tableLit:   lit(parts),
		indexLit:   lit(index),
		seqLit:     lit(seq),
		storeIDLit: lit(storeID),
	}, nil
}

// fill puts the names into a statement.
func (n names) fill(sql string) string {
	return strings.NewReplacer("{table}", n.table, "{index}", n.index, "{seq}", n.seq, "{store_id}", n.storeID,
		"{table_lit}", n.tableLit, "{index_lit}", n.indexLit, "{seq_lit}", n.seqLit, "{store_id_lit}", n.storeIDLit).Replace(sql)
}

// Migrate creates table (DefaultTable if empty), its expiry index, its
// token sequence and the table of its store id (<table>_store_id, see
// Store.Namespace) with the id, those that do not exist yet. It is
// idempotent and safe to run from several processes at once.
func Migrate(ctx context.Context, pool *pgxpool.Pool, table string) error {
	n, err := tableNames(table)
	if err != nil {
		return err
	}
	// Nothing to do when everything exists: CREATE INDEX IF NOT EXISTS
	// would still wait for a SHARE lock, which conflicts with every
	// transaction writing to the table, and hold up the writers queued
	// behind it (a rolling deploy would stall the live traffic). A table
	// migrated by v1.0 lacks the store id's table only: it is created
	// alone.
	var present, idPresent bool
	if err := pool.QueryRow(ctx, n.fill(migratedSQL)).Scan(&present, &idPresent); err != nil {
		return fmt.Errorf("pgstore: migrate %s: %w", n.table, err)
	}
	// No arguments: pgx sends the simple protocol, which runs the
	// statements in one implicit transaction.
	switch {
	case !present:
		_, err = pool.Exec(ctx, n.fill(migrateSQL))
	case !idPresent:
		_, err = pool.Exec(ctx, n.fill(storeIDTableSQL))
		if pgid.Denied(err) {
			// v1.0's tables, made by a role with rights this one lacks:
			// they work as they did, and the store keeps v1.0's
			// namespace (New warns).
			return nil
		}
	}
	if err == nil {
		_, err = pool.Exec(ctx, n.fill(insertIDSQL), storeid.New())
		if pgid.Denied(err) {
			err = nil // as above
		}
	}
	if err != nil {
		return fmt.Errorf("pgstore: migrate %s: %w", n.table, err)
	}
	return nil
}

// New returns a Store on pool, which stays the caller's: Close stops the
// store's reaper (Options.ReapInterval) and leaves the pool open. It runs
// Migrate first if opts.Migrate is set. It then reads the store id (Namespace),
// storing one first unless opts.NoStoreID (into the id's table, which
// Migrate creates: New creates no table without opts.Migrate). A
// database that does not answer does not fail New, as in v1.0: the id is
// read when Namespace is next asked.
func New(ctx context.Context, pool *pgxpool.Pool, opts Options) (*Store, error) {
	if pool == nil {
		return nil, errors.New("pgstore: New: nil pool")
	}
	n, err := tableNames(opts.Table)
	if err != nil {
		return nil, err
	}
	if opts.Migrate {
		if err := Migrate(ctx, pool, opts.Table); err != nil {
			return nil, err
		}
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if !utf8.ValidString(opts.Namespace) || strings.ContainsRune(opts.Namespace, 0) {
		return nil, errors.New("pgstore: New: Options.Namespace must be valid UTF-8 without NUL bytes")
	}
	if opts.ReapGrace < 0 {
		return nil, fmt.Errorf("pgstore: New: Options.ReapGrace %v is negative", opts.ReapGrace)
	}
	if opts.ReapGrace == 0 {
		opts.ReapGrace = DefaultReapGrace
	}
	s := &Store{
		pool:   pool,
		grace:  opts.ReapGrace,
		ns:     opts.Namespace,
		legacy: fmt.Sprintf("postgres table %s namespace %q", cmp.Or(opts.Table, DefaultTable), opts.Namespace),
		log:    opts.Logger,
		onReap: opts.OnReap,
		names:  n,
		sql: statements{
			acquire:    n.fill(acquireSQL),
			renew:      n.fill(renewSQL),
			complete:   n.fill(completeSQL),
			completeTx: n.fill(completeTxSQL),
			release:    n.fill(releaseSQL),
			get:        n.fill(getSQL),
			del:        n.fill(deleteSQL),
			reap:       n.fill(reapSQL),

			acquireMany:  n.fill(acquireManySQL),
			completeMany: n.fill(completeManySQL),
			releaseMany:  n.fill(releaseManySQL),
		},
	}
	var onNone func(error)
	if !opts.NoStoreID {
		onNone = storeid.LegacyWarning(s.log, "pgstore", n.storeID)
	}
	s.id = storeid.Open(ctx, pgid.Read(s.pool, n.fill(insertIDSQL), n.fill(selectIDSQL), n.storeID, !opts.NoStoreID), storeIDTimeout, onNone)
	if opts.ReapInterval > 0 {
		s.reaper, _ = reaper.Start(ctx, s.reaperConfig(opts.ReapInterval, DefaultReapBatch)) // both positive: no error
	}
	return s, nil
}

// DefaultReapBatch is the most records one statement of the store's
// reaper (Options.ReapInterval) deletes.
const DefaultReapBatch = 1000

// ErrBadURL is wrapped by Open's errors about the form of its URL.
var ErrBadURL = errors.New("not a PostgreSQL URL of a form Open accepts (" + pgurl.Form + ")")

// Open returns a Store on a pool of its own on the PostgreSQL database at
// url, postgres://[user[:pass]@]host[:port]/db[?params] (or
// postgresql://), whose params are pgx's (pgxpool.ParseConfig): sslmode,
// pool_max_conns and the like. Connecting times out after 10 seconds
// unless the URL sets connect_timeout. The pool connects on first use, or
// at once with opts.Migrate. Close stops the reaper
// (opts.ReapInterval) and closes the pool; Pool returns it, for
// BeginFunc and CompleteTx.
//
// A URL of another form is an error wrapping ErrBadURL, before any
// connection is tried: a scheme other than postgres or postgresql, a URL
// without a host (postgres:host/db, with the // missing), or parameters
// pgx refuses. Errors never repeat the URL's password.
func Open(ctx context.Context, url string, opts Options) (*Store, error) {
	cfg, err := pgurl.Parse(url)
	if err != nil {
		return nil, fmt.Errorf("pgstore: Open: %w: %w", ErrBadURL, err)
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("pgstore: Open: %w", err)
	}
	s, err := New(ctx, pool, opts)
	if err != nil {
		pool.Close()
		return nil, err
	}
	s.owned = true
	return s, nil
}

// Pool returns the store's pool: the one New was given, or the one Open
// made, which Close closes. BeginFunc and CompleteTx take it (or a
// transaction begun on it).
func (s *Store) Pool() *pgxpool.Pool { return s.pool }

// Close stops the store's reaper (Options.ReapInterval), waiting for a
// pass in progress to be cancelled, and then, if Open made the pool,
// closes it. It leaves a pool given to New open. Calling it again does
// nothing. It returns nil.
func (s *Store) Close() error {
	s.closeOnce.Do(func() {
		s.reaper.Stop()
		if s.owned {
			s.pool.Close()
		}
	})
	return nil
}

// reaperConfig is the reaper loop (internal/reaper) of this store.
func (s *Store) reaperConfig(every time.Duration, batch int) reaper.Config {
	return reaper.Config{Every: every, Batch: batch, Reap: s.Reap, Name: "pgstore",
		Attrs: []slog.Attr{slog.String("table", s.names.table)}, Logger: s.log, OnReap: s.onReap}
}

// storeIDTimeout bounds reading the store id.
const storeIDTimeout = 5 * time.Second

// Acquire implements idem.Store. A request that fails Validate is an error
// and writes nothing.
func (s *Store) Acquire(ctx context.Context, req idem.AcquireRequest) (idem.Acquisition, error) {
	if err := req.Validate(); err != nil {
		return idem.Acquisition{}, err
	}
	if err := ctxErr(ctx, "acquire", req.Key); err != nil {
		return idem.Acquisition{}, err
	}
	var r row
	var leftNow time.Duration
	err := s.pool.QueryRow(ctx, s.sql.acquire, s.ns, req.Key[:], req.Fingerprint[:], req.LeaseID[:], interval(req.TTL)).
		Scan(append(r.dest(), &leftNow)...)
	if err != nil {
		return idem.Acquisition{}, &idem.StoreError{Op: "acquire", Key: req.Key, Err: err}
	}
	return acquisition(req, &r, leftNow)
}

// acquisition maps the row acquireSQL (or acquireManySQL) returned for
// req, and the time left at the statement's end, to Acquire's answer.
func acquisition(req idem.AcquireRequest, r *row, leftNow time.Duration) (idem.Acquisition, error) {
	rec, err := r.record()
	if err != nil {
		return idem.Acquisition{}, &idem.StoreError{Op: "acquire", Key: req.Key, Err: err}
	}
	switch {
	case rec.State == idem.StateInFlight && rec.LeaseID == req.LeaseID:
		// Taken by this statement (the time left is the TTL, rounded up to
		// a microsecond) or, after a lost reply, by the same call before.
		// The time left is measured at the statement's end: a statement
		// that waited on a row lock must not report more than is left.
		if leftNow <= 0 { // already over: the caller may try again at once
			return idem.Acquisition{Outcome: idem.InFlight, RetryAfter: time.Millisecond}, nil
		}
		l := idem.Lease{Key: req.Key, ID: req.LeaseID, Token: rec.Token, TTL: min(req.TTL, leftNow)}
		return idem.Acquisition{Outcome: idem.Acquired, Lease: l}, nil
	case rec.Fingerprint != req.Fingerprint:
		return idem.Acquisition{Outcome: idem.Mismatch}, nil
	case rec.State == idem.StateInFlight:
		// The lease may have ended while the statement ran: retry soon.
		return idem.Acquisition{Outcome: idem.InFlight, RetryAfter: max(leftNow, time.Millisecond)}, nil
	}
	// Completed: the statement returns no released or dead record.
	resp, err := decode(r.response)
	if err != nil {
		return idem.Acquisition{}, &idem.StoreError{Op: "acquire", Key: req.Key, Err: err}
	}
	return idem.Acquisition{Outcome: idem.Replay, Response: resp}, nil
}

// Renew implements idem.Store. A ttl shorter than a millisecond is an
// error and changes nothing.
func (s *Store) Renew(ctx context.Context, l idem.Lease, ttl time.Duration) error {
	if ttl < time.Millisecond {
		return fmt.Errorf("pgstore: renew: lease TTL %v is shorter than 1ms", ttl)
	}
	if err := ctxErr(ctx, "renew", l.Key); err != nil {
		return err
	}
	tag, err := s.pool.Exec(ctx, s.sql.renew, s.ns, l.Key[:], l.ID[:], interval(ttl))
	if err != nil {
		return &idem.StoreError{Op: "renew", Key: l.Key, Err: err}
	}
	return lost(tag.RowsAffected() == 1)
}

// Complete implements idem.Store. resp is encoded before the call returns
// and not retained; a nil resp is an error. A retention shorter than a
// millisecond is an error and changes nothing. For completion inside the
// caller's transaction, see CompleteTx.
func (s *Store) Complete(ctx context.Context, l idem.Lease, resp *idem.Response, retention time.Duration) error {
	enc, err := s.encode(ctx, "complete", l, resp, retention)
	if err != nil {
		return err
	}
	var ok bool
	err = s.pool.QueryRow(ctx, s.sql.complete, s.ns, l.Key[:], l.ID[:], enc, interval(retention), int64(l.Token)).Scan(&ok)
	if err != nil {
		return &idem.StoreError{Op: "complete", Key: l.Key, Err: err}
	}
	return lost(ok)
}

// CompleteTx is Complete run in the caller's transaction tx, so that the
// completion commits, or not, with the business writes made in tx: see the
// package documentation. Until tx ends, the record is locked: other
// callers' Acquire of the key answer in flight, or, once the lease has
// ended, wait for tx.
//
// It returns nil when the record is now completed in tx, ErrLeaseLost when
// the lease ended or was taken over, or completed or released already (also
// by this very lease: a repeat would commit the business writes twice),
// and a *StoreError when the statement fails. On any error, roll tx back.
// The statement is one round trip on tx's connection.
func (s *Store) CompleteTx(ctx context.Context, tx pgx.Tx, l idem.Lease, resp *idem.Response, retention time.Duration) error {
	enc, err := s.encode(ctx, "complete", l, resp, retention)
	if err != nil {
		return err
	}
	tag, err := tx.Exec(ctx, s.sql.completeTx, s.ns, l.Key[:], l.ID[:], enc, interval(retention))
	if err != nil {
		return &idem.StoreError{Op: "complete", Key: l.Key, Err: err}
	}
	return lost(tag.RowsAffected() == 1)
}

// encode checks Complete's and CompleteTx's arguments and encodes resp.
func (s *Store) encode(ctx context.Context, op string, l idem.Lease, resp *idem.Response, retention time.Duration) ([]byte, error) {
	if retention < time.Millisecond {
		return nil, fmt.Errorf("pgstore: %s: retention %v is shorter than 1ms", op, retention)
	}
	if err := ctxErr(ctx, op, l.Key); err != nil {
		return nil, err
	}
	enc, err := resp.AppendBinary(nil)
	if err != nil {
		return nil, &idem.StoreError{Op: op, Key: l.Key, Err: err}
	}
	return enc, nil
}

// Release implements idem.Store. The tombstone left behind is kept for
// l.TTL (at least a millisecond), so that a repeated Release and Get see
// it; the next token is larger in any case.
func (s *Store) Release(ctx context.Context, l idem.Lease) error {
	if err := ctxErr(ctx, "release", l.Key); err != nil {
		return err
	}
	var ok bool
	err := s.pool.QueryRow(ctx, s.sql.release, s.ns, l.Key[:], l.ID[:], interval(max(l.TTL, time.Millisecond)), int64(l.Token)).Scan(&ok)
	if err != nil {
		return &idem.StoreError{Op: "release", Key: l.Key, Err: err}
	}
	return lost(ok)
}

// Get implements idem.Store. Record.Size is the length of the encoded
// response plus the fixed-size columns.
func (s *Store) Get(ctx context.Context, key idem.Key) (idem.Record, bool, error) {
	if err := ctxErr(ctx, "get", key); err != nil {
		return idem.Record{}, false, err
	}
	var r row
	err := s.pool.QueryRow(ctx, s.sql.get, s.ns, key[:]).Scan(r.dest()...)
	if errors.Is(err, pgx.ErrNoRows) {
		return idem.Record{}, false, nil
	}
	if err != nil {
		return idem.Record{}, false, &idem.StoreError{Op: "get", Key: key, Err: err}
	}
	rec, err := r.record()
	if err == nil && rec.State == idem.StateCompleted {
		rec.Response, err = decode(r.response)
	}
	if err != nil {
		return idem.Record{}, false, &idem.StoreError{Op: "get", Key: key, Err: err}
	}
	return rec, true, nil
}

// Delete implements idem.Store. It also deletes an expired record, but
// reports true only for a live one. Tokens keep increasing after it.
func (s *Store) Delete(ctx context.Context, key idem.Key) (bool, error) {
	if err := ctxErr(ctx, "delete", key); err != nil {
		return false, err
	}
	var live bool
	err := s.pool.QueryRow(ctx, s.sql.del, s.ns, key[:]).Scan(&live)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil
	}
	if err != nil {
		return false, &idem.StoreError{Op: "delete", Key: key, Err: err}
	}
	return live, nil
}

// Reap deletes the table's expired records, of every namespace, in
// statements of at most batch rows each (so that no statement holds many
// locks or writes much WAL at once), until a statement finds fewer than
// batch or ctx ends. It returns how many it deleted. Records locked by a
// transaction in progress are left for a later pass. Expired records are
// absent to every method already: reaping only reclaims space.
func (s *Store) Reap(ctx context.Context, batch int) (deleted int, err error) {
	if batch < 1 {
		return 0, fmt.Errorf("pgstore: reap: batch %d is less than 1", batch)
	}
	for {
		if err := ctx.Err(); err != nil {
			return deleted, fmt.Errorf("pgstore: reap %s: %w", s.names.table, err)
		}
		tag, err := s.pool.Exec(ctx, s.sql.reap, batch, interval(s.grace))
		if err != nil {
			return deleted, fmt.Errorf("pgstore: reap %s: %w", s.names.table, err)
		}
		n := int(tag.RowsAffected())
		deleted += n
		if n < batch {
			return deleted, nil
		}
	}
}

// RunReaper calls Reap(ctx, batch) at every tick of every until ctx ends,
// then returns nil; it returns an error at once if every or batch is not
// positive. A failed pass is logged to Options.Logger and tried again at
// the next tick; each pass is reported to Options.OnReap. One reaper per
// table is enough, whatever the namespaces; more do no harm. To stop it
// before closing the pool, cancel ctx and wait for RunReaper to return.
//
// Options.ReapInterval runs the same loop, owned by the store: started by
// New or Open, stopped by Close. Prefer it.
func (s *Store) RunReaper(ctx context.Context, every time.Duration, batch int) error {
	if err := reaper.Run(ctx, s.reaperConfig(every, batch)); err != nil {
		return fmt.Errorf("pgstore: RunReaper: %w", err)
	}
	return nil
}

// row is a record as the statements return it.
type row struct {
	state       int16
	token       int64
	fp, leaseID []byte
	left        time.Duration
	response    []byte
}

func (r *row) dest() []any {
	return []any{&r.state, &r.token, &r.fp, &r.leaseID, &r.left, &r.response}
}

// fixedSize is the size of a record's columns besides the response and
// the namespace: key, state, token, fingerprint, lease id and expiry.
const fixedSize = 16 + 2 + 8 + 16 + 16 + 8

// record checks the row and returns it as a Record without the Response.
// A row that no statement of the store writes is corrupt.
func (r *row) record() (idem.Record, error) {
	rec := idem.Record{State: idem.State(r.state), Token: uint64(r.token), TTL: r.left, Size: fixedSize + len(r.response)}
	ok := r.token > 0
	switch rec.State {
	case idem.StateInFlight:
		ok = ok && len(r.fp) == len(rec.Fingerprint) && len(r.leaseID) == len(rec.LeaseID)
	case idem.StateCompleted:
		ok = ok && len(r.fp) == len(rec.Fingerprint) && r.response != nil
	case idem.StateReleased:
		ok = ok && r.fp == nil
	default:
		ok = false
	}
	if !ok {
		return idem.Record{}, fmt.Errorf("%w: row with state %d, token %d, %d-byte fingerprint, %d-byte lease id",
			idem.ErrCorrupt, r.state, r.token, len(r.fp), len(r.leaseID))
	}
	copy(rec.Fingerprint[:], r.fp)
	copy(rec.LeaseID[:], r.leaseID)
	return rec, nil
}

func decode(enc []byte) (*idem.Response, error) {
	resp := new(idem.Response)
	if err := resp.UnmarshalBinary(enc); err != nil {
		return nil, err
	}
	return resp, nil
}

// interval returns d rounded up to the microsecond, the resolution of
// PostgreSQL's interval (pgx would truncate it).
func interval(d time.Duration) time.Duration {
	if d > math.MaxInt64-time.Microsecond { // saturate instead of wrapping
		return d.Truncate(time.Microsecond)
	}
	return (d + time.Microsecond - 1).Truncate(time.Microsecond)
}

// lost maps a statement's verdict to nil or ErrLeaseLost.
func lost(ok bool) error {
	if ok {
		return nil
	}
	return idem.ErrLeaseLost
}

func ctxErr(ctx context.Context, op string, key idem.Key) error {
	if err := ctx.Err(); err != nil {
		return &idem.StoreError{Op: op, Key: key, Err: err}
	}
	return nil
}
