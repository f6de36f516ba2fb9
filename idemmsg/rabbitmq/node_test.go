package rabbitmq

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/nettest"
)

// node is a private RabbitMQ node the tests own, for the broker-fault
// scenarios: its own name, AMQP and distribution ports on loopback, data
// and logs in a temporary directory (durable queues and persistent
// messages survive its restarts), its own Erlang cookie (HOME is the
// directory), and the machine's epmd. Started once per test binary on
// first use, stopped by TestMain.
type node struct {
	name, dir string
	port      int
	ctl       string // rabbitmqctl
	cmd       *exec.Cmd
	exited    chan struct{}
	env       []string

	// mu is held for writing by a topic that restarts the node, for its
	// whole life, and for reading by the other topics on the node: a
	// restart is the only fault its scenario sees.
	mu sync.RWMutex
}

// nodeSpec is what a private node is configured with.
type nodeSpec struct {
	// consumerTimeout, when positive, is the node's consumer_timeout:
	// a channel whose oldest unacknowledged delivery is older is closed by
	// the broker (PRECONDITION_FAILED), and its deliveries requeued. The
	// node checks every channel_tick_interval, set to a quarter of it.
	consumerTimeout time.Duration
}

var (
	nodesMu sync.Mutex
	nodes   = map[nodeSpec]*nodeOnce{}
)

type nodeOnce struct {
	once sync.Once
	n    *node
	err  error
}

// privateNode returns the private node for spec, starting it on first
// use; the test is skipped when RabbitMQ's scripts are not installed.
func privateNode(t *testing.T, spec nodeSpec) *node {
	t.Helper()
	nodesMu.Lock()
	o := nodes[spec]
	if o == nil {
		o = new(nodeOnce)
		nodes[spec] = o
	}
	nodesMu.Unlock()
	o.once.Do(func() {
		for range 3 { // a free port may be taken before the node binds it
			if o.n, o.err = startNode(spec); o.err == nil || !errors.Is(o.err, errPortTaken) {
				return
			}
		}
	})
	if errors.Is(o.err, errNoScripts) {
		t.Skip(o.err)
	}
	if o.err != nil {
		t.Fatalf("private RabbitMQ node: %v", o.err)
	}
	return o.n
}

// stopNodes stops every private node started, and removes its directory.
func stopNodes() {
	nodesMu.Lock()
	defer nodesMu.Unlock()
	for _, o := range nodes {
		if o.n != nil {
			o.n.stop()
		}
	}
}

var (
	errNoScripts  = errors.New("RabbitMQ's scripts (rabbitmq-server, rabbitmqctl) not found: set IDEM_RABBITMQ_SBIN to their directory")
	errPortTaken  = errors.New("port taken")
	nodeSeq       sync.Mutex
	nodeSeqNumber int
)

// sbin finds the directory of RabbitMQ's own scripts, not the Debian
// wrappers in /usr/sbin (which run them as the rabbitmq user).
func sbin() (string, error) {
	for _, d := range []string{os.Getenv("IDEM_RABBITMQ_SBIN"), "/usr/lib/rabbitmq/bin"} {
		if d == "" {
			continue
		}
		if _, err := os.Stat(filepath.Join(d, "rabbitmq-server")); err == nil {
			return d, nil
		}
	}
	if p, err := exec.LookPath("rabbitmq-server"); err == nil && !strings.HasPrefix(p, "/usr/sbin/") {
		return filepath.Dir(p), nil
	}
	return "", errNoScripts
}

func startNode(spec nodeSpec) (*node, error) {
	bin, err := sbin()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "idem-rabbitmq-")
	if err != nil {
		return nil, err
	}
	port, err := nettest.FreePort()
	if err != nil {
		return nil, err
	}
	dist, err := nettest.FreePort()
	if err != nil {
		return nil, err
	}
	nodeSeq.Lock()
	nodeSeqNumber++
	name := fmt.Sprintf("idemtest-%d-%d@localhost", os.Getpid(), nodeSeqNumber)
	nodeSeq.Unlock()
	conf := fmt.Sprintf("listeners.tcp.1 = 127.0.0.1:%d\nloopback_users = none\nheartbeat = 10\n", port)
	advanced := "[]."
	if spec.consumerTimeout > 0 {
		conf += fmt.Sprintf("consumer_timeout = %d\n", spec.consumerTimeout.Milliseconds())
		advanced = fmt.Sprintf("[{rabbit, [{channel_tick_interval, %d}]}].", max(spec.consumerTimeout.Milliseconds()/4, 50))
	}
	for name, text := range map[string]string{"rabbitmq.conf": conf, "advanced.config": advanced, "enabled_plugins": "[]."} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(text+"\n"), 0o600); err != nil {
			return nil, err
		}
	}
	n := &node{name: name, dir: dir, port: port, ctl: filepath.Join(bin, "rabbitmqctl"), exited: make(chan struct{})}
	n.env = append(os.Environ(),
		"HOME="+dir, // its own Erlang cookie, shared with rabbitmqctl
		"RABBITMQ_NODENAME="+name,
		fmt.Sprintf("RABBITMQ_DIST_PORT=%d", dist),
		"RABBITMQ_MNESIA_BASE="+filepath.Join(dir, "mnesia"),
		"RABBITMQ_LOG_BASE="+filepath.Join(dir, "log"),
		"RABBITMQ_CONFIG_FILE="+filepath.Join(dir, "rabbitmq.conf"),
		"RABBITMQ_ADVANCED_CONFIG_FILE="+filepath.Join(dir, "advanced.config"),
		"RABBITMQ_ENABLED_PLUGINS_FILE="+filepath.Join(dir, "enabled_plugins"),
		"RABBITMQ_PID_FILE="+filepath.Join(dir, "pid"),
	)
	out, err := os.Create(filepath.Join(dir, "server.out"))
	if err != nil {
		return nil, err
	}
	defer out.Close()
	n.cmd = exec.Command(filepath.Join(bin, "rabbitmq-server"))
	n.cmd.Env, n.cmd.Dir, n.cmd.Stdout, n.cmd.Stderr = n.env, dir, out, out
	n.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
	if err := n.cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	go func() { n.cmd.Wait(); close(n.exited) }()
	if err := n.ctlRun(90*time.Second, "wait", "--timeout", "60", filepath.Join(dir, "pid")); err != nil {
		log, _ := os.ReadFile(filepath.Join(dir, "server.out"))
		n.stop()
		if strings.Contains(string(log), "eaddrinuse") {
			return nil, fmt.Errorf("%w: %v", errPortTaken, err)
		}
		return nil, fmt.Errorf("%v\n%s", err, tail(log, 2000))
	}
	return n, nil
}

func tail(b []byte, n int) []byte {
	if len(b) > n {
		return b[len(b)-n:]
	}
	return b
}

// url is the node's AMQP URL for addr (host:port; "" for the node's own).
func (n *node) url(addr string) string {
	if addr == "" {
		addr = fmt.Sprintf("127.0.0.1:%d", n.port)
	}
	return "amqp://guest:guest@" + addr + "/"
}

func (n *node) addr() string { return fmt.Sprintf("127.0.0.1:%d", n.port) }

func (n *node) ctlRun(limit time.Duration, args ...string) error {
	_, err := n.ctlOutput(limit, args...)
	return err
}

func (n *node) ctlOutput(limit time.Duration, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	cmd := exec.CommandContext(ctx, n.ctl, append([]string{"-n", n.name}, args...)...)
	cmd.Env = n.env
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("rabbitmqctl -n %s %s: %v: %s", n.name, strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

// restart stops the RabbitMQ application on the node, closing every
// connection, and starts it again (the Erlang VM stays up): durable queues
// come back with their persistent messages. It returns once the node
// accepts connections again.
func (n *node) restart(t testing.TB) {
	t.Helper()
	if err := n.ctlRun(60*time.Second, "stop_app"); err != nil {
		t.Fatal(err)
	}
	if err := n.ctlRun(60*time.Second, "start_app"); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		c, err := net.DialTimeout("tcp", n.addr(), time.Second)
		if err == nil {
			c.Close()
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("node %s does not accept connections after its restart: %v", n.name, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// queueCounts returns a queue's ready and unacknowledged messages, which
// AMQP does not report (a passive declare counts only the ready ones).
func (n *node) queueCounts(t testing.TB, queue string) (ready, unacked int) {
	t.Helper()
	out, err := n.ctlOutput(30*time.Second, "list_queues", "-q", "--no-table-headers", "name", "messages_ready", "messages_unacknowledged")
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.Lines(out) {
		f := strings.Fields(line)
		if len(f) == 3 && f[0] == queue {
			fmt.Sscan(f[1], &ready)
			fmt.Sscan(f[2], &unacked)
			return ready, unacked
		}
	}
	t.Fatalf("queue %s not listed by the node: %q", queue, out)
	return 0, 0
}

// stop stops the node (SIGTERM to its process group, then SIGKILL) and
// removes its directory.
func (n *node) stop() {
	if n.cmd != nil && n.cmd.Process != nil {
		syscall.Kill(-n.cmd.Process.Pid, syscall.SIGTERM)
		select {
		case <-n.exited:
		case <-time.After(15 * time.Second):
			syscall.Kill(-n.cmd.Process.Pid, syscall.SIGKILL)
			<-n.exited
		}
		// The Erlang VM may outlive the script that started it.
		if b, err := os.ReadFile(filepath.Join(n.dir, "pid")); err == nil {
			var pid int
			if _, err := fmt.Sscan(string(b), &pid); err == nil && pid > 0 {
				for i := 0; i < 150 && syscall.Kill(pid, 0) == nil; i++ {
					if i == 100 {
						syscall.Kill(pid, syscall.SIGKILL)
					}
					time.Sleep(100 * time.Millisecond)
				}
			}
		}
	}
	os.RemoveAll(n.dir)
}
