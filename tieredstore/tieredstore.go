package tieredstore

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"regexp"
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
	"github.com/idemkit/idem/pgstore"
	"github.com/idemkit/idem/redisstore"
)

// DefaultTable is the table name when Options.Table is empty.
const DefaultTable = "idem_completions"

// Defaults of Options' zero fields.
const (
	DefaultRelayInterval = time.Second
	DefaultRelayDelay    = 2 * time.Second
	DefaultReapInterval  = time.Minute
	DefaultReapGrace     = time.Hour
)

// Options configures a Store. The zero value means the defaults.
type Options struct {
	// Table holds the completions, optionally qualified by a schema that
	// exists already ("idem.completions"). Each part is 1 to 48 letters,
	// digits or underscores, not starting with a digit. Default
	// DefaultTable.
	Table string

	// Namespace isolates stores sharing a table, as the Redis store's
	// Prefix isolates them in Redis. The two must pair one to one: stores
	// with the same Redis prefix use the same namespace, and stores with
	// different prefixes different namespaces.
	Namespace string

	// Migrate makes New create the table and its indexes if they are
	// missing (Migrate).
	Migrate bool

	// NoStoreID keeps New from storing a store id for the PostgreSQL side
	// (see Namespace) in a database that has none: for tools that create
	// nothing (idem inspect, purge and gc; give the Redis store
	// redisstore.Options.NoStoreID too). Default false.
	NoStoreID bool

	// VerifyAcquire makes Acquire read PostgreSQL once after Redis grants
	// a lease: a key that PostgreSQL holds completed (because Redis lost
	// its record) is answered Replay (or Mismatch) and copied back to
	// Redis, instead of being granted, and the lease's token is raised
	// above any token PostgreSQL committed for the key. It costs one
	// PostgreSQL read (an index lookup, no commit) per first execution.
	// Without it, a key whose Redis record was lost runs again, and its
	// CompleteTx fails with the first completion (see the package
	// documentation). Use it when the work has effects outside
	// PostgreSQL that matter more than that read: idem proxy turns it on.
	VerifyAcquire bool

	// RelayInterval is how often the background relay looks for
	// completions that were committed but not copied to Redis (the
	// outbox). Default DefaultRelayInterval. Negative: no background relay
	// and no reaper (then call RelayPending and Reap yourself).
	RelayInterval time.Duration

	// RelayDelay is how old an unrelayed completion must be before the
	// background relay copies it: the synchronous relay after the commit
	// normally does it first. Default DefaultRelayDelay.
	RelayDelay time.Duration

	// ReapInterval is how often the store's reaper deletes rows expired
	// for ReapGrace (Reap, in statements of at most 1000 rows). New and
	// Open start it beside the background relay, Close stops it. Default
	// DefaultReapInterval: unlike pgstore's and mysqlstore's, whose zero
	// value means no reaper, the tiered store runs a background loop in
	// any case. Negative: no reaper (call Reap yourself, or run another
	// process's reaper on the table).
	ReapInterval time.Duration

	// ReapGrace is how long an expired completion is kept: until then its
	// token stays the floor of the key's next completion. Default
	// DefaultReapGrace.
	ReapGrace time.Duration

	// Logger receives the background relay's failures. Default
	// slog.Default().
	Logger *slog.Logger

	// OnReap, when set, is called after each pass of the background
	// reaper with the number of rows the pass deleted, how long it took,
	// and its error (nil when it finished; a failure is also logged to
	// Logger). A pass cut short by Close is not reported. It is called on
	// the background relay's goroutine, which waits for it: it should not
	// block.
	OnReap func(deleted int, took time.Duration, err error)
}

// Store is an idem.Store with leases and replays on Redis and completions
// in PostgreSQL: see the package documentation. It is safe for concurrent
// use. Create one with New or Open, and Close it.
type Store struct {
	redis  *redisstore.Store
	pool   *pgxpool.Pool
	ns     string
	table  string          // Options.Table, or DefaultTable
	pgID   *storeid.Holder // the PostgreSQL side's store id (Namespace)
	legacy string          // LegacyNamespace
	verify bool
	log    *slog.Logger
	onReap func(deleted int, took time.Duration, err error)
	sql    statements

	relayDelay   time.Duration
	reapGrace    time.Duration
	relayEvery   time.Duration
	reapEvery    time.Duration
	marks        chan mark
	reaper       *reaper.Reaper // ReapInterval's, or nil
	stop         context.CancelFunc
	done         chan struct{}
	closeOnce    sync.Once
	closeClients func()
}

var (
	_ idem.Store      = (*Store)(nil)
	_ idem.Namespacer = (*Store)(nil)
)

// Namespace implements idem.Namespacer: the Redis store's (with the store
// id kept in Redis), the table, Options.Namespace and the store id kept
// in PostgreSQL, as in: tiered redis prefix "idem:" store 3f0c… postgres
// table idem_completions namespace "" store 9a1e…. It differs from the
// Redis store's alone: a tiered store's records are not all in Redis. The
// PostgreSQL id is kept in the one-row table <Table>_store_id, which
// Migrate creates and the first New fills (as pgstore's): so another
// PostgreSQL database behind the same Redis has another namespace. A
// database without it (migrated by v1.0 and not since) leaves that part
// out; the Redis store's id still names the Redis database.
func (s *Store) Namespace() string {
	ns := fmt.Sprintf("tiered %s postgres table %s namespace %q", s.redis.Namespace(), s.table, s.ns)
	if id := s.pgID.Get(); id != "" {
		ns += " store " + id
	}
	return ns
}

// LegacyNamespace is v1.0's Namespace, with the Redis store's
// LegacyNamespace (its prefix, without its store id): the blobs named
// with it are left alone by sweeps (blobstore.LegacyNamespacer).
func (s *Store) LegacyNamespace() string { return s.legacy }

type statements struct {
	complete, row, del, pending, mark, reap, count string
}

var identPart = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,47}$`)

// names checks table (DefaultTable if empty) and returns the replacer
// that puts its quoted names (the table, its expiry index and its outbox,
// as identifiers and as string literals) in place of {table}, {expiry},
// {outbox} and their _lit forms in the statements and the schema.
func names(table string) (*strings.Replacer, error) {
	if table == "" {
		table = DefaultTable
	}
	parts := strings.Split(table, ".")
	if len(parts) > 2 {
		return nil, fmt.Errorf("tieredstore: table name %q: want name or schema.name", table)
	}
	for _, p := range parts {
		if !identPart.MatchString(p) {
			return nil, fmt.Errorf("tieredstore: table name %q: each part must be 1 to 48 letters, digits or underscores, not starting with a digit", table)
		}
	}
	name := parts[len(parts)-1]
	quote := func(id pgx.Identifier) string { return "'" + strings.ReplaceAll(id.Sanitize(), "'", "''") + "'" }
	qualified := func(suffix string) pgx.Identifier {
		n := append([]string(nil), parts...)
		n[len(n)-1] = name + suffix
		return n
	}
	return strings.NewReplacer(
		"{table_lit}", quote(parts),
		"{expiry_lit}", quote(qualified("_expires_at")),
		"{outbox_lit}", quote(qualified("_outbox")),
		"{store_id_lit}", quote(qualified("_store_id")),
		"{store_id}", pgx.Identifier(qualified("_store_id")).Sanitize(),
		"{table}", pgx.Identifier(parts).Sanitize(),
		"{expiry}", pgx.Identifier{name + "_expires_at"}.Sanitize(),
		"{outbox}", pgx.Identifier{name + "_outbox"}.Sanitize(),
	), nil
}

// Migrate creates table (DefaultTable if empty) and its indexes, those
// that do not exist yet. It is idempotent and safe to run from several
// processes at once.
func Migrate(ctx context.Context, pool *pgxpool.Pool, table string) error {
	r, err := names(table)
	if err != nil {
		return err
	}
	// Nothing to do when everything exists: CREATE INDEX IF NOT EXISTS
	// would still wait for a lock that conflicts with every transaction
	// writing to the table, and hold up the writers queued behind it.
	// A table migrated by v1.0 lacks the store id's table only: it is
	// created alone.
	var present, idPresent bool
	if err := pool.QueryRow(ctx, r.Replace(migratedSQL)).Scan(&present, &idPresent); err != nil {
		return fmt.Errorf("tieredstore: migrate: %w", err)
	}
	switch {
	case !present:
		_, err = pool.Exec(ctx, r.Replace(migrateSQL))
	case !idPresent:
		_, err = pool.Exec(ctx, r.Replace(storeIDTableSQL))
		if pgid.Denied(err) {
			// v1.0's tables, made by a role with rights this one lacks:
			// they work as they did, without the PostgreSQL id (New
			// warns).
			return nil
		}
	}
	if err == nil {
		_, err = pool.Exec(ctx, r.Replace(insertIDSQL), storeid.New())
		if pgid.Denied(err) {
			err = nil // as above
		}
	}
	if err != nil {
		return fmt.Errorf("tieredstore: migrate: %w", err)
	}
	return nil
}

// New returns a Store on a Redis store and a PostgreSQL pool, which stay
// the caller's, and starts its background relay (unless
// Options.RelayInterval is negative); Close stops it. It runs Migrate
// first with Options.Migrate. The Redis store's Prefix and the Namespace
// must name the same set of records.
func New(ctx context.Context, rs *redisstore.Store, pool *pgxpool.Pool, opts Options) (*Store, error) {
	if rs == nil || pool == nil {
		return nil, errors.New("tieredstore: New: nil Redis store or PostgreSQL pool")
	}
	r, err := names(opts.Table)
	if err != nil {
		return nil, err
	}
	if !utf8.ValidString(opts.Namespace) || strings.ContainsRune(opts.Namespace, 0) {
		return nil, errors.New("tieredstore: New: Options.Namespace must be valid UTF-8 without NUL bytes")
	}
	if opts.RelayDelay < 0 || opts.ReapGrace < 0 {
		return nil, errors.New("tieredstore: New: negative Options.RelayDelay or ReapGrace")
	}
	if opts.Migrate {
		if err := Migrate(ctx, pool, opts.Table); err != nil {
			return nil, err
		}
	}
	s := &Store{
		redis:      rs,
		pool:       pool,
		ns:         opts.Namespace,
		table:      cmp.Or(opts.Table, DefaultTable),
		legacy:     fmt.Sprintf("tiered %s postgres table %s namespace %q", rs.LegacyNamespace(), cmp.Or(opts.Table, DefaultTable), opts.Namespace),
		verify:     opts.VerifyAcquire,
		log:        opts.Logger,
		onReap:     opts.OnReap,
		relayDelay: orDefault(opts.RelayDelay, DefaultRelayDelay),
		reapGrace:  orDefault(opts.ReapGrace, DefaultReapGrace),
		relayEvery: orDefault(opts.RelayInterval, DefaultRelayInterval),
		reapEvery:  orDefault(opts.ReapInterval, DefaultReapInterval),
		sql: statements{
			complete: r.Replace(completeSQL),
			row:      r.Replace(rowSQL),
			del:      r.Replace(deleteSQL),
			pending:  r.Replace(pendingSQL),
			mark:     r.Replace(markSQL),
			reap:     r.Replace(reapSQL),
			count:    r.Replace(countPendingSQL),
		},
		marks: make(chan mark, markQueue),
		done:  make(chan struct{}),
	}
	if s.log == nil {
		s.log = slog.Default()
	}
	var onNone func(error)
	if !opts.NoStoreID {
		onNone = func(why error) {
			s.log.Warn("tieredstore: the PostgreSQL database has no store id, so this store's namespace names its Redis database only; run Migrate (Options.Migrate) to create the id's table",
				slog.String("table", r.Replace("{store_id}")), slog.Any("error", why))
		}
	}
	s.pgID = storeid.Open(ctx, pgid.Read(pool, r.Replace(insertIDSQL), r.Replace(selectIDSQL), r.Replace("{store_id}"), !opts.NoStoreID), 5*time.Second, onNone)
	bg, stop := context.WithCancel(context.WithoutCancel(ctx))
	s.stop = stop
	if opts.RelayInterval < 0 {
		close(s.done)
		s.marks = nil // nobody marks: the rows stay in the outbox for RelayPending
	} else {
		go s.background(bg)
		if s.reapEvery > 0 {
			s.reaper, _ = reaper.Start(ctx, reaper.Config{Every: s.reapEvery, Batch: reapBatch, Reap: s.Reap, // both positive: no error
				Name: "tieredstore", Attrs: []slog.Attr{slog.String("table", s.table)}, Logger: s.log, OnReap: s.onReap})
		}
	}
	return s, nil
}

// orDefault returns v, or def when v is zero.
func orDefault(v, def time.Duration) time.Duration {
	if v == 0 {
		return def
	}
	return v
}

// Open connects to Redis at redisURL (the forms redisstore.Open takes)
// and to PostgreSQL at pgURL (the forms pgstore.Open takes, with its
// 10-second connect timeout unless the URL sets connect_timeout), and
// returns a Store that owns both clients: Close closes them; Redis and
// Pool return them. The Redis client connects at once (as
// redisstore.Open's does); the PostgreSQL pool on its first use, or at
// once with opts.Migrate. A PostgreSQL URL of another form is an error
// wrapping pgstore.ErrBadURL (a Redis one, redisstore.ErrBadURL), before
// any connection is tried.
func Open(ctx context.Context, redisURL, pgURL string, ropts redisstore.Options, opts Options) (*Store, error) {
	cfg, err := pgurl.Parse(pgURL)
	if err != nil {
		return nil, fmt.Errorf("tieredstore: Open: %w: %w", pgstore.ErrBadURL, err)
	}
	rs, err := redisstore.Open(redisURL, ropts)
	if err != nil {
		return nil, err
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		rs.Close()
		return nil, fmt.Errorf("tieredstore: Open: %w", err)
	}
	s, err := New(ctx, rs, pool, opts)
	if err != nil {
		pool.Close()
		rs.Close()
		return nil, err
	}
	s.closeClients = func() { pool.Close(); rs.Close() }
	return s, nil
}

// Close stops the background relay, after marking what the synchronous
// relay copied, and the reaper (waiting for a pass in progress to be
// cancelled), and closes the clients if Open created them. Completions
// not yet copied to Redis stay in the outbox for the next relay.
func (s *Store) Close() error {
	s.closeOnce.Do(func() {
		s.stop()
		<-s.done
		s.reaper.Stop()
		if s.closeClients != nil {
			s.closeClients()
		}
	})
	return nil
}

// Redis returns the Redis store that holds the leases.
func (s *Store) Redis() *redisstore.Store { return s.redis }

// Pool returns the PostgreSQL pool of the completions: the one New was
// given, or the one Open made, which Close closes. BeginFunc and
// CompleteTx take it (or a transaction begun on it).
func (s *Store) Pool() *pgxpool.Pool { return s.pool }

// Acquire implements idem.Store: one Redis script, plus, with
// Options.VerifyAcquire and a lease granted, one PostgreSQL read.
func (s *Store) Acquire(ctx context.Context, req idem.AcquireRequest) (idem.Acquisition, error) {
	acq, err := s.redis.Acquire(ctx, req)
	if err != nil || acq.Outcome != idem.Acquired || !s.verify {
		return acq, err
	}
	l := acq.Lease
	r, ok, err := s.readRow(ctx, s.pool, l.Key)
	if err == nil && ok && r.live() {
		// Redis lost the record of a completed key: answer from
		// PostgreSQL and put the record back (over the lease just taken).
		if _, ferr := s.fill(ctx, l.Key, r); ferr != nil {
			s.redis.Release(context.WithoutCancel(ctx), l)
		}
		if r.fp != req.Fingerprint {
			return idem.Acquisition{Outcome: idem.Mismatch}, nil
		}
		return idem.Acquisition{Outcome: idem.Replay, Response: r.resp}, nil
	}
	if err == nil && ok && r.token >= l.Token {
		// PostgreSQL committed a larger token than Redis issued (Redis lost
		// the key and its clock is behind that token): raise this one.
		l, err = s.redis.RaiseToken(ctx, l, r.token)
		if errors.Is(err, idem.ErrLeaseLost) {
			return idem.Acquisition{Outcome: idem.InFlight, RetryAfter: time.Millisecond}, nil
		}
	}
	if err != nil {
		// Fail closed: nothing runs without the check it was asked for.
		s.redis.Release(context.WithoutCancel(ctx), l)
		return idem.Acquisition{}, storeErr("acquire", l.Key, err)
	}
	acq.Lease = l
	return acq, nil
}

// Renew implements idem.Store: one Redis script.
func (s *Store) Renew(ctx context.Context, l idem.Lease, ttl time.Duration) error {
	return s.redis.Renew(ctx, l, ttl)
}

// Release implements idem.Store: one Redis script.
func (s *Store) Release(ctx context.Context, l idem.Lease) error {
	return s.redis.Release(ctx, l)
}

// Complete implements idem.Store. It checks and extends the lease on Redis
// (one script), commits the completion to PostgreSQL in a transaction of
// its own (one statement), and copies it to Redis (one script; if that
// fails, the background relay copies it later, and Complete still returns
// nil: the completion is durable). When PostgreSQL holds another
// completion of the key already, Complete returns an
// *AlreadyCompletedError, which matches idem.ErrLeaseLost, and puts that
// completion back in Redis. A repeated Complete of the same lease returns
// nil. For completion inside your own transaction, see CompleteTx.
func (s *Store) Complete(ctx context.Context, l idem.Lease, resp *idem.Response, retention time.Duration) error {
	enc, err := s.encode(ctx, l, resp, retention)
	if err != nil {
		return err
	}
	fp, err := s.redis.Hold(ctx, l, max(l.TTL, time.Millisecond))
	if errors.Is(err, idem.ErrLeaseLost) {
		// Perhaps this lease completed already (a repeat after a lost
		// reply): then the completion is in PostgreSQL, with its lease id.
		r, ok, rerr := s.readRow(ctx, s.pool, l.Key)
		switch {
		case rerr != nil:
			return storeErr("complete", l.Key, rerr)
		case ok && r.live() && r.lease == l.ID:
			s.fill(ctx, l.Key, r)
			return nil
		}
		return idem.ErrLeaseLost
	}
	if err != nil {
		return storeErr("complete", l.Key, err)
	}
	tag, err := s.pool.Exec(ctx, s.sql.complete, s.ns, l.Key[:], int64(l.Token), l.ID[:], fp[:], enc, interval(retention))
	if err != nil {
		return storeErr("complete", l.Key, err)
	}
	if tag.RowsAffected() == 1 {
		if err := s.relay(ctx, l, fp, enc, retention); err != nil {
			s.log.LogAttrs(ctx, slogWarn, "tieredstore: relay to Redis failed; the background relay will copy the completion",
				slogKey(l.Key), slogErr(err))
		}
		return nil
	}
	err = s.lost(ctx, s.pool, l, fp)
	var ace *AlreadyCompletedError
	if errors.As(err, &ace) && ace.ByLease {
		return nil // a repeat: this lease's completion is the one committed
	}
	return err
}

// Get implements idem.Store. It reads PostgreSQL, then Redis, and returns
// the Redis record when it is in flight or completed (what Acquire answers
// from); when Redis holds nothing for the key, or a released record, it
// returns the live completion PostgreSQL holds, if any (Redis lost it).
// Two round trips; nothing is written. A completion committed but not yet
// relayed shows in flight, as Acquire sees it.
//
// The order matters (found by the linearizability suite): once a
// completion has committed, Redis holds the completing lease's record,
// then the completion, until the completion expires, unless Redis loses
// it. So a completion read from PostgreSQL before Redis shows nothing is
// one that Redis lost, whereas one read after Redis showed nothing may be
// a completion committed meanwhile and not yet relayed, which no Acquire
// would answer yet.
func (s *Store) Get(ctx context.Context, key idem.Key) (idem.Record, bool, error) {
	if err := ctx.Err(); err != nil {
		return idem.Record{}, false, &idem.StoreError{Op: "get", Key: key, Err: err}
	}
	r, found, err := s.readRow(ctx, s.pool, key)
	if err != nil {
		return idem.Record{}, false, storeErr("get", key, err)
	}
	rec, ok, err := s.redis.Get(ctx, key)
	if err != nil || ok && (rec.State == idem.StateCompleted || rec.State == idem.StateInFlight) {
		return rec, ok, err
	}
	if found && r.live() {
		return idem.Record{State: idem.StateCompleted, Token: r.token, Fingerprint: r.fp, TTL: r.left,
			Response: r.resp, Size: rowFixedSize + r.size}, true, nil
	}
	return rec, ok, nil
}

// Delete implements idem.Store: it deletes the key's completion from
// PostgreSQL, then its record from Redis, and reports whether either was
// live. Like every Delete, it drops the key's token history.
func (s *Store) Delete(ctx context.Context, key idem.Key) (bool, error) {
	if err := ctx.Err(); err != nil {
		return false, &idem.StoreError{Op: "delete", Key: key, Err: err}
	}
	var live bool
	err := s.pool.QueryRow(ctx, s.sql.del, s.ns, key[:]).Scan(&live)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return false, &idem.StoreError{Op: "delete", Key: key, Err: err}
	}
	had, err := s.redis.Delete(ctx, key)
	return live || had, err
}

// encode checks Complete's and CompleteTx's arguments and encodes resp.
func (s *Store) encode(ctx context.Context, l idem.Lease, resp *idem.Response, retention time.Duration) ([]byte, error) {
	if retention < time.Millisecond {
		return nil, fmt.Errorf("tieredstore: complete: retention %v is shorter than 1ms", retention)
	}
	if err := ctx.Err(); err != nil {
		return nil, &idem.StoreError{Op: "complete", Key: l.Key, Err: err}
	}
	if l.Token == 0 || l.Token > math.MaxInt64 {
		return nil, fmt.Errorf("tieredstore: complete: token %d is not one Redis issues", l.Token)
	}
	enc, err := resp.AppendBinary(nil)
	if err != nil {
		return nil, &idem.StoreError{Op: "complete", Key: l.Key, Err: err}
	}
	return enc, nil
}

// querier is what the statements run on: the pool, or a transaction.
type querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// row is a key's completion as PostgreSQL holds it.
type row struct {
	token uint64
	lease idem.LeaseID
	fp    idem.Fingerprint
	enc   []byte // the encoded response
	resp  *idem.Response
	left  time.Duration // time until it expires; not positive once it has
	size  int
}

func (r *row) live() bool { return r.left > 0 }

// rowFixedSize is the size of a row's columns besides the response and
// the namespace: key, token, lease id, fingerprint, two timestamps, flag.
const rowFixedSize = 16 + 8 + 16 + 16 + 8 + 8 + 1

// readRow reads key's row, live or expired, and decodes it.
func (s *Store) readRow(ctx context.Context, q querier, key idem.Key) (row, bool, error) {
	var (
		r            row
		token        int64
		lease, fp, e []byte
	)
	err := q.QueryRow(ctx, s.sql.row, s.ns, key[:]).Scan(&token, &lease, &fp, &e, &r.left)
	if errors.Is(err, pgx.ErrNoRows) {
		return row{}, false, nil
	}
	if err != nil {
		return row{}, false, err
	}
	if token <= 0 || len(lease) != len(r.lease) || len(fp) != len(r.fp) {
		return row{}, false, fmt.Errorf("%w: completion row with token %d, %d-byte lease id, %d-byte fingerprint",
			idem.ErrCorrupt, token, len(lease), len(fp))
	}
	r.token, r.enc, r.size = uint64(token), e, len(e)
	copy(r.lease[:], lease)
	copy(r.fp[:], fp)
	r.resp = new(idem.Response)
	if err := r.resp.UnmarshalBinary(e); err != nil {
		return row{}, false, err
	}
	return r, true, nil
}

// lost explains a completion statement that changed nothing: it reads the
// row that won (in a new statement, which sees it) and puts it in Redis.
// It returns an *AlreadyCompletedError for a live completion, an error
// matching ErrStaleToken for an expired one with a token at least l's, and
// idem.ErrLeaseLost when the row has gone meanwhile (a Delete).
func (s *Store) lost(ctx context.Context, q querier, l idem.Lease, fp idem.Fingerprint) error {
	r, ok, err := s.readRow(ctx, q, l.Key)
	switch {
	case err != nil:
		return storeErr("complete", l.Key, err)
	case !ok:
		return idem.ErrLeaseLost
	case !r.live():
		// Committed tokens only grow: make the next lease's larger than
		// this completion's, then let the caller release this one.
		s.redis.RaiseToken(ctx, l, r.token)
		return &StaleTokenError{Key: l.Key, Token: l.Token, Committed: r.token}
	}
	s.fill(ctx, l.Key, r)
	e := &AlreadyCompletedError{Key: l.Key, Token: r.token, ByLease: r.lease == l.ID, Mismatch: r.fp != fp}
	if !e.Mismatch {
		e.Response = r.resp
	}
	return e
}

// fill copies a completion from PostgreSQL to Redis, and queues the mark
// of its row when Redis holds it now.
func (s *Store) fill(ctx context.Context, key idem.Key, r row) (redisstore.FillResult, error) {
	res, err := s.redis.Fill(ctx, redisstore.Fill{Key: key, Token: r.token, Fingerprint: r.fp, Lease: r.lease, TTL: r.left, Response: r.enc})
	if err == nil {
		s.marked(key, r.token, res)
	}
	return res, err
}

// storeErr wraps err in an *idem.StoreError for op, unless it is one
// already (then only its Op is set) or it is idem.ErrLeaseLost.
func storeErr(op string, key idem.Key, err error) error {
	if errors.Is(err, idem.ErrLeaseLost) {
		return err
	}
	var se *idem.StoreError
	if errors.As(err, &se) {
		c := *se
		c.Op = op
		return &c
	}
	return &idem.StoreError{Op: op, Key: key, Err: err}
}

// interval returns d rounded up to the microsecond, the resolution of
// PostgreSQL's interval (pgx would truncate it).
func interval(d time.Duration) time.Duration {
	if d > math.MaxInt64-time.Microsecond {
		return d.Truncate(time.Microsecond)
	}
	return (d + time.Microsecond - 1).Truncate(time.Microsecond)
}
