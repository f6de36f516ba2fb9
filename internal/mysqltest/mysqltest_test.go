package mysqltest_test

import (
	"os"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/mysqltest"
)

// TestServer starts a private server on loopback, gives two tests
// databases that do not see each other's tables, and removes everything
// on Stop. It logs how long the start took.
func TestServer(t *testing.T) {
	start := time.Now()
	s, err := mysqltest.Start()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("initialised and started in %v", time.Since(start).Round(time.Millisecond))
	var datadir string
	t.Cleanup(func() { // runs last, after Stop
		if _, err := os.Stat(datadir); datadir == "" || !os.IsNotExist(err) {
			t.Errorf("datadir %q after Stop: got %v, want it removed", datadir, err)
		}
	})
	t.Cleanup(s.Stop) // after the databases are dropped
	if !strings.HasPrefix(s.Addr(), "127.0.0.1:") || s.Addr() == "127.0.0.1:3306" {
		t.Fatalf("Addr: got %s, want a free port of 127.0.0.1", s.Addr())
	}
	a, b := s.New(t), s.New(t)
	if _, err := a.Exec("CREATE TABLE only_a (x INT)"); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Exec("SELECT * FROM only_a"); err == nil {
		t.Fatal("a table of one test's database is visible in another's")
	}
	var version string
	if err := a.QueryRow("SELECT VERSION()").Scan(&version); err != nil || !strings.Contains(version, "MariaDB") {
		t.Fatalf("VERSION(): got %q, %v; want MariaDB", version, err)
	}
	if err := a.QueryRow("SELECT @@datadir").Scan(&datadir); err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(datadir, os.TempDir()) {
		t.Errorf("datadir: got %s, want one under %s", datadir, os.TempDir())
	}
}
