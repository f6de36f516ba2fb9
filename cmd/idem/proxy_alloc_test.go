package main

import (
	"bytes"
	"cmp"
	"context"
	"crypto/tls"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// TestBufferPool: the copy buffers are copyBufferSize long, one put back
// is handed out again whole, and Put costs no allocation.
func TestBufferPool(t *testing.T) {
	var p bufferPool
	buf := p.Get()
	if len(buf) != copyBufferSize {
		t.Fatalf("Get: %d bytes, want %d", len(buf), copyBufferSize)
	}
	if n := testing.AllocsPerRun(100, func() { p.Put(p.Get()) }); n != 0 {
		t.Errorf("Get and Put: %v allocations, want 0", n)
	}
	other := make([]byte, 10)
	p.Put(other)
	for range 3 {
		if got := p.Get(); len(got) != copyBufferSize && len(got) != len(other) {
			t.Fatalf("Get after Put of a short buffer: %d bytes", len(got))
		}
	}
}

// TestSetXForwarded: setXForwarded sets what httputil's SetXForwarded
// sets, and an append to one header's values leaves the others'.
func TestSetXForwarded(t *testing.T) {
	for _, c := range []struct {
		name, remote string
		prior        []string
		tls          bool
	}{
		{"plain", "192.0.2.1:1234", nil, false},
		{"tls", "[2001:db8::1]:443", nil, true},
		{"prior", "192.0.2.1:1234", []string{"198.51.100.7", "203.0.113.9"}, false},
		{"no port", "192.0.2.1", []string{"198.51.100.7"}, false},
		{"empty", "", nil, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			pr := func() *httputil.ProxyRequest {
				in := httptest.NewRequest(http.MethodPost, "http://api.example/x", nil)
				in.RemoteAddr = c.remote
				if !c.tls {
					in.TLS = nil
				} else {
					in.TLS = &tls.ConnectionState{}
				}
				out := in.Clone(context.Background())
				out.Header = http.Header{"Accept": {"*/*"}}
				if c.prior != nil {
					out.Header["X-Forwarded-For"] = slices.Clone(c.prior)
				}
				return &httputil.ProxyRequest{In: in, Out: out}
			}
			want, got := pr(), pr()
			want.SetXForwarded()
			setXForwarded(got)
			if !reflect.DeepEqual(got.Out.Header, want.Out.Header) {
				t.Fatalf("setXForwarded: %v; SetXForwarded: %v", got.Out.Header, want.Out.Header)
			}
			h := got.Out.Header
			for _, k := range []string{"X-Forwarded-For", "X-Forwarded-Host", "X-Forwarded-Proto"} {
				h[k] = append(h[k], "appended")
			}
			for _, k := range []string{"X-Forwarded-For", "X-Forwarded-Host", "X-Forwarded-Proto"} {
				if w := append(slices.Clone(want.Out.Header[k]), "appended"); !slices.Equal(h[k], w) {
					t.Errorf("%s after appends: %q, want %q", k, h[k], w)
				}
			}
		})
	}
}

// TestLogRequestLine: the request's log line is, byte for byte, the one
// written with each attribute on its own (as before issue 36's group),
// in JSON and in text, whatever facts it has.
func TestLogRequestLine(t *testing.T) {
	// The time and the duration differ from one line to the next.
	fixed := func(_ []string, a slog.Attr) slog.Attr {
		switch a.Key {
		case slog.TimeKey:
			return slog.Attr{}
		case "duration_ms":
			return slog.Float64("duration_ms", 1.25)
		}
		return a
	}
	flat := func(logger *slog.Logger, r *http.Request, rt *route, st *reqState, start time.Time, upstreamAborted bool) {
		status := st.sw.status
		if upstreamAborted {
			status = http.StatusBadGateway
		}
		attrs := []slog.Attr{
			slog.String("method", r.Method),
			slog.String("path", r.URL.EscapedPath()),
			slog.String("route", rt.name),
			slog.String("outcome", st.info.outcome),
			slog.Int("status", cmp.Or(status, http.StatusOK)),
			slog.Int64("bytes", st.sw.written),
			durationMS(time.Since(start)),
		}
		if st.sw.gone {
			attrs = append(attrs, slog.Bool("client_gone", true))
		}
		if upstreamAborted {
			attrs = append(attrs, slog.Bool("upstream_aborted", true))
		}
		if st.info.keyed {
			attrs = append(attrs, slog.String("key", st.info.key.String()))
		}
		logger.LogAttrs(r.Context(), slog.LevelInfo, "request", attrs...)
	}
	for _, format := range []string{"json", "text"} {
		for _, gone := range []bool{false, true} {
			for _, aborted := range []bool{false, true} {
				for _, keyed := range []bool{false, true} {
					var got, want bytes.Buffer
					newLog := func(w *bytes.Buffer) *slog.Logger {
						opts := &slog.HandlerOptions{ReplaceAttr: fixed}
						if format == "text" {
							return slog.New(slog.NewTextHandler(w, opts))
						}
						return slog.New(slog.NewJSONHandler(w, opts))
					}
					r := httptest.NewRequest(http.MethodPost, "http://api.example/pay%20ments/7?x=1", nil)
					rt := &route{name: "/pay ments/{id}"}
					st := &reqState{sw: statusWriter{status: 201, written: 12, gone: gone}, info: reqInfo{outcome: "executed", key: idem.Key{1, 2, 3}, keyed: keyed}}
					start := time.Now()
					(&proxy{logger: newLog(&got)}).logRequest(r, rt, st, start, aborted)
					flat(newLog(&want), r, rt, st, start, aborted)
					if got.String() != want.String() || got.Len() == 0 {
						t.Errorf("%s, gone %v, aborted %v, keyed %v:\n got  %s\n want %s", format, gone, aborted, keyed, got.String(), want.String())
					}
				}
			}
		}
	}
}

// TestProxyAllocs bounds the allocations of the proxy's handler around
// the upstream: a pass-through request and one the middleware reports
// on cost the proxy this many (its state, and for a covered method the
// context that carries it: the value and the request's copy).
func TestProxyAllocs(t *testing.T) {
	if testing.CoverMode() != "" || proxyRace {
		t.Skip("allocation counts differ under -race and -cover")
	}
	upstream := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusNoContent) })
	// Text: the JSON handler's float (duration_ms) costs an allocation
	// of its own, unless it is 0.
	logger := slog.New(slog.NewTextHandler(io.Discard, nil))
	metrics := newProxyMetrics()
	for _, c := range []struct {
		method string
		want   float64
	}{{http.MethodGet, 1}, {http.MethodPost, 3}} {
		rt := &route{covered: map[string]bool{http.MethodPost: true}, handler: upstream}
		p := &proxy{logger: logger, metrics: metrics}
		p.routes.Store(&routeTable{def: rt})
		r := httptest.NewRequest(c.method, "http://api.example/payments", nil)
		w := httptest.NewRecorder()
		w.Body = nil
		n := testing.AllocsPerRun(200, func() { p.ServeHTTP(w, r) })
		if n > c.want {
			t.Errorf("%s: %v allocations, want at most %v", c.method, n, c.want)
		}
	}
}
