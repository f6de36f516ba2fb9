// Package hostile attacks idem's HTTP layer the way a hostile or broken
// client would (issue 8, "Hostile input"): huge headers and bodies,
// slowloris connections, floods of distinct keys, hash-tag games in keys,
// cross-tenant replay, Set-Cookie replay, and a Redis user limited by ACL.
// Every scenario runs against a real HTTP server on 127.0.0.1 with the
// idemhttp middleware over redisstore on a private redis-server (never the
// system Redis), and reports a row with reltest.Report.
//
// The callers of issue 31 are driven from the outside, through the built
// `idem proxy` and Caddy with idem's handler (idem-caddy) on that Redis,
// with Go's client, curl, raw sockets, Python requests and HAProxy:
// every credential style (TestCallerCredentialStyles, and a TLS client
// certificate in Caddy: TestClientCertificateCaddy), header case from a
// Python upstream (TestHeaderCase), virtual hosts, credential spellings,
// path escapes, anonymous callers, and cookie-jar retries
// (TestCookieJarRetries).
package hostile

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/proctest"
	"github.com/idemkit/idem/internal/redisserver"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/idemkit/idem/redisstore"
)

// rdb is the private redis-server shared by the tests that only need
// records under their own prefix. Tests that change server-wide state
// (ACL users) or measure the whole server (memory, DBSIZE) start their own.
var rdb *redisserver.Server

func TestMain(m *testing.M) {
	code := redistest.Run(m, &rdb)
	proctest.RemoveIdem()
	proctest.RemoveCaddy()
	os.Exit(code)
}

// quietLogger drops the middleware's logs (store failures are expected in
// some scenarios).
func quietLogger() *slog.Logger { return slog.New(slog.DiscardHandler) }

// newRedisStore opens a store (rueidis, as Open makes it) on srv under a
// fresh prefix, which it returns, closed at the end of the test.
func newRedisStore(t testing.TB, srv *redisserver.Server) (*redisstore.Store, string) {
	t.Helper()
	prefix := redistest.Prefix("h")
	return redistest.Store(t, srv, redisstore.Options{Prefix: prefix}), prefix
}

// keysWith returns the names of the keys on srv that start with prefix.
func keysWith(t testing.TB, srv *redisserver.Server, prefix string) []string {
	t.Helper()
	out, err := srv.Do("KEYS", prefix+"*")
	if err != nil {
		t.Fatalf("KEYS %s*: %v", prefix, err)
	}
	if out == "" {
		return nil
	}
	return strings.Split(out, "\n")
}

// app is the protected service: POST /charges counts its executions, and
// answers 201 with a body naming the tenant and the execution number, and a
// session cookie.
type app struct {
	runs atomic.Int64
}

func (a *app) handler() *http.ServeMux {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /charges", func(w http.ResponseWriter, r *http.Request) {
		n := a.runs.Add(1)
		body, _ := io.ReadAll(r.Body)
		http.SetCookie(w, &http.Cookie{Name: "session", Value: "s" + strconv.FormatInt(n, 10) + "-" + r.Header.Get("X-Tenant")})
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"run":%d,"tenant":%q,"auth":%q,"body_len":%d}`, n, r.Header.Get("X-Tenant"), r.Header.Get("Authorization"), len(body))
	})
	return mux
}

// countingListener counts the bytes the server reads from its connections.
type countingListener struct {
	net.Listener
	read atomic.Int64
}

func (l *countingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &countingConn{Conn: c, n: &l.read}, nil
}

type countingConn struct {
	net.Conn
	n *atomic.Int64
}

func (c *countingConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.n.Add(int64(n))
	return n, err
}

// startServer serves h on 127.0.0.1 behind a counting listener; configure
// sets the http.Server's limits before it starts.
func startServer(t testing.TB, h http.Handler, configure func(*http.Server)) (*httptest.Server, *countingListener) {
	t.Helper()
	ts := httptest.NewUnstartedServer(h)
	cl := &countingListener{Listener: ts.Listener}
	ts.Listener = cl
	ts.Config.ErrorLog = nil
	if configure != nil {
		configure(ts.Config)
	}
	ts.Start()
	t.Cleanup(ts.Close)
	return ts, cl
}

// newClient is a bounded HTTP client for the well-behaved requests.
func newClient(timeout time.Duration) *http.Client {
	return &http.Client{
		Timeout: timeout,
		Transport: &http.Transport{
			MaxIdleConnsPerHost: 64,
			IdleConnTimeout:     5 * time.Second,
		},
	}
}

// answer is what a client saw.
type answer struct {
	status int
	header http.Header
	body   string
}

func (a answer) problemType() string {
	var p struct{ Type string }
	json.Unmarshal([]byte(a.body), &p)
	return p.Type
}

// post sends one POST with an optional key, tenant (X-Tenant) and
// Authorization.
func post(c *http.Client, url, key, body string, hdr map[string]string) (answer, error) {
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		return answer{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set(idemhttp.HeaderKey, key)
	}
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := c.Do(req)
	if err != nil {
		return answer{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return answer{status: resp.StatusCode, header: resp.Header, body: string(b)}, err
}

// mustPost is post failing the test on a transport error.
func mustPost(t testing.TB, c *http.Client, url, key, body string, hdr map[string]string) answer {
	t.Helper()
	a, err := post(c, url, key, body, hdr)
	if err != nil {
		t.Fatalf("POST %s (key %.40q): %v", url, key, err)
	}
	return a
}

// rawResult is what rawExchange saw.
type rawResult struct {
	status  int
	body    string
	elapsed time.Duration // from the first byte written to the response read
	written int64         // bytes of body the client managed to write
	err     error
}

// rawExchange writes head (request line and headers, ending in an empty
// line) to addr, then streams body (if any) while reading the response,
// and returns as soon as a response has been read (or within timeout).
// The body writer stops at the first write error (the server closed the
// connection), so nothing the server refuses to read is sent for long.
func rawExchange(addr, head string, body io.Reader, timeout time.Duration) rawResult {
	start := time.Now()
	conn, err := net.DialTimeout("tcp", addr, 2*time.Second)
	if err != nil {
		return rawResult{err: err}
	}
	defer conn.Close()
	conn.SetDeadline(start.Add(timeout))
	var written atomic.Int64
	var wg sync.WaitGroup
	wg.Go(func() {
		if _, err := io.WriteString(conn, head); err != nil || body == nil {
			return
		}
		buf := make([]byte, 64<<10)
		for {
			n, rerr := body.Read(buf)
			if n > 0 {
				m, werr := conn.Write(buf[:n])
				written.Add(int64(m))
				if werr != nil {
					return
				}
			}
			if rerr != nil {
				return
			}
		}
	})
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	res := rawResult{elapsed: time.Since(start), err: err}
	if err == nil {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
		resp.Body.Close()
		res.status, res.body = resp.StatusCode, string(b)
	}
	conn.Close() // stops the writer
	wg.Wait()
	if c, ok := body.(io.Closer); ok {
		c.Close()
	}
	res.written = written.Load()
	return res
}

// zeros is an endless reader of zero bytes that allocates nothing.
type zeros struct{}

func (zeros) Read(p []byte) (int, error) {
	clear(p)
	return len(p), nil
}

// chunked encodes r as an HTTP/1.1 chunked body of size bytes in 32 KiB
// chunks, ending with the last chunk.
func chunked(size int64) io.Reader {
	pr, pw := io.Pipe()
	go func() {
		buf := make([]byte, 32<<10)
		for left := size; left > 0; {
			n := min(left, int64(len(buf)))
			if _, err := fmt.Fprintf(pw, "%x\r\n", n); err != nil {
				return
			}
			if _, err := pw.Write(buf[:n]); err != nil {
				return
			}
			if _, err := io.WriteString(pw, "\r\n"); err != nil {
				return
			}
			left -= n
		}
		io.WriteString(pw, "0\r\n\r\n")
		pw.Close()
	}()
	return pr // rawExchange closes it, which ends the goroutine
}

// allocated runs f and returns the bytes the whole process allocated on
// the heap meanwhile (runtime.MemStats.TotalAlloc), and the growth of the
// live heap after a GC.
func allocated(f func()) (total, retained int64) {
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	f()
	runtime.ReadMemStats(&after)
	total = int64(after.TotalAlloc - before.TotalAlloc)
	runtime.GC()
	runtime.ReadMemStats(&after)
	retained = int64(after.HeapAlloc) - int64(before.HeapAlloc)
	return total, retained
}

// mib formats bytes in MiB.
func mib(n int64) string { return fmt.Sprintf("%.2f MiB", float64(n)/(1<<20)) }

// waitFor polls cond every 50ms until it holds or d passes.
func waitFor(d time.Duration, cond func() bool) bool {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	for {
		if cond() {
			return true
		}
		select {
		case <-ctx.Done():
			return cond()
		case <-time.After(50 * time.Millisecond):
		}
	}
}
