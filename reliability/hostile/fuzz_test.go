package hostile

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/memstore"
)

// FuzzRawRequest parses arbitrary bytes as an HTTP/1.1 request, as
// net/http's server does (http.ReadRequest), and serves it twice through
// the middleware on a fresh memstore. Whatever the bytes:
//   - nothing panics;
//   - a covered request with a malformed key gets 400 and runs nothing;
//   - the handler sees exactly the body that was sent;
//   - a covered request with a valid key that ran and was stored runs
//     once: the second copy is a byte-for-byte replay, marked
//     Idempotent-Replayed, without Set-Cookie;
//   - the middleware's own answers are 400, 413 or 422 problem+json.
func FuzzRawRequest(f *testing.F) {
	seeds := []string{
		"POST /charges HTTP/1.1\r\nHost: a\r\nIdempotency-Key: k1\r\nContent-Length: 2\r\n\r\n{}",
		"POST /charges HTTP/1.1\r\nHost: a\r\nIdempotency-Key: {x}\r\nContent-Length: 0\r\n\r\n",
		"POST /charges HTTP/1.1\r\nHost: a\r\nIdempotency-Key: \"{x} {y}\"\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
		"PATCH /r/%7Bx%7D?q=1 HTTP/1.1\r\nHost: a\r\nIdempotency-Key: a\r\nIdempotency-Key: b\r\nContent-Length: 1\r\n\r\nz",
		"POST / HTTP/1.1\r\nHost: a\r\nIdempotency-Key: \"unterminated\r\nAuthorization: Bearer x\r\n\r\n",
		"POST / HTTP/1.1\r\nHost: a\r\nIdempotency-Key: k\x7f\r\n\r\n",
		"GET / HTTP/1.1\r\nHost: a\r\nIdempotency-Key: k\r\n\r\n",
		"POST /x HTTP/1.0\r\nIdempotency-Key:    spaced   \r\nContent-Type: text/plain\r\nContent-Length: 5\r\n\r\nhello",
		"POST /x HTTP/1.1\r\nHost: a\r\nIdempotency-Key: big\r\nContent-Length: 2000\r\n\r\n" + string(bytes.Repeat([]byte("b"), 2000)),
	}
	for _, s := range seeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		req, err := http.ReadRequest(bufio.NewReader(bytes.NewReader(data)))
		if err != nil {
			return
		}
		body, err := io.ReadAll(io.LimitReader(req.Body, 4<<20))
		if err != nil {
			return // a malformed body framing: net/http's business
		}
		req.RemoteAddr = "127.0.0.1:1"
		const maxBody = 1024
		var runs int
		var seen [][32]byte
		handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			runs++
			b, _ := io.ReadAll(r.Body)
			seen = append(seen, sha256.Sum256(b))
			http.SetCookie(w, &http.Cookie{Name: "s", Value: fmt.Sprint(runs)})
			w.WriteHeader(http.StatusCreated)
			fmt.Fprintf(w, "run %d, %d bytes", runs, len(b))
		})
		mw := idemhttp.Middleware(memstore.New(memstore.Options{Shards: 1}), idemhttp.Config{MaxBodySize: maxBody, Logger: quietLogger()})(handler)

		serve := func() *httptest.ResponseRecorder {
			r := req.Clone(req.Context())
			r.Body = io.NopCloser(bytes.NewReader(body))
			w := httptest.NewRecorder()
			mw.ServeHTTP(w, r)
			return w
		}
		first, second := serve(), serve()

		covered := req.Method == http.MethodPost || req.Method == http.MethodPatch
		_, keyErr := idemhttp.ParseKey(req.Header)
		missing := keyErr != nil && !errors.Is(keyErr, idem.ErrInvalidKey)
		want := sha256.Sum256(body)
		for i, h := range seen {
			if h != want {
				t.Fatalf("run %d of the handler saw a body other than the one sent", i+1)
			}
		}
		switch {
		case !covered || missing:
			// Not covered, or no key: passed through, the handler ran twice.
			if runs != 2 {
				t.Fatalf("pass-through request ran %d times, want 2", runs)
			}
		case keyErr != nil:
			if first.Code != http.StatusBadRequest || runs != 0 {
				t.Fatalf("malformed key (%v): %d, handler ran %d times; want 400 and none", keyErr, first.Code, runs)
			}
		case len(body) > maxBody:
			if first.Code != http.StatusRequestEntityTooLarge || second.Code != http.StatusRequestEntityTooLarge || runs != 0 {
				t.Fatalf("body of %d bytes: %d, %d, handler ran %d times; want 413 twice and none", len(body), first.Code, second.Code, runs)
			}
		default: // covered, valid key, body within the limit
			if runs != 1 || first.Code != http.StatusCreated {
				t.Fatalf("keyed request: first %d, handler ran %d times; want 201 and once", first.Code, runs)
			}
			if second.Code != first.Code || second.Body.String() != first.Body.String() ||
				second.Header().Get(idemhttp.HeaderReplayed) != "true" || len(second.Header().Values("Set-Cookie")) != 0 {
				t.Fatalf("keyed request repeated: %d %q %v, want the replay of %d %q without Set-Cookie",
					second.Code, second.Body, second.Header(), first.Code, first.Body)
			}
		}
	})
}
