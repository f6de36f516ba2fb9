package mysqlstore_test

import (
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/mysqlstore"
)

// TestParseURL checks the driver configuration Open makes of its URL:
// the address with its default port, the user, password and database,
// the connect timeout (the URL's, or 10s).
func TestParseURL(t *testing.T) {
	for _, c := range []struct {
		url, addr, user, pass, db string
		timeout                   time.Duration
	}{
		{"mysql://u:pw@db.example:3307/idem", "db.example:3307", "u", "pw", "idem", 10 * time.Second},
		{"mariadb://db.example/idem", "db.example:3306", "", "", "idem", 10 * time.Second},
		{"mysql://u@127.0.0.1/idem?timeout=2s&tls=false", "127.0.0.1:3306", "u", "", "idem", 2 * time.Second},
	} {
		cfg, err := mysqlstore.ParseURL(c.url)
		if err != nil {
			t.Fatalf("%s: %v", c.url, err)
		}
		if cfg.Net != "tcp" || cfg.Addr != c.addr || cfg.User != c.user || cfg.Passwd != c.pass || cfg.DBName != c.db || cfg.Timeout != c.timeout {
			t.Errorf("%s: got net %q addr %q user %q pass %q db %q timeout %v", c.url, cfg.Net, cfg.Addr, cfg.User, cfg.Passwd, cfg.DBName, cfg.Timeout)
		}
	}
}

// TestOpenBadURL checks that Open refuses a URL of another form before
// connecting, with an error that wraps ErrBadURL, names the form wanted
// and never shows the password.
func TestOpenBadURL(t *testing.T) {
	for raw, want := range map[string]string{
		"mysql:u:s3cret@127.0.0.1/db":               "no host",
		"postgres://u:s3cret@127.0.0.1/db":          `scheme "postgres"`,
		"mysql://u:s3cret@127.0.0.1:1/":             "names no database",
		"mysql://u:s3cret@127.0.0.1:1/a/b":          "names no database",
		"mysql://u:s3cret@127.0.0.1:1/db?timeout=x": "parameters",
		"mysql://u:s3cret@[::1/db":                  "does not parse",
	} {
		s, err := mysqlstore.Open(t.Context(), raw, mysqlstore.Options{})
		if s != nil || !errors.Is(err, mysqlstore.ErrBadURL) || !strings.Contains(err.Error(), want) ||
			!strings.Contains(err.Error(), "mysql://[user[:pass]@]host[:port]/db") || strings.Contains(err.Error(), "s3cret") {
			t.Errorf("Open(%s): got %v, want an ErrBadURL saying %q and the form, without the password", raw, err, want)
		}
	}
}

// TestOpenReapClose checks the store Open returns: it owns its *sql.DB
// (DB; Close closes it), runs its reaper every Options.ReapInterval, and
// Close stops it.
func TestOpenReapClose(t *testing.T) {
	name, err := srv.CreateDatabase()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.DropDatabase(name) })
	ctx := t.Context()
	var passes, reaped atomic.Int64
	s, err := mysqlstore.Open(ctx, srv.URL(name), mysqlstore.Options{Migrate: true, ReapGrace: time.Millisecond, ReapInterval: 10 * time.Millisecond,
		OnReap: func(deleted int, _ time.Duration, err error) {
			if err != nil {
				t.Errorf("OnReap: pass failed: %v", err)
			}
			passes.Add(1)
			reaped.Add(int64(deleted))
		}})
	if err != nil {
		t.Fatal(err)
	}
	lease(t, s, newKey(1), time.Millisecond)
	lease(t, s, newKey(2), time.Hour)
	count := func() (n int) {
		if err := s.DB().QueryRowContext(ctx, "SELECT count(*) FROM idem_records").Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	deadline := time.Now().Add(5 * time.Second)
	for (count() != 1 || reaped.Load() < 1) && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if n := count(); n != 1 || reaped.Load() != 1 {
		t.Fatalf("with ReapInterval 10ms: %d rows left and %d reaped, want the live one left and the expired one reaped", n, reaped.Load())
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	stopped := passes.Load()
	time.Sleep(50 * time.Millisecond)
	if p := passes.Load(); p != stopped {
		t.Errorf("after Close: %d more passes, want none (the reaper stopped)", p-stopped)
	}
	if err := s.DB().PingContext(ctx); err == nil {
		t.Error("after Close: the *sql.DB Open made still answers, want it closed")
	}
	if err := s.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}
