// Package kmstest starts a private local-kms (an AWS KMS emulator written
// in Go, from the Go module proxy) for tests, with two seeded AES-256
// keys, its database in a temporary directory and a port of the kernel's
// choosing. scripts/test.sh installs it with go install into
// $(go env GOPATH)/bin when it is missing; a test that needs it and does
// not find it fails with the command that installs it (it never skips).
//
// local-kms listens on every address whatever it is asked (its PORT is
// a port only); the tests talk to it on 127.0.0.1 only. Clients get static
// credentials, region Region and the server as endpoint: they never reach
// AWS. Set AWS_EC2_METADATA_DISABLED=true too.
//
// # Where local-kms differs from KMS
//
// Checked against local-kms v0.0.0-20260228092603-2a5e92d09ab6 (its
// src/handler sources) and by the tests of seal/awskms:
//
//   - It checks no signature: any credentials are accepted. A wrong
//     endpoint or key is all a test can get wrong.
//   - Decrypt with a KeyId of another key than the one that made the
//     ciphertext fails with InvalidCiphertextException (KMS:
//     IncorrectKeyException).
//   - Its ciphertext blob (a length, the key's ARN, the key version, then
//     AES-GCM) authenticates only its last part: a blob whose ARN bytes
//     are altered still decrypts under the KeyId given. (KMS refuses any
//     altered blob.)
//   - It logs every call at INFO on stderr; Server keeps the last lines for
//     a test's failure message.
package kmstest

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"go/build"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awshttp "github.com/aws/aws-sdk-go-v2/aws/transport/http"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/kms"

	"github.com/idemkit/idem/internal/childproc"
)

// Module and Version are the local-kms that scripts/test.sh installs.
const (
	Module  = "github.com/nsmithuk/local-kms"
	Version = "v0.0.0-20260228092603-2a5e92d09ab6"
)

// Binary is the installed command's name.
const Binary = "local-kms"

// Install is the command that installs local-kms where Find looks.
const Install = `GOBIN="$(go env GOPATH)/bin" go install ` + Module + "@" + Version

// Region and AccountID are the server's: they make its key ARNs.
const (
	Region    = "us-east-1"
	AccountID = "111122223333"
)

// The seeded keys: Key, and Other, a second key of the same account (a
// value sealed under one of them must not open under the other).
const (
	KeyID      = "0b5d8b35-8a5e-4b8e-9f1c-6d1b0c9e7a11"
	OtherKeyID = "7c2e4f90-3d6a-4c1b-8e5f-2a9b8c7d6e22"
	// KeyAlias names Key.
	KeyAlias = "alias/idem-test"
)

// ARN returns the ARN of the key of the server with id.
func ARN(id string) string { return "arn:aws:kms:" + Region + ":" + AccountID + ":key/" + id }

// seed is the server's seed file: the two keys (their backing keys are
// test keys, fixed so that a failure reproduces) and the alias.
const seed = `Keys:
  Symmetric:
    Aes:
      - Metadata:
          KeyId: ` + KeyID + `
          Description: idem kmstest key
        BackingKeys:
          - 5cdaead27fe7da2de47945d73cd6d79e36494e73802f3cd3869f1d2cb0b5d7a9
      - Metadata:
          KeyId: ` + OtherKeyID + `
          Description: idem kmstest other key
        BackingKeys:
          - 34743777217a25432a46294a404e635266556a586e3272357538782f413f4428
Aliases:
  - AliasName: ` + KeyAlias + `
    TargetKeyId: ` + KeyID + `
`

// Find returns the path of the local-kms binary: on $PATH, or in the bin
// folder of a $GOPATH entry.
func Find() (string, error) {
	if p, err := exec.LookPath(Binary); err == nil {
		return p, nil
	}
	for _, p := range filepath.SplitList(build.Default.GOPATH) {
		bin := filepath.Join(p, "bin", Binary)
		if _, err := os.Stat(bin); err == nil {
			return bin, nil
		}
	}
	return "", fmt.Errorf("kmstest: %s not found on $PATH or in $GOPATH/bin; ./scripts/test.sh installs it, or run: %s", Binary, Install)
}

// Server is one local-kms process.
type Server struct {
	bin, dir string
	port     string

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{}
	logs []string // the last lines of its log
}

// maxLogLines is how many lines of the server's log Server keeps.
const maxLogLines = 50

// startedLine is local-kms's line once it listens, with the port.
var startedLine = regexp.MustCompile(`Local KMS started on [0-9.]+:([0-9]+)`)

// Start starts a server with the seeded keys and stops it (and removes
// its data) at the test's cleanup. It fails the test when local-kms is
// missing or does not answer.
func Start(t testing.TB) *Server {
	t.Helper()
	bin, err := Find()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "seed.yaml"), []byte(seed), 0o600); err != nil {
		t.Fatal(err)
	}
	s := &Server{bin: bin, dir: dir, port: "0"}
	t.Cleanup(s.Stop)
	if err := s.start(); err != nil {
		t.Fatalf("%v\n%s", err, s.LogText())
	}
	return s
}

func (s *Server) start() error {
	cmd := exec.Command(s.bin)
	cmd.Env = append(os.Environ(),
		"PORT="+s.port,
		"KMS_ACCOUNT_ID="+AccountID,
		"KMS_REGION="+Region,
		"KMS_DATA_PATH="+filepath.Join(s.dir, "data"),
		"KMS_SEED_PATH="+filepath.Join(s.dir, "seed.yaml"),
	)
	cmd.Dir = s.dir
	cmd.SysProcAttr = childproc.SysProcAttr()
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return err
	}
	cmd.Stdout = io.Discard
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("kmstest: starting %s: %w", s.bin, err)
	}
	done := make(chan struct{})
	listening := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			line := sc.Text()
			if m := startedLine.FindStringSubmatch(line); m != nil {
				select {
				case listening <- m[1]:
				default:
				}
			}
			s.mu.Lock()
			s.logs = append(s.logs, line)
			if len(s.logs) > maxLogLines {
				s.logs = s.logs[len(s.logs)-maxLogLines:]
			}
			s.mu.Unlock()
		}
		io.Copy(io.Discard, stderr)
		cmd.Wait()
		close(done)
	}()
	s.mu.Lock()
	s.cmd, s.done = cmd, done
	s.mu.Unlock()
	select {
	case s.port = <-listening:
	case <-done:
		return errors.New("kmstest: local-kms exited at start")
	case <-time.After(20 * time.Second):
		return errors.New("kmstest: local-kms did not listen within 20s")
	}
	// It answers: the seeded key is there and enabled.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	out, err := s.Client().DescribeKey(ctx, &kms.DescribeKeyInput{KeyId: aws.String(KeyAlias)})
	if err != nil {
		return fmt.Errorf("kmstest: local-kms does not answer DescribeKey %s: %w", KeyAlias, err)
	}
	if got := aws.ToString(out.KeyMetadata.Arn); got != s.KeyARN() {
		return fmt.Errorf("kmstest: local-kms's %s is %s; want %s", KeyAlias, got, s.KeyARN())
	}
	return nil
}

// Endpoint is the server's URL, http://127.0.0.1:PORT.
func (s *Server) Endpoint() string { return "http://" + s.Addr() }

// Addr is host:port on 127.0.0.1.
func (s *Server) Addr() string { return "127.0.0.1:" + s.port }

// KeyARN is the ARN of the seeded key Key; OtherKeyARN of the other one.
func (s *Server) KeyARN() string { return ARN(KeyID) }

// OtherKeyARN is the ARN of the second seeded key.
func (s *Server) OtherKeyARN() string { return ARN(OtherKeyID) }

// Region is the server's region.
func (s *Server) Region() string { return Region }

// Client returns a client of the server (NewClient of its address).
func (s *Server) Client() *kms.Client { return NewClient(s.Addr()) }

// NewClient returns a client of a KMS endpoint at addr (host:port, plain
// HTTP) with static credentials, region Region and one try per call (the
// SDK's retries off, so that a test sees what the code under test does
// with a failure).
func NewClient(addr string) *kms.Client {
	return kms.New(kms.Options{
		Region:           Region,
		BaseEndpoint:     aws.String("http://" + addr),
		Credentials:      credentials.NewStaticCredentialsProvider("idemtest", "idemtestsecret", ""),
		RetryMaxAttempts: 1,
		HTTPClient: awshttp.NewBuildableClient().WithTransportOptions(func(t *http.Transport) {
			t.MaxIdleConns, t.MaxIdleConnsPerHost = 64, 64
		}),
	})
}

// Env returns the environment variables that point the AWS SDK's usual
// configuration (config.LoadDefaultConfig) at the server, with static
// credentials: AWS_ENDPOINT_URL_KMS, AWS_REGION, AWS_ACCESS_KEY_ID,
// AWS_SECRET_ACCESS_KEY, AWS_EC2_METADATA_DISABLED, and no shared files.
func (s *Server) Env() map[string]string {
	return map[string]string{
		"AWS_ENDPOINT_URL_KMS":        s.Endpoint(),
		"AWS_REGION":                  Region,
		"AWS_ACCESS_KEY_ID":           "idemtest",
		"AWS_SECRET_ACCESS_KEY":       "idemtestsecret",
		"AWS_SESSION_TOKEN":           "",
		"AWS_PROFILE":                 "",
		"AWS_EC2_METADATA_DISABLED":   "true",
		"AWS_CONFIG_FILE":             os.DevNull,
		"AWS_SHARED_CREDENTIALS_FILE": os.DevNull,
	}
}

// LogText is the last lines of the server's log.
func (s *Server) LogText() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return strings.Join(s.logs, "\n")
}

// Stop kills the server and waits for it to exit; its data stays (for
// Restart) until the test's cleanup removes the directory. Stop twice is
// Stop once.
func (s *Server) Stop() {
	s.mu.Lock()
	cmd, done := s.cmd, s.done
	s.cmd = nil
	s.mu.Unlock()
	if cmd == nil {
		return
	}
	if cmd.Process != nil {
		cmd.Process.Kill()
	}
	<-done
}

// Restart starts a stopped server again on its port with its data.
func (s *Server) Restart() error {
	s.Stop()
	var err error
	for range 50 { // the port may linger a moment
		if err = s.start(); err == nil {
			return nil
		}
		s.Stop()
		time.Sleep(100 * time.Millisecond)
	}
	return err
}
