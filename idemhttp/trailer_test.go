package idemhttp_test

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/memstore"
)

// trailered answers as gRPC does: a body, then trailers, one announced in
// the Trailer header and one set with http.TrailerPrefix once the body was
// written (as ReverseProxy passes on an upstream's undeclared trailers),
// and a denied one.
func trailered(body string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Trailer", "Grpc-Status")
		w.Header().Set("Content-Type", "application/grpc")
		w.WriteHeader(http.StatusOK)
		io.WriteString(w, body)
		w.(http.Flusher).Flush()
		w.Header().Set("Grpc-Status", "3")
		w.Header()[http.TrailerPrefix+"grpc-message"] = []string{"bad%20thing"}
		w.Header().Set(http.TrailerPrefix+"X-Secret", "private")
	}
}

// TestTrailersReplayed: the trailers a handler set are stored and replayed
// as trailers, on HTTP/1.1 (chunked) and HTTP/2, from the record and from
// a blob; a denied name is dropped as a trailer too.
func TestTrailersReplayed(t *testing.T) {
	for _, tc := range []struct {
		name  string
		h2    bool
		blobs bool
	}{{"http1", false, false}, {"http2", true, false}, {"http1-blob", false, true}, {"http2-blob", true, true}} {
		t.Run(tc.name, func(t *testing.T) {
			body := "message"
			cfg := idemhttp.Config{ReplayHeaderDenylist: []string{"X-Secret"}, Logger: quietLogger()}
			if tc.blobs {
				body = strings.Repeat("m", 100<<10)
				cfg.MaxResponseSize = 1 << 10
				cfg.Blobs = newMemBlobs()
			}
			runs := 0
			h := idemhttp.Middleware(memstore.New(memstore.Options{}), cfg)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				runs++
				trailered(body)(w, r)
			}))
			srv := httptest.NewUnstartedServer(h)
			if tc.h2 {
				srv.EnableHTTP2 = true
				srv.StartTLS()
			} else {
				srv.Start()
			}
			defer srv.Close()
			call := func() (*http.Response, string) {
				req, _ := http.NewRequest("POST", srv.URL+"/pay", strings.NewReader("req"))
				req.Header.Set(idemhttp.HeaderKey, "k1")
				resp, err := srv.Client().Do(req)
				if err != nil {
					t.Fatal(err)
				}
				defer resp.Body.Close()
				b, err := io.ReadAll(resp.Body) // trailers are read with the body
				if err != nil {
					t.Fatal(err)
				}
				if tc.h2 != (resp.ProtoMajor == 2) {
					t.Fatalf("got %s, want HTTP/2 %v", resp.Proto, tc.h2)
				}
				return resp, string(b)
			}
			first, firstBody := call()
			again, againBody := call()
			if runs != 1 {
				t.Fatalf("handler ran %d times, want 1", runs)
			}
			if again.Header.Get(idemhttp.HeaderReplayed) != "true" {
				t.Fatalf("second answer is not a replay: %v", again.Header)
			}
			if againBody != firstBody || againBody != body {
				t.Errorf("replayed body of %d bytes, want %d", len(againBody), len(body))
			}
			for _, resp := range []*http.Response{first, again} {
				if got := resp.Trailer.Get("Grpc-Status"); got != "3" {
					t.Errorf("trailer Grpc-Status: got %q, want 3 (trailers %v)", got, resp.Trailer)
				}
				if got := resp.Trailer.Get("Grpc-Message"); got != "bad%20thing" {
					t.Errorf("trailer Grpc-Message: got %q, want bad%%20thing", got)
				}
				if resp.Header.Get("Grpc-Status") != "" || resp.Header.Get(http.TrailerPrefix+"Grpc-Status") != "" {
					t.Errorf("trailer sent as a header: %v", resp.Header)
				}
			}
			if got := again.Trailer.Get("X-Secret"); got != "" {
				t.Errorf("denied trailer replayed: %q", got)
			}
		})
	}
}

// TestTrailersEncoded: a record with trailers survives the record
// encoding, under the names a replay hands to net/http.
func TestTrailersEncoded(t *testing.T) {
	resp := &idem.Response{Status: 200, Header: http.Header{"Content-Type": {"application/grpc"}, http.TrailerPrefix + "Grpc-Status": {"0"}}, Body: []byte("x")}
	b, err := resp.AppendBinary(nil)
	if err != nil {
		t.Fatal(err)
	}
	var got idem.Response
	if err := got.UnmarshalBinary(b); err != nil {
		t.Fatal(err)
	}
	if v := got.Header[http.TrailerPrefix+"Grpc-Status"]; len(v) != 1 || v[0] != "0" {
		t.Errorf("decoded header %v, want Trailer:Grpc-Status 0", got.Header)
	}
}
