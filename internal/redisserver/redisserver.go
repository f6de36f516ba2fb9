// Package redisserver starts private, real redis-server processes on
// 127.0.0.1: a server, a Redis Cluster, a Sentinel set. It is not test
// support only: idem bench (and internal/benchpeers) start a server with
// it when no --redis URL is given, so it imports neither testing nor any
// internal/*test package (cmd/idem's TestBinariesLinkNoTestPackages
// checks that no binary links one).
//
// Every server listens on a free port on 127.0.0.1, keeps its files (log and,
// for cluster nodes, the cluster config) in its own temporary directory and
// persists nothing (--save "" --appendonly no). Servers are started with a
// parent-death signal on Linux (internal/childproc), so they do not outlive
// their parent even if it crashes, but callers should still Stop them. A
// test package usually shares one server among its tests through
// internal/redistest (redistest.Run in TestMain, redistest.Store for a
// store under a prefix of its own); a test that kills, pauses or
// configures a server starts one of its own here and stops it.
//
// A test that fails a Sentinel deployment over starts its own
// [SentinelSet] (a primary, a replica, three sentinels) and stops it when
// it ends.
//
// Servers and clusters need only the standard library: [Server.Do] speaks
// just enough RESP2 to send commands such as INFO, CONFIG SET or FLUSHALL.
// The Sentinel set and [CPUTime] use go-redis, a dependency of the module
// anyway.
package redisserver

import (
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/idemkit/idem/internal/childproc"
)

const (
	// startTimeout bounds how long a launched redis-server may take to answer.
	startTimeout = 10 * time.Second
	// stopTimeout bounds the wait after SIGTERM before SIGKILL, and the wait
	// for a killed process to be reaped.
	stopTimeout = 5 * time.Second
	// startAttempts is how many fresh ports StartServer tries when another
	// process binds the chosen port before redis-server does.
	startAttempts = 5
	// logTailBytes is how much of the server log a start error shows.
	logTailBytes = 2048
)

// errPortInUse marks a start failure caused by a port bound by someone else.
var errPortInUse = errors.New("port already in use")

// Server is one private redis-server process listening on 127.0.0.1.
// Its methods are safe for concurrent use.
type Server struct {
	bin     string     // path of the redis-server binary
	port    int        // client port
	busPort int        // cluster bus port (port+10000), 0 for a standalone server
	dir     string     // temporary directory holding the log and cluster config
	logPath string     // server log; also receives the process's stdout and stderr
	args    []string   // redis-server arguments, reused by Restart
	post    [][]string // commands sent after every start (WithKind)

	mu      sync.Mutex
	proc    *process // the last process started; nil after Kill or Stop
	stopped bool     // Stop has run: ports released, dir removed
}

// process is one run of redis-server.
type process struct {
	cmd  *exec.Cmd
	done chan struct{} // closed once the process has exited and been reaped
}

// Option configures a server started by StartServer or StartCluster.
type Option func(*config)

type config struct {
	args    []string   // extra redis-server arguments
	cluster bool       // start as a cluster node; set by StartCluster only
	kind    Kind       // the server build (WithKind); "" is the system's redis-server
	post    [][]string // commands sent after every start (WithKind)
}

// WithArgs adds redis-server command-line arguments, for example
// WithArgs("--maxmemory", "10mb"). They come after the package's own
// arguments and so override them, but must not change port, bind, dir or
// logfile, which the package relies on.
func WithArgs(args ...string) Option {
	return func(c *config) { c.args = append(c.args, args...) }
}

// StartServer starts a redis-server on a free port on 127.0.0.1 with its own
// temporary directory, no persistence (--save "" --appendonly no) and its log
// in that directory. It returns once the server answers commands, waiting at
// most 10s. If the server fails to start, the error includes the tail of its
// log; if the port was taken by another process in the meantime it retries on
// other ports a few times. It fails at once if redis-server is not on PATH.
func StartServer(opts ...Option) (*Server, error) {
	var cfg config
	for _, opt := range opts {
		opt(&cfg)
	}
	bin, err := cfg.binary()
	if err != nil {
		return nil, err
	}
	return startServer(bin, cfg)
}

// MustStartServer is StartServer for TestMain: on failure it prints the error
// to stderr and exits the test binary with status 1.
func MustStartServer(opts ...Option) *Server {
	s, err := StartServer(opts...)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	return s
}

// lookPath finds bin on PATH, or explains which Debian package provides it.
func lookPath(bin, pkg string) (string, error) {
	path, err := exec.LookPath(bin)
	if err != nil {
		return "", fmt.Errorf("redisserver: %s not found on PATH; install it (apt-get install %s)", bin, pkg)
	}
	return path, nil
}

// startServer creates the server's directory and starts it, picking new
// ports when a bind races with another process.
func startServer(bin string, cfg config) (*Server, error) {
	dir, err := os.MkdirTemp("", "redisserver-")
	if err != nil {
		return nil, fmt.Errorf("redisserver: %w", err)
	}
	s := &Server{bin: bin, dir: dir, logPath: filepath.Join(dir, "redis.log"), post: cfg.post}
	for attempt := 1; ; attempt++ {
		s.port, s.busPort, err = reservePorts(cfg.cluster)
		if err != nil {
			break
		}
		s.args = s.serverArgs(cfg)
		if err = s.launch(); err == nil {
			return s, nil
		}
		releasePorts(s.port, s.busPort)
		if !errors.Is(err, errPortInUse) || attempt == startAttempts {
			break
		}
	}
	_ = os.RemoveAll(dir)
	return nil, err
}

// serverArgs returns the redis-server command line for s.
func (s *Server) serverArgs(cfg config) []string {
	args := []string{
		"--port", strconv.Itoa(s.port),
		"--bind", "127.0.0.1",
		"--dir", s.dir,
		"--logfile", s.logPath,
		"--daemonize", "no",
		"--save", "",
		"--appendonly", "no",
		// Serve a replica's full sync at once instead of waiting 5s for
		// more replicas to join the transfer.
		"--repl-diskless-sync-delay", "0",
	}
	if cfg.cluster {
		args = append(args,
			"--cluster-enabled", "yes",
			"--cluster-config-file", filepath.Join(s.dir, "nodes.conf"),
			"--cluster-node-timeout", "2000",
		)
	}
	return append(args, cfg.args...)
}

// launch starts redis-server with s.args and waits until it answers. On
// failure the process is killed and the error carries the tail of the log
// written by this attempt. The caller holds s.mu or has not shared s yet.
func (s *Server) launch() error {
	logFile, err := os.OpenFile(s.logPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("redisserver: %w", err)
	}
	logStart, err := logFile.Seek(0, io.SeekEnd)
	if err != nil {
		logFile.Close()
		return fmt.Errorf("redisserver: %w", err)
	}
	cmd := exec.Command(s.bin, s.args...)
	cmd.Dir = s.dir
	// Errors printed before the log file is open (bad arguments) go to
	// stderr; append them to the same log.
	cmd.Stdout, cmd.Stderr = logFile, logFile
	cmd.SysProcAttr = childproc.SysProcAttr()
	err = cmd.Start()
	logFile.Close() // the child has its own descriptor
	if err != nil {
		return fmt.Errorf("redisserver: starting redis-server: %w", err)
	}
	p := &process{cmd: cmd, done: make(chan struct{})}
	go func() {
		_ = cmd.Wait()
		close(p.done)
	}()

	if err := s.waitReady(p); err != nil {
		p.kill()
		tail := logTail(s.logPath, logStart)
		if strings.Contains(tail, "Address already in use") {
			err = errPortInUse
		}
		return fmt.Errorf("redisserver: redis-server on %s did not start: %w\n--- redis-server log (tail) ---\n%s",
			s.Addr(), err, tail)
	}
	for _, c := range s.post {
		if _, err := do(s.Addr(), startTimeout, c...); err != nil {
			p.kill()
			return fmt.Errorf("redisserver: %s on the server on %s: %w", strings.Join(c, " "), s.Addr(), err)
		}
	}
	s.proc = p
	return nil
}

// waitReady polls until the server on s's port answers INFO with p's process
// id (so a foreign server that holds the port is not mistaken for ours),
// until p exits, or until startTimeout passes.
func (s *Server) waitReady(p *process) error {
	want := strconv.Itoa(p.cmd.Process.Pid)
	deadline := time.Now().Add(startTimeout)
	for {
		info, err := do(s.Addr(), time.Second, "INFO", "server")
		if pid, _ := InfoField(info, "process_id"); err == nil && pid == want {
			return nil
		}
		select {
		case <-p.done:
			return fmt.Errorf("redis-server exited early (%v)", p.cmd.ProcessState)
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("no answer within %v", startTimeout)
		}
	}
}

// logTail returns the end of the log file from offset from, at most
// logTailBytes, starting at a line boundary.
func logTail(path string, from int64) string {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Sprintf("(cannot read log: %v)", err)
	}
	defer f.Close()
	trimmed := false
	if fi, err := f.Stat(); err == nil && fi.Size()-from > logTailBytes {
		from, trimmed = fi.Size()-logTailBytes, true
	}
	b, err := io.ReadAll(io.NewSectionReader(f, from, logTailBytes))
	if err != nil {
		return fmt.Sprintf("(cannot read log: %v)", err)
	}
	text := string(b)
	if _, rest, ok := strings.Cut(text, "\n"); trimmed && ok {
		text = rest // drop the partial first line
	}
	return text
}

// Addr returns the server's address, "127.0.0.1:PORT".
func (s *Server) Addr() string { return loopback(s.port) }

// Port returns the server's client port.
func (s *Server) Port() int { return s.port }

// Stop terminates the server and cleans up: SIGTERM, then SIGKILL if it has
// not exited within 5s, then it removes the temporary directory and releases
// the ports. A paused server is resumed so that it can act on SIGTERM. Stop
// is safe to call more than once; after it the Server cannot be restarted.
func (s *Server) Stop() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stopped {
		return
	}
	s.stopped = true
	if p := s.proc; p != nil {
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		_ = p.cmd.Process.Signal(syscall.SIGCONT)
		if !p.wait(stopTimeout) {
			p.kill()
		}
		s.proc = nil
	}
	releasePorts(s.port, s.busPort)
	_ = os.RemoveAll(s.dir)
}

// Kill sends SIGKILL and waits for the process to exit. The ports and the
// directory (with the log and any cluster config) are kept, so Restart can
// bring the server back on the same address. Killing a server that is not
// running does nothing.
func (s *Server) Kill() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc != nil {
		s.proc.kill()
		s.proc = nil
	}
}

// Restart starts the server again on the same port, with the same directory
// and arguments, and waits (bounded) until it answers. It is meant for a
// server that is down: after Kill, or after it went down by itself (e.g.
// SHUTDOWN sent through Do, or a crash). A process that is still running,
// or still shutting down, is killed first. Restart fails after Stop.
// Nothing is persisted, so the data set starts empty; a cluster node keeps
// its identity and rejoins the cluster through its nodes.conf.
func (s *Server) Restart() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stopped {
		return fmt.Errorf("redisserver: cannot restart %s after Stop", s.Addr())
	}
	if s.proc != nil {
		s.proc.kill()
		s.proc = nil
	}
	// The port may linger in use briefly (e.g. by a process not yet reaped);
	// keep trying on the same port until startTimeout.
	deadline := time.Now().Add(startTimeout)
	for {
		err := s.launch()
		if err == nil || !errors.Is(err, errPortInUse) || time.Now().After(deadline) {
			return err
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// Pause freezes the server with SIGSTOP: it keeps its port, and connections
// are accepted by the kernel, but nothing is answered until Resume.
// It returns once the server has stopped (childproc.Pause): until then a
// busy server may still answer.
func (s *Server) Pause() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc == nil || s.proc.exited() {
		return fmt.Errorf("redisserver: server %s is not running", s.Addr())
	}
	if err := childproc.Pause(s.proc.cmd.Process, 10*time.Second); err != nil {
		return fmt.Errorf("redisserver: pausing %s: %w", s.Addr(), err)
	}
	return nil
}

// Resume continues a paused server with SIGCONT.
func (s *Server) Resume() error { return s.signal(syscall.SIGCONT) }

// signal sends sig to the running server process.
func (s *Server) signal(sig syscall.Signal) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc == nil || s.proc.exited() {
		return fmt.Errorf("redisserver: server %s is not running", s.Addr())
	}
	if err := s.proc.cmd.Process.Signal(sig); err != nil {
		return fmt.Errorf("redisserver: signalling %s: %w", s.Addr(), err)
	}
	return nil
}

// kill sends SIGKILL and waits, at most stopTimeout, for the process to be
// reaped.
func (p *process) kill() {
	_ = p.cmd.Process.Kill()
	p.wait(stopTimeout)
}

// wait reports whether the process exited within d.
func (p *process) wait(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-p.done:
		return true
	case <-t.C:
		return false
	}
}

// exited reports whether the process has already exited.
func (p *process) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}
