package idemhttp_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/memstore"
)

// pieces is a request body read in the given pieces, then err (io.EOF
// when nil), with the last piece when together is set.
type pieces struct {
	parts    []string
	err      error
	together bool
}

func (p *pieces) Read(b []byte) (int, error) {
	end := p.err
	if end == nil {
		end = io.EOF
	}
	if len(p.parts) == 0 {
		return 0, end
	}
	n := copy(b, p.parts[0])
	if n < len(p.parts[0]) {
		p.parts[0] = p.parts[0][n:]
		return n, nil
	}
	p.parts = p.parts[1:]
	if len(p.parts) == 0 && p.together {
		return n, end
	}
	return n, nil
}

func (p *pieces) Close() error { return nil }

// The body as read for the fingerprint: up to MaxBodySize bytes whatever
// the pieces, a byte more is 413, a failed read 400, and the handler gets
// the body whole.
func TestReadBodyLimit(t *testing.T) {
	const limit = 100
	boom := errors.New("boom")
	for _, c := range []struct {
		name     string
		body     pieces
		length   int64
		status   int
		wantBody string
	}{
		{"at the limit", pieces{parts: []string{strings.Repeat("a", limit)}}, -1, http.StatusCreated, strings.Repeat("a", limit)},
		{"at the limit, declared", pieces{parts: []string{strings.Repeat("a", limit)}}, limit, http.StatusCreated, strings.Repeat("a", limit)},
		{"at the limit, EOF with it", pieces{parts: []string{strings.Repeat("a", limit)}, together: true}, -1, http.StatusCreated, strings.Repeat("a", limit)},
		{"in pieces", pieces{parts: []string{"ab", "", "cd", strings.Repeat("e", limit-4)}}, -1, http.StatusCreated, "abcd" + strings.Repeat("e", limit-4)},
		{"one past", pieces{parts: []string{strings.Repeat("a", limit+1)}}, -1, http.StatusRequestEntityTooLarge, ""},
		{"one past in pieces", pieces{parts: []string{strings.Repeat("a", limit), "b"}}, -1, http.StatusRequestEntityTooLarge, ""},
		{"one past, declared short", pieces{parts: []string{strings.Repeat("a", limit+1)}}, 10, http.StatusRequestEntityTooLarge, ""},
		{"declared past", pieces{parts: []string{"a"}}, limit + 1, http.StatusRequestEntityTooLarge, ""},
		{"past the limit, then an error", pieces{parts: []string{strings.Repeat("a", limit+5)}, err: boom, together: true}, -1, http.StatusRequestEntityTooLarge, ""},
		{"an error", pieces{parts: []string{"ab"}, err: boom}, -1, http.StatusBadRequest, ""},
		// An outer limit smaller than ours (http.MaxBytesHandler, a
		// proxy's body limit): too large all the same, 413 as before.
		{"an outer limit", pieces{parts: []string{"ab"}, err: &http.MaxBytesError{Limit: 1}}, -1, http.StatusRequestEntityTooLarge, ""},
		{"an outer limit, wrapped", pieces{parts: []string{"ab"}, err: fmt.Errorf("read: %w", &http.MaxBytesError{Limit: 1}), together: true}, -1, http.StatusRequestEntityTooLarge, ""},
		{"an error with data", pieces{parts: []string{"ab"}, err: boom, together: true}, -1, http.StatusBadRequest, ""},
		{"empty", pieces{}, -1, http.StatusCreated, ""},
		{"empty, declared", pieces{}, 0, http.StatusCreated, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			var got string
			h := idemhttp.Middleware(memstore.New(memstore.Options{}), idemhttp.Config{MaxBodySize: limit})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				b, err := io.ReadAll(r.Body)
				if err != nil {
					t.Errorf("handler's body: %v", err)
				}
				if r.ContentLength != int64(len(b)) {
					t.Errorf("handler's ContentLength %d, body of %d bytes", r.ContentLength, len(b))
				}
				got = string(b)
				w.WriteHeader(http.StatusCreated)
			}))
			body := c.body
			r := httptest.NewRequest("POST", "/charges", nil)
			r.Body, r.ContentLength = &body, c.length
			r.Header.Set(idemhttp.HeaderKey, "k")
			w := httptest.NewRecorder()
			h.ServeHTTP(w, r)
			if w.Code != c.status {
				t.Fatalf("got %d %q, want %d", w.Code, w.Body, c.status)
			}
			if got != c.wantBody {
				t.Errorf("handler's body: got %q, want %q", got, c.wantBody)
			}
		})
	}
}

// A body larger than the first buffer (64 KiB and a bit) grows it, in
// pieces or not, declared or not, up to the default limit.
func TestReadBodyGrows(t *testing.T) {
	big := strings.Repeat("0123456789abcdef", 20000) // 320000 bytes
	for _, c := range []struct {
		name   string
		parts  []string
		length int64
	}{
		{"whole", []string{big}, -1},
		{"declared", []string{big}, int64(len(big))},
		{"pieces", []string{big[:1000], big[1000:70000], big[70000:70001], big[70001:]}, -1},
	} {
		t.Run(c.name, func(t *testing.T) {
			var got string
			h := idemhttp.Middleware(memstore.New(memstore.Options{}), idemhttp.Config{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				b, _ := io.ReadAll(r.Body)
				got = string(b)
				w.WriteHeader(http.StatusCreated)
			}))
			r := httptest.NewRequest("POST", "/charges", nil)
			r.Body, r.ContentLength = &pieces{parts: c.parts}, c.length
			r.Header.Set(idemhttp.HeaderKey, "k")
			w := httptest.NewRecorder()
			h.ServeHTTP(w, r)
			if w.Code != http.StatusCreated || got != big {
				t.Fatalf("got %d and a body of %d bytes, want 201 and %d", w.Code, len(got), len(big))
			}
		})
	}
}

// The handler's body has the methods of io.NopCloser(bytes.NewReader(b)),
// which it was: Read, Close and WriteTo, no Seek nor ReadAt; its
// ContentLength is the body's.
func TestHandlerBodyMethods(t *testing.T) {
	h := idemhttp.Middleware(memstore.New(memstore.Options{}), idemhttp.Config{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, ok := r.Body.(io.WriterTo); !ok {
			t.Error("the body is no io.WriterTo")
		}
		if _, ok := r.Body.(io.Seeker); ok {
			t.Error("the body is an io.Seeker")
		}
		if _, ok := r.Body.(io.ReaderAt); ok {
			t.Error("the body is an io.ReaderAt")
		}
		var b strings.Builder
		if n, err := r.Body.(io.WriterTo).WriteTo(&b); err != nil || n != 4 || b.String() != "abcd" {
			t.Errorf("WriteTo: %d %v %q", n, err, b.String())
		}
		if err := r.Body.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
		w.WriteHeader(http.StatusCreated)
	}))
	r := httptest.NewRequest("POST", "/charges", strings.NewReader("abcd"))
	r.Header.Set(idemhttp.HeaderKey, "k")
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	if w.Code != http.StatusCreated {
		t.Fatalf("got %d", w.Code)
	}
}

// Behind http.MaxBytesHandler with a smaller limit than MaxBodySize, a
// keyed body over that limit is 413 body-too-large, as a body over the
// middleware's own limit is, and the handler does not run.
func TestReadBodyOuterLimit(t *testing.T) {
	ran := false
	h := http.MaxBytesHandler(idemhttp.Middleware(memstore.New(memstore.Options{}), idemhttp.Config{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ran = true
	})), 10)
	r := httptest.NewRequest("POST", "/charges", strings.NewReader(strings.Repeat("a", 100)))
	r.Header.Set(idemhttp.HeaderKey, "k")
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	if w.Code != http.StatusRequestEntityTooLarge || !strings.Contains(w.Body.String(), "body-too-large") || ran {
		t.Fatalf("got %d %s (handler ran: %t), want 413 body-too-large, not run", w.Code, w.Body, ran)
	}
}

// writeCounter counts the writes to a client's connection.
type writeCounter struct {
	net.Conn
	n *atomic.Int32
}

func (c writeCounter) Write(p []byte) (int, error) {
	c.n.Add(1)
	return c.Conn.Write(p)
}

// A handler that forwards the request it was given (r.Clone and a
// Transport, as a hand-written proxy does) sends its body in the one
// write of the header: net/http's client knows the body for the
// fingerprint to be in memory, as it knew io.NopCloser(bytes.NewReader).
func TestHandlerBodyForwardedInOneWrite(t *testing.T) {
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.WriteHeader(http.StatusCreated)
	}))
	defer up.Close()
	var writes atomic.Int32
	tr := &http.Transport{DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
		return writeCounter{c, &writes}, err
	}}
	defer tr.CloseIdleConnections()
	h := idemhttp.Middleware(memstore.New(memstore.Options{}), idemhttp.Config{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		out := r.Clone(r.Context())
		out.URL, _ = url.Parse(up.URL + "/charges")
		out.Host, out.RequestURI = "", ""
		resp, err := tr.RoundTrip(out)
		if err != nil {
			t.Errorf("forward: %v", err)
			w.WriteHeader(http.StatusBadGateway)
			return
		}
		resp.Body.Close()
		w.WriteHeader(resp.StatusCode)
	}))
	r := httptest.NewRequest("POST", "/charges", strings.NewReader(strings.Repeat("a", 600)))
	r.Header.Set(idemhttp.HeaderKey, "k")
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	if w.Code != http.StatusCreated {
		t.Fatalf("got %d %s", w.Code, w.Body)
	}
	if n := writes.Load(); n != 1 {
		t.Errorf("the forwarded request took %d writes, want 1 (header and body together)", n)
	}
}
