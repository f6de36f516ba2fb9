package proctest

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/childproc"
)

var (
	caddyOnce sync.Once
	caddyDir  string // the temporary directory of the binary
	caddyBin  string
	caddyErr  error
)

// BuildCaddy builds caddyidem/cmd/idem-caddy (Caddy with its standard
// modules and idem's handler; a module of its own, in the caddyidem
// directory of this module's root) once per process, without -race, into
// a temporary directory, and returns the binary's path. The first build
// on a machine compiles Caddy (about 2 minutes on 2 cores); later ones
// find it in Go's build cache and only link. scripts/test.sh builds it
// before the tests.
func BuildCaddy() (string, error) {
	caddyOnce.Do(func() {
		root, err := moduleRoot()
		if err != nil {
			caddyErr = err
			return
		}
		caddyDir, err = os.MkdirTemp("", "idem-proctest-caddy-")
		if err != nil {
			caddyErr = err
			return
		}
		caddyBin = filepath.Join(caddyDir, "idem-caddy")
		cmd := exec.Command("go", "build", "-o", caddyBin, "./cmd/idem-caddy")
		cmd.Dir = filepath.Join(root, "caddyidem")
		if out, err := cmd.CombinedOutput(); err != nil {
			caddyErr = fmt.Errorf("go build ./cmd/idem-caddy in caddyidem: %v\n%s", err, out)
		}
	})
	return caddyBin, caddyErr
}

// RemoveCaddy deletes the binary BuildCaddy built, if any; TestMain calls
// it after the tests.
func RemoveCaddy() {
	if caddyDir != "" {
		os.RemoveAll(caddyDir)
	}
}

// Caddy is a running idem-caddy and its log (stderr: Caddy's JSON log,
// the access log included when the Caddyfile sends it there).
type Caddy struct {
	Cmd  *exec.Cmd
	Addr string // host:port of its one site

	mu  sync.Mutex
	log strings.Builder
}

// LogText returns the log captured so far (at most about 8 MiB).
func (c *Caddy) LogText() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.log.String()
}

// StartCaddy runs `idem-caddy run --adapter caddyfile` on a Caddyfile
// made by caddyfile from a free loopback port (addr, host:port: its site
// must listen there, with admin off), waits up to 30s for the port to
// accept connections, and kills it at the end of the test, logging the
// tail of its log if the test failed.
func StartCaddy(t testing.TB, caddyfile func(addr string) string) *Caddy {
	t.Helper()
	bin, err := BuildCaddy()
	if err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	dir, err := os.MkdirTemp("", "idem-caddy-")
	if err != nil {
		t.Fatal(err)
	}
	conf := filepath.Join(dir, "Caddyfile")
	if err := os.WriteFile(conf, []byte(caddyfile(addr)), 0o644); err != nil {
		t.Fatal(err)
	}
	c := &Caddy{Cmd: exec.Command(bin, "run", "--adapter", "caddyfile", "--config", conf), Addr: addr}
	// Caddy keeps its data and config in XDG_DATA_HOME and
	// XDG_CONFIG_HOME: a directory of the test's, not the user's.
	c.Cmd.Env = append(os.Environ(), "XDG_DATA_HOME="+dir, "XDG_CONFIG_HOME="+dir, "HOME="+dir, "AWS_EC2_METADATA_DISABLED=true")
	c.Cmd.SysProcAttr = childproc.SysProcAttr()
	stderr, err := c.Cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(stderr)
		sc.Buffer(nil, 4<<20)
		for sc.Scan() {
			c.mu.Lock()
			if c.log.Len() < logCap {
				c.log.Write(sc.Bytes())
				c.log.WriteByte('\n')
			}
			c.mu.Unlock()
		}
		io.Copy(io.Discard, stderr)
		c.Cmd.Wait()
		close(exited)
	}()
	t.Cleanup(func() {
		c.Cmd.Process.Kill()
		<-exited
		if t.Failed() {
			log := c.LogText()
			t.Logf("idem-caddy %s log (last 4 KiB):\n%s", c.Addr, log[max(0, len(log)-4096):])
		}
		os.RemoveAll(dir)
	})
	deadline := time.Now().Add(30 * time.Second)
	for {
		select {
		case <-exited:
			t.Fatalf("idem-caddy exited at start:\n%s", c.LogText())
		default:
		}
		if conn, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
			conn.Close()
			return c
		}
		if time.Now().After(deadline) {
			t.Fatalf("idem-caddy did not listen on %s within 30s:\n%s", addr, c.LogText())
		}
		time.Sleep(20 * time.Millisecond)
	}
}
