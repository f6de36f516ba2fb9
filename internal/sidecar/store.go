package sidecar

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"os"
	"regexp"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/rueidis"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/pgurl"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/mysqlstore"
	"github.com/idemkit/idem/pgstore"
	"github.com/idemkit/idem/redisstore"
	"github.com/idemkit/idem/tieredstore"
)

// The store URL's opener of both sidecars, and of idem's commands that
// read a store (inspect, purge, gc). Its errors never repeat the URL (it
// may hold a password), and name the setting as the front end does
// (StoreOptions.Name).

// BadStore is an error in the store's URL itself, not in reaching the
// store: idem proxy's usage error (exit 2).
type BadStore struct{ Msg string }

func (e BadStore) Error() string { return e.Msg }

// badStore is a BadStore whose message names the setting as o does.
func badStore(o StoreOptions, msg string) error {
	return BadStore{strings.Replace(msg, "--store", cmp.Or(o.Name, "--store"), 1)}
}

// StoreOptions are what the sidecars and the commands that read set on
// their store. The zero value leaves each store as its package makes it,
// creating PostgreSQL's table if missing.
type StoreOptions struct {
	// Name is the setting's name in errors: "--store" (the default) for
	// idem's flags, "store" for Caddy's.
	Name string
	// ReadOnly (inspect, purge, gc): create nothing: no table, no index,
	// and no background relay or reaper of the tiered store. A missing
	// table is then an error saying so.
	ReadOnly bool
	// MaxBytes is memstore.Options.MaxBytes: 0, no bound.
	MaxBytes int64
	// ReapEvery is the SQL store's Options.ReapInterval: how often its
	// reaper (pgstore's, mysqlstore's, the tiered store's table's)
	// deletes expired records. 0: the store's own way (pgstore and
	// mysqlstore: no reaper; the tiered store: every
	// tieredstore.DefaultReapInterval). Negative: no reaper.
	ReapEvery time.Duration
	// OnReap receives each pass of the reaper (pgstore.Options.OnReap).
	OnReap func(deleted int, took time.Duration, err error)
	// Logger receives the stores' background failures; nil: slog.Default().
	Logger *slog.Logger
}

// OpenStore opens the store a store URL (idem proxy's --store, the Caddy
// handler's store) names, with its key prefix (Redis) or namespace (the
// SQL stores); the front end checks the prefix. Each store opens from
// its URL in its own package (redisstore.Open, pgstore.Open,
// mysqlstore.Open; the tiered store from its two); the reaper is the
// store's (Options.ReapInterval: o.ReapEvery), and close is the store's
// Close, which stops it (and waits for a pass in progress) before closing
// the connections. A BadStore error is one in the URL.
func OpenStore(ctx context.Context, spec, prefix string, o StoreOptions) (store idem.Store, close func(), err error) {
	if spec == "" || spec == "memory" {
		return memstore.New(memstore.Options{MaxBytes: o.MaxBytes}), func() {}, nil
	}
	if fields := strings.Fields(spec); len(fields) > 1 {
		return openTiered(ctx, fields, prefix, o)
	}
	if IsHostPort(spec) { // localhost:6379: no scheme
		return nil, nil, badStore(o, fmt.Sprintf("--store %s: want a URL; for Redis: redis://%s", spec, spec))
	}
	if spec == "mem" || spec == "memstore" || spec == "mem://" || spec == "memory://" {
		return nil, nil, badStore(o, fmt.Sprintf("--store %s: the in-process store is written memory", spec))
	}
	// Errors never repeat spec otherwise: it may hold a password.
	u, err := url.Parse(spec)
	if err != nil {
		return nil, nil, badStore(o, "--store: not a URL (the value is not shown: it may hold a password); "+storeForms)
	}
	switch u.Scheme {
	case "redis", "rediss", "valkey", "valkeys":
		s, err := openRedis(spec, prefix, o)
		if err != nil {
			return nil, nil, err
		}
		return s, func() { s.Close() }, nil
	case "postgres", "postgresql":
		return openPGStore(ctx, spec, u, prefix, o)
	case "mysql", "mariadb":
		return openMySQL(ctx, spec, u, prefix, o)
	}
	return nil, nil, badStore(o, fmt.Sprintf("--store: unknown scheme %q; %s", u.Scheme, storeForms))
}

// openPGStore opens a pgstore (pgstore.Open), creating its table unless
// o.ReadOnly, with its reaper every o.ReapEvery (Options.ReapInterval).
func openPGStore(ctx context.Context, spec string, u *url.URL, prefix string, o StoreOptions) (idem.Store, func(), error) {
	s, err := pgstore.Open(ctx, spec, pgstore.Options{Namespace: prefix, Migrate: !o.ReadOnly, NoStoreID: o.ReadOnly,
		ReapInterval: o.ReapEvery, Logger: o.Logger, OnReap: o.OnReap})
	if errors.Is(err, pgstore.ErrBadURL) {
		return nil, nil, badStore(o, "--store: "+strings.TrimPrefix(err.Error(), "pgstore: Open: "))
	}
	if err == nil && o.ReadOnly {
		if err = checkTable(ctx, s.Pool(), pgstore.DefaultTable); err != nil {
			s.Close()
		}
	}
	if err != nil {
		return nil, nil, pgError(err, u.Host)
	}
	return s, func() { s.Close() }, nil
}

// openMySQL opens a mysqlstore (mysqlstore.Open), creating its tables
// unless o.ReadOnly, with its reaper every o.ReapEvery
// (Options.ReapInterval).
func openMySQL(ctx context.Context, spec string, u *url.URL, prefix string, o StoreOptions) (idem.Store, func(), error) {
	s, err := mysqlstore.Open(ctx, spec, mysqlstore.Options{Namespace: prefix, Migrate: !o.ReadOnly, NoStoreID: o.ReadOnly,
		ReapInterval: o.ReapEvery, Logger: o.Logger, OnReap: o.OnReap})
	if errors.Is(err, mysqlstore.ErrBadURL) {
		return nil, nil, badStore(o, "--store: "+strings.TrimPrefix(err.Error(), "mysqlstore: Open: "))
	}
	if err == nil && o.ReadOnly {
		var n int
		err = s.DB().QueryRowContext(ctx, "SELECT count(*) FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name = ?", mysqlstore.DefaultTable).Scan(&n)
		if err == nil && n == 0 {
			err = errNoTable{mysqlstore.DefaultTable}
		}
		if err != nil {
			s.Close()
		}
	}
	if err != nil {
		return nil, nil, fmt.Errorf("MySQL at %s: %w", strings.TrimPrefix(StoreForLog(spec), u.Scheme+"://"), err)
	}
	return s, func() { s.Close() }, nil
}

// storeForms names what --store takes, for its usage errors.
const storeForms = "want memory, redis://host:port[/db], rediss://…, valkey(s)://…, postgres://…, mysql://… (or mariadb://…), " +
	"or for the tiered store 'redis://host:port postgres://host/db' (two URLs, one space between them)"

// openTiered opens the tiered store that two --store URLs name, one for
// Redis and one for PostgreSQL, in either order. The Redis prefix and the
// PostgreSQL namespace are both prefix. Acquire checks PostgreSQL after
// Redis grants a lease (tieredstore.Options.VerifyAcquire): the proxy's
// upstream effects are outside PostgreSQL, so a key whose Redis record was
// lost is replayed from PostgreSQL rather than sent upstream again.
func openTiered(ctx context.Context, fields []string, prefix string, o StoreOptions) (idem.Store, func(), error) {
	const form = "--store with two URLs is the tiered store: 'redis://host:port[/db] postgres://[user@]host[:port]/db' (one Redis URL, one PostgreSQL URL, one space between them)"
	if len(fields) != 2 {
		return nil, nil, badStore(o, fmt.Sprintf("%s; got %d words (the value is not shown: it may hold a password)", form, len(fields)))
	}
	var redisURL, pgURL string
	for _, f := range fields {
		u, err := url.Parse(f)
		if err != nil {
			return nil, nil, badStore(o, form+"; one of the two does not parse as a URL (not shown: it may hold a password)")
		}
		switch u.Scheme {
		case "redis", "rediss", "valkey", "valkeys":
			if redisURL != "" {
				return nil, nil, badStore(o, form+"; got two Redis URLs")
			}
			redisURL = f
		case "postgres", "postgresql":
			if pgURL != "" {
				return nil, nil, badStore(o, form+"; got two PostgreSQL URLs")
			}
			if u.Opaque != "" {
				return nil, nil, badStore(o, "--store: the PostgreSQL URL has no host: write postgres://[user:pass@]host:port/db (is the // after postgres: missing?)")
			}
			pgURL = f
		default:
			return nil, nil, badStore(o, fmt.Sprintf("%s; unknown scheme %q", form, u.Scheme))
		}
	}
	if redisURL == "" || pgURL == "" {
		return nil, nil, badStore(o, form+"; got no "+map[bool]string{true: "Redis", false: "PostgreSQL"}[redisURL == ""]+" URL")
	}
	rs, err := openRedis(redisURL, prefix, o)
	if err != nil {
		return nil, nil, err
	}
	pool, err := openPG(ctx, pgURL, o)
	if err != nil {
		rs.Close()
		return nil, nil, err
	}
	// The background reaper runs every o.ReapEvery (0: its default;
	// negative: none); Close stops it before closing the pool.
	opts := tieredstore.Options{Namespace: prefix, Migrate: !o.ReadOnly, NoStoreID: o.ReadOnly, VerifyAcquire: true,
		ReapInterval: o.ReapEvery, OnReap: o.OnReap, Logger: o.Logger}
	if o.ReadOnly {
		opts.RelayInterval = -1 // no background relay or reaper: a command that reads writes nothing
		err = checkTable(ctx, pool, tieredstore.DefaultTable)
	}
	var s *tieredstore.Store
	if err == nil {
		s, err = tieredstore.New(ctx, rs, pool, opts)
	}
	if err != nil {
		pool.Close()
		rs.Close()
		pgHost := ""
		if u, e := url.Parse(pgURL); e == nil {
			pgHost = u.Host
		}
		return nil, nil, pgError(err, pgHost)
	}
	return s, func() { s.Close(); pool.Close(); rs.Close() }, nil
}

// openRedis opens a Redis URL. A server that does not speak Redis (or not
// without TLS or a password) gets an error saying so, not io.EOF. A server
// whose maxmemory-policy evicts keys is refused (redisstore.ErrEvictingPolicy)
// unless the URL says allow_eviction=1; the commands that only read
// (o.ReadOnly) open it all the same, and create no store id.
func openRedis(spec, prefix string, o StoreOptions) (*redisstore.Store, error) {
	s, err := redisstore.Open(spec, redisstore.Options{Prefix: prefix, Logger: o.Logger,
		AllowEviction: o.ReadOnly, NoStoreID: o.ReadOnly})
	switch {
	case errors.Is(err, redisstore.ErrEvictingPolicy):
		return nil, errors.New(strings.TrimPrefix(err.Error(), "redisstore: "))
	case errors.Is(err, redisstore.ErrBadURL):
		return nil, badStore(o, "--store: "+strings.TrimPrefix(err.Error(), "redisstore: Open: "))
	case err == nil:
		return s, nil
	}
	var dial *net.OpError
	if errors.As(err, new(*rueidis.RedisError)) || errors.As(err, &dial) && dial.Op == "dial" {
		return nil, err // the server's own answer (NOAUTH, WRONGPASS…), or nothing listening: clear as they are
	}
	host := "the server"
	if u, e := url.Parse(spec); e == nil {
		host = "the server at " + u.Host
	}
	cause := strings.TrimPrefix(err.Error(), "redisstore: Open: ")
	return nil, fmt.Errorf("%s did not answer as Redis (%s): is it Redis? does it want TLS (rediss://) or a password (redis://:PASSWORD@host:port)?", host, cause)
}

// openPG creates a pool on a PostgreSQL URL (internal/pgurl, as
// pgstore.Open and tieredstore.Open read it); it connects on first use.
func openPG(ctx context.Context, spec string, o StoreOptions) (*pgxpool.Pool, error) {
	cfg, err := pgurl.Parse(spec)
	if err != nil {
		return nil, badStore(o, "--store: the PostgreSQL URL: "+err.Error())
	}
	return pgxpool.NewWithConfig(ctx, cfg)
}

// errNoTable is checkTable's error: the database has no idem table.
type errNoTable struct{ table string }

func (e errNoTable) Error() string {
	return fmt.Sprintf("no idem table %q in this database: has a proxy run against this database? (inspect, purge and gc create nothing)", e.table)
}

// checkTable returns errNoTable when table does not exist (in the
// search_path), without creating it.
func checkTable(ctx context.Context, pool *pgxpool.Pool, table string) error {
	var exists bool
	if err := pool.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", table).Scan(&exists); err != nil {
		return err
	}
	if !exists {
		return errNoTable{table}
	}
	return nil
}

// pgError shortens the errors of connecting to PostgreSQL at host to one
// line that says what went wrong: a server that did not answer as
// PostgreSQL, nothing listening, or the server's own refusal.
func pgError(err error, host string) error {
	var ce *pgconn.ConnectError
	if !errors.As(err, &ce) {
		return err
	}
	var pe *pgconn.PgError
	switch {
	case errors.As(err, &pe):
		return fmt.Errorf("PostgreSQL at %s: %s (SQLSTATE %s)", host, pe.Message, pe.Code)
	case errors.Is(err, syscall.ECONNREFUSED):
		return fmt.Errorf("nothing listens at %s (connection refused): is PostgreSQL running there?", host)
	}
	var dns *net.DNSError
	if errors.As(err, &dns) {
		return fmt.Errorf("PostgreSQL at %s: %v", host, dns)
	}
	why := "it closed the connection"
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, os.ErrDeadlineExceeded) {
		why = "no answer within the connect timeout"
	}
	return fmt.Errorf("the server at %s did not answer as PostgreSQL (%s): is it PostgreSQL? does it want TLS (sslmode=require) or a password?", host, why)
}

// hostPort matches a bare host:port, which users write for Redis.
var hostPort = regexp.MustCompile(`^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}$`)

// IsHostPort reports whether s is a bare host:port, which users write
// where a URL belongs (for Redis, for an upstream).
func IsHostPort(s string) bool { return hostPort.MatchString(s) }

// StoreForLog names the store without credentials or query, and always
// with its database: its scheme, host and database, as in
// redis://host:6379/0 (the index, 0 when the URL gives none, or the
// query's db=N), postgres://host:5432/shop (with no database in the URL,
// the user's: PostgreSQL's default), mysql://host:3306/shop (the port
// 3306 when the URL gives none); for the tiered store, both URLs so.
// Never the user's password.
func StoreForLog(spec string) string {
	if spec == "" || spec == "memory" {
		return "memory"
	}
	if f := strings.Fields(spec); len(f) > 1 {
		for i := range f {
			f[i] = StoreForLog(f[i])
		}
		return strings.Join(f, " ")
	}
	u, err := url.Parse(spec)
	if err != nil {
		return "(unparsable)"
	}
	host, db := u.Host, strings.TrimPrefix(u.EscapedPath(), "/")
	q := u.Query()
	switch u.Scheme {
	case "redis", "rediss", "valkey", "valkeys":
		db = cmp.Or(db, q.Get("db"), "0")
	case "postgres", "postgresql":
		host = cmp.Or(host, url.PathEscape(q.Get("host")))
		if db = cmp.Or(db, url.PathEscape(q.Get("dbname"))); db == "" && u.User != nil {
			db = url.PathEscape(u.User.Username())
		}
	case "mysql", "mariadb":
		if host != "" && u.Port() == "" {
			host = net.JoinHostPort(u.Hostname(), "3306")
		}
	}
	if db == "" {
		return u.Scheme + "://" + host
	}
	return u.Scheme + "://" + host + "/" + db
}
