package natsjs

import (
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"time"
)

// natsServer is a private nats-server with JetStream, on a free loopback
// port, storing in its own temporary directory.
type natsServer struct {
	cmd  *exec.Cmd
	dir  string
	url  string
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
	port, err := freePort()
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	logPath := dir + "/nats.log"
	cmd := exec.Command(bin, "-a", "127.0.0.1", "-p", strconv.Itoa(port), "-js", "-sd", dir, "-l", logPath)
	cmd.SysProcAttr = sysProcAttr()
	if err := cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("natsjs tests: starting nats-server: %w", err)
	}
	s := &natsServer{cmd: cmd, dir: dir, url: "nats://" + addr, done: make(chan struct{})}
	go func() { cmd.Wait(); close(s.done) }()
	deadline := time.Now().Add(serverStartTimeout)
	for {
		conn, err := net.DialTimeout("tcp", addr, 200*time.Millisecond)
		if err == nil {
			conn.Close()
			return s, nil
		}
		select {
		case <-s.done:
			log, _ := os.ReadFile(logPath)
			s.Stop()
			return nil, fmt.Errorf("natsjs tests: nats-server exited: %s", log)
		default:
		}
		if time.Now().After(deadline) {
			s.Stop()
			return nil, fmt.Errorf("natsjs tests: nats-server not accepting connections on %s after %v", addr, serverStartTimeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Stop kills the server, waits (bounded) for it to exit, and removes its
// directory.
func (s *natsServer) Stop() {
	_ = s.cmd.Process.Kill()
	select {
	case <-s.done:
	case <-time.After(serverStopTimeout):
	}
	os.RemoveAll(s.dir)
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}
