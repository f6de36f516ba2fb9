// Package dynamotest starts a private dynalite (the DynamoDB API on
// LevelDB, from npm) for tests, in memory, on a free port of 127.0.0.1.
// scripts/test.sh installs it with npm into $(go env GOPATH)/idem-dynalite
// when it is missing; a test that needs it and does not find it fails with
// a message saying how to install it (it never skips).
//
// Clients get static credentials, region us-east-1 and the server as
// endpoint: they never reach AWS. Set AWS_EC2_METADATA_DISABLED=true too.
package dynamotest

import (
	"errors"
	"fmt"
	"go/build"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awshttp "github.com/aws/aws-sdk-go-v2/aws/transport/http"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb"

	"github.com/idemkit/idem/internal/childproc"
)

// Version is the dynalite release scripts/test.sh installs.
const Version = "4.0.0"

// Dir is the folder under $GOPATH that dynalite is installed into.
const Dir = "idem-dynalite"

// Install is the command that installs dynalite where Start finds it.
const Install = "npm install --prefix \"$(go env GOPATH)/" + Dir + "\" dynalite@" + Version

// Region of every client.
const Region = "us-east-1"

// serve is what cli.js does with --host 127.0.0.1 --createTableMs 0
// --deleteTableMs 0 --updateTableMs 0, with Node.js's connection timeouts off:
// idle connections stay open (Node.js closes them after 5s) and a request
// may wait for the server as long as it must (Node.js resets a connection
// whose request it has not read in full after 60s or 300s). On a loaded
// machine both happened to the tests' clients, whose calls make one
// attempt each ("server closed idle connection", "broken pipe",
// "connection reset by peer"): failures of the test server, not of the
// store.
//
// A client that goes away in the middle of a request (its context ended,
// or a connection cut by the tests' proxies) makes dynalite throw from the
// request's "error" event ("aborted", ECONNRESET), which would end the
// process: the script ignores that one exception (the request was never
// read in full, so nothing was applied) and exits on any other.
//
// It also listens with a backlog of Backlog connections (the kernel caps
// it at net.core.somaxconn) instead of Node.js's 511. A storm of new
// connections (storetest's Concurrency: 2,000 callers at once) fills a
// backlog of 511 faster than the busy server accepts them; Linux then
// answers with SYN cookies and drops the handshakes it cannot queue, and
// resets some of those connections later, when their cookie no longer
// checks: the client, which took the connection for open and sent its
// request on it, reads "connection reset by peer" (each one counted in
// TcpExtSyncookiesFailed and TcpEstabResets). Clients from Client open
// at most MaxConns connections, within even a small backlog.
const serve = `const server = require(process.argv[1])({createTableMs: 0, deleteTableMs: 0, updateTableMs: 0});
server.keepAliveTimeout = 0;
server.headersTimeout = 0;
server.requestTimeout = 0;
process.on("uncaughtException", (err) => {
  if (err && err.code === "ECONNRESET" && err.message === "aborted") return;
  console.error(err);
  process.exit(1);
});
server.listen(Number(process.argv[2]), "127.0.0.1", Number(process.argv[3]));`

// Backlog is the listen backlog the server asks for.
const Backlog = 4096

// MaxConns is the most connections a client from Client opens to the
// server (dynalite serves one request at a time: more would only queue
// in the server, and past its backlog be reset).
const MaxConns = 64

// Server is one dynalite process.
type Server struct {
	cmd  *exec.Cmd
	port int
	done chan struct{}
}

// Find returns the path of dynalite's cli.js.
func Find() (string, error) {
	for _, p := range filepath.SplitList(build.Default.GOPATH) {
		cli := filepath.Join(p, Dir, "node_modules", "dynalite", "cli.js")
		if _, err := os.Stat(cli); err == nil {
			return cli, nil
		}
	}
	return "", fmt.Errorf("dynamotest: dynalite not found in $GOPATH/%s; ./scripts/test.sh installs it, or run: %s", Dir, Install)
}

// Start starts a server. The caller stops it.
func Start() (*Server, error) {
	cli, err := Find()
	if err != nil {
		return nil, err
	}
	var lastErr error
	for range 5 { // another process may take the free port first
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		port := l.Addr().(*net.TCPAddr).Port
		l.Close()
		s := &Server{port: port, done: make(chan struct{})}
		s.cmd = exec.Command("node", "-e", serve, filepath.Join(filepath.Dir(cli), "index.js"), strconv.Itoa(port), strconv.Itoa(Backlog))
		s.cmd.SysProcAttr = childproc.SysProcAttr()
		if err := s.cmd.Start(); err != nil {
			return nil, err
		}
		go func() { s.cmd.Wait(); close(s.done) }()
		if lastErr = s.wait(); lastErr == nil {
			return s, nil
		}
		s.Stop()
	}
	return nil, lastErr
}

func (s *Server) wait() error {
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case <-s.done:
			return errors.New("dynamotest: dynalite exited at start")
		default:
		}
		c, err := net.DialTimeout("tcp", s.Addr(), 100*time.Millisecond)
		if err == nil {
			c.Close()
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	return errors.New("dynamotest: dynalite did not listen within 20s")
}

// Addr is host:port.
func (s *Server) Addr() string { return "127.0.0.1:" + strconv.Itoa(s.port) }

// Client returns a client of the server. It makes one attempt per call
// (the SDK's retries off, so that the tests see what the code under test
// does with a failure) over at most MaxConns connections.
func (s *Server) Client() *dynamodb.Client { return Client(s.Addr()) }

// Client returns a client of a server at addr (host:port), made as
// Server.Client makes one: for a proxy in front of the server.
func Client(addr string) *dynamodb.Client {
	return dynamodb.New(dynamodb.Options{
		Region:           Region,
		BaseEndpoint:     aws.String("http://" + addr),
		Credentials:      credentials.NewStaticCredentialsProvider("idemtest", "idemtestsecret", ""),
		RetryMaxAttempts: 1,
		HTTPClient: awshttp.NewBuildableClient().WithTransportOptions(func(t *http.Transport) {
			t.MaxConnsPerHost = MaxConns
		}),
	})
}

// Stop kills the server and waits for it to exit.
func (s *Server) Stop() {
	if s.cmd.Process != nil {
		s.cmd.Process.Kill()
	}
	<-s.done
}
