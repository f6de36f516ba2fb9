package redisserver

import (
	"errors"
	"net"
	"strconv"
	"sync"
)

const (
	// clusterBusOffset is how far above its client port a cluster node
	// listens for the cluster bus.
	clusterBusOffset = 10000
	// pickAttempts bounds the search for a free port (or pair of ports).
	pickAttempts = 100
)

// reserved holds the ports (client and cluster bus) of every Server of this
// process that has not been stopped, so that a killed server's port is not
// handed to another server before it is restarted.
var reserved = struct {
	sync.Mutex
	ports map[int]bool
}{ports: make(map[int]bool)}

// reservePorts picks a free loopback port and, for a cluster node, checks
// that port+10000 is free as well, then reserves them; bus is 0 when cluster
// is false. The ports are free when checked, but another process may still
// bind them before redis-server does: callers retry on errPortInUse.
func reservePorts(cluster bool) (port, bus int, err error) {
	reserved.Lock()
	defer reserved.Unlock()
	for range pickAttempts {
		port, err = freePort()
		if err != nil {
			return 0, 0, err
		}
		if reserved.ports[port] {
			continue
		}
		bus = 0
		if cluster {
			bus = port + clusterBusOffset
			if bus > 65535 || reserved.ports[bus] || !portFree(bus) {
				continue
			}
			reserved.ports[bus] = true
		}
		reserved.ports[port] = true
		return port, bus, nil
	}
	return 0, 0, errors.New("redisserver: no free loopback port found")
}

// freePort returns a loopback TCP port that nothing listened on a moment
// ago (another process may take it first: see reservePorts).
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// releasePorts undoes reservePorts.
func releasePorts(port, bus int) {
	reserved.Lock()
	defer reserved.Unlock()
	delete(reserved.ports, port)
	delete(reserved.ports, bus)
}

// portFree reports whether port can be bound on 127.0.0.1 right now.
func portFree(port int) bool {
	l, err := net.Listen("tcp", loopback(port))
	if err != nil {
		return false
	}
	l.Close()
	return true
}

// loopback returns "127.0.0.1:port".
func loopback(port int) string {
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
}
