package idemhttp

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// HeaderKeyLifetime is the response header that says, with
// Config.LifetimeHeader, how long a key's record is kept (Config.Retention)
// as an ISO 8601 duration: "PT24H", the form Apache Iceberg's REST catalog
// uses for its idempotency-key-lifetime.
const HeaderKeyLifetime = "Idempotency-Key-Lifetime"

// isoDuration writes d as an ISO 8601 duration of whole seconds, rounded
// down, in hours, minutes and seconds (a day is 24 hours): 24h is "PT24H",
// 90s "PT1M30S", and less than a second "PT0S".
func isoDuration(d time.Duration) string {
	s := int64(d / time.Second)
	if s <= 0 {
		return "PT0S"
	}
	b := []byte("PT")
	for _, u := range []struct {
		n    int64
		unit byte
	}{{s / 3600, 'H'}, {s / 60 % 60, 'M'}, {s % 60, 'S'}} {
		if u.n > 0 {
			b = strconv.AppendInt(b, u.n, 10)
			b = append(b, u.unit)
		}
	}
	return string(b)
}

// stamped is the ResponseWriter of a request of a covered method when
// Config.EchoKey or Config.LifetimeHeader is set: it sets the
// middleware's own headers (Idempotency-Key once the key is read,
// Idempotency-Key-Lifetime) on the response as its final header goes out
// (the final status, the first write or flush, or, if the handler wrote
// nothing, once the middleware is done), whoever writes it: the handler,
// a replay or a problem. Set then, they replace the headers of those
// names the handler set, in any case (and as trailers), so that the
// client gets each once, with the middleware's value. The capture of a
// handler's response (which wraps stamped) sees them, but both names are
// denied (middleware.deny): never stored, nor replayed from a record that
// holds a handler's.
//
// It keeps what the handler may ask of the ResponseWriter it wraps:
// Flush, Hijack, io.ReaderFrom, and Unwrap for http.ResponseController
// (write deadlines, full duplex).
type stamped struct {
	w        http.ResponseWriter
	key      []string  // the key to echo; nil until it is read, or without EchoKey
	keyv     [1]string // key's value (echo), allocated with s
	lifetime []string  // nil without LifetimeHeader; shared by every response: sent as lifev
	lifev    [1]string // this response's copy of lifetime's value, allocated with s
	done     bool      // the final header went out
	hijacked bool      // the handler took the connection: no header of ours
}

// stamp sets the headers, once: before the final header goes out.
func (s *stamped) stamp() {
	if !s.done && !s.hijacked {
		s.done = true
		s.set()
	}
}

// end runs once the middleware is done, before net/http sends what is
// left: a response nobody wrote gets the headers; after one that went out,
// what the handler set of either name since can only be a trailer, and is
// dropped.
func (s *stamped) end() {
	switch {
	case s.hijacked:
	case !s.done:
		s.stamp()
	default:
		h := s.w.Header()
		if s.key != nil {
			drop(h, HeaderKey, "")
		}
		if s.lifetime != nil {
			drop(h, HeaderKeyLifetime, "")
		}
	}
}

func (s *stamped) set() {
	h := s.w.Header()
	if s.key != nil {
		drop(h, HeaderKey, HeaderKey)
		h[HeaderKey] = s.key
	}
	if s.lifetime != nil {
		drop(h, HeaderKeyLifetime, HeaderKeyLifetime)
		// A copy of its own: code after this (Caddy's header replace, any
		// middleware) may write into the value in place.
		s.lifev[0] = s.lifetime[0]
		h[HeaderKeyLifetime] = s.lifev[:]
	}
}

// drop deletes the entries of h named name (canonical) in any case, and
// its trailers (http.TrailerPrefix), but the entry keep: net/http would
// send each.
func drop(h http.Header, name, keep string) {
	for k := range h {
		if k != keep && strings.EqualFold(strings.TrimPrefix(k, http.TrailerPrefix), name) {
			delete(h, k)
		}
	}
}

func (s *stamped) Header() http.Header { return s.w.Header() }

func (s *stamped) WriteHeader(code int) {
	if code < 100 || code > 199 || code == http.StatusSwitchingProtocols {
		s.stamp() // not on an informational response: it is not the answer
	}
	s.w.WriteHeader(code)
}

func (s *stamped) Write(p []byte) (int, error) {
	s.stamp()
	return s.w.Write(p)
}

// ReadFrom keeps the ResponseWriter's io.ReaderFrom (net/http's sends a
// file with sendfile).
func (s *stamped) ReadFrom(src io.Reader) (int64, error) {
	s.stamp()
	return io.Copy(s.w, src)
}

func (s *stamped) FlushError() error {
	s.stamp()
	return http.NewResponseController(s.w).Flush()
}

func (s *stamped) Flush() { s.FlushError() }

func (s *stamped) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	conn, rw, err := http.NewResponseController(s.w).Hijack()
	if err == nil {
		s.hijacked = true
	}
	return conn, rw, err
}

func (s *stamped) Unwrap() http.ResponseWriter { return s.w }

// echo returns the value of the header that echoes key: []string{key},
// in s (one value, no room for another).
func (s *stamped) echo(key string) []string {
	s.keyv[0] = key
	return s.keyv[:]
}
