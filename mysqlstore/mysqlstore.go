package mysqlstore

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net"
	neturl "net/url"
	"regexp"
	"strings"
	"sync"
	"time"

	"github.com/go-sql-driver/mysql"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/reaper"
	"github.com/idemkit/idem/internal/storeid"
)

// DefaultReapGrace is Options.ReapGrace's default.
const DefaultReapGrace = time.Minute

// DefaultTable is the table name when Options.Table is empty.
const DefaultTable = "idem_records"

// MaxNamespace is the longest Options.Namespace, in bytes.
const MaxNamespace = 255

// Options configures a Store. The zero value means the defaults.
type Options struct {
	// Table is the table holding the records, optionally qualified by a
	// database that exists already ("idem.records"). Each part is an
	// unquoted-identifier-like name of at most 48 bytes: letters, digits
	// and underscores, not starting with a digit. The token counter is
	// the table <Table>_token. Default DefaultTable.
	Table string

	// Namespace isolates stores sharing a table: each sees only the
	// records of its own namespace. At most MaxNamespace bytes. Default "".
	Namespace string

	// Migrate makes New run Migrate for Table first.
	Migrate bool

	// ReapGrace is how long a record must have been expired before Reap
	// deletes it. Deleting a record the instant it expires lets an Acquire
	// that drew its token before a larger one was granted insert it; the
	// grace makes that need an Acquire stalled for this long. Default
	// DefaultReapGrace.
	ReapGrace time.Duration

	// ReapInterval, when positive, makes New and Open start the store's
	// reaper: every ReapInterval it deletes the table's expired records
	// (Reap, in statements of at most DefaultReapBatch rows), until Close
	// stops it. Zero or negative: no reaper (call Reap yourself), as with
	// pgstore, whose New starts nothing unless asked. One reaper per
	// table is enough, whatever the namespaces; more do no harm.
	ReapInterval time.Duration

	// Logger receives the failures of the reaper's passes. Default
	// slog.Default().
	Logger *slog.Logger

	// OnReap, when set, is called after each pass of the reaper
	// (ReapInterval) with the number of records the pass deleted, how
	// long it took, and its error (nil when it finished; a failure is
	// also logged to Logger). A pass cut short by Close is not reported.
	// It is called on the reaper's goroutine, which waits for it: it
	// should not block.
	OnReap func(deleted int, took time.Duration, err error)

	// NoStoreID keeps New from storing a store id (see Namespace) in a
	// database that has none: for tools that create nothing (idem inspect,
	// purge and gc). Namespace is then LegacyNamespace, whose blobs no
	// sweep judges. Default false.
	NoStoreID bool
}

// Store is an idem.Store on a MySQL or MariaDB table. It is safe for
// concurrent use. Create one with New, on a *sql.DB of yours, or Open, on
// a URL; Close it.
type Store struct {
	db     *sql.DB
	owned  bool           // Open made db: Close closes it
	reaper *reaper.Reaper // Options.ReapInterval's, or nil
	ns     string
	legacy string          // LegacyNamespace
	id     *storeid.Holder // the store id (Namespace)
	grace  time.Duration
	log    *slog.Logger
	onReap func(deleted int, took time.Duration, err error)
	names  names
	sql    statements

	mu    sync.Mutex
	stmts map[string]*sql.Stmt // prepared statements, by text

	afterDraw func(drawn int64) // tests: called between the draw and the insert

	closeOnce sync.Once
}

var (
	_ idem.Store      = (*Store)(nil)
	_ idem.Namespacer = (*Store)(nil)
)

// Namespace implements idem.Namespacer: the table, Options.Namespace and
// the store id, as in: mysql table idem_records namespace "" store 3f0c….
// The store id is 32 random hex digits kept in the database itself, in
// the one-row table <Table>_store_id, which Migrate creates; the first
// store that opens the database stores it. So two stores have one
// Namespace exactly when they read the same records: the same table and
// namespace in the same database (schema) of the same server, whatever
// address reaches it (a replica promoted, or a database restored from a
// dump, has the table's id). Another database or server has another id.
// The names of the blobs of large responses (idem.NewBlobName) carry its
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
// Options.Namespace, as in: mysql table idem_records namespace "". The
// blobs written by v1.0 carry its digest. It cannot tell two databases
// apart, so a sweep leaves those blobs alone (blobstore.LegacyNamespacer);
// their replays read them as before.
func (s *Store) LegacyNamespace() string { return s.legacy }

type statements struct {
	draw, acquire, get, renew, complete, completeTx, release string
	delLive, delDead, reapSelect, reapDelete                 string
}

type names struct{ table, tok, index, storeID string }

var identPart = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,47}$`)

func tableNames(table string) (names, error) {
	if table == "" {
		table = DefaultTable
	}
	parts := strings.Split(table, ".")
	if len(parts) > 2 {
		return names{}, fmt.Errorf("mysqlstore: table name %q: want name or database.name", table)
	}
	for _, p := range parts {
		if !identPart.MatchString(p) {
			return names{}, fmt.Errorf("mysqlstore: table name %q: each part must be 1 to 48 letters, digits or underscores, not starting with a digit", table)
		}
	}
	quote := func(ps []string) string { return "`" + strings.Join(ps, "`.`") + "`" }
	tok := append([]string(nil), parts...)
	tok[len(tok)-1] += "_token"
	storeID := append([]string(nil), parts...)
	storeID[len(storeID)-1] += "_store_id"
	return names{
		table:   quote(parts),
		tok:     quote(tok),
		index:   "`" + parts[len(parts)-1] + "_expires_at`",
		storeID: quote(storeID),
	}, nil
}

func (n names) fill(sql string) string {
	return strings.NewReplacer("{table}", n.table, "{tok}", n.tok, "{index}", n.index, "{store_id}", n.storeID).Replace(sql)
}

// Migrate creates table (DefaultTable if empty) with its expiry index, its
// token counter, and the table of its store id (<table>_store_id, see
// Store.Namespace) with the id, those that do not exist yet. It is
// idempotent and safe to run from several processes at once.
func Migrate(ctx context.Context, db *sql.DB, table string) error {
	n, err := tableNames(table)
	if err != nil {
		return err
	}
	for _, q := range migrateSQL {
		if err := retry(ctx, func() error { _, err := db.ExecContext(ctx, n.fill(q)); return err }); err != nil {
			return fmt.Errorf("mysqlstore: migrate %s: %w", n.table, err)
		}
	}
	id := storeid.New()
	if err := retry(ctx, func() error { _, err := db.ExecContext(ctx, n.fill(insertIDSQL), id); return err }); err != nil {
		return fmt.Errorf("mysqlstore: migrate %s: %w", n.table, err)
	}
	return nil
}

// New returns a Store on db, which stays the caller's: Close stops the
// store's reaper (Options.ReapInterval) and leaves db open. It runs
// Migrate first if opts.Migrate is set. It then reads the store id (Namespace),
// storing one first unless opts.NoStoreID (into the id's table, which
// Migrate creates: New creates no table without opts.Migrate). A
// database that does not answer does not fail New, as in v1.0: the id is
// read when Namespace is next asked.
func New(ctx context.Context, db *sql.DB, opts Options) (*Store, error) {
	if db == nil {
		return nil, errors.New("mysqlstore: New: nil db")
	}
	n, err := tableNames(opts.Table)
	if err != nil {
		return nil, err
	}
	if len(opts.Namespace) > MaxNamespace {
		return nil, fmt.Errorf("mysqlstore: New: Options.Namespace is %d bytes, more than %d", len(opts.Namespace), MaxNamespace)
	}
	if opts.ReapGrace < 0 {
		return nil, fmt.Errorf("mysqlstore: New: Options.ReapGrace %v is negative", opts.ReapGrace)
	}
	if opts.Migrate {
		if err := Migrate(ctx, db, opts.Table); err != nil {
			return nil, err
		}
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.ReapGrace == 0 {
		opts.ReapGrace = DefaultReapGrace
	}
	s := &Store{
		db:     db,
		ns:     opts.Namespace,
		legacy: fmt.Sprintf("mysql table %s namespace %q", cmp.Or(opts.Table, DefaultTable), opts.Namespace),
		grace:  opts.ReapGrace,
		log:    opts.Logger,
		onReap: opts.OnReap,
		names:  n,
		sql: statements{
			draw:       n.fill(drawSQL),
			acquire:    n.fill(acquireSQL),
			get:        n.fill(getSQL),
			renew:      n.fill(renewSQL),
			complete:   n.fill(completeSQL),
			completeTx: n.fill(completeTxSQL),
			release:    n.fill(releaseSQL),
			delLive:    n.fill(deleteLiveSQL),
			delDead:    n.fill(deleteDeadSQL),
			reapSelect: n.fill(reapSelectSQL),
			reapDelete: n.fill(reapDeleteSQL),
		},
	}
	var onNone func(error)
	if !opts.NoStoreID {
		onNone = storeid.LegacyWarning(s.log, "mysqlstore", n.storeID)
	}
	s.id = storeid.Open(ctx, s.readID(!opts.NoStoreID), storeIDTimeout, onNone)
	if opts.ReapInterval > 0 {
		s.reaper, _ = reaper.Start(ctx, reaper.Config{Every: opts.ReapInterval, Batch: DefaultReapBatch, Reap: s.Reap, // both positive: no error
			Name: "mysqlstore", Attrs: []slog.Attr{slog.String("table", s.names.table)}, Logger: s.log, OnReap: s.onReap})
	}
	return s, nil
}

// DefaultReapBatch is the most records one statement of the store's
// reaper (Options.ReapInterval) deletes.
const DefaultReapBatch = 1000

// ErrBadURL is wrapped by Open's errors about the form of its URL.
var ErrBadURL = errors.New("not a MySQL URL of a form Open accepts (" + urlForm + ")")

// urlForm is the form of Open's URL.
const urlForm = "mysql://[user[:pass]@]host[:port]/db[?params], mariadb://…"

// connectTimeout bounds connecting to the server when Open's URL does not
// say (timeout=DURATION), as pgstore.Open's does.
const connectTimeout = 10 * time.Second

// Open returns a Store on a *sql.DB of its own on the MySQL or MariaDB
// database at url, mysql://[user[:pass]@]host[:port]/db[?params] (or
// mariadb://), whose params are go-sql-driver/mysql's DSN parameters
// (tls, timeout, parseTime and the like; mysql.ParseDSN). The port
// defaults to 3306, and the connect timeout to 10 seconds unless the URL
// sets timeout. The connections are made on first use, or at once
// with opts.Migrate. Close stops the reaper (opts.ReapInterval) and
// closes the *sql.DB; DB returns it, for BeginFunc and CompleteTx.
//
// A URL of another form is an error wrapping ErrBadURL, before any
// connection is tried: another scheme, no host (mysql:host/db, with the
// // missing), no database, or parameters the driver refuses. Errors
// never repeat the URL's password.
func Open(ctx context.Context, url string, opts Options) (*Store, error) {
	cfg, err := parseURL(url)
	if err != nil {
		return nil, fmt.Errorf("mysqlstore: Open: %w: %s", ErrBadURL, err)
	}
	conn, err := mysql.NewConnector(cfg)
	if err != nil {
		return nil, fmt.Errorf("mysqlstore: Open: %w: %s", ErrBadURL, err)
	}
	db := sql.OpenDB(conn)
	s, err := New(ctx, db, opts)
	if err != nil {
		db.Close()
		return nil, err
	}
	s.owned = true
	return s, nil
}

// parseURL returns the driver's configuration of Open's URL. Its errors
// never repeat the URL.
func parseURL(raw string) (*mysql.Config, error) {
	u, err := neturl.Parse(raw)
	if err != nil {
		return nil, errors.New("it does not parse as a URL (not shown: it may hold a password)")
	}
	if u.Scheme != "mysql" && u.Scheme != "mariadb" {
		return nil, fmt.Errorf("scheme %q, not mysql or mariadb", u.Scheme)
	}
	if u.Opaque != "" || u.Host == "" {
		return nil, fmt.Errorf("no host (is the // after %s: missing?)", u.Scheme)
	}
	dbName := strings.TrimPrefix(u.Path, "/")
	if dbName == "" || strings.Contains(dbName, "/") {
		return nil, errors.New("it names no database (one path segment, /db)")
	}
	cfg := mysql.NewConfig()
	if u.RawQuery != "" {
		// go-sql-driver parses its parameters from a DSN: let it.
		parsed, err := mysql.ParseDSN("/?" + u.RawQuery)
		if err != nil {
			return nil, fmt.Errorf("its parameters: %w", err)
		}
		cfg = parsed
	}
	if u.User != nil {
		cfg.User = u.User.Username()
		cfg.Passwd, _ = u.User.Password()
	}
	cfg.Net = "tcp"
	cfg.Addr = u.Host
	if u.Port() == "" {
		cfg.Addr = net.JoinHostPort(u.Hostname(), "3306")
	}
	cfg.DBName = dbName
	if cfg.Timeout == 0 {
		cfg.Timeout = connectTimeout
	}
	return cfg, nil
}

// DB returns the store's *sql.DB: the one New was given, or the one Open
// made, which Close closes. BeginFunc and CompleteTx take it (or a
// transaction begun on it).
func (s *Store) DB() *sql.DB { return s.db }

// Close stops the store's reaper (Options.ReapInterval), waiting for a
// pass in progress to be cancelled, closes the statements the store
// prepared, and then, if Open made the *sql.DB, closes it. It leaves a
// *sql.DB given to New open. Call it once the store's calls have
// returned; calling it again does nothing. It returns nil.
func (s *Store) Close() error {
	s.closeOnce.Do(func() {
		s.reaper.Stop()
		s.mu.Lock()
		for _, st := range s.stmts {
			st.Close()
		}
		s.stmts = nil
		s.mu.Unlock()
		if s.owned {
			s.db.Close()
		}
	})
	return nil
}

// storeIDTimeout bounds reading the store id.
const storeIDTimeout = 5 * time.Second

// readID reads the store id, storing a new one first when create is set
// and the database has none.
func (s *Store) readID(create bool) storeid.Read {
	insert, sel := s.names.fill(insertIDSQL), s.names.fill(selectIDSQL)
	return func(ctx context.Context) (string, error) {
		if create {
			err := retry(ctx, func() error { _, err := s.db.ExecContext(ctx, insert, storeid.New()); return err })
			// Without the right to insert, read what is there.
			if err != nil && !isNumber(err, 1142) {
				return "", noID(err, s.names.storeID)
			}
		}
		var id string
		err := s.db.QueryRowContext(ctx, sel).Scan(&id)
		if errors.Is(err, sql.ErrNoRows) {
			return "", storeid.None(fmt.Errorf("%s has no row", s.names.storeID))
		}
		if err != nil {
			return "", noID(err, s.names.storeID)
		}
		return id, nil
	}
}

// noID is readID's error for err: final (storeid.None) when the table is
// missing (1146) or may not be read (1142).
func noID(err error, table string) error {
	switch {
	case isNumber(err, 1146):
		return storeid.None(fmt.Errorf("no table %s", table))
	case isNumber(err, 1142):
		return storeid.None(err)
	}
	return err
}

// isNumber reports whether err is the server's error number n.
func isNumber(err error, n uint16) bool {
	var me *mysql.MySQLError
	return errors.As(err, &me) && me.Number == n
}

// maxAttempts bounds the tries of a statement that deadlocks or times out
// on a lock.
const maxAttempts = 10

// retryable reports a deadlock (1213) or a lock wait timeout (1205). In
// autocommit mode, either rolls the statement back whole: it wrote
// nothing, and may run again. (Inside a transaction, a deadlock rolls back
// the whole transaction: CompleteTx never retries.)
func retryable(err error) bool {
	var me *mysql.MySQLError
	return errors.As(err, &me) && (me.Number == 1213 || me.Number == 1205)
}

// retry runs f, again after a short pause while it fails with a
// retryable error, at most maxAttempts times in all.
func retry(ctx context.Context, f func() error) error {
	for attempt := 1; ; attempt++ {
		err := f()
		if err == nil || !retryable(err) || attempt == maxAttempts {
			return err
		}
		t := time.NewTimer(time.Duration(attempt) * time.Millisecond)
		select {
		case <-ctx.Done():
			t.Stop()
			return err
		case <-t.C:
		}
	}
}

// stmt returns the prepared statement of q, preparing it on first use.
// database/sql prepares it again on each connection that runs it, once:
// an unprepared statement with arguments would cost go-sql-driver three
// round trips per call (prepare, execute, close), unless the DSN sets
// interpolateParams.
func (s *Store) stmt(ctx context.Context, q string) (*sql.Stmt, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if st, ok := s.stmts[q]; ok {
		return st, nil
	}
	st, err := s.db.PrepareContext(ctx, q)
	if err != nil {
		return nil, err
	}
	if s.stmts == nil {
		s.stmts = make(map[string]*sql.Stmt)
	}
	s.stmts[q] = st
	return st, nil
}

// exec runs a store-owned statement in autocommit mode, retrying it after
// a deadlock or a lock wait timeout.
func (s *Store) exec(ctx context.Context, q string, args ...any) (sql.Result, error) {
	st, err := s.stmt(ctx, q)
	if err != nil {
		return nil, err
	}
	var res sql.Result
	err = retry(ctx, func() error {
		var err error
		res, err = st.ExecContext(ctx, args...)
		return err
	})
	return res, err
}

// Acquire implements idem.Store. A request that fails Validate is an error
// and writes nothing.
//
// It reads the record first (a consistent read, which takes no lock and
// does not wait for a transaction holding the record): a live record
// answers in flight, replay or mismatch in one statement, even while a
// CompleteTx holds the record. Otherwise it draws a token (a second
// statement), then inserts the record or takes it over (a third), which
// waits for a transaction holding it; should the record turn out live
// then, it reads it again to answer, and starts over should it have died
// in between, or be dead with a token larger than the one drawn (granted
// after the draw). A new lease is measured from its write on the
// server's clock, so Acquire reports the whole TTL.
func (s *Store) Acquire(ctx context.Context, req idem.AcquireRequest) (idem.Acquisition, error) {
	if err := req.Validate(); err != nil {
		return idem.Acquisition{}, err
	}
	for range maxRounds {
		if err := ctxErr(ctx, "acquire", req.Key); err != nil {
			return idem.Acquisition{}, err
		}
		acq, done, err := s.acquireOnce(ctx, req)
		if err != nil {
			return idem.Acquisition{}, &idem.StoreError{Op: "acquire", Key: req.Key, Err: err}
		}
		if done {
			return acq, nil
		}
	}
	return idem.Acquisition{}, &idem.StoreError{Op: "acquire", Key: req.Key,
		Err: fmt.Errorf("the record was left by the insert (live, or dead with a token larger than the one drawn) and not live for the read %d times in a row", maxRounds)}
}

// maxRounds bounds Acquire's rounds: a record that the insert leaves (live,
// or dead with a token granted after the draw) and that is not live when
// the read follows, every time, is a key acquired and released in a tight
// loop by others, or a server (or proxy) that does not return
// LAST_INSERT_ID in its OK packets.
const maxRounds = 100

func (s *Store) acquireOnce(ctx context.Context, req idem.AcquireRequest) (idem.Acquisition, bool, error) {
	if acq, ok, err := s.answer(ctx, req); err != nil || ok {
		return acq, ok, err
	}
	res, err := s.exec(ctx, s.sql.draw)
	if err != nil {
		return idem.Acquisition{}, false, err
	}
	drawn, err := res.LastInsertId()
	if err == nil && drawn < 1 {
		err = fmt.Errorf("no token drawn from %s: is the table migrated (Migrate), and does the server return LAST_INSERT_ID in its OK packets?", s.names.tok)
	}
	if err != nil {
		return idem.Acquisition{}, false, err
	}
	if s.afterDraw != nil {
		s.afterDraw(drawn)
	}
	ttl := micros(req.TTL)
	id := req.LeaseID[:]
	res, err = s.exec(ctx, s.sql.acquire, s.ns, req.Key[:], drawn, req.Fingerprint[:], id, ttl,
		drawn, req.Fingerprint[:], // fingerprint
		drawn,     // response
		drawn, id, // lease_id
		drawn, drawn, // token
		drawn, id, ttl, // expires_at
		drawn, id) // state
	if err != nil {
		return idem.Acquisition{}, false, err
	}
	token, err := res.LastInsertId()
	if err != nil {
		return idem.Acquisition{}, false, err
	}
	if token > 0 { // inserted or taken over, the lease measured from the write
		l := idem.Lease{Key: req.Key, ID: req.LeaseID, Token: uint64(token), TTL: req.TTL}
		return idem.Acquisition{Outcome: idem.Acquired, Lease: l}, true, nil
	}
	// Left as it was: answer from the record as it is now if it is live;
	// if it is dead (its token was larger than the draw, or it died in
	// between), the caller starts over with a new draw.
	return s.answer(ctx, req)
}

// answer reads the record of req's key and answers from it when it is
// live and not released; otherwise it reports false.
func (s *Store) answer(ctx context.Context, req idem.AcquireRequest) (idem.Acquisition, bool, error) {
	r, ok, err := s.read(ctx, req.Key)
	if err != nil || !ok || r.state == int16(idem.StateReleased) {
		return idem.Acquisition{}, false, err
	}
	acq, err := acquisition(req, &r)
	return acq, true, err
}

// acquisition maps a live record to Acquire's answer for req.
func acquisition(req idem.AcquireRequest, r *row) (idem.Acquisition, error) {
	rec, err := r.record()
	if err != nil {
		return idem.Acquisition{}, err
	}
	switch {
	case rec.State == idem.StateInFlight && rec.LeaseID == req.LeaseID:
		// Taken by an earlier call with the same lease id (a repeat after
		// a lost reply): the time it has left.
		if rec.TTL <= 0 {
			return idem.Acquisition{Outcome: idem.InFlight, RetryAfter: time.Millisecond}, nil
		}
		l := idem.Lease{Key: req.Key, ID: req.LeaseID, Token: rec.Token, TTL: min(req.TTL, rec.TTL)}
		return idem.Acquisition{Outcome: idem.Acquired, Lease: l}, nil
	case rec.Fingerprint != req.Fingerprint:
		return idem.Acquisition{Outcome: idem.Mismatch}, nil
	case rec.State == idem.StateInFlight:
		return idem.Acquisition{Outcome: idem.InFlight, RetryAfter: max(rec.TTL, time.Millisecond)}, nil
	}
	resp, err := decode(r.response)
	if err != nil {
		return idem.Acquisition{}, err
	}
	return idem.Acquisition{Outcome: idem.Replay, Response: resp}, nil
}

// read reads the live record of key.
func (s *Store) read(ctx context.Context, key idem.Key) (row, bool, error) {
	var r row
	var left int64
	st, err := s.stmt(ctx, s.sql.get)
	if err != nil {
		return row{}, false, err
	}
	err = st.QueryRowContext(ctx, s.ns, key[:]).Scan(&r.state, &r.token, &r.fp, &r.leaseID, &left, &r.response)
	if errors.Is(err, sql.ErrNoRows) {
		return row{}, false, nil
	}
	if err != nil {
		return row{}, false, err
	}
	// Live at the statement's start; it may have ended by the row's
	// evaluation.
	r.left = max(time.Duration(left)*time.Microsecond, time.Microsecond)
	return r, true, nil
}

// Renew implements idem.Store. A ttl shorter than a millisecond is an
// error and changes nothing.
func (s *Store) Renew(ctx context.Context, l idem.Lease, ttl time.Duration) error {
	if ttl < time.Millisecond {
		return fmt.Errorf("mysqlstore: renew: lease TTL %v is shorter than 1ms", ttl)
	}
	if err := ctxErr(ctx, "renew", l.Key); err != nil {
		return err
	}
	res, err := s.exec(ctx, s.sql.renew, micros(ttl), s.ns, l.Key[:], l.ID[:])
	return s.verdict("renew", l.Key, res, err)
}

// verdict maps the LastInsertId of a statement that sets
// token = LAST_INSERT_ID(token) on the row it matches to nil or
// ErrLeaseLost.
func (s *Store) verdict(op string, key idem.Key, res sql.Result, err error) error {
	var id int64
	if err == nil {
		id, err = res.LastInsertId()
	}
	if err != nil {
		return &idem.StoreError{Op: op, Key: key, Err: err}
	}
	return lost(id > 0)
}

// Complete implements idem.Store. resp is encoded before the call returns
// and not retained; a nil resp is an error. A retention shorter than a
// millisecond is an error and changes nothing. For completion inside the
// caller's transaction, see CompleteTx.
//
// A response larger than the server's max_allowed_packet (16 MiB by
// default on MariaDB, 64 MiB on MySQL 8) fails with a *StoreError
// (mysql.ErrPktTooLarge from the driver, before anything is sent, or the
// server's error 1153) and changes nothing: the key stays in flight until
// its holder releases it or the lease ends. Keep large bodies in a blob
// store (idemhttp.Config.Blobs), which this store's records carry by
// reference.
func (s *Store) Complete(ctx context.Context, l idem.Lease, resp *idem.Response, retention time.Duration) error {
	enc, err := encode(ctx, "complete", l, resp, retention)
	if err != nil {
		return err
	}
	res, err := s.exec(ctx, s.sql.complete, enc, micros(retention), s.ns, l.Key[:], l.ID[:], int64(l.Token))
	return s.verdict("complete", l.Key, res, err)
}

// Execer is the part of a *sql.Tx that CompleteTx uses (a *sql.Conn or a
// *sql.DB has it too, but then the completion commits alone).
type Execer interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
}

// CompleteTx is Complete run in the caller's transaction tx, so that the
// completion commits, or not, with the business writes made in tx: see the
// package documentation. Until tx ends, the record is locked: other
// callers' Acquire of the key wait for tx (up to innodb_lock_wait_timeout)
// and then find it completed, or, after a rollback, in flight or dead.
//
// It returns nil when the record is now completed in tx, ErrLeaseLost when
// the lease ended or was taken over, or completed or released already
// (also by this very lease: a repeat would commit the business writes
// twice), and a *StoreError when the statement fails. On any error, roll
// tx back. It is one statement on tx's connection, never retried: a
// deadlock rolls back the whole of tx. It leaves the session's
// LAST_INSERT_ID alone.
func (s *Store) CompleteTx(ctx context.Context, tx Execer, l idem.Lease, resp *idem.Response, retention time.Duration) error {
	enc, err := encode(ctx, "complete", l, resp, retention)
	if err != nil {
		return err
	}
	res, err := tx.ExecContext(ctx, s.sql.completeTx, enc, micros(retention), s.ns, l.Key[:], l.ID[:])
	var n int64
	if err == nil {
		n, err = res.RowsAffected()
	}
	if err != nil {
		return &idem.StoreError{Op: "complete", Key: l.Key, Err: err}
	}
	return lost(n == 1)
}

// encode checks Complete's and CompleteTx's arguments and encodes resp.
func encode(ctx context.Context, op string, l idem.Lease, resp *idem.Response, retention time.Duration) ([]byte, error) {
	if retention < time.Millisecond {
		return nil, fmt.Errorf("mysqlstore: %s: retention %v is shorter than 1ms", op, retention)
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
	res, err := s.exec(ctx, s.sql.release, micros(max(l.TTL, time.Millisecond)), s.ns, l.Key[:], l.ID[:], int64(l.Token))
	return s.verdict("release", l.Key, res, err)
}

// Get implements idem.Store. Record.Size is the length of the encoded
// response plus the fixed-size columns.
func (s *Store) Get(ctx context.Context, key idem.Key) (idem.Record, bool, error) {
	if err := ctxErr(ctx, "get", key); err != nil {
		return idem.Record{}, false, err
	}
	r, ok, err := s.read(ctx, key)
	if err != nil {
		return idem.Record{}, false, &idem.StoreError{Op: "get", Key: key, Err: err}
	}
	if !ok {
		return idem.Record{}, false, nil
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
// reports true only for a live one. It is two statements when the record
// is not live: the second deletes an expired one. A later grant of the key
// carries a larger token than the deleted record's unless its Acquire drew
// the token before that record's was drawn (see Fencing tokens in the
// package documentation).
func (s *Store) Delete(ctx context.Context, key idem.Key) (bool, error) {
	if err := ctxErr(ctx, "delete", key); err != nil {
		return false, err
	}
	res, err := s.exec(ctx, s.sql.delLive, s.ns, key[:])
	var n int64
	if err == nil {
		n, err = res.RowsAffected()
	}
	if err == nil && n == 0 {
		_, err = s.exec(ctx, s.sql.delDead, s.ns, key[:])
	}
	if err != nil {
		return false, &idem.StoreError{Op: "delete", Key: key, Err: err}
	}
	return n > 0, nil
}

// Reap deletes the table's expired records, of every namespace, in
// transactions of at most batch rows each, until one finds fewer than
// batch or ctx ends. It returns how many it deleted. Records locked by a
// transaction in progress are left for a later pass (SKIP LOCKED: MySQL
// 8.0.1, MariaDB 10.6). Expired records are absent to every method
// already: reaping only reclaims space.
func (s *Store) Reap(ctx context.Context, batch int) (deleted int, err error) {
	if batch < 1 {
		return 0, fmt.Errorf("mysqlstore: reap: batch %d is less than 1", batch)
	}
	for {
		if err := ctx.Err(); err != nil {
			return deleted, fmt.Errorf("mysqlstore: reap %s: %w", s.names.table, err)
		}
		var n, found int
		err := retry(ctx, func() (err error) {
			n, found, err = s.reapOnce(ctx, batch)
			return err
		})
		if err != nil {
			return deleted, fmt.Errorf("mysqlstore: reap %s: %w", s.names.table, err)
		}
		deleted += n
		if found < batch {
			return deleted, nil
		}
	}
}

// reapOnce deletes up to batch expired records in one transaction and
// returns how many it deleted and how many it found.
func (s *Store) reapOnce(ctx context.Context, batch int) (deleted, found int, err error) {
	tx, err := s.db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return 0, 0, err
	}
	defer tx.Rollback()
	grace := micros(s.grace)
	rows, err := tx.QueryContext(ctx, s.sql.reapSelect, grace, batch)
	if err != nil {
		return 0, 0, err
	}
	var b strings.Builder
	b.WriteString(s.sql.reapDelete)
	args := []any{grace}
	for rows.Next() {
		var ns, key []byte
		if err := rows.Scan(&ns, &key); err != nil {
			rows.Close()
			return 0, 0, err
		}
		if len(args) > 1 {
			b.WriteString(" OR ")
		}
		b.WriteString("(namespace = ? AND `key` = ?)")
		args = append(args, ns, key)
	}
	if err := rows.Close(); err != nil {
		return 0, 0, err
	}
	if err := rows.Err(); err != nil {
		return 0, 0, err
	}
	found = (len(args) - 1) / 2
	if found == 0 {
		return 0, 0, tx.Commit()
	}
	b.WriteString(")")
	res, err := tx.ExecContext(ctx, b.String(), args...)
	if err != nil {
		return 0, 0, err
	}
	n, err := res.RowsAffected()
	if err != nil {
		return 0, 0, err
	}
	if err := tx.Commit(); err != nil {
		return 0, 0, err
	}
	return int(n), found, nil
}

// row is a record as getSQL returns it.
type row struct {
	state       int16
	token       int64
	fp, leaseID []byte
	left        time.Duration
	response    []byte
}

// fixedSize is the size of a record's columns besides the response and
// the namespace: key, state, token, fingerprint, lease id and expiry.
const fixedSize = 16 + 1 + 8 + 16 + 16 + 8

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
	if rec.State == idem.StateInFlight {
		// Completed and released records keep the lease id of the lease
		// that ended them, for its repeats; Record.LeaseID is the holder's.
		copy(rec.LeaseID[:], r.leaseID)
	}
	return rec, nil
}

func decode(enc []byte) (*idem.Response, error) {
	resp := new(idem.Response)
	if err := resp.UnmarshalBinary(enc); err != nil {
		return nil, err
	}
	return resp, nil
}

// micros returns d in microseconds, rounded up (DATETIME(6)'s resolution;
// a lease is never shorter than asked), saturating instead of wrapping.
func micros(d time.Duration) int64 {
	if d > math.MaxInt64-time.Microsecond {
		return int64(d / time.Microsecond)
	}
	return int64((d + time.Microsecond - 1) / time.Microsecond)
}

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
