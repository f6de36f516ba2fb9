// Package s3test starts a private, real S3-compatible server for tests:
// versitygw (github.com/versity/versitygw) with its posix backend, in a
// temporary directory, on a free port of 127.0.0.1. scripts/test.sh
// installs versitygw when it is missing; a test that needs S3 and does not
// find it fails with a message saying how to install it (it never skips).
//
//	srv := s3test.MustStart()   // in TestMain, or s3test.Start(t) in a test
//	defer srv.Stop()
//	url := srv.URL(srv.MustBucket())   // s3://KEY:SECRET@bucket?endpoint=…&region=us-east-1&use_path_style=true
//
// Servers are started with a parent-death signal on Linux, so they do not
// outlive a crashed test binary.
package s3test

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"go/build"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/s3"

	"github.com/idemkit/idem/internal/childproc"
	"github.com/idemkit/idem/internal/nettest"
)

// Version is the versitygw release scripts/test.sh installs.
const Version = "v1.8.0"

// Install is the command that installs versitygw where Start finds it.
const Install = "go install github.com/versity/versitygw/cmd/versitygw@" + Version

// Credentials and region of every server.
const (
	AccessKey = "idemtestkey"
	SecretKey = "idemtestsecret0123456789"
	Region    = "us-east-1"
)

const (
	startTimeout = 20 * time.Second
	stopTimeout  = 5 * time.Second
)

// Server is one versitygw process and its directory. Its methods are safe
// for concurrent use.
type Server struct {
	bin  string
	dir  string // root of the posix backend (buckets are its directories)
	log  string
	port int

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{}
}

// Find returns the path of the versitygw binary: on PATH, in $GOBIN, or
// in $GOPATH/bin (where go install puts it).
func Find() (string, error) {
	if p, err := exec.LookPath("versitygw"); err == nil {
		return p, nil
	}
	var dirs []string
	if gobin := os.Getenv("GOBIN"); gobin != "" {
		dirs = append(dirs, gobin)
	}
	for _, p := range filepath.SplitList(build.Default.GOPATH) {
		dirs = append(dirs, filepath.Join(p, "bin"))
	}
	for _, d := range dirs {
		p := filepath.Join(d, "versitygw")
		if fi, err := os.Stat(p); err == nil && !fi.IsDir() && fi.Mode()&0o111 != 0 {
			return p, nil
		}
	}
	return "", fmt.Errorf("s3test: versitygw not found on PATH, in $GOBIN or in $GOPATH/bin; "+
		"./scripts/test.sh installs it, or run: %s", Install)
}

// Start starts a server. The caller stops it.
func Start() (*Server, error) {
	bin, err := Find()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "idem-s3test-")
	if err != nil {
		return nil, err
	}
	s := &Server{bin: bin, dir: filepath.Join(dir, "root"), log: filepath.Join(dir, "versitygw.log")}
	if err := os.Mkdir(s.dir, 0o755); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	var lastErr error
	for range 5 { // another process may take the free port first
		if s.port, err = nettest.FreePort(); err != nil {
			os.RemoveAll(dir)
			return nil, err
		}
		if lastErr = s.launch(); lastErr == nil {
			return s, nil
		}
	}
	os.RemoveAll(dir)
	return nil, lastErr
}

// MustStart is Start that panics on failure (for TestMain).
func MustStart() *Server {
	s, err := Start()
	if err != nil {
		panic(err)
	}
	return s
}

func (s *Server) launch() error {
	logFile, err := os.OpenFile(s.log, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	cmd := exec.Command(s.bin, "--access", AccessKey, "--secret", SecretKey, "--region", Region,
		"--port", s.Addr(), "--quiet", "posix", s.dir)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	cmd.SysProcAttr = childproc.SysProcAttr()
	err = cmd.Start()
	logFile.Close()
	if err != nil {
		return fmt.Errorf("s3test: starting versitygw: %w", err)
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	deadline := time.Now().Add(startTimeout)
	for {
		if ready(s.Endpoint()) {
			break
		}
		select {
		case <-done:
			return fmt.Errorf("s3test: versitygw exited at start (%v):\n%s", cmd.ProcessState, tail(s.log))
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			cmd.Process.Kill()
			<-done
			return fmt.Errorf("s3test: versitygw did not answer on %s within %v:\n%s", s.Addr(), startTimeout, tail(s.log))
		}
	}
	s.mu.Lock()
	s.cmd, s.done = cmd, done
	s.mu.Unlock()
	return nil
}

// ready reports whether an S3 server answers at endpoint (any HTTP answer:
// an anonymous request is refused, which is an answer).
func ready(endpoint string) bool {
	c := http.Client{Timeout: time.Second}
	resp, err := c.Get(endpoint + "/")
	if err != nil {
		return false
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return true
}

func tail(path string) string {
	b, _ := os.ReadFile(path)
	if len(b) > 2048 {
		b = b[len(b)-2048:]
	}
	return string(b)
}

// Addr is the server's host:port.
func (s *Server) Addr() string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port)) }

// Endpoint is the server's base URL, http://127.0.0.1:PORT.
func (s *Server) Endpoint() string { return "http://" + s.Addr() }

// Dir is the root of the posix backend: bucket b's object o is the file
// Dir()/b/o.
func (s *Server) Dir() string { return s.dir }

// URL is the blobstore URL of bucket, credentials included, with extra
// query parameters appended ("prefix=x/").
func (s *Server) URL(bucket string, extra ...string) string {
	q := url.Values{"endpoint": {s.Endpoint()}, "region": {Region}, "use_path_style": {"true"}}
	u := "s3://" + AccessKey + ":" + SecretKey + "@" + bucket + "?" + q.Encode()
	for _, e := range extra {
		u += "&" + e
	}
	return u
}

// Client returns an S3 client of the server.
func (s *Server) Client() *s3.Client {
	return s3.New(s3.Options{
		Region:       Region,
		BaseEndpoint: aws.String(s.Endpoint()),
		UsePathStyle: true,
		Credentials:  credentials.NewStaticCredentialsProvider(AccessKey, SecretKey, ""),
	})
}

// Bucket creates a bucket with a fresh name and returns the name.
func (s *Server) Bucket() (string, error) {
	name := "idemtest-" + strings.ToLower(rand.Text()[:12])
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := s.Client().CreateBucket(ctx, &s3.CreateBucketInput{Bucket: aws.String(name)}); err != nil {
		return "", fmt.Errorf("s3test: create bucket %s: %w", name, err)
	}
	return name, nil
}

// MustBucket is Bucket that panics on failure.
func (s *Server) MustBucket() string {
	b, err := s.Bucket()
	if err != nil {
		panic(err)
	}
	return b
}

// Pause stops the server process (SIGSTOP): connections hang, as with a
// server that stopped answering. Resume continues it.
// It returns once every thread of the server has stopped: until then it
// may still answer (childproc.Pause).
func (s *Server) Pause() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd == nil {
		return errors.New("s3test: server not running")
	}
	return childproc.Pause(s.cmd.Process, 10*time.Second)
}

// Resume continues a paused server (SIGCONT).
func (s *Server) Resume() error { return s.signal(syscall.SIGCONT) }

func (s *Server) signal(sig syscall.Signal) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd == nil {
		return errors.New("s3test: server not running")
	}
	return s.cmd.Process.Signal(sig)
}

// Kill kills the server (SIGKILL); its port then refuses connections.
// Restart starts it again on the same port and directory.
func (s *Server) Kill() {
	s.mu.Lock()
	cmd, done := s.cmd, s.done
	s.cmd = nil
	s.mu.Unlock()
	if cmd != nil {
		cmd.Process.Signal(syscall.SIGCONT)
		cmd.Process.Kill()
		<-done
	}
}

// Restart starts a killed server again on its port, with its data.
func (s *Server) Restart() error {
	s.Kill()
	return s.launch()
}

// Stop ends the server and removes its directory.
func (s *Server) Stop() {
	s.mu.Lock()
	cmd, done := s.cmd, s.done
	s.cmd = nil
	s.mu.Unlock()
	if cmd != nil {
		cmd.Process.Signal(syscall.SIGCONT)
		cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-done:
		case <-time.After(stopTimeout):
			cmd.Process.Kill()
			<-done
		}
	}
	os.RemoveAll(filepath.Dir(s.dir))
}
