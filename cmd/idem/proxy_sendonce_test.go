package main

import (
	"bytes"
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"sync/atomic"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/memstore"
)

// sendOnce, given a leased request whose GetBody is set (as
// http.NewRequest sets it for a *bytes.Reader body), still sends it once:
// when the reused connection breaks after the request was written,
// net/http's Transport must not rewind the body with GetBody and resend
// it. The unleased request first shows that the Transport does resend such
// a request on this upstream, so the leased cases test something.
func TestSendOnceWithGetBody(t *testing.T) {
	t.Parallel()
	up := newResettingUpstream(t)
	url := "http://" + up.ln.Addr().String() + "/pay"
	base := http.DefaultTransport.(*http.Transport).Clone()
	t.Cleanup(base.CloseIdleConnections)
	rt := sendOnce{base: base}
	g, err := idem.New(memstore.New(memstore.Options{}), idem.Config{})
	if err != nil {
		t.Fatal(err)
	}

	// send sends one POST with GetBody set, on the connection the warm-up
	// request before it left idle, which the upstream resets after reading.
	send := func(ctx context.Context, key, body string) (*http.Response, error) {
		t.Helper()
		warm, err := http.NewRequestWithContext(t.Context(), "POST", url, bytes.NewReader([]byte("{}")))
		if err != nil {
			t.Fatal(err)
		}
		warm.Header.Set(idemhttp.HeaderKey, "warm-"+key)
		resp, err := rt.RoundTrip(warm)
		if err != nil {
			t.Fatalf("%s: warm-up request: %v", key, err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()

		req, err := http.NewRequestWithContext(ctx, "POST", url, bytes.NewReader([]byte(body)))
		if err != nil {
			t.Fatal(err)
		}
		if req.GetBody == nil {
			t.Fatalf("%s: http.NewRequest left GetBody unset", key)
		}
		req.Header.Set(idemhttp.HeaderKey, key)
		resp, err = rt.RoundTrip(req)
		if err == nil {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
		return resp, err
	}

	// Without a lease the request goes as it is, and the Transport resends
	// it: the upstream reads it twice.
	if resp, err := send(t.Context(), "unleased", `{"amount":5}`); err != nil || resp.StatusCode != http.StatusCreated {
		t.Fatalf("unleased: got %v, want 201 from the Transport's resend", err)
	}
	if got := up.arrivalsOf("unleased"); got != 2 {
		t.Fatalf("unleased: the upstream received the request %d times, want 2 (the Transport resends it): the test no longer exercises a resend", got)
	}

	for _, c := range []struct{ name, body string }{{"leased-empty-body", ""}, {"leased-with-body", `{"amount":5}`}} {
		key, err := idem.Scope{Route: "/pay"}.Key(c.name)
		if err != nil {
			t.Fatal(err)
		}
		att, acq, err := g.Begin(t.Context(), key, idem.Fingerprint{})
		if err != nil || acq.Outcome != idem.Acquired {
			t.Fatalf("%s: Begin: got %v, %v; want acquired", c.name, acq.Outcome, err)
		}
		resp, err := send(att.Context(), c.name, c.body)
		att.Release(context.Background())
		if got := up.arrivalsOf(c.name); got != 1 {
			t.Errorf("%s: the upstream received the request %d times, want 1 (never resent)", c.name, got)
		}
		if err == nil {
			t.Errorf("%s: got %d, want an error (the upstream reset the connection after reading the request)", c.name, resp.StatusCode)
		}
	}
}

// countingConn counts the writes made to a connection.
type countingConn struct {
	net.Conn
	n *atomic.Int64
}

func (c countingConn) Write(p []byte) (int, error) { c.n.Add(1); return c.Conn.Write(p) }

// A request body up to inlineBodySize goes to the upstream in the
// header's write, through ReverseProxy (whose body wrapper hides from the
// Transport that the body is in memory) and the proxy's transport (whose
// write buffer holds both).
func TestInlineBodyOneWrite(t *testing.T) {
	t.Parallel()
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.Copy(io.Discard, r.Body) }))
	t.Cleanup(up.Close)
	target, _ := url.Parse(up.URL)
	var writes atomic.Int64
	tr := newTransport(nil)
	t.Cleanup(tr.CloseIdleConnections)
	dialer := &net.Dialer{}
	tr.DialContext = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dialer.DialContext(ctx, network, addr)
		return countingConn{c, &writes}, err
	}
	rp := &httputil.ReverseProxy{Rewrite: func(pr *httputil.ProxyRequest) { pr.SetURL(target) }, Transport: sendOnce{base: tr}}
	for _, size := range []int{1 << 10, inlineBodySize} {
		r := httptest.NewRequest("POST", "/x", io.NopCloser(bytes.NewReader(make([]byte, size))))
		r.ContentLength = int64(size)
		writes.Store(0)
		rec := httptest.NewRecorder()
		rp.ServeHTTP(rec, r)
		if rec.Code != http.StatusOK {
			t.Fatalf("body of %d bytes: status %d", size, rec.Code)
		}
		if n := writes.Load(); n != 1 {
			t.Errorf("body of %d bytes: %d writes to the upstream connection, want 1 (header and body together)", size, n)
		}
	}
}
