package idemhttp_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"reflect"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/idemkit/idem/idemhttp"
)

// transportSeen is one request as a test server received it.
type transportSeen struct {
	Method string
	Path   string
	Keys   []string // every Idempotency-Key value
	Body   []byte
}

// transportServer is a loopback server that records every request it
// receives and answers the nth (1-based) with respond.
type transportServer struct {
	*httptest.Server
	mu   sync.Mutex
	seen []transportSeen
}

func newTransportServer(t *testing.T, respond func(n int, w http.ResponseWriter, r *http.Request)) *transportServer {
	t.Helper()
	s := &transportServer{}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			t.Errorf("server: reading body: %v", err)
		}
		s.mu.Lock()
		s.seen = append(s.seen, transportSeen{r.Method, r.URL.Path, r.Header.Values("Idempotency-Key"), body})
		n := len(s.seen)
		s.mu.Unlock()
		respond(n, w, r)
	}))
	t.Cleanup(s.Close)
	return s
}

// attempts returns a copy of what the server has received.
func (s *transportServer) attempts() []transportSeen {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.seen)
}

// transport returns a Transport on the server's own client transport with
// short waits.
func (s *transportServer) transport() *idemhttp.Transport {
	return &idemhttp.Transport{
		Base:       s.Client().Transport,
		MinBackoff: time.Millisecond,
		MaxBackoff: 10 * time.Millisecond,
	}
}

// transportStatus answers with status, Retry-After: retryAfter when it is
// not empty, and a body naming the status and attempt.
func transportStatus(w http.ResponseWriter, n, status int, retryAfter string) {
	if retryAfter != "" {
		w.Header().Set("Retry-After", retryAfter)
	}
	w.WriteHeader(status)
	fmt.Fprintf(w, "%d on attempt %d", status, n)
}

// transportReset closes the request's connection with a TCP RST.
func transportReset(t *testing.T, w http.ResponseWriter) {
	conn, _, err := http.NewResponseController(w).Hijack()
	if err != nil {
		t.Errorf("server: hijack: %v", err)
		return
	}
	if tcp, ok := conn.(*net.TCPConn); ok {
		tcp.SetLinger(0) // Close sends RST instead of FIN
	}
	conn.Close()
}

// transportSameKey checks that every attempt carried exactly one key, the
// same one, and returns it.
func transportSameKey(t *testing.T, seen []transportSeen) string {
	t.Helper()
	if len(seen) == 0 {
		t.Fatal("server saw no request")
	}
	key := ""
	for i, s := range seen {
		if len(s.Keys) != 1 {
			t.Fatalf("attempt %d: got Idempotency-Key %q, want exactly one", i+1, s.Keys)
		}
		if i == 0 {
			key = s.Keys[0]
		} else if s.Keys[0] != key {
			t.Errorf("attempt %d: got key %q, want %q (the first attempt's)", i+1, s.Keys[0], key)
		}
	}
	return key
}

func transportIsUUIDv4(t *testing.T, key string) {
	t.Helper()
	id, err := uuid.Parse(key)
	if err != nil {
		t.Fatalf("key %q: %v", key, err)
	}
	if id.Version() != 4 || id.Variant() != uuid.RFC4122 {
		t.Errorf("key %q: got version %d variant %v, want a UUIDv4", key, id.Version(), id.Variant())
	}
}

func transportReadBody(t *testing.T, resp *http.Response) string {
	t.Helper()
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("reading response body: %v", err)
	}
	return string(b)
}

func TestTransportAddsKeyToCoveredMethods(t *testing.T) {
	srv := newTransportServer(t, func(n int, w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusOK)
	})
	client := &http.Client{Transport: srv.transport()}

	for _, method := range []string{http.MethodPost, http.MethodPatch, http.MethodGet, http.MethodPut, http.MethodDelete} {
		t.Run(method, func(t *testing.T) {
			before := len(srv.attempts())
			req, err := http.NewRequest(method, srv.URL, strings.NewReader("payload"))
			if err != nil {
				t.Fatal(err)
			}
			resp, err := client.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			transportReadBody(t, resp)
			seen := srv.attempts()[before:]
			if len(seen) != 1 {
				t.Fatalf("got %d requests, want 1", len(seen))
			}
			covered := method == http.MethodPost || method == http.MethodPatch
			if !covered {
				if len(seen[0].Keys) != 0 {
					t.Errorf("got Idempotency-Key %q, want none", seen[0].Keys)
				}
				if got := idemhttp.KeyFromResponse(resp); got != "" {
					t.Errorf("KeyFromResponse: got %q, want empty", got)
				}
				return
			}
			key := transportSameKey(t, seen)
			transportIsUUIDv4(t, key)
			if got := idemhttp.KeyFromResponse(resp); got != key {
				t.Errorf("KeyFromResponse: got %q, want %q", got, key)
			}
			if got := string(seen[0].Body); got != "payload" {
				t.Errorf("body: got %q, want %q", got, "payload")
			}
		})
	}

	t.Run("fresh key per request", func(t *testing.T) {
		before := len(srv.attempts())
		for range 2 {
			resp, err := client.Post(srv.URL, "text/plain", strings.NewReader("x"))
			if err != nil {
				t.Fatal(err)
			}
			transportReadBody(t, resp)
		}
		seen := srv.attempts()[before:]
		if len(seen) != 2 {
			t.Fatalf("got %d requests, want 2", len(seen))
		}
		if seen[0].Keys[0] == seen[1].Keys[0] {
			t.Errorf("got the same key %q for two requests, want two keys", seen[0].Keys[0])
		}
	})
}

func TestTransportKeepsCallerKey(t *testing.T) {
	srv := newTransportServer(t, func(n int, w http.ResponseWriter, r *http.Request) {
		if n == 1 {
			transportStatus(w, n, http.StatusServiceUnavailable, "0")
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
	tr := srv.transport()
	tr.NewKey = func(*http.Request) string {
		t.Error("NewKey called for a request that has a key")
		return "generated"
	}
	req, err := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader("x"))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Idempotency-Key", `"caller-key"`)
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	transportReadBody(t, resp)
	seen := srv.attempts()
	if len(seen) != 2 {
		t.Fatalf("got %d attempts, want 2", len(seen))
	}
	if key := transportSameKey(t, seen); key != `"caller-key"` {
		t.Errorf("got key %q, want %q", key, `"caller-key"`)
	}
}

func TestTransportNewKey(t *testing.T) {
	srv := newTransportServer(t, func(n int, w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusOK)
	})
	tr := srv.transport()
	tr.NewKey = func(r *http.Request) string { return "order-" + r.URL.Query().Get("id") }
	resp, err := (&http.Client{Transport: tr}).Post(srv.URL+"?id=42", "text/plain", strings.NewReader("x"))
	if err != nil {
		t.Fatal(err)
	}
	transportReadBody(t, resp)
	if key := transportSameKey(t, srv.attempts()); key != "order-42" {
		t.Errorf("got key %q, want %q", key, "order-42")
	}

	tr.NewKey = func(*http.Request) string { return "" }
	_, err = (&http.Client{Transport: tr}).Post(srv.URL, "text/plain", strings.NewReader("x"))
	if err == nil || !strings.Contains(err.Error(), "idemhttp: NewKey returned an empty key") {
		t.Errorf("empty key: got error %v, want idemhttp: NewKey returned an empty key", err)
	}
	if got := len(srv.attempts()); got != 1 {
		t.Errorf("empty key: got %d requests at the server, want 1 (none sent)", got)
	}
}

func TestTransportDoesNotModifyRequest(t *testing.T) {
	srv := newTransportServer(t, func(n int, w http.ResponseWriter, r *http.Request) {
		if n == 1 {
			transportStatus(w, n, http.StatusServiceUnavailable, "0")
			return
		}
		w.WriteHeader(http.StatusOK)
	})
	for _, name := range []string{"GetBody", "no GetBody"} {
		t.Run(name, func(t *testing.T) {
			req, err := http.NewRequest(http.MethodPost, srv.URL+"/path?q=1", bytes.NewReader([]byte("payload")))
			if err != nil {
				t.Fatal(err)
			}
			if name == "no GetBody" {
				req.GetBody = nil
				req.Body = io.NopCloser(req.Body)
				req.ContentLength = 0
			}
			req.Header.Set("Content-Type", "text/plain")
			req.Header.Set("X-Trace", "abc")
			wantHeader := req.Header.Clone()
			wantBody, wantURL, wantLen := req.Body, req.URL.String(), req.ContentLength
			wantGetBody := req.GetBody != nil

			resp, err := srv.transport().RoundTrip(req)
			if err != nil {
				t.Fatal(err)
			}
			transportReadBody(t, resp)

			if !reflect.DeepEqual(req.Header, wantHeader) {
				t.Errorf("caller's header: got %v, want %v", req.Header, wantHeader)
			}
			if req.Body != wantBody {
				t.Errorf("caller's Body: got %T %p, want the original %p", req.Body, req.Body, wantBody)
			}
			if req.URL.String() != wantURL || req.ContentLength != wantLen || (req.GetBody != nil) != wantGetBody {
				t.Errorf("caller's request: got URL %s ContentLength %d GetBody %t, want %s %d %t",
					req.URL, req.ContentLength, req.GetBody != nil, wantURL, wantLen, wantGetBody)
			}
			if resp.Request == req {
				t.Error("response's Request: got the caller's request, want the clone that was sent")
			}
		})
	}
}

func TestTransportRetriesWithSameKeyAndBody(t *testing.T) {
	payload := []byte(`{"amount":1000,"currency":"eur"}`)
	for _, name := range []string{"GetBody", "no GetBody"} {
		t.Run(name, func(t *testing.T) {
			srv := newTransportServer(t, func(n int, w http.ResponseWriter, r *http.Request) {
				switch n {
				case 1:
					transportStatus(w, n, http.StatusServiceUnavailable, "0")
				case 2:
					transportStatus(w, n, http.StatusServiceUnavailable, "")
				default:
					transportStatus(w, n, http.StatusCreated, "")
				}
			})
			tr := srv.transport()
			var body io.Reader = bytes.NewReader(payload)
			if name == "no GetBody" {
				body = io.NopCloser(body) // http.NewRequest sets no GetBody for it
				tr.MaxBodyBuffer = int64(len(payload))
			}
			req, err := http.NewRequest(http.MethodPost, srv.URL, body)
			if err != nil {
				t.Fatal(err)
			}
			if got := req.GetBody != nil; got != (name == "GetBody") {
				t.Fatalf("request has GetBody: got %t, want %t", got, name == "GetBody")
			}

			resp, err := (&http.Client{Transport: tr}).Do(req)
			if err != nil {
				t.Fatal(err)
			}
			if got := transportReadBody(t, resp); resp.StatusCode != http.StatusCreated || got != "201 on attempt 3" {
				t.Errorf("got %d %q, want 201 %q", resp.StatusCode, got, "201 on attempt 3")
			}
			seen := srv.attempts()
			if len(seen) != 3 {
				t.Fatalf("got %d attempts, want 3", len(seen))
			}
			key := transportSameKey(t, seen)
			transportIsUUIDv4(t, key)
			if got := idemhttp.KeyFromResponse(resp); got != key {
				t.Errorf("KeyFromResponse: got %q, want %q", got, key)
			}
			for i, s := range seen {
				if !bytes.Equal(s.Body, payload) {
					t.Errorf("attempt %d: got body %q, want %q", i+1, s.Body, payload)
				}
			}
		})
	}
}

func TestTransportRetriesConnectionReset(t *testing.T) {
	srv := newTransportServer(t, func(n int, w http.ResponseWriter, r *http.Request) {
		switch n {
		case 1:
			transportReset(t, w)
		case 2:
			transportStatus(w, n, http.StatusServiceUnavailable, "")
		default:
			transportStatus(w, n, http.StatusOK, "")
		}
	})
	resp, err := (&http.Client{Transport: srv.transport()}).Post(srv.URL, "text/plain", strings.NewReader("payload"))
	if err != nil {
		t.Fatal(err)
	}
	if got := transportReadBody(t, resp); resp.StatusCode != http.StatusOK {
		t.Errorf("got %d %q, want 200", resp.StatusCode, got)
	}
	seen := srv.attempts()
	if len(seen) != 3 {
		t.Fatalf("got %d attempts, want 3", len(seen))
	}
	transportSameKey(t, seen)
	for i, s := range seen {
		if string(s.Body) != "payload" {
			t.Errorf("attempt %d: got body %q, want %q", i+1, s.Body, "payload")
		}
	}
}

func TestTransportGivesUpOnErrors(t *testing.T) {
	srv := newTransportServer(t, func(n int, w http.ResponseWriter, r *http.Request) {
		transportReset(t, w)
	})
	tr := srv.transport()
	tr.MaxAttempts = 3
	resp, err := (&http.Client{Transport: tr}).Post(srv.URL, "text/plain", strings.NewReader("payload"))
	if err == nil {
		resp.Body.Close()
		t.Fatalf("got %d, want an error", resp.StatusCode)
	}
	if want := "idemhttp: giving up after 3 attempts: "; !strings.Contains(err.Error(), want) {
		t.Errorf("got error %q, want it to contain %q", err, want)
	}
	seen := srv.attempts()
	if len(seen) != 3 {
		t.Fatalf("got %d attempts, want 3", len(seen))
	}
	transportSameKey(t, seen)
}

func TestTransportHonoursRetryAfterSeconds(t *testing.T) {
	srv := newTransportServer(t, func(n int, w http.ResponseWriter, r *http.Request) {
		if n == 1 {
			transportStatus(w, n, http.StatusTooManyRequests, "1")
			return
		}
		transportStatus(w, n, http.StatusOK, "")
	})
	start := time.Now()
	resp, err := (&http.Client{Transport: srv.transport()}).Post(srv.URL, "text/plain", strings.NewReader("x"))
	if err != nil {
		t.Fatal(err)
	}
	elapsed := time.Since(start)
	transportReadBody(t, resp)
	if resp.StatusCode != http.StatusOK {
		t.Errorf("got %d, want 200", resp.StatusCode)
	}
	if elapsed < 900*time.Millisecond {
		t.Errorf("got a round trip of %v, want at least ~1s (Retry-After: 1)", elapsed)
	}
	if got := len(srv.attempts()); got != 2 {
		t.Errorf("got %d attempts, want 2", got)
	}
}

func TestTransportStatuses(t *testing.T) {
	for _, tc := range []struct {
		status       int
		wantAttempts int
	}{
		{http.StatusBadRequest, 1},
		{http.StatusUnprocessableEntity, 1},
		{http.StatusInternalServerError, 1},
		{http.StatusNotImplemented, 1},
		{http.StatusConflict, 3},
		{http.StatusTooManyRequests, 3},
		{http.StatusBadGateway, 3},
		{http.StatusServiceUnavailable, 3},
		{http.StatusGatewayTimeout, 3},
	} {
		t.Run(fmt.Sprint(tc.status), func(t *testing.T) {
			srv := newTransportServer(t, func(n int, w http.ResponseWriter, r *http.Request) {
				if n < 3 {
					transportStatus(w, n, tc.status, "")
					return
				}
				transportStatus(w, n, http.StatusOK, "")
			})
			resp, err := (&http.Client{Transport: srv.transport()}).Post(srv.URL, "text/plain", strings.NewReader("x"))
			if err != nil {
				t.Fatal(err)
			}
			body := transportReadBody(t, resp)
			if got := len(srv.attempts()); got != tc.wantAttempts {
				t.Errorf("got %d attempts, want %d", got, tc.wantAttempts)
			}
			wantStatus := tc.status
			if tc.wantAttempts == 3 {
				wantStatus = http.StatusOK
			}
			if want := fmt.Sprintf("%d on attempt %d", wantStatus, tc.wantAttempts); resp.StatusCode != wantStatus || body != want {
				t.Errorf("got %d %q, want %d %q", resp.StatusCode, body, wantStatus, want)
			}
		})
	}
}

func TestTransportMaxAttempts(t *testing.T) {
	srv := newTransportServer(t, func(n int, w http.ResponseWriter, r *http.Request) {
		transportStatus(w, n, http.StatusServiceUnavailable, "0")
	})
	tr := srv.transport()
	tr.MaxAttempts = 4
	resp, err := (&http.Client{Transport: tr}).Post(srv.URL, "text/plain", strings.NewReader("x"))
	if err != nil {
		t.Fatal(err)
	}
	body := transportReadBody(t, resp)
	if resp.StatusCode != http.StatusServiceUnavailable || body != "503 on attempt 4" {
		t.Errorf("got %d %q, want 503 %q", resp.StatusCode, body, "503 on attempt 4")
	}
	seen := srv.attempts()
	if len(seen) != 4 {
		t.Errorf("got %d attempts, want 4", len(seen))
	}
	transportSameKey(t, seen)

	t.Run("MaxAttempts 1 disables retries", func(t *testing.T) {
		before := len(srv.attempts())
		tr.MaxAttempts = 1
		resp, err := (&http.Client{Transport: tr}).Post(srv.URL, "text/plain", strings.NewReader("x"))
		if err != nil {
			t.Fatal(err)
		}
		transportReadBody(t, resp)
		if got := len(srv.attempts()) - before; got != 1 {
			t.Errorf("got %d attempts, want 1", got)
		}
	})
}

func TestTransportMaxElapsed(t *testing.T) {
	t.Run("Retry-After beyond the budget", func(t *testing.T) {
		srv := newTransportServer(t, func(n int, w http.ResponseWriter, r *http.Request) {
			transportStatus(w, n, http.StatusServiceUnavailable, "10")
		})
		tr := srv.transport()
		tr.MaxElapsed = 200 * time.Millisecond
		start := time.Now()
		resp, err := (&http.Client{Transport: tr}).Post(srv.URL, "text/plain", strings.NewReader("x"))
		if err != nil {
			t.Fatal(err)
		}
		elapsed := time.Since(start)
		body := transportReadBody(t, resp)
		if resp.StatusCode != http.StatusServiceUnavailable || body != "503 on attempt 1" {
			t.Errorf("got %d %q, want 503 %q", resp.StatusCode, body, "503 on attempt 1")
		}
		if elapsed > 2*time.Second {
			t.Errorf("got a round trip of %v, want well under the 10s of Retry-After", elapsed)
		}
		if got := len(srv.attempts()); got != 1 {
			t.Errorf("got %d attempts, want 1", got)
		}
	})

	t.Run("backoff waits", func(t *testing.T) {
		srv := newTransportServer(t, func(n int, w http.ResponseWriter, r *http.Request) {
			transportStatus(w, n, http.StatusServiceUnavailable, "")
		})
		tr := srv.transport()
		tr.MaxAttempts = 100
		tr.MaxElapsed = 100 * time.Millisecond
		tr.Backoff = func(_, _ time.Duration, _ int, _ *http.Response) time.Duration { return 30 * time.Millisecond }
		start := time.Now()
		resp, err := (&http.Client{Transport: tr}).Post(srv.URL, "text/plain", strings.NewReader("x"))
		if err != nil {
			t.Fatal(err)
		}
		elapsed := time.Since(start)
		transportReadBody(t, resp)
		if resp.StatusCode != http.StatusServiceUnavailable {
			t.Errorf("got %d, want 503", resp.StatusCode)
		}
		// Attempts at about 0, 30, 60 and 90ms; the next wait would end
		// after 100ms.
		if got := len(srv.attempts()); got < 2 || got > 4 {
			t.Errorf("got %d attempts, want 2 to 4", got)
		}
		if elapsed > time.Second {
			t.Errorf("got a round trip of %v, want about 100ms", elapsed)
		}
	})

	t.Run("context deadline", func(t *testing.T) {
		srv := newTransportServer(t, func(n int, w http.ResponseWriter, r *http.Request) {
			transportStatus(w, n, http.StatusServiceUnavailable, "5")
		})
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL, strings.NewReader("x"))
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		resp, err := (&http.Client{Transport: srv.transport()}).Do(req)
		if err != nil {
			t.Fatalf("got error %v, want the 503 (the wait would outlast the context)", err)
		}
		transportReadBody(t, resp)
		if elapsed := time.Since(start); resp.StatusCode != http.StatusServiceUnavailable || elapsed > time.Second {
			t.Errorf("got %d after %v, want 503 at once", resp.StatusCode, elapsed)
		}
	})
}

func TestTransportContextCanceledDuringBackoff(t *testing.T) {
	srv := newTransportServer(t, func(n int, w http.ResponseWriter, r *http.Request) {
		transportStatus(w, n, http.StatusServiceUnavailable, "5")
	})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL, strings.NewReader("x"))
	if err != nil {
		t.Fatal(err)
	}
	timer := time.AfterFunc(100*time.Millisecond, cancel)
	defer timer.Stop()
	start := time.Now()
	resp, err := (&http.Client{Transport: srv.transport()}).Do(req)
	elapsed := time.Since(start)
	if err == nil {
		resp.Body.Close()
		t.Fatalf("got %d, want an error", resp.StatusCode)
	}
	if !errors.Is(err, context.Canceled) {
		t.Errorf("got error %v, want context.Canceled", err)
	}
	if elapsed > 2*time.Second {
		t.Errorf("got a round trip of %v, want it to end soon after the cancellation at 100ms", elapsed)
	}
	if got := len(srv.attempts()); got != 1 {
		t.Errorf("got %d attempts, want 1", got)
	}
}

func TestTransportLargeBodySentOnce(t *testing.T) {
	payload := bytes.Repeat([]byte("0123456789"), 1000)
	for _, name := range []string{"unknown length", "known length"} {
		t.Run(name, func(t *testing.T) {
			srv := newTransportServer(t, func(n int, w http.ResponseWriter, r *http.Request) {
				transportStatus(w, n, http.StatusServiceUnavailable, "0")
			})
			tr := srv.transport()
			tr.MaxBodyBuffer = 64
			req, err := http.NewRequest(http.MethodPost, srv.URL, bytes.NewReader(payload))
			if err != nil {
				t.Fatal(err)
			}
			req.GetBody = nil
			req.Body = io.NopCloser(req.Body)
			if name == "unknown length" {
				req.ContentLength = 0
			}
			resp, err := (&http.Client{Transport: tr}).Do(req)
			if err != nil {
				t.Fatal(err)
			}
			transportReadBody(t, resp)
			if resp.StatusCode != http.StatusServiceUnavailable {
				t.Errorf("got %d, want 503", resp.StatusCode)
			}
			seen := srv.attempts()
			if len(seen) != 1 {
				t.Fatalf("got %d attempts, want 1", len(seen))
			}
			transportSameKey(t, seen)
			if !bytes.Equal(seen[0].Body, payload) {
				t.Errorf("got a body of %d bytes, want the %d sent", len(seen[0].Body), len(payload))
			}
		})
	}
}

func TestTransportFollowsRedirectWithSameKey(t *testing.T) {
	srv := newTransportServer(t, func(n int, w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/old" {
			http.Redirect(w, r, "/new", http.StatusPermanentRedirect)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
	resp, err := (&http.Client{Transport: srv.transport()}).Post(srv.URL+"/old", "text/plain", strings.NewReader("payload"))
	if err != nil {
		t.Fatal(err)
	}
	transportReadBody(t, resp)
	seen := srv.attempts()
	if len(seen) != 2 || seen[0].Path != "/old" || seen[1].Path != "/new" {
		t.Fatalf("got requests %+v, want /old then /new", seen)
	}
	transportSameKey(t, seen)
	if string(seen[1].Body) != "payload" {
		t.Errorf("redirected body: got %q, want %q", seen[1].Body, "payload")
	}
}

func TestTransportConcurrent(t *testing.T) {
	var mu sync.Mutex
	perKey := map[string]int{}
	srv := newTransportServer(t, func(n int, w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		key := r.Header.Get("Idempotency-Key")
		perKey[key]++
		first := perKey[key] == 1
		mu.Unlock()
		if first {
			transportStatus(w, n, http.StatusServiceUnavailable, "0")
			return
		}
		w.WriteHeader(http.StatusOK)
	})
	client := &http.Client{Transport: srv.transport()}
	const workers = 16
	var wg sync.WaitGroup
	for i := range workers {
		wg.Go(func() {
			resp, err := client.Post(srv.URL, "text/plain", strings.NewReader(fmt.Sprint(i)))
			if err != nil {
				t.Error(err)
				return
			}
			transportReadBody(t, resp)
			if resp.StatusCode != http.StatusOK {
				t.Errorf("got %d, want 200", resp.StatusCode)
			}
		})
	}
	wg.Wait()
	mu.Lock()
	defer mu.Unlock()
	if len(perKey) != workers {
		t.Errorf("got %d keys, want %d", len(perKey), workers)
	}
	for key, n := range perKey {
		if n != 2 {
			t.Errorf("key %q: got %d attempts, want 2", key, n)
		}
	}
}

func TestTransportZeroValue(t *testing.T) {
	srv := newTransportServer(t, func(n int, w http.ResponseWriter, r *http.Request) {
		if n == 1 {
			transportStatus(w, n, http.StatusServiceUnavailable, "0")
			return
		}
		transportStatus(w, n, http.StatusCreated, "")
	})
	var tr idemhttp.Transport
	client := &http.Client{Transport: &tr}
	defer client.CloseIdleConnections()
	resp, err := client.Post(srv.URL, "application/json", strings.NewReader(`{}`))
	if err != nil {
		t.Fatal(err)
	}
	if body := transportReadBody(t, resp); resp.StatusCode != http.StatusCreated || body != "201 on attempt 2" {
		t.Errorf("got %d %q, want 201 %q", resp.StatusCode, body, "201 on attempt 2")
	}
	transportIsUUIDv4(t, transportSameKey(t, srv.attempts()))
}

// transportCountingRT counts the attempts that reach it.
type transportCountingRT struct {
	n    atomic.Int32
	base http.RoundTripper
}

func (c *transportCountingRT) RoundTrip(r *http.Request) (*http.Response, error) {
	c.n.Add(1)
	return c.base.RoundTrip(r)
}

func TestTransportPermanentErrorsNotRetried(t *testing.T) {
	tlsSrv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		t.Error("handler reached through an untrusted certificate")
	}))
	tlsSrv.Config.ErrorLog = log.New(io.Discard, "", 0) // the handshake failures are expected
	tlsSrv.StartTLS()
	defer tlsSrv.Close()

	for _, tc := range []struct{ name, url, want string }{
		{"unsupported scheme", "ftp://example.invalid/upload", "unsupported protocol scheme"},
		{"untrusted certificate", tlsSrv.URL, "certificate"},
		{"no host", "http:///path", "no Host"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			base := &http.Transport{}
			defer base.CloseIdleConnections()
			counting := &transportCountingRT{base: base}
			tr := &idemhttp.Transport{Base: counting, MinBackoff: time.Millisecond, MaxBackoff: 10 * time.Millisecond}
			resp, err := (&http.Client{Transport: tr}).Post(tc.url, "text/plain", strings.NewReader("x"))
			if err == nil {
				resp.Body.Close()
				t.Fatalf("got %d, want an error", resp.StatusCode)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("got error %q, want it to mention %q", err, tc.want)
			}
			if strings.Contains(err.Error(), "giving up") {
				t.Errorf("got error %q, want the error of the single attempt", err)
			}
			if got := counting.n.Load(); got != 1 {
				t.Errorf("got %d attempts, want 1", got)
			}
		})
	}
}

func TestDefaultCheckRetry(t *testing.T) {
	ctx := context.Background()
	canceled, cancel := context.WithCancel(ctx)
	cancel()

	_, schemeErr := (&http.Transport{}).RoundTrip(&http.Request{
		Method: http.MethodPost,
		URL:    &url.URL{Scheme: "ftp", Host: "example.invalid"},
		Header: http.Header{},
	})
	if schemeErr == nil {
		t.Fatal("ftp request: got no error from http.Transport")
	}
	reset := &net.OpError{Op: "read", Net: "tcp", Err: os.NewSyscallError("read", syscall.ECONNRESET)}
	refused := &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}

	for _, tc := range []struct {
		name    string
		ctx     context.Context
		status  int // 0: no response
		err     error
		want    bool
		wantErr error
	}{
		{name: "200", status: 200},
		{name: "201", status: 201},
		{name: "400", status: 400},
		{name: "404", status: 404},
		{name: "408", status: 408},
		{name: "422", status: 422},
		{name: "500", status: 500},
		{name: "501", status: 501},
		{name: "409", status: 409, want: true},
		{name: "429", status: 429, want: true},
		{name: "502", status: 502, want: true},
		{name: "503", status: 503, want: true},
		{name: "504", status: 504, want: true},
		{name: "connection reset", err: reset, want: true},
		{name: "connection refused", err: refused, want: true},
		{name: "EOF", err: io.EOF, want: true},
		{name: "unexpected EOF", err: fmt.Errorf("net/http: HTTP/1.x transport connection broken: %w", io.ErrUnexpectedEOF), want: true},
		{name: "unsupported scheme", err: schemeErr},
		{name: "unknown authority", err: &tls.CertificateVerificationError{Err: x509.UnknownAuthorityError{}}},
		{name: "hostname mismatch", err: x509.HostnameError{Host: "example.com", Certificate: &x509.Certificate{}}},
		{name: "invalid host", err: &url.Error{Op: "Post", URL: "http://a b", Err: url.InvalidHostError(" ")}},
		{name: "context canceled", ctx: canceled, err: context.Canceled, wantErr: context.Canceled},
		{name: "context canceled with a response", ctx: canceled, status: 503, wantErr: context.Canceled},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := tc.ctx
			if c == nil {
				c = ctx
			}
			var resp *http.Response
			if tc.status != 0 {
				resp = &http.Response{StatusCode: tc.status, Header: http.Header{}, Body: http.NoBody}
			}
			got, err := idemhttp.DefaultCheckRetry(c, resp, tc.err)
			if got != tc.want || !errors.Is(err, tc.wantErr) || (tc.wantErr == nil && err != nil) {
				t.Errorf("got (%t, %v), want (%t, %v)", got, err, tc.want, tc.wantErr)
			}
		})
	}
}

func TestDefaultBackoff(t *testing.T) {
	const (
		minWait = 10 * time.Millisecond
		maxWait = time.Second
	)
	t.Run("full jitter", func(t *testing.T) {
		for attempt := range 12 {
			ceiling := min(maxWait, minWait<<attempt)
			lo, hi := ceiling, time.Duration(0)
			for range 1000 {
				d := idemhttp.DefaultBackoff(minWait, maxWait, attempt, nil)
				if d < 0 || d >= ceiling {
					t.Fatalf("attempt %d: got %v, want within [0, %v)", attempt, d, ceiling)
				}
				lo, hi = min(lo, d), max(hi, d)
			}
			if lo >= ceiling/2 || hi < ceiling/2 {
				t.Errorf("attempt %d: got values in [%v, %v], want them spread over [0, %v)", attempt, lo, hi, ceiling)
			}
		}
	})
	t.Run("capped by max", func(t *testing.T) {
		for _, attempt := range []int{7, 20, 62, 63, 64, 1000} {
			for range 100 {
				if d := idemhttp.DefaultBackoff(minWait, maxWait, attempt, nil); d < 0 || d >= maxWait {
					t.Fatalf("attempt %d: got %v, want within [0, %v)", attempt, d, maxWait)
				}
			}
		}
	})
	t.Run("degenerate bounds", func(t *testing.T) {
		for _, tc := range []struct{ minWait, maxWait time.Duration }{{0, maxWait}, {minWait, 0}, {-minWait, maxWait}} {
			if d := idemhttp.DefaultBackoff(tc.minWait, tc.maxWait, 3, nil); d != 0 {
				t.Errorf("min %v max %v: got %v, want 0", tc.minWait, tc.maxWait, d)
			}
		}
		if d := idemhttp.DefaultBackoff(minWait, maxWait, -1, nil); d < 0 || d >= minWait {
			t.Errorf("attempt -1: got %v, want within [0, %v)", d, minWait)
		}
	})

	retryAfter := func(v string) *http.Response {
		return &http.Response{StatusCode: http.StatusServiceUnavailable, Header: http.Header{"Retry-After": {v}}}
	}
	t.Run("Retry-After seconds", func(t *testing.T) {
		if d := idemhttp.DefaultBackoff(minWait, maxWait, 0, retryAfter("3")); d != 3*time.Second {
			t.Errorf("got %v, want 3s", d)
		}
		// The server's word beats maxWait; the Transport's MaxElapsed
		// decides whether the wait is affordable.
		if d := idemhttp.DefaultBackoff(minWait, maxWait, 0, retryAfter("60")); d != time.Minute {
			t.Errorf("Retry-After beyond max: got %v, want 1m", d)
		}
		if d := idemhttp.DefaultBackoff(minWait, maxWait, 0, retryAfter("0")); d < 0 || d >= minWait {
			t.Errorf("Retry-After: 0: got %v, want the jitter, within [0, %v)", d, minWait)
		}
		if d := idemhttp.DefaultBackoff(minWait, maxWait, 0, retryAfter("99999999999999999999")); d < 24*time.Hour {
			t.Errorf("huge Retry-After: got %v, want a very long wait", d)
		}
	})
	t.Run("Retry-After date", func(t *testing.T) {
		date := time.Now().Add(3 * time.Second).UTC().Format(http.TimeFormat) // second resolution
		if d := idemhttp.DefaultBackoff(minWait, maxWait, 0, retryAfter(date)); d < 1900*time.Millisecond || d > 3*time.Second {
			t.Errorf("Retry-After %s: got %v, want 2s to 3s", date, d)
		}
		past := time.Now().Add(-time.Hour).UTC().Format(http.TimeFormat)
		if d := idemhttp.DefaultBackoff(minWait, maxWait, 0, retryAfter(past)); d < 0 || d >= minWait {
			t.Errorf("Retry-After in the past: got %v, want the jitter, within [0, %v)", d, minWait)
		}
	})
	t.Run("Retry-After malformed", func(t *testing.T) {
		for _, v := range []string{"soon", "-5", "1.5", "+3"} {
			if d := idemhttp.DefaultBackoff(minWait, maxWait, 0, retryAfter(v)); d < 0 || d >= minWait {
				t.Errorf("Retry-After %q: got %v, want the jitter, within [0, %v)", v, d, minWait)
			}
		}
	})
}
