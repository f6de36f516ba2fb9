// Package upstreamtest holds the upstreams that the tests of cmd/idem
// (idem proxy) and of caddyidem share: Python's http.server on a unix
// socket (unix_upstream.py, embedded, so that both modules run the same
// script), an upstream that counts its requests by path (Counter), and
// the gRPC codec by which their gRPC peers pass raw bytes.
// It is test support: only _test.go files import it (it imports testing),
// so it is never linked into the idem binary.
package upstreamtest

import (
	"bufio"
	_ "embed"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/childproc"
	"github.com/idemkit/idem/internal/proctest"
)

// unixUpstream is an HTTP/1.1 server on Python's standard library that
// serves a unix socket; see the script's header for what it answers.
//
//go:embed unix_upstream.py
var unixUpstream []byte

// StartUnixPython runs unix_upstream.py with python3 on a socket in a
// fresh directory, waits for its "ready", and returns the socket's path.
// The server is killed when the test ends.
func StartUnixPython(t testing.TB) string {
	t.Helper()
	dir := t.TempDir()
	script, sock := filepath.Join(dir, "unix_upstream.py"), filepath.Join(dir, "app.sock")
	if err := os.WriteFile(script, unixUpstream, 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(proctest.RequireTool(t, "python3"), script, sock)
	cmd.SysProcAttr = childproc.SysProcAttr()
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	ready := make(chan bool, 1)
	go func() {
		sc := bufio.NewScanner(out)
		ready <- sc.Scan() && sc.Text() == "ready"
		io.Copy(io.Discard, out)
	}()
	select {
	case ok := <-ready:
		if !ok {
			t.Fatal("unix_upstream.py did not start (no \"ready\" on its stdout)")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("unix_upstream.py not ready within 10s")
	}
	return sock
}

// RawCodec passes gRPC messages as raw bytes (*[]byte), under the name
// "proto" so that calls go as application/grpc: the tests' peers need no
// generated code to send and check exact bytes.
type RawCodec struct{}

// Marshal returns the bytes of v, a *[]byte.
func (RawCodec) Marshal(v any) ([]byte, error) { return *v.(*[]byte), nil }

// Unmarshal copies b into v, a *[]byte (b is not the caller's to keep).
func (RawCodec) Unmarshal(b []byte, v any) error {
	*v.(*[]byte) = append([]byte(nil), b...)
	return nil
}

// Name is "proto", the content subtype of application/grpc.
func (RawCodec) Name() string { return "proto" }
