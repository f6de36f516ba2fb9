package idemhttp

import (
	"bufio"
	"net"
	"net/http"
)

// capture passes a handler's response through to the client as it is
// written and keeps a copy for the store: the final status, the header
// as it was when the status was written, and up to max body bytes.
type capture struct {
	w        http.ResponseWriter
	max      int
	status   int         // 0 until the final status is written
	header   http.Header // snapshot taken with the final status
	body     []byte
	overflow bool // the body outgrew max: store it omitted
	hijacked bool // the handler took the connection: nothing to store
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
	if !c.overflow {
		if len(c.body)+len(p) > c.max {
			c.overflow, c.body = true, nil
		} else {
			c.body = append(c.body, p...)
		}
	}
	return c.w.Write(p)
}

// FlushError sends what was written so far to the client (used by
// http.ResponseController and Flush). The captured copy is unaffected.
func (c *capture) FlushError() error {
	if c.status == 0 {
		c.WriteHeader(http.StatusOK)
	}
	return http.NewResponseController(c.w).Flush()
}

// Flush implements http.Flusher.
func (c *capture) Flush() { c.FlushError() }

// Hijack hands the connection to the handler. Such a response cannot be
// captured, so the key is released afterwards.
func (c *capture) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	c.hijacked = true
	return http.NewResponseController(c.w).Hijack()
}

// Unwrap lets http.ResponseController reach the underlying writer for
// deadlines and the like.
func (c *capture) Unwrap() http.ResponseWriter { return c.w }

// finish settles the final status of a handler that wrote nothing:
// net/http sends 200 with the header as the handler left it.
func (c *capture) finish() {
	if c.status == 0 {
		c.status, c.header = http.StatusOK, c.w.Header().Clone()
	}
}
