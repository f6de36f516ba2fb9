// Package nettest holds test helpers that act as network clients do when
// they misbehave.
package nettest

import (
	"io"
	"net"
	"testing"
)

// DialStalled opens a TCP connection to addr with a small receive buffer,
// sends request on it, and never reads: the server's writes block once
// the socket buffers are full, as with a client that stopped reading
// without leaving. The connection is closed when tb ends.
func DialStalled(tb testing.TB, addr, request string) net.Conn {
	tb.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		tb.Fatal(err)
	}
	// A small buffer, which also caps the window it advertises.
	if err := conn.(*net.TCPConn).SetReadBuffer(4096); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { conn.Close() })
	if _, err := io.WriteString(conn, request); err != nil {
		tb.Fatal(err)
	}
	return conn
}

// FreePort returns a loopback TCP port that nothing listened on a moment
// ago (another process may take it first: callers that start a server on
// it retry on failure).
func FreePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}
