package clients

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/childproc"
	"github.com/idemkit/idem/internal/proctest"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/idemkit/idem/internal/reltest"
)

// nginxConf is a private nginx: one process in the foreground, every file
// in dir, listening on 127.0.0.1:port, balancing over the backends and
// resending a request, POST included (non_idempotent), to the next backend
// when one fails or takes more than 300 ms to answer. max_fails=0 keeps
// both backends in the rotation after a timeout.
const nginxConf = `daemon off;
master_process off;
worker_processes 1;
pid %[1]s/nginx.pid;
error_log %[1]s/error.log info;
events { worker_connections 256; }
http {
	client_body_temp_path %[1]s/client_body;
	proxy_temp_path %[1]s/proxy;
	fastcgi_temp_path %[1]s/fastcgi;
	uwsgi_temp_path %[1]s/uwsgi;
	scgi_temp_path %[1]s/scgi;
	log_format lb '$http_idempotency_key|$status|$upstream_addr|$upstream_status';
	access_log %[1]s/access.log lb;
	upstream idem {
%[3]s	}
	server {
		listen 127.0.0.1:%[2]d;
		location / {
			proxy_pass http://idem;
			proxy_connect_timeout 1s;
			proxy_send_timeout 1s;
			proxy_read_timeout 300ms;
			proxy_next_upstream error timeout non_idempotent;
			proxy_next_upstream_tries 2;
		}
	}
}
`

// nginxProc is a running private nginx.
type nginxProc struct {
	addr, dir string
}

// accessLog returns nginx's access log lines (key|status|upstreams|statuses).
func (n *nginxProc) accessLog() []string {
	b, _ := os.ReadFile(filepath.Join(n.dir, "access.log"))
	return strings.Split(strings.TrimSpace(string(b)), "\n")
}

// startNginx runs nginx in front of backends on a free loopback port and
// kills it at the end of the test. A port taken between the pick and
// nginx's bind makes it try another.
func startNginx(t *testing.T, backends ...string) *nginxProc {
	t.Helper()
	bin := toolPath(t, "nginx")
	dir := t.TempDir()
	var servers strings.Builder
	for _, b := range backends {
		fmt.Fprintf(&servers, "\t\tserver %s max_fails=0;\n", b)
	}
	for attempt := 1; ; attempt++ {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		port := l.Addr().(*net.TCPAddr).Port
		l.Close()
		conf := filepath.Join(dir, "nginx.conf")
		if err := os.WriteFile(conf, fmt.Appendf(nil, nginxConf, dir, port, servers.String()), 0o644); err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command(bin, "-p", dir+"/", "-e", filepath.Join(dir, "error.log"), "-c", conf)
		cmd.SysProcAttr = childproc.SysProcAttr()
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		if err := cmd.Start(); err != nil {
			t.Fatalf("starting nginx: %v", err)
		}
		exited := make(chan struct{})
		go func() { cmd.Wait(); close(exited) }()
		n := &nginxProc{addr: fmt.Sprintf("127.0.0.1:%d", port), dir: dir}
		ready := waitFor(10*time.Second, func() bool {
			select {
			case <-exited:
				return true
			default:
			}
			c, err := net.DialTimeout("tcp", n.addr, time.Second)
			if err == nil {
				c.Close()
			}
			return err == nil
		})
		select {
		case <-exited:
			errLog, _ := os.ReadFile(filepath.Join(dir, "error.log"))
			if bytes.Contains(errLog, []byte("Address already in use")) && attempt < 3 {
				continue
			}
			t.Fatalf("got nginx exiting at start (%s), want it serving:\n%s%s", cmd.ProcessState, out.Bytes(), lastN(string(errLog), 2048))
		default:
		}
		t.Cleanup(func() {
			cmd.Process.Kill()
			<-exited
			if t.Failed() {
				errLog, _ := os.ReadFile(filepath.Join(dir, "error.log"))
				t.Logf("nginx error log (last 2 KiB):\n%s", lastN(string(errLog), 2048))
			}
		})
		if !ready {
			t.Fatalf("got nginx not accepting connections on %s after 10s, want it serving", n.addr)
		}
		return n
	}
}

// TestLoadBalancerResend: nginx balances over two `idem proxy` instances
// that share one Redis, and resends a POST to the other instance when the
// first has not answered within 300 ms (the work takes 1 s). The second
// instance finds the key in flight and answers 409, which nginx passes on;
// the client retries after Retry-After, through either instance, and gets
// the replay. The first instance must finish the work and store its answer
// although nginx closed the connection.
func TestLoadBalancerResend(t *testing.T) {
	loadBalancerResend(t, "idem proxy", func(up *upstream, prefix string) *target {
		// --wait 0: the second instance answers 409 at once; with the
		// default wait (500ms) it would wait past nginx's 300ms, which
		// would then give up on it too.
		args := []string{"--upstream", up.srv.URL, "--store", "redis://" + rdb.Addr(), "--prefix", prefix, "--wait", "0"}
		a, b := proctest.StartProxy(t, args...), proctest.StartProxy(t, args...)
		return &target{name: "nginx → 2 × idem proxy", short: "lb", url: a.Addr + " " + b.Addr, proxies: []*proctest.Proxy{a, b}}
	})
}

// TestLoadBalancerResendCaddy is TestLoadBalancerResend with two Caddy
// instances (idem-caddy: the idempotency handler in front of
// reverse_proxy) on one Redis in place of the idem proxies.
func TestLoadBalancerResendCaddy(t *testing.T) {
	loadBalancerResend(t, "Caddy", func(up *upstream, prefix string) *target {
		store := "redis://" + rdb.Addr()
		// wait 0: 409 at once, as --wait 0 for the idem proxies.
		cf := func(addr string) string {
			return strings.Replace(caddyfile(addr, up.srv.URL, store, prefix), "\t\tstore ", "\t\twait 0\n\t\tstore ", 1)
		}
		a, b := proctest.StartCaddy(t, cf), proctest.StartCaddy(t, cf)
		return &target{name: "nginx → 2 × Caddy", short: "lb-caddy", url: a.Addr + " " + b.Addr, caddies: []*proctest.Caddy{a, b}}
	})
}

// loadBalancerResend runs the scenario of TestLoadBalancerResend on the
// two instances start returns (their addresses in url, space-separated,
// which nginx then replaces with its own).
func loadBalancerResend(t *testing.T, what string, start func(up *upstream, prefix string) *target) {
	clients := []client{pythonClient, nodeClient, curlClient, goClient}
	for _, c := range clients {
		if c.tool != "" {
			toolPath(t, c.tool)
		}
	}
	up := startUpstream(t)
	tg := start(up, redistest.Prefix("clients"))
	tg.store = "redis (single)"
	lb := startNginx(t, strings.Fields(tg.url)...)
	tg.url = "http://" + lb.addr
	row, keys := runOn(t, up, tg, scenario{
		name: "load balancer resends the POST to the second instance", short: tg.short, path: "/pay",
		fault:   "nginx (proxy_next_upstream error timeout non_idempotent; proxy_read_timeout 300ms) over 2 " + what + " instances on one Redis; 1 s of work; clients with 5 s timeouts retry",
		timeout: 5 * time.Second, attempts: 6, clients: clients,
	})
	// nginx did resend: some request of every key went to both instances.
	lines := lb.accessLog()
	var paths []string
	for _, key := range keys {
		resent := false
		var mine []string
		for _, l := range lines {
			f := strings.Split(l, "|")
			if len(f) == 4 && f[0] == key {
				mine = append(mine, f[3])
				resent = resent || strings.Contains(f[2], ",")
			}
		}
		if !resent {
			t.Errorf("key %s: got no request that nginx sent to both instances (upstream statuses %q), want the resend", key, mine)
		}
		paths = append(paths, strings.Join(mine, " then "))
	}
	row.Notes += "; nginx upstream statuses per key: " + strings.Join(paths, "; ")
	reltest.Report(t, row)
}
