package idemhttp

import (
	"bufio"
	"net"
	"net/http"
	"slices"
)

// capture passes a handler's response through to the client as it is
// written and keeps a copy for the store: the final status, the header
// the client received, and up to max body bytes.
type capture struct {
	w   http.ResponseWriter
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
	hijacked bool // the handler took the connection: nothing to store
}

func newCapture(w http.ResponseWriter, max int) *capture {
	c := &capture{w: w, max: max}
	if h := w.Header(); len(h) > 0 {
		c.before = h.Clone()
	}
	return c
}

func (c *capture) Header() http.Header { return c.w.Header() }

func (c *capture) WriteHeader(code int) {
	if c.status != 0 {
		return // a second WriteHeader changes nothing, as in net/http
	}
	if code >= 100 && code <= 199 && code != http.StatusSwitchingProtocols {
		c.w.WriteHeader(code) // informational: not the final status
		return
	}
	c.w.WriteHeader(code) // panics on an invalid code, before we record it
	c.status = code
	c.header = c.w.Header().Clone()
}

func (c *capture) Write(p []byte) (int, error) {
	if c.status == 0 {
		c.WriteHeader(http.StatusOK)
	}
	n, err := c.w.Write(p) // keep only what net/http took (none for 204, 304, HEAD)
	if !c.overflow && n > 0 {
		if len(c.body)+n > c.max {
			c.settle(c.body) // net/http has sent the header by now
			c.overflow, c.body = true, nil
		} else {
			c.body = append(c.body, p[:n]...)
		}
	}
	return n, err
}

// FlushError sends what was written so far to the client (used by
// http.ResponseController and Flush). The captured copy is unaffected.
func (c *capture) FlushError() error {
	if c.status == 0 {
		c.WriteHeader(http.StatusOK)
	}
	c.settle(c.body)
	return http.NewResponseController(c.w).Flush()
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
	conn, rw, err := http.NewResponseController(c.w).Hijack()
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
// had set before it ran (unless the handler changed it).
func (c *capture) finish() http.Header {
	if c.status == 0 {
		c.status, c.header = http.StatusOK, c.w.Header().Clone()
	}
	c.settle(c.body)
	for name, vs := range c.before {
		if slices.Equal(c.header[name], vs) {
			delete(c.header, name)
		}
	}
	return c.header
}
