package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"time"
)

// The upstream schemes besides http:// and https://: cleartext HTTP/2 by
// prior knowledge to host:port (h2c://), HTTP/1.1 over a unix socket
// (unix:///path) and cleartext HTTP/2 over a unix socket (h2c+unix:///path).
const (
	schemeH2C     = "h2c"
	schemeUnix    = "unix"
	schemeH2CUnix = "h2c+unix"
)

// unixUpstreamHost is the Host a unix-socket upstream sees (a socket has
// no host name; servers that check Host, such as Django's ALLOWED_HOSTS,
// accept localhost in development settings). The client's Host is in
// X-Forwarded-Host, as for a TCP upstream.
const unixUpstreamHost = "localhost"

// listenSocketMode is the mode of the socket --listen unix:///path
// creates: its owner and group may connect (connecting needs write
// permission on the socket), nobody else.
const listenSocketMode fs.FileMode = 0o660

// socketPath is the path of a unix:// URL (unix:///run/app.sock), or an
// error that says what was expected. flag is the flag's name, for it.
func socketPath(flag string, u *url.URL) (string, error) {
	if u.Host != "" || u.Opaque != "" || !strings.HasPrefix(u.Path, "/") {
		return "", usageError{fmt.Sprintf("--%s %s: want an absolute socket path, such as %s:///run/app.sock", flag, u.Redacted(), u.Scheme)}
	}
	if u.RawQuery != "" || u.Fragment != "" || u.User != nil {
		return "", usageError{fmt.Sprintf("--%s %s: want a socket path alone, without a query, fragment or credentials", flag, u.Redacted())}
	}
	if len(u.Path) > 107 { // sun_path holds 108 bytes, the NUL included
		return "", usageError{fmt.Sprintf("--%s %s: a socket path is at most 107 bytes long; this one has %d", flag, u.Redacted(), len(u.Path))}
	}
	return u.Path, nil
}

// checkUpstreamURL checks an h2c://, unix:// or h2c+unix:// upstream (ok
// false for any other scheme, which the caller checks).
func checkUpstreamURL(u *url.URL) (ok bool, err error) {
	switch u.Scheme {
	case schemeUnix, schemeH2CUnix:
		_, err := socketPath("upstream", u)
		return true, err
	case schemeH2C:
		if u.Host == "" || u.Port() == "" {
			return true, usageError{fmt.Sprintf("--upstream %s: want h2c://host:port[/path] (cleartext HTTP/2 to host:port)", u.Redacted())}
		}
		return true, nil
	}
	return false, nil
}

// upstreamDest is where the ReverseProxy sends requests for target, and
// the transport that reaches it: for h2c:// an http:// URL over a
// Transport that speaks only cleartext HTTP/2 (prior knowledge, no
// upgrade); for a unix socket http://localhost (the request's path is the
// client's, as for an http:// upstream without a path) over a Transport
// that dials the socket. Every other upstream, https:// included, is
// reached over HTTP/1.1 only (below).
func upstreamDest(target *url.URL, tlsConfig *tls.Config) (*url.URL, *http.Transport) {
	t := newTransport(tlsConfig)
	dest := *target
	switch target.Scheme {
	case schemeH2C:
		dest.Scheme = "http"
	case schemeUnix, schemeH2CUnix:
		path := target.Path
		dest = url.URL{Scheme: "http", Host: unixUpstreamHost}
		var d net.Dialer
		t.DialContext = func(ctx context.Context, _, _ string) (net.Conn, error) {
			return d.DialContext(ctx, "unix", path)
		}
	}
	t.Protocols = new(http.Protocols)
	switch target.Scheme {
	case schemeH2C, schemeH2CUnix:
		t.Protocols.SetUnencryptedHTTP2(true)
	default:
		// HTTP/1.1 only, https:// too: with HTTP/2 negotiated by ALPN a
		// leased request without a body would need sendOnce's empty
		// body (net/http's HTTP/2 client resends a bodiless request
		// after some stream errors, golang/go#47635), which HTTP/1.1
		// sends chunked; which protocol a request will go over is not
		// known when sendOnce frames it. An HTTP/2 upstream is h2c://.
		t.Protocols.SetHTTP1(true)
	}
	return &dest, t
}

// listenUnixURL is the socket path of --listen unix:///path, "" when addr
// is host:port.
func listenUnixURL(addr string) (string, bool, error) {
	if !strings.HasPrefix(addr, "unix:") {
		return "", false, nil
	}
	u, err := url.Parse(addr)
	if err != nil {
		return "", true, usageError{fmt.Sprintf("--listen %q: want unix:///path/to/idem.sock", addr)}
	}
	p, err := socketPath("listen", u)
	return p, true, err
}

// listenProxy opens the listener of the proxied traffic: TCP on
// host:port, or a unix socket on unix:///path, created with
// listenSocketMode. A socket left at the path by a process that is gone
// (nothing accepts on it) is replaced; a path that exists and is not a
// socket, or a socket another process serves, is refused. The socket is
// removed when the listener is closed (net.UnixListener unlinks it).
func listenProxy(addr string) (net.Listener, string, error) {
	path, isUnix, err := listenUnixURL(addr)
	if err != nil {
		return nil, "", err
	}
	if !isUnix {
		ln, err := listenTCP("listen", addr)
		if err != nil {
			return nil, "", err
		}
		return ln, ln.Addr().String(), nil
	}
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode().Type() != fs.ModeSocket {
			return nil, "", usageError{fmt.Sprintf("--listen unix://%s: the path exists and is not a socket (a %s); remove it or choose another path", path, fileKind(fi.Mode()))}
		}
		if c, err := net.DialTimeout("unix", path, time.Second); err == nil {
			c.Close()
			return nil, "", fmt.Errorf("--listen unix://%s: another process serves this socket", path)
		}
		// Stale: left by a process that did not close it (killed).
		if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return nil, "", fmt.Errorf("--listen unix://%s: removing the stale socket: %w", path, err)
		}
	}
	ln, err := net.Listen("unix", path)
	if err != nil {
		return nil, "", fmt.Errorf("--listen unix://%s: %w", path, err)
	}
	if err := os.Chmod(path, listenSocketMode); err != nil {
		ln.Close()
		return nil, "", fmt.Errorf("--listen unix://%s: setting its mode to %04o: %w", path, listenSocketMode, err)
	}
	return ln, "unix://" + path, nil
}

// checkListenAddr checks the host:port of a listening flag (--listen,
// --admin-listen) before anything is opened: a port that is not a number
// from 0 to 65535 (or a service name) is a usage error naming the flag.
func checkListenAddr(flag, addr, example string) error {
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		return usageError{fmt.Sprintf("--%s %q: want host:port, such as %s", flag, addr, example)}
	}
	if _, err := net.LookupPort("tcp", port); err != nil {
		return usageError{fmt.Sprintf("--%s %q: port %q: want a port number from 0 to 65535 (0: any free port)", flag, addr, port)}
	}
	return nil
}

// listenTCP binds the TCP address of a listening flag; the error names
// the flag and the address, and why (the port is taken, the address is
// not this host's).
func listenTCP(flag, addr string) (net.Listener, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		var op *net.OpError
		if errors.As(err, &op) && op.Err != nil {
			err = op.Err // "bind: address already in use", without net's "listen tcp ADDR:"
		}
		return nil, fmt.Errorf("--%s %s: %w", flag, addr, err)
	}
	return ln, nil
}

// proxyListeners are the proxy's listeners: the proxied traffic's
// (--listen) and the admin server's (--admin-listen; nil without it).
type proxyListeners struct {
	main, admin net.Listener
	mainAddr    string // as logged: host:port or unix:///path
}

// bindListeners binds --listen and --admin-listen, before the store is
// opened: a port that is taken fails the start with the flag and the
// address, and leaves no store connection made, no table created and no
// reaper started behind it.
func (o *proxyOptions) bindListeners() (*proxyListeners, error) {
	main, mainAddr, err := listenProxy(o.listen)
	if err != nil {
		return nil, err
	}
	l := &proxyListeners{main: main, mainAddr: mainAddr}
	if o.adminListen != "" {
		if l.admin, err = listenTCP("admin-listen", o.adminListen); err != nil {
			main.Close()
			return nil, err
		}
	}
	return l, nil
}

// close closes the listeners that no server took (a start that failed
// after they were bound).
func (l *proxyListeners) close() {
	l.main.Close()
	if l.admin != nil {
		l.admin.Close()
	}
}

func fileKind(m fs.FileMode) string {
	switch {
	case m.IsDir():
		return "directory"
	case m.IsRegular():
		return "regular file"
	case m&fs.ModeSymlink != 0:
		return "symbolic link"
	}
	return m.Type().String()
}
