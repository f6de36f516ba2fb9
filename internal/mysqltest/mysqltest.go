// Package mysqltest starts a private MariaDB server for tests and gives each
// test a database of its own on it.
//
// Start initialises a data directory in a temporary directory
// (mariadb-install-db --no-defaults) and runs mariadbd --no-defaults on a
// free port of 127.0.0.1, with its socket in that directory, no binary
// log and a parent-death signal on Linux, so the server never outlives the
// test binary. It never uses a server that happens to run on the machine
// (the system's mariadbd on 3306, which need not be running). Starting
// takes about two to three seconds, so a test package starts one server in
// TestMain and each test creates a database on it:
//
//	var srv *mysqltest.Server
//
//	func TestMain(m *testing.M) {
//		srv = mysqltest.MustStart()
//		code := m.Run()
//		srv.Stop()
//		os.Exit(code)
//	}
//
//	func TestSomething(t *testing.T) {
//		db := srv.New(t) // a *sql.DB on a private database, dropped at the end
//		...
//	}
//
// scripts/test.sh installs mariadb-server when mariadbd is missing; a
// test that needs it and does not find it fails with a message saying how
// to install it (it never skips). The package does not import testing.
package mysqltest

import (
	"context"
	"crypto/rand"
	"database/sql"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/go-sql-driver/mysql"

	"github.com/idemkit/idem/internal/childproc"
	"github.com/idemkit/idem/internal/nettest"
)

// Install is the command that installs the server where Start finds it.
const Install = "apt-get update && apt-get install -y mariadb-server"

// MaxConns bounds each pool New returns (max_connections is set to 500).
const MaxConns = 16

const (
	startTimeout  = 60 * time.Second
	setupTimeout  = 30 * time.Second
	startAttempts = 5
)

// Server is one private mariadbd process.
type Server struct {
	dir  string
	port int
	cmd  *exec.Cmd
	done chan struct{}
}

// find returns the path of a program in PATH or in the sbin directories,
// which are not in every user's PATH.
func find(name string) (string, error) {
	if p, err := exec.LookPath(name); err == nil {
		return p, nil
	}
	for _, d := range []string{"/usr/sbin", "/usr/local/sbin", "/sbin"} {
		p := filepath.Join(d, name)
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
	}
	return "", fmt.Errorf("mysqltest: %s not found; ./scripts/test.sh installs it, or run: %s", name, Install)
}

// Start initialises a data directory and starts a server on it. The caller
// stops it with Stop.
func Start() (*Server, error) {
	mysqld, err := find("mariadbd")
	if err != nil {
		return nil, err
	}
	installDB, err := find("mariadb-install-db")
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "idem-mysqltest-")
	if err != nil {
		return nil, err
	}
	data := filepath.Join(dir, "data")
	// Each server has its own tmpdir: in the shared /tmp, two bootstraps
	// at once (test packages run side by side) removed each other's
	// temporary tables and one failed ("Unknown table
	// 'mysql.tmp_user_nopasswd…'").
	tmp := filepath.Join(dir, "tmp")
	if err := os.Mkdir(tmp, 0o700); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	args := []string{"--no-defaults", "--datadir=" + data, "--tmpdir=" + tmp, "--auth-root-authentication-method=normal",
		"--skip-test-db", "--skip-name-resolve"}
	if os.Geteuid() == 0 {
		args = append(args, "--user=root")
	}
	install := exec.Command(installDB, args...)
	install.SysProcAttr = childproc.SysProcAttr()
	if out, err := install.CombinedOutput(); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("mysqltest: mariadb-install-db: %v\n%s", err, out)
	}
	var lastErr error
	for range startAttempts { // another process may take the free port first
		port, err := nettest.FreePort()
		if err != nil {
			os.RemoveAll(dir)
			return nil, err
		}
		s := &Server{dir: dir, port: port, done: make(chan struct{})}
		if lastErr = s.launch(mysqld); lastErr == nil {
			return s, nil
		}
	}
	os.RemoveAll(dir)
	return nil, lastErr
}

// MustStart is Start that panics on failure, for TestMain.
func MustStart() *Server {
	s, err := Start()
	if err != nil {
		panic(err)
	}
	return s
}

func (s *Server) launch(mysqld string) error {
	logPath := filepath.Join(s.dir, "server.log")
	args := []string{"--no-defaults",
		"--datadir=" + filepath.Join(s.dir, "data"),
		"--tmpdir=" + filepath.Join(s.dir, "tmp"),
		"--bind-address=127.0.0.1", "--port=" + strconv.Itoa(s.port),
		"--socket=" + filepath.Join(s.dir, "sock"),
		"--pid-file=" + filepath.Join(s.dir, "pid"),
		"--log-error=" + logPath,
		"--skip-name-resolve", "--skip-log-bin",
		"--max-connections=500",
		"--innodb-buffer-pool-size=64M",
	}
	if os.Geteuid() == 0 {
		args = append(args, "--user=root")
	}
	s.cmd = exec.Command(mysqld, args...)
	s.cmd.SysProcAttr = childproc.SysProcAttr()
	if err := s.cmd.Start(); err != nil {
		return err
	}
	go func() { s.cmd.Wait(); close(s.done) }()
	deadline := time.Now().Add(startTimeout)
	for time.Now().Before(deadline) {
		select {
		case <-s.done:
			return fmt.Errorf("mysqltest: mariadbd exited at start:\n%s", tail(logPath))
		default:
		}
		db, err := sql.Open("mysql", s.DSN(""))
		if err == nil {
			err = db.Ping()
			db.Close()
		}
		if err == nil {
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	s.kill()
	return fmt.Errorf("mysqltest: mariadbd did not answer within %v:\n%s", startTimeout, tail(logPath))
}

func tail(path string) string {
	b, _ := os.ReadFile(path)
	return string(b[max(0, len(b)-2048):])
}

// Addr is host:port.
func (s *Server) Addr() string { return "127.0.0.1:" + strconv.Itoa(s.port) }

// DSN returns a go-sql-driver/mysql data source name for root on database
// db ("" for none).
func (s *Server) DSN(db string) string {
	c := mysql.NewConfig()
	c.User = "root"
	c.Net = "tcp"
	c.Addr = s.Addr()
	c.DBName = db
	return c.FormatDSN()
}

// URL returns the mysql:// URL of database db, as idem proxy --store takes
// it.
func (s *Server) URL(db string) string {
	return "mysql://root@" + s.Addr() + "/" + db
}

// Config returns the driver configuration of database db, to adjust
// before mysql.NewConnector.
func (s *Server) Config(db string) *mysql.Config {
	c, err := mysql.ParseDSN(s.DSN(db))
	if err != nil {
		panic(err)
	}
	return c
}

// TB is the part of testing.TB New uses.
type TB interface {
	Helper()
	Cleanup(func())
	Fatal(args ...any)
	Error(args ...any)
}

// New creates a private database and returns a pool on it, of at most
// MaxConns connections. The pool is closed and the database dropped when tb
// ends.
func (s *Server) New(tb TB) *sql.DB {
	tb.Helper()
	name, err := s.CreateDatabase()
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		if err := s.DropDatabase(name); err != nil {
			tb.Error(err)
		}
	})
	db, err := sql.Open("mysql", s.DSN(name))
	if err != nil {
		tb.Fatal(err)
	}
	db.SetMaxOpenConns(MaxConns)
	db.SetMaxIdleConns(MaxConns)
	tb.Cleanup(func() { db.Close() }) // runs before the drop
	return db
}

// CreateDatabase creates a database named idemtest_<random> and returns
// its name.
func (s *Server) CreateDatabase() (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), setupTimeout)
	defer cancel()
	admin, err := sql.Open("mysql", s.DSN(""))
	if err != nil {
		return "", err
	}
	defer admin.Close()
	name := "idemtest_" + strings.ToLower(rand.Text()[:16])
	if _, err := admin.ExecContext(ctx, "CREATE DATABASE "+name); err != nil {
		return "", fmt.Errorf("mysqltest: CREATE DATABASE %s: %v", name, err)
	}
	return name, nil
}

// DropDatabase drops the database name.
func (s *Server) DropDatabase(name string) error {
	ctx, cancel := context.WithTimeout(context.Background(), setupTimeout)
	defer cancel()
	admin, err := sql.Open("mysql", s.DSN(""))
	if err != nil {
		return err
	}
	defer admin.Close()
	if _, err := admin.ExecContext(ctx, "DROP DATABASE IF EXISTS "+name); err != nil {
		return fmt.Errorf("mysqltest: DROP DATABASE %s: %v", name, err)
	}
	return nil
}

func (s *Server) kill() {
	if s.cmd != nil && s.cmd.Process != nil {
		s.cmd.Process.Kill()
		<-s.done
	}
}

// Stop kills the server, waits for it and removes its directory.
func (s *Server) Stop() {
	s.kill()
	os.RemoveAll(s.dir)
}
