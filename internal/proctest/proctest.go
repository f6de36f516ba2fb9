// Package proctest runs the child processes of the test suites: it builds
// the idem command once per test binary and runs `idem proxy` with its JSON
// log captured (with internal/childproc's parent-death signal, so none
// outlives a crashed test binary), and does the same for Caddy.
//
// A suite that starts proxies removes the built binary in TestMain:
//
//	func TestMain(m *testing.M) {
//		code := m.Run()
//		proctest.RemoveIdem()
//		os.Exit(code)
//	}
package proctest

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/childproc"
)

// modulePath is the module whose cmd/idem BuildIdem builds.
const modulePath = "github.com/idemkit/idem"

var (
	idemOnce sync.Once
	idemDir  string // the temporary directory of the binary
	idemBin  string
	idemErr  error
)

// BuildIdem builds cmd/idem of this module once per process (without
// -race: the proxy is the system under test, in its own process, not the
// subject of the race detector) into a temporary directory, and returns
// the binary's path. The module is found by walking up from the working
// directory (a test's package directory) to its go.mod.
func BuildIdem() (string, error) {
	idemOnce.Do(func() {
		root, err := moduleRoot()
		if err != nil {
			idemErr = err
			return
		}
		idemDir, err = os.MkdirTemp("", "idem-proctest-")
		if err != nil {
			idemErr = err
			return
		}
		idemBin = filepath.Join(idemDir, "idem")
		cmd := exec.Command("go", "build", "-o", idemBin, "./cmd/idem")
		cmd.Dir = root
		if out, err := cmd.CombinedOutput(); err != nil {
			idemErr = fmt.Errorf("go build ./cmd/idem: %v\n%s", err, out)
		}
	})
	return idemBin, idemErr
}

// BuildIdemAt builds cmd/idem as it was at commit (a released version,
// for upgrade tests) into $(go env GOPATH)/idem-servers/idem-COMMIT, once:
// later runs find it there. The source comes from the module's git
// history (git archive), its dependencies from the module proxy.
func BuildIdemAt(commit string) (string, error) {
	root, err := moduleRoot()
	if err != nil {
		return "", err
	}
	gopath, err := exec.Command("go", "env", "GOPATH").Output()
	if err != nil {
		return "", fmt.Errorf("go env GOPATH: %v", err)
	}
	dir := filepath.Join(strings.Split(strings.TrimSpace(string(gopath)), string(os.PathListSeparator))[0], "idem-servers")
	bin := filepath.Join(dir, "idem-"+commit)
	if _, err := os.Stat(bin); err == nil {
		return bin, nil
	}
	src, err := os.MkdirTemp("", "idem-"+commit+"-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(src)
	archive := exec.Command("sh", "-c", `git -C "$1" archive "$2" | tar -x -C "$3"`, "sh", root, commit, src)
	if out, err := archive.CombinedOutput(); err != nil {
		return "", fmt.Errorf("proctest: the source of commit %s from git (a clone with its history is needed): %v\n%s", commit, err, out)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	build := exec.Command("go", "build", "-o", bin+".tmp", "./cmd/idem")
	build.Dir = src
	if out, err := build.CombinedOutput(); err != nil {
		return "", fmt.Errorf("proctest: go build ./cmd/idem at %s: %v\n%s", commit, err, out)
	}
	return bin, os.Rename(bin+".tmp", bin)
}

// RemoveIdem deletes the binary BuildIdem built, if any; TestMain calls it
// after the tests.
func RemoveIdem() {
	if idemDir != "" {
		os.RemoveAll(idemDir)
	}
}

// moduleRoot returns the directory of the go.mod of modulePath at or above
// the working directory (skipping nested modules such as examples/frameworks).
func moduleRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		b, err := os.ReadFile(filepath.Join(dir, "go.mod"))
		if err == nil {
			for line := range bytes.Lines(b) {
				if f := strings.Fields(string(line)); len(f) == 2 && f[0] == "module" && strings.Trim(f[1], `"`) == modulePath {
					return dir, nil
				}
			}
		} else if !errors.Is(err, os.ErrNotExist) {
			return "", err
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", fmt.Errorf("proctest: no go.mod of %s at or above the working directory", modulePath)
		}
		dir = parent
	}
}

// logCap bounds the captured log of a proxy; lines past it are dropped.
const logCap = 8 << 20

// Proxy is a running `idem proxy` and its JSON log (stderr).
type Proxy struct {
	Cmd  *exec.Cmd
	Addr string // host:port it listens on

	mu  sync.Mutex
	log strings.Builder
}

// LogText returns the log captured so far (at most about 8 MiB: the
// first lines).
func (p *Proxy) LogText() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.log.String()
}

// StartProxy runs `idem proxy --listen 127.0.0.1:0 --log-format json` with
// args (built by BuildIdem; IDEM_* variables removed from its environment,
// since they would change the flags), waits up to 15s for its "idem proxy
// listening" log line, and kills it at the end of the test, logging the
// tail of its log if the test failed.
func StartProxy(t testing.TB, args ...string) *Proxy {
	t.Helper()
	bin, err := BuildIdem()
	if err != nil {
		t.Fatal(err)
	}
	return StartProxyBin(t, bin, args...)
}

// StartProxyBin is StartProxy with the idem binary bin (BuildIdemAt's).
func StartProxyBin(t testing.TB, bin string, args ...string) *Proxy {
	t.Helper()
	all := append([]string{"proxy", "--listen", "127.0.0.1:0", "--log-format", "json"}, args...)
	p := &Proxy{Cmd: exec.Command(bin, all...)}
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "IDEM_") {
			p.Cmd.Env = append(p.Cmd.Env, kv)
		}
	}
	// The AWS SDK behind s3:// looks for credentials at the EC2 metadata
	// address when it finds none: tests send traffic to loopback only.
	p.Cmd.Env = append(p.Cmd.Env, "AWS_EC2_METADATA_DISABLED=true")
	p.Cmd.SysProcAttr = childproc.SysProcAttr()
	stderr, err := p.Cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Cmd.Start(); err != nil {
		t.Fatal(err)
	}
	listening := make(chan string, 1)
	exited := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(stderr)
		sc.Buffer(nil, 4<<20)
		for sc.Scan() {
			p.mu.Lock()
			if p.log.Len() < logCap {
				p.log.Write(sc.Bytes())
				p.log.WriteByte('\n')
			}
			p.mu.Unlock()
			var rec struct{ Msg, Listen string }
			if json.Unmarshal(sc.Bytes(), &rec) == nil && rec.Msg == "idem proxy listening" {
				select { // never block the log reader
				case listening <- rec.Listen:
				default:
				}
			}
		}
		io.Copy(io.Discard, stderr)
		p.Cmd.Wait()
		close(exited)
	}()
	t.Cleanup(func() {
		p.Cmd.Process.Kill()
		<-exited
		if t.Failed() {
			log := p.LogText()
			t.Logf("idem proxy %s log (last 4 KiB):\n%s", p.Addr, log[max(0, len(log)-4096):])
		}
	})
	select {
	case p.Addr = <-listening:
	case <-exited:
		t.Fatalf("idem proxy exited at start:\n%s", p.LogText())
	case <-time.After(15 * time.Second):
		t.Fatal("idem proxy did not listen within 15s")
	}
	return p
}

// RequireTool is the path of the installed tool name, or it fails the
// test: scripts/test.sh installs every tool a test runs, so a missing one
// is a broken machine, not a reason to skip.
func RequireTool(t testing.TB, name string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		t.Fatalf("%s is not installed (scripts/test.sh installs it): %v", name, err)
	}
	return p
}
