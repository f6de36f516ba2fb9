package natsjs

import (
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"time"

	"github.com/idemkit/idem/internal/nettest"
)

// natsServer is a private nats-server with JetStream, on a free loopback
// port, storing in its own temporary directory. Restart starts it again on
// the same port and directory, so that file-storage streams survive.
type natsServer struct {
	bin  string
	dir  string
	addr string
	url  string
	cmd  *exec.Cmd
	done chan struct{}
}

const (
	serverStartTimeout = 10 * time.Second
	serverStopTimeout  = 5 * time.Second
)

// startNATS starts nats-server and waits, at most serverStartTimeout,
// until it accepts connections.
func startNATS() (*natsServer, error) {
	bin, err := exec.LookPath("nats-server")
	if err != nil {
		return nil, errors.New("natsjs tests: nats-server not found on PATH; install it (apt-get install nats-server)")
	}
	dir, err := os.MkdirTemp("", "natsjs-test-")
	if err != nil {
		return nil, err
	}
	port, err := nettest.FreePort()
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	s := &natsServer{bin: bin, dir: dir, addr: addr, url: "nats://" + addr}
	if err := s.start(); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	return s, nil
}

// start runs the server process and waits until it accepts connections.
func (s *natsServer) start() error {
	_, port, _ := net.SplitHostPort(s.addr)
	logPath := s.dir + "/nats.log"
	cmd := exec.Command(s.bin, "-a", "127.0.0.1", "-p", port, "-js", "-sd", s.dir, "-l", logPath)
	cmd.SysProcAttr = sysProcAttr()
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("natsjs tests: starting nats-server: %w", err)
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	s.cmd, s.done = cmd, done
	deadline := time.Now().Add(serverStartTimeout)
	for {
		conn, err := net.DialTimeout("tcp", s.addr, 200*time.Millisecond)
		if err == nil {
			conn.Close()
			return nil
		}
		select {
		case <-done:
			log, _ := os.ReadFile(logPath)
			return fmt.Errorf("natsjs tests: nats-server exited: %s", log)
		default:
		}
		if time.Now().After(deadline) {
			s.kill()
			return fmt.Errorf("natsjs tests: nats-server not accepting connections on %s after %v", s.addr, serverStartTimeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// kill kills the server process and waits (bounded) for it to exit.
func (s *natsServer) kill() {
	_ = s.cmd.Process.Kill()
	select {
	case <-s.done:
	case <-time.After(serverStopTimeout):
	}
}

// Restart kills the server (SIGKILL: no goodbye to its clients, nothing
// flushed beyond what the store wrote) and starts it again on the same
// port and store directory.
func (s *natsServer) Restart() error {
	s.kill()
	return s.start()
}

// Stop kills the server, waits (bounded) for it to exit, and removes its
// directory.
func (s *natsServer) Stop() {
	s.kill()
	os.RemoveAll(s.dir)
}
