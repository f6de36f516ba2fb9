package main

import (
	"context"
	"crypto/tls"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"reflect"
	"slices"
	"testing"
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
