package idemhttp

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/idemkit/idem"
)

// writePiece is the largest piece of a handler's write that goes to the
// client under one write deadline (ClientWriteTimeout): a client must take
// at least this much in each ClientWriteTimeout. 32 KiB is what
// httputil.ReverseProxy writes at a time.
const writePiece = 32 << 10

// capture passes a handler's response through to the client as it is
// written and keeps a copy for the store: the final status, the header
// the client received, and up to max body bytes. With a blob store
// (toBlob), a longer body goes on to a blob as it is written, the first
// max bytes included, and the copy in memory is dropped: memory stays
// bounded whatever the body's size.
//
// The response belongs to the key, not to the connection: once writing to
// the client fails (it disconnected, timed out, reset the stream), capture
// stops writing to it and goes on keeping what the handler writes, and
// reports every write as a success. So the handler (or ReverseProxy, which
// aborts on a write error) runs to its end and its response is stored for
// the client's retry.
//
// A client that stops reading without leaving (its receive window full)
// would block the handler at its write for as long as it keeps the
// connection open, and the key with it. With a write timeout, each write
// to the client (in pieces of at most writePiece bytes) and each flush
// runs under a write deadline that is lifted again once it returns: a
// write the client does not take within the timeout fails, and the client
// is gone like one that disconnected.
type capture struct {
	w   http.ResponseWriter
	rc  http.ResponseController // for w: deadlines, flushes, hijacks
	max int
	// before is the header as it was when the handler started: headers
	// that outer middleware set for this request are not the handler's
	// response and are not stored.
	before   http.Header
	status   int         // 0 until the final status is written
	header   http.Header // snapshot taken with the final status
	body     []byte
	sent     bool // the header went to the client, its Content-Type settled
	overflow bool // the body outgrew max: store it omitted
	// toBlob starts the blob a body that outgrows max goes to; nil, or a
	// nil answer (a status not to be stored), makes it overflow instead.
	toBlob   func() *spill
	spill    *spill       // the blob the body goes to, once it outgrew max
	hijacked bool         // the handler took the connection: nothing to store
	gone     error        // the first failed write to the client: it left
	cw       clientWrites // the write deadlines (see above)
	// reqBody is the reader of the handler's request body (see
	// withBody), and resp the response stored (execute), here to be
	// allocated with the capture.
	reqBody bytes.Reader
	resp    idem.Response
	vals    [8]string // the values of header, when they fit (snapshot)
}

// newCapture returns the capture of w's response; its cw is to be set.
func newCapture(w http.ResponseWriter, max int) *capture {
	c := &capture{w: w, rc: *http.NewResponseController(w), max: max}
	if h := w.Header(); len(h) > 0 {
		c.before = h.Clone()
	}
	return c
}

// bounded reports whether writes to the client run under a deadline.
func (c *capture) bounded() bool { return c.cw.on() && !c.hijacked && c.gone == nil }

func (c *capture) arm() {
	if c.bounded() {
		c.cw.arm(&c.rc)
	}
}

func (c *capture) disarm() {
	if c.bounded() {
		c.cw.disarm(&c.rc)
	}
}

// send writes p to the client (see clientWrites.write).
func (c *capture) send(p []byte) (int, error) {
	if !c.bounded() {
		return c.w.Write(p)
	}
	return c.cw.write(c.w, &c.rc, p)
}

// clientWrites bounds writes to a client: with a positive timeout, each
// write (in pieces of at most writePiece bytes) runs under a write
// deadline that is lifted once it returns, never past limit, the server's
// own write deadline (http.Server.WriteTimeout, counted from when the
// middleware got the request; zero for none), which stays. A write the
// client does not take in time fails: the client is gone. A
// ResponseWriter that takes no deadlines (off) writes unbounded.
type clientWrites struct {
	timeout time.Duration
	limit   time.Time
	off     bool
}

// on reports whether writes run under a deadline.
func (b *clientWrites) on() bool { return b.timeout > 0 && !b.off }

// arm sets the deadline of a write that starts now.
func (b *clientWrites) arm(rc *http.ResponseController) {
	d := time.Now().Add(b.timeout)
	if !b.limit.IsZero() && b.limit.Before(d) {
		d = b.limit
	}
	b.set(rc, d)
}

// disarm lifts the deadline once a write returned: a handler that works
// between two writes is not a client that stopped reading.
func (b *clientWrites) disarm(rc *http.ResponseController) { b.set(rc, b.limit) }

func (b *clientWrites) set(rc *http.ResponseController, d time.Time) {
	if err := rc.SetWriteDeadline(d); errors.Is(err, http.ErrNotSupported) {
		b.off = true // writes stay unbounded, as without a timeout
	}
}

// write writes p to w, in pieces under their own deadlines when on.
func (b *clientWrites) write(w io.Writer, rc *http.ResponseController, p []byte) (int, error) {
	if !b.on() {
		return w.Write(p)
	}
	n := 0
	for {
		b.arm(rc)
		m, err := w.Write(p[n:min(len(p), n+writePiece)])
		b.disarm(rc)
		n += m
		if err != nil || n >= len(p) {
			return n, err
		}
	}
}

func (c *capture) Header() http.Header { return c.w.Header() }

func (c *capture) WriteHeader(code int) {
	if c.status != 0 {
		return // a second WriteHeader changes nothing, as in net/http
	}
	if code >= 100 && code <= 199 && code != http.StatusSwitchingProtocols {
		c.arm()               // net/http sends it at once
		c.w.WriteHeader(code) // informational: not the final status
		c.disarm()
		return
	}
	c.w.WriteHeader(code) // panics on an invalid code, before we record it
	c.status = code
	c.header = c.snapshot(c.w.Header())
}

// snapshot is h.Clone(), with the values in c.vals when they fit: the
// header of the final status, taken once.
func (c *capture) snapshot(h http.Header) http.Header {
	if h == nil {
		return nil
	}
	nv := 0
	for _, vv := range h {
		nv += len(vv)
	}
	var sv []string // shared backing array for headers' values
	if nv <= len(c.vals) {
		sv = c.vals[:nv]
	} else {
		sv = make([]string, nv)
	}
	h2 := make(http.Header, len(h))
	for k, vv := range h {
		if vv == nil {
			h2[k] = nil // as Clone: nil stays nil
			continue
		}
		n := copy(sv, vv)
		h2[k] = sv[:n:n]
		sv = sv[n:]
	}
	return h2
}

func (c *capture) Write(p []byte) (int, error) {
	if c.status == 0 {
		c.WriteHeader(http.StatusOK)
	}
	n := len(p)
	if c.gone == nil {
		var err error
		n, err = c.send(p)
		if err != nil {
			if handlerError(err) {
				// The handler's own mistake: nothing more was taken.
				c.keep(p[:n])
				return n, err
			}
			c.gone, n = err, len(p)
			if !bodyAllowed(c.status) {
				n = 0
			}
		}
	}
	// Keep what net/http took (none for 204, 304, HEAD), or, once the
	// client is gone, what it would have taken.
	c.keep(p[:n])
	return n, nil
}

// WriteString is Write of s (io.WriteString's), without its copy of s as
// a []byte while the copy in memory takes s whole: s is added to the copy
// first, the client is sent that, and the copy keeps what Write would
// have kept (what the client took, or all once it is gone).
func (c *capture) WriteString(s string) (int, error) {
	if c.status == 0 {
		c.WriteHeader(http.StatusOK)
	}
	if c.gone != nil || c.overflow || c.spill != nil || len(c.body)+len(s) > c.max {
		return c.Write([]byte(s))
	}
	old := len(c.body)
	c.body = append(c.body, s...)
	n, err := c.send(c.body[old:])
	_ = s[:n] // as Write's p[:n]: a writer that took more than it was given
	if err != nil && !handlerError(err) {
		c.gone, n, err = err, len(s), nil
		if !bodyAllowed(c.status) {
			n = 0
		}
	}
	c.body = c.body[:old+n]
	return n, err
}

// keep adds p, written by the handler, to the copy.
func (c *capture) keep(p []byte) {
	n := len(p)
	if !c.overflow && n > 0 {
		switch {
		case c.spill != nil:
			c.spill.write(p[:n])
		case len(c.body)+n <= c.max:
			c.body = append(c.body, p[:n]...)
		default:
			c.settle(c.body) // net/http has sent the header by now
			if c.toBlob != nil {
				c.spill = c.toBlob()
			}
			if c.spill == nil {
				c.overflow, c.body = true, nil
				break
			}
			c.spill.write(c.body)
			c.spill.write(p[:n])
			c.body = nil
		}
	}
}

// handlerError reports whether err, from a write to the client, is about
// what the handler wrote (a body where none is allowed, more than its
// Content-Length, a hijacked connection) rather than about the client.
func handlerError(err error) bool {
	return errors.Is(err, http.ErrBodyNotAllowed) || errors.Is(err, http.ErrContentLength) || errors.Is(err, http.ErrHijacked)
}

// FlushError sends what was written so far to the client (used by
// http.ResponseController and Flush). The captured copy is unaffected. A
// client that is gone is not an error here either (see capture).
func (c *capture) FlushError() error {
	if c.status == 0 {
		c.WriteHeader(http.StatusOK)
	}
	c.settle(c.body)
	if c.gone != nil {
		return nil
	}
	c.arm()
	err := c.rc.Flush()
	c.disarm()
	if err != nil {
		if errors.Is(err, http.ErrNotSupported) {
			return err
		}
		c.gone = err
	}
	return nil
}

// Flush implements http.Flusher.
func (c *capture) Flush() { c.FlushError() }

// settle records the Content-Type the client receives when the header is
// sent with body as the data written so far: net/http sniffs one from that
// data when the handler set none, and sends none when there is no data
// yet. A replay writes the whole body at once, so it must not sniff again.
func (c *capture) settle(body []byte) {
	if c.sent {
		return
	}
	c.sent = true
	if _, set := c.header["Content-Type"]; set || len(body) == 0 || !bodyAllowed(c.status) || c.header.Get("Transfer-Encoding") != "" {
		return
	}
	c.header.Set("Content-Type", http.DetectContentType(body))
}

func bodyAllowed(status int) bool {
	return status != http.StatusNoContent && status != http.StatusNotModified && (status < 100 || status > 199)
}

// Hijack hands the connection to the handler. Such a response cannot be
// captured, so the key is released afterwards.
func (c *capture) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	conn, rw, err := c.rc.Hijack()
	if err == nil {
		c.hijacked = true
	}
	return conn, rw, err
}

// Unwrap lets http.ResponseController reach the underlying writer for
// deadlines and the like.
func (c *capture) Unwrap() http.ResponseWriter { return c.w }

// finish settles the response once the handler has returned: a handler
// that wrote nothing gets 200 with the header as it left it. It returns
// the header to store: what the handler set, without what outer middleware
// had set before it ran (unless the handler changed it), and its trailers.
func (c *capture) finish() http.Header {
	if c.status == 0 {
		c.status, c.header = http.StatusOK, c.snapshot(c.w.Header())
	}
	c.settle(c.body)
	for name, vs := range c.before {
		if slices.Equal(c.header[name], vs) {
			delete(c.header, name)
		}
	}
	c.trailers()
	return c.header
}

// trailers adds the handler's trailers to the stored header, each under
// http.TrailerPrefix and its canonical name: the form that makes net/http
// send a replay's entry as a trailer, on HTTP/2 and on a chunked HTTP/1.1
// response alike (gRPC's grpc-status lives there). They are read from the
// header map now that the handler has returned, as net/http reads them:
// the names the handler announced in its Trailer header (ReverseProxy
// announces the upstream's), and the keys it set with the prefix.
func (c *capture) trailers() {
	live := c.w.Header()
	for name := range c.header {
		if strings.HasPrefix(name, http.TrailerPrefix) {
			delete(c.header, name) // set before the status: re-added below, canonical
		}
	}
	for _, v := range c.header["Trailer"] {
		for name := range strings.SplitSeq(v, ",") {
			name = http.CanonicalHeaderKey(strings.TrimSpace(name))
			if vs := live[name]; name != "" && len(vs) > 0 {
				c.header[http.TrailerPrefix+name] = slices.Clone(vs)
			}
		}
	}
	for key, vs := range live {
		if name, ok := strings.CutPrefix(key, http.TrailerPrefix); ok && name != "" && len(vs) > 0 {
			key = http.TrailerPrefix + http.CanonicalHeaderKey(name)
			c.header[key] = append(c.header[key], vs...)
		}
	}
}

// hasTrailers reports whether a stored header holds trailers.
func hasTrailers(h http.Header) bool {
	for name := range h {
		if strings.HasPrefix(name, http.TrailerPrefix) {
			return true
		}
	}
	return false
}
