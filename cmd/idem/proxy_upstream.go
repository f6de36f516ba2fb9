package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/sidecar"
)

// ProblemBadGateway is the problem type of the proxy's 502 answer when
// the upstream cannot be reached or fails to answer. The default storage
// policy releases the key on 502: a retry forwards the request again.
const ProblemBadGateway = "urn:idem:problem:bad-gateway"

// ProblemUpstreamTimeout is the problem type of the proxy's 504 answer
// when the upstream ran past the route's --max-execution. The default
// storage policy releases the key on 504.
const ProblemUpstreamTimeout = "urn:idem:problem:upstream-timeout"

// newUpstream is the handler every route forwards to: a ReverseProxy to
// target over sendOnce, which answers 502 (ProblemBadGateway) or, past a
// route's --max-execution, 504 (ProblemUpstreamTimeout) when the upstream
// fails (a gRPC call gets a gRPC status: sidecar.WriteProblem), and times
// each request for idem_upstream_duration_seconds.
func newUpstream(target *url.URL, tlsConfig *tls.Config, metrics *proxyMetrics, logger *slog.Logger) http.Handler {
	dest, transport := upstreamDest(target, tlsConfig) // h2c://, unix://: an http:// URL and a transport to reach it
	rp := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(dest)
			setXForwarded(pr)
		},
		Transport:  sendOnce{base: transport, h2: transport.Protocols.UnencryptedHTTP2()},
		BufferPool: copyBuffers,
		ErrorLog:   slog.NewLogLogger(logger.Handler(), slog.LevelWarn),
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			cause := context.Cause(r.Context())
			if errors.Is(cause, idem.ErrMaxExecution) {
				logger.LogAttrs(r.Context(), slog.LevelWarn, "upstream request cut off by --max-execution", slog.String("method", r.Method), slog.Any("error", err))
				sidecar.WriteProblem(w, r, &idemhttp.Problem{Type: ProblemUpstreamTimeout, Title: "Gateway Timeout",
					Status: http.StatusGatewayTimeout, Detail: "The upstream service did not answer within the route's maximum execution time."})
				return
			}
			level := slog.LevelWarn
			if errors.Is(cause, context.Canceled) {
				level = slog.LevelDebug // the client left, on a route with cancel-on-disconnect
			}
			attrs := []slog.Attr{slog.String("method", r.Method), slog.String("path", r.URL.EscapedPath()), slog.Any("error", err)}
			if cause != nil && cause != err {
				attrs = append(attrs, slog.Any("cause", cause))
			}
			logger.LogAttrs(r.Context(), level, "upstream request failed", attrs...)
			sidecar.WriteProblem(w, r, &idemhttp.Problem{Type: ProblemBadGateway, Title: "Bad Gateway",
				Status: http.StatusBadGateway, Detail: "The upstream service could not be reached or did not answer."})
		},
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, leased := idem.LeaseFromContext(r.Context()); !leased && r.ContentLength > 0 {
			// From the client. (A leased request's body was read whole by
			// the middleware and goes from memory.) Up to inlineBodySize
			// it is read whole first, as nginx buffers request bodies, so
			// that it goes in the header's write; a larger one streams.
			if r.ContentLength > inlineBodySize {
				r.Body = &declaredBody{ReadCloser: r.Body, left: r.ContentLength}
			} else if !readWhole(w, r, logger) {
				return
			}
		}
		start := time.Now()
		defer func() { metrics.upstream.Observe(time.Since(start).Seconds()) }() // aborted bodies too
		rp.ServeHTTP(w, r)
	})
}

// setXForwarded is pr.SetXForwarded (X-Forwarded-For, -Host and -Proto,
// the same values) with the three headers' values in one allocation
// rather than one each; each header's slice is capped, so that an append
// to one never writes into another's.
func setXForwarded(pr *httputil.ProxyRequest) {
	v := new([3]string)
	h := pr.Out.Header
	clientIP, _, err := net.SplitHostPort(pr.In.RemoteAddr)
	if err == nil {
		if prior := h["X-Forwarded-For"]; len(prior) > 0 {
			clientIP = strings.Join(prior, ", ") + ", " + clientIP
		}
		v[0] = clientIP
		h["X-Forwarded-For"] = v[0:1:1]
	} else {
		delete(h, "X-Forwarded-For")
	}
	v[1] = pr.In.Host
	h["X-Forwarded-Host"] = v[1:2:2]
	v[2] = "http"
	if pr.In.TLS != nil {
		v[2] = "https"
	}
	h["X-Forwarded-Proto"] = v[2:3:3]
}

// newTransport is the proxy's transport to the upstream (under sendOnce),
// with tlsConfig for an https:// upstream (sidecar.UpstreamTLS's; nil:
// TLS 1.2 at least, the system's CAs).
func newTransport(tlsConfig *tls.Config) *http.Transport {
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.MaxIdleConnsPerHost = 256
	// Room for a header and an inlined body (sendOnce) in one write; the
	// default, 4 KiB, splits a larger request into several.
	t.WriteBufferSize = 2 * inlineBodySize
	t.TLSClientConfig = tlsConfig
	if tlsConfig == nil {
		t.TLSClientConfig = &tls.Config{MinVersion: tls.VersionTLS12}
	}
	return t
}

// readWhole reads r's body of declared length (at most inlineBodySize)
// into memory, or answers 400 when it ends before that length (the client
// stopped sending, or left): nothing is forwarded then.
func readWhole(w http.ResponseWriter, r *http.Request, logger *slog.Logger) bool {
	body := make([]byte, r.ContentLength)
	n, err := io.ReadFull(r.Body, body)
	r.Body.Close()
	if err != nil {
		logger.LogAttrs(r.Context(), slog.LevelDebug, "request body shorter than its Content-Length; not forwarded",
			slog.String("method", r.Method), slog.Int64("content_length", r.ContentLength), slog.Int("read", n), slog.Any("error", err))
		idemhttp.WriteProblem(w, r, &idemhttp.Problem{Type: "about:blank", Title: "Bad Request", Status: http.StatusBadRequest,
			Detail: fmt.Sprintf("The request body ended after %d of the %d bytes its Content-Length declares.", n, r.ContentLength)})
		return false
	}
	r.Body = io.NopCloser(bytes.NewReader(body))
	return true
}

// copyBuffers are the buffers ReverseProxy copies response bodies
// through. Without a pool it allocates 32 KiB per request and clears it:
// for the small answers most APIs give, that allocation and the garbage
// collection it causes were the largest cost of a request passed through.
var copyBuffers = &bufferPool{}

type bufferPool struct{ p sync.Pool }

// copyBufferSize is the size of copyBuffers' buffers.
const copyBufferSize = 32 << 10

// The pool keeps a buffer as a pointer to its array, which goes in an
// interface without an allocation (a *[]byte to Put's argument would be
// one per request); a buffer of another length, which ReverseProxy never
// puts back (it puts the one it got), is kept as a *[]byte.
func (b *bufferPool) Get() []byte {
	switch buf := b.p.Get().(type) {
	case *[copyBufferSize]byte:
		return buf[:]
	case *[]byte:
		return *buf
	}
	return make([]byte, copyBufferSize)
}

func (b *bufferPool) Put(buf []byte) {
	if len(buf) == copyBufferSize {
		b.p.Put((*[copyBufferSize]byte)(buf))
		return
	}
	other := buf // escapes here only, not on every Put
	b.p.Put(&other)
}

// sendOnce is the upstream transport of the proxy. It sends a request
// that runs under a lease exactly once, framed as the client framed it.
//
// net/http's Transport resends a request on its own when a reused
// connection breaks after the request was written, if the request looks
// safe to resend: it has no body (or can rewind it with GetBody), and
// its method is safe or it carries an Idempotency-Key header. The
// upstream may have acted on the first copy. So a leased request goes
// without GetBody, which alone makes a request with a body one the
// Transport never resends once any of it was written (net/http's
// Request.isReplayable); its body goes with its Content-Length (the
// middleware read it whole and set ContentLength) and, up to
// inlineBodySize, in the same write as the header (a body the Transport
// does not know to be in memory gets a write of its own: ReverseProxy's
// wrapper hides it). A request without a body goes without
// one (Content-Length: 0 for POST, PUT and PATCH), and its Idempotency-Key
// and X-Idempotency-Key headers are sent under their lower-case names,
// which the upstream reads the same (header names are case-insensitive)
// but Transport does not take for a sign that it may resend. An empty
// chunked body would have done the same for the Transport, but servers
// that do not read chunked request bodies (Python's http.server) take its
// last chunk for the next request and answer it: a response desync.
// Requests without a lease are sent as they are, except that the
// connection of a chunked one is closed after it (below). Any body up to
// inlineBodySize, in memory by then, goes in the header's write.
//
// An HTTP/2 upstream (h2c://, h2c+unix://) frames each request in its own
// stream: a body it does not read cannot be taken for another request,
// so its connection is kept for the next request (gRPC calls, which are
// all streamed, would otherwise open a connection each).
type sendOnce struct {
	base http.RoundTripper
	h2   bool // the upstream speaks HTTP/2
}

func (t sendOnce) RoundTrip(r *http.Request) (*http.Response, error) {
	_, leased := idem.LeaseFromContext(r.Context())
	chunked := !leased && !t.h2 && r.ContentLength < 0 && r.Body != nil && r.Body != http.NoBody
	// What a leased request keeps of its body: a length of its own, and
	// a body then (the Body a bodiless one gets below has none).
	inline := r.Body != nil && r.ContentLength > 0 && r.ContentLength <= inlineBodySize
	if !leased && !chunked && !inline {
		return t.base.RoundTrip(r) // nothing to change: no copy
	}
	o := &outgoing{req: *r}
	out := &o.req
	if leased {
		out.GetBody = nil
		if out.ContentLength == 0 {
			if out.Body != nil {
				out.Body.Close()
			}
			if t.h2 {
				// HTTP/2's Transport resends a request without a body
				// after stream errors that do not prove the upstream
				// never acted on it (golang/go#47635); one with a body
				// it cannot rewind (no GetBody) it never resends. An
				// empty body is an empty DATA frame on the wire.
				out.Body = io.NopCloser(strings.NewReader(""))
			} else {
				out.Body = nil
				out.Header = sidecar.HideReplayHints(out.Header)
			}
		}
	} else if chunked {
		// A body streamed as the client sent it, chunked: an upstream
		// that does not read chunked bodies takes its chunks for the
		// next request and answers them. The connection is closed after
		// the response, so that such an answer never reaches another
		// request (a keyed one, whose key would store it).
		out.Close = true
	}
	if inline {
		// In memory already (newUpstream, the middleware), but behind
		// ReverseProxy's wrapper, which the Transport does not know to
		// be in memory: it would write the header and the body apart.
		body := make([]byte, out.ContentLength)
		_, err := io.ReadFull(out.Body, body)
		out.Body.Close()
		if err != nil {
			return nil, fmt.Errorf("reading the request body (%d bytes declared): %w", out.ContentLength, err)
		}
		o.body.Reset(body) // bytes.NewReader(body), in o
		out.Body = io.NopCloser(&o.body)
	}
	return t.base.RoundTrip(out)
}

// outgoing is the request sendOnce sends in place of one it changes, and
// the reader of its body when that is inlined: one allocation for both.
type outgoing struct {
	req  http.Request
	body bytes.Reader
}

// inlineBodySize is the largest request body the proxy reads whole before
// it forwards the request, and sends in the header's write (nginx buffers
// 8 or 16 KiB of a request body in memory by default).
const inlineBodySize = 8 << 10

// declaredBody ends a request body of known length at that length: once
// it has been read, it answers io.EOF itself and reads the client's body
// no more.
//
// Without it, a response was sometimes cut in the middle of its body on
// a request whose body the proxy streams (no Idempotency-Key, or a method
// not covered): net/http's transport, having sent Content-Length bytes,
// reads the body once more to check that it holds no more; net/http's
// server, when the response header goes out, consumes what is left of the
// request body and closes it (unless the handler enabled full duplex). The
// upstream can answer as soon as it has the body, before that last read:
// the read then fails (http: invalid Read on closed Body), and the
// transport closes the upstream connection while the response streams
// through it (golang/go#40747). A keyed request's body was read by the
// middleware and is sent from memory: it never raced.
type declaredBody struct {
	io.ReadCloser
	left int64
}

func (b *declaredBody) Read(p []byte) (int, error) {
	if b.left <= 0 {
		return 0, io.EOF
	}
	if int64(len(p)) > b.left {
		p = p[:b.left]
	}
	n, err := b.ReadCloser.Read(p)
	b.left -= int64(n)
	return n, err
}
