package main

import (
	"net"
	"strings"
	"sync/atomic"
	"testing"
)

// connCounter listens on a loopback port and counts the connections made
// to it (closing each at once): a store URL that names it shows whether
// the store was opened.
func connCounter(t *testing.T) (port string, n *atomic.Int64) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	n = new(atomic.Int64)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			n.Add(1)
			c.Close()
		}
	}()
	_, port, _ = net.SplitHostPort(ln.Addr().String())
	return port, n
}

// TestProxyListenErrors: through the binary, a listening flag that cannot
// be used fails the start with a line naming the flag and the address: a
// port out of range is a usage error (exit 2) before anything opens; a
// port another process holds exits 1 and is found before the store is
// opened, so the tiered store's Redis and PostgreSQL (counting listeners
// here) see no connection: no table is created behind a failed start. A
// value from the environment names its variable too.
func TestProxyListenErrors(t *testing.T) {
	t.Parallel()
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	busyAddr := busy.Addr().String()
	redisPort, redisConns := connCounter(t)
	pgPort, pgConns := connCounter(t)
	tiered := "redis://127.0.0.1:" + redisPort + " postgres://idem@127.0.0.1:" + pgPort + "/shop?connect_timeout=2"
	for _, c := range []struct {
		args []string // flags, and IDEM_ variables for the environment
		code int
		want string // the whole of stderr, after "idem proxy: "
	}{
		{[]string{"--listen", "127.0.0.1:99999"}, 2, `--listen "127.0.0.1:99999": port "99999": want a port number from 0 to 65535 (0: any free port)`},
		{[]string{"--listen", "127.0.0.1:-1"}, 2, `--listen "127.0.0.1:-1": port "-1": want a port number from 0 to 65535 (0: any free port)`},
		{[]string{"--listen", "127.0.0.1"}, 2, `--listen "127.0.0.1": want host:port, such as 127.0.0.1:8080 or :8080, or unix:///path/to/idem.sock`},
		{[]string{"--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:65536"}, 2, `--admin-listen "127.0.0.1:65536": port "65536": want a port number from 0 to 65535 (0: any free port)`},
		{[]string{"--listen", "127.0.0.1:18089", "--admin-listen", "127.0.0.1:18089"}, 2, "--listen and --admin-listen are both 127.0.0.1:18089: want two addresses"},
		{[]string{"--listen", busyAddr, "--store", tiered}, 1, "--listen " + busyAddr + ": bind: address already in use"},
		{[]string{"--listen", "127.0.0.1:0", "--admin-listen", busyAddr, "--store", tiered}, 1, "--admin-listen " + busyAddr + ": bind: address already in use"},
		{[]string{"IDEM_LISTEN=127.0.0.1:0", "IDEM_ADMIN_LISTEN=" + busyAddr, "IDEM_STORE=" + tiered}, 1,
			"IDEM_ADMIN_LISTEN: --admin-listen " + busyAddr + ": bind: address already in use"},
		{[]string{"IDEM_LISTEN=127.0.0.1:70000"}, 2, `IDEM_LISTEN: --listen "127.0.0.1:70000": port "70000": want a port number from 0 to 65535 (0: any free port)`},
	} {
		var env, args []string // IDEM_ variables, or flags
		for _, a := range c.args {
			if strings.HasPrefix(a, "IDEM_") {
				env = append(env, a)
			} else {
				args = append(args, a)
			}
		}
		code, stderr := runIdem(t, env, append([]string{"proxy", "--upstream", "http://127.0.0.1:1"}, args...)...)
		if got := strings.TrimSpace(stderr); code != c.code || got != "idem proxy: "+c.want {
			t.Errorf("idem proxy %q: exit %d, stderr %q; want exit %d and %q", c.args, code, got, c.code, "idem proxy: "+c.want)
		}
	}
	if r, p := redisConns.Load(), pgConns.Load(); r != 0 || p != 0 {
		t.Errorf("the tiered store was dialled (Redis %d, PostgreSQL %d connections) by a start whose port was taken; want none: listeners first", r, p)
	}
	// The same store with free ports is dialled: the counters can see it.
	code, stderr := runIdem(t, nil, "proxy", "--upstream", "http://127.0.0.1:1", "--listen", "127.0.0.1:0", "--store", tiered)
	if code != 1 || redisConns.Load()+pgConns.Load() == 0 {
		t.Errorf("with free ports: exit %d, %d+%d store connections (stderr %q); want exit 1 after the store was dialled",
			code, redisConns.Load(), pgConns.Load(), stderr)
	}
}
