package idemhttp_test

// Large responses: bodies over MaxResponseSize stream to a blob store and
// replay from it, byte for byte, with the digest checked.

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/memstore"
)

const (
	kib = 1 << 10
	mib = 1 << 20
)

// stream is the deterministic body of n bytes for seed: the handler writes
// it without holding it, and the test checks a replay by its digest.
func stream(seed string, n int64) io.Reader {
	var s [32]byte
	copy(s[:], seed)
	return io.LimitReader(rand.NewChaCha8(s), n)
}

func digest(r io.Reader) ([32]byte, int64) {
	h := sha256.New()
	n, _ := io.Copy(h, r)
	var sum [32]byte
	h.Sum(sum[:0])
	return sum, n
}

// bigApp answers POST /report?size=N&status=S with N bytes of stream(key),
// written in 32 KiB pieces as httputil.ReverseProxy does, and counts its
// executions per key. hold, when set, is closed by the test to let a
// handler finish its second half.
type bigApp struct {
	mu    sync.Mutex
	runs  map[string]int
	hold  chan struct{} // nil: no pause halfway
	half  chan struct{} // nil, or told (without blocking) when a handler is halfway
	panic atomic.Bool   // panic halfway
}

func newBigApp() *bigApp { return &bigApp{runs: map[string]int{}} }

func (a *bigApp) count(key string) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.runs[key]
}

func (a *bigApp) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	key := r.Header.Get(idemhttp.HeaderKey)
	a.mu.Lock()
	a.runs[key]++
	a.mu.Unlock()
	size, _ := strconv.ParseInt(r.URL.Query().Get("size"), 10, 64)
	status := http.StatusOK
	if s := r.URL.Query().Get("status"); s != "" {
		status, _ = strconv.Atoi(s)
	}
	w.Header().Set("Content-Type", "text/csv")
	w.Header().Set("Content-Disposition", `attachment; filename="report.csv"`)
	w.Header().Set("Content-Length", strconv.FormatInt(size, 10))
	w.WriteHeader(status)
	buf := make([]byte, 32*kib)
	src := stream(key, size)
	var written int64
	halfway := false
	for {
		n, err := io.ReadFull(src, buf)
		if n > 0 {
			w.Write(buf[:n])
			written += int64(n)
		}
		if written >= size/2 && !halfway {
			halfway = true
			select {
			case a.half <- struct{}{}:
			default:
			}
			if a.panic.Load() {
				panic("handler failed halfway")
			}
			if a.hold != nil {
				<-a.hold
			}
		}
		if err != nil {
			return
		}
	}
}

// blobEnv is a middleware with a blob store in front of a bigApp.
type blobEnv struct {
	srv       *httptest.Server
	app       *bigApp
	store     *memstore.Store
	blobs     idem.BlobStore
	dir       string // the file store's directory, when it is one
	outcomes  sync.Map
	blobErrs  sync.Map // op + ":" + kind → count
	cfg       idemhttp.Config
	keyRoutes string
}

func (e *blobEnv) outcome(o idemhttp.Outcome) int64 {
	v, _ := e.outcomes.Load(o)
	if v == nil {
		return 0
	}
	return v.(*atomic.Int64).Load()
}

func (e *blobEnv) blobErr(op, kind string) int64 {
	v, _ := e.blobErrs.Load(op + ":" + kind)
	if v == nil {
		return 0
	}
	return v.(*atomic.Int64).Load()
}

func errKind(err error) string {
	switch {
	case errors.Is(err, idem.ErrBlobNotFound):
		return "missing"
	case errors.Is(err, idem.ErrBlobCorrupt):
		return "corrupt"
	}
	return "unavailable"
}

func newBlobEnv(t testing.TB, backend string, cfg idemhttp.Config) *blobEnv {
	t.Helper()
	e := &blobEnv{app: newBigApp(), store: memstore.New(memstore.Options{})}
	if cfg.Blobs == nil {
		if backend == "file" {
			e.dir = filepath.Join(t.TempDir(), "blobs")
			cfg.Blobs = newDirBlobs(e.dir)
		} else {
			cfg.Blobs = newMemBlobs()
		}
	}
	e.blobs = cfg.Blobs
	if cfg.Wait == 0 {
		// The client can read a streamed body to its end before the
		// handler returns and the key completes: a retry right after
		// waits for the completion instead of getting 409.
		cfg.Wait = 10 * time.Second
	}
	cfg.Logger = quietLogger()
	cfg.Route = func(*http.Request) string { return "/report" }
	cfg.OnOutcome = func(_ *http.Request, o idemhttp.Outcome) {
		v, _ := e.outcomes.LoadOrStore(o, new(atomic.Int64))
		v.(*atomic.Int64).Add(1)
	}
	cfg.OnBlobError = func(_ *http.Request, op string, err error) {
		v, _ := e.blobErrs.LoadOrStore(op+":"+errKind(err), new(atomic.Int64))
		v.(*atomic.Int64).Add(1)
	}
	e.cfg = cfg
	e.srv = httptest.NewUnstartedServer(idemhttp.Middleware(e.store, cfg)(e.app))
	e.srv.Config.ErrorLog = quietStdLogger() // the handler that panics on purpose
	e.srv.Start()
	t.Cleanup(e.srv.Close)
	return e
}

// post sends the keyed request for a body of size bytes and returns the
// response with its body read into a digest.
type got struct {
	status int
	header http.Header
	sum    [32]byte
	n      int64
	err    error // reading the body
	body   []byte
}

func (e *blobEnv) post(t testing.TB, key string, size int64, query string) got {
	t.Helper()
	req, _ := http.NewRequest("POST", e.srv.URL+"/report?size="+strconv.FormatInt(size, 10)+query, strings.NewReader("{}"))
	req.Header.Set(idemhttp.HeaderKey, key)
	resp, err := e.srv.Client().Do(req)
	if err != nil {
		t.Fatalf("POST %s: %v", key, err)
	}
	defer resp.Body.Close()
	g := got{status: resp.StatusCode, header: resp.Header}
	if resp.StatusCode >= 300 {
		g.body, g.err = io.ReadAll(resp.Body)
		return g
	}
	h := sha256.New()
	g.n, g.err = io.Copy(h, resp.Body)
	h.Sum(g.sum[:0])
	return g
}

// record returns the completed record of clientKey, waiting for the
// completion (the client may have read the whole body before it).
func (e *blobEnv) record(t *testing.T, clientKey string) idem.Record {
	t.Helper()
	key, _ := idem.Scope{Method: "POST", Route: "/report"}.Key(clientKey)
	deadline := time.Now().Add(10 * time.Second)
	for {
		rec, ok, err := e.store.Get(context.Background(), key)
		if err != nil || !ok {
			t.Fatalf("record of %s: %v, %v", clientKey, ok, err)
		}
		if rec.State == idem.StateCompleted {
			return rec
		}
		if time.Now().After(deadline) {
			t.Fatalf("record of %s: still %s after 10s", clientKey, rec.State)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func (e *blobEnv) blobNames(t *testing.T) []string {
	t.Helper()
	var names []string
	if err := e.blobs.List(context.Background(), "", func(i idem.BlobInfo) error {
		names = append(names, i.Name)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return names
}

// checkBody fails unless g is a whole 2xx body of size bytes of
// stream(key).
func checkBody(t *testing.T, what string, g got, key string, size int64) {
	t.Helper()
	want, _ := digest(stream(key, size))
	if g.err != nil || g.n != size || g.sum != want {
		t.Errorf("%s: got %d bytes (error %v), digest match %v; want the %d bytes of the original", what, g.n, g.err, g.sum == want, size)
	}
}

// The sizes of the issue, byte for byte, on the file system and in
// memory: 1 MiB stays in the record (the default inline limit), a byte
// more and 10 MiB and 100 MiB go to the blob store.
func TestBlobReplayByteIdentical(t *testing.T) {
	sizes := []int64{1 * mib, 1*mib + 1, 10 * mib, 100 * mib}
	for _, backend := range []string{"file", "mem"} {
		t.Run(backend, func(t *testing.T) {
			e := newBlobEnv(t, backend, idemhttp.Config{})
			for _, size := range sizes {
				if backend == "mem" && size > 10*mib {
					continue // the file store carries the big one; memory holds it whole
				}
				key := fmt.Sprintf("%s-%d", backend, size)
				first := e.post(t, key, size, "")
				checkBody(t, key+" first", first, key, size)
				for i := range 2 {
					g := e.post(t, key, size, "")
					checkBody(t, fmt.Sprintf("%s replay %d", key, i), g, key, size)
					if g.header.Get(idemhttp.HeaderReplayed) != "true" || g.header.Get("Content-Type") != "text/csv" ||
						g.header.Get("Content-Disposition") != `attachment; filename="report.csv"` ||
						g.header.Get(idemhttp.HeaderBodyOmitted) != "" {
						t.Errorf("%s replay: header %v", key, g.header)
					}
				}
				if n := e.app.count(key); n != 1 {
					t.Errorf("%s: the handler ran %d times, want 1", key, n)
				}
				rec := e.record(t, key)
				switch blob := rec.Response.Blob; {
				case size <= idemhttp.DefaultMaxResponseSize && blob != nil:
					t.Errorf("%s: in a blob, want it in the record", key)
				case size > idemhttp.DefaultMaxResponseSize && (blob == nil || blob.Size != size):
					t.Errorf("%s: blob %+v, want one of %d bytes", key, blob, size)
				case size > idemhttp.DefaultMaxResponseSize && rec.Size > 300:
					t.Errorf("%s: a record of %d bytes, want at most 300", key, rec.Size)
				}
			}
			if got, want := e.outcome(idemhttp.OutcomeReplayed), int64(2*len(sizes)); backend == "file" && got != want {
				t.Errorf("replayed outcomes: %d, want %d", got, want)
			}
		})
	}
}

// Memory stays bounded: storing and replaying 100 MiB through the file
// store allocates less than half of it (about 30 MiB here, the client's,
// the server's and the store's buffers), where one copy of the body would
// be 100 MiB. The bound leaves room for the GC's timing on a loaded
// machine.
func TestBlobMemoryBounded(t *testing.T) {
	e := newBlobEnv(t, "file", idemhttp.Config{})
	e.post(t, "warm", 2*mib, "") // the pools and connections
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	const size = 100 * mib
	checkBody(t, "first", e.post(t, "big", size, ""), "big", size)
	checkBody(t, "replay", e.post(t, "big", size, ""), "big", size)
	runtime.ReadMemStats(&after)
	// The client's and the handler's own buffers count too; what must
	// not be there is a copy of the body.
	alloc := after.TotalAlloc - before.TotalAlloc
	t.Logf("storing and replaying %d MiB allocated %d MiB", size/mib, alloc/mib)
	if alloc > size/2 {
		t.Errorf("storing and replaying %d MiB allocated %d MiB, want less than half the body", size/mib, alloc/mib)
	}
}

// A blob deleted behind idem's back: 503 with its own type, counted, and
// the handler does not run again.
func TestBlobMissing(t *testing.T) {
	e := newBlobEnv(t, "file", idemhttp.Config{})
	e.post(t, "k", 3*mib, "")
	rec := e.record(t, "k")
	if err := e.blobs.Delete(context.Background(), rec.Response.Blob.Name); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		g := e.post(t, "k", 3*mib, "")
		if g.status != http.StatusServiceUnavailable || !bytes.Contains(g.body, []byte(idemhttp.ProblemStoredBodyUnavailable)) ||
			g.header.Get("Content-Type") != "application/problem+json" {
			t.Errorf("replay of a missing blob: got %d %s, want 503 %s", g.status, g.body, idemhttp.ProblemStoredBodyUnavailable)
		}
	}
	if n := e.app.count("k"); n != 1 {
		t.Errorf("the handler ran %d times, want 1", n)
	}
	if e.outcome(idemhttp.OutcomeReplayFailed) != 3 || e.blobErr(idemhttp.BlobOpRead, "missing") != 3 {
		t.Errorf("counted %d replay_failed and %d missing reads, want 3 and 3", e.outcome(idemhttp.OutcomeReplayFailed),
			e.blobErr(idemhttp.BlobOpRead, "missing"))
	}
}

// A corrupt blob is never replayed as a whole body: of the wrong size, it
// gets 503 before any header; of the right size with other bytes, the
// replay breaks off (the client sees an error, not a short 200); small
// enough to be checked before the header goes out, 503 again.
func TestBlobCorrupt(t *testing.T) {
	e := newBlobEnv(t, "file", idemhttp.Config{MaxResponseSize: 16 * kib})
	path := func(key string) string {
		return filepath.Join(e.dir, filepath.FromSlash(e.record(t, key).Response.Blob.Name))
	}

	// Truncated: 503 at once.
	e.post(t, "short", 5*mib, "")
	if err := os.Truncate(path("short"), 5*mib-1); err != nil {
		t.Fatal(err)
	}
	if g := e.post(t, "short", 5*mib, ""); g.status != http.StatusServiceUnavailable ||
		!bytes.Contains(g.body, []byte(idemhttp.ProblemStoredBodyUnavailable)) {
		t.Errorf("truncated blob: got %d %s, want 503", g.status, g.body)
	}

	// One byte flipped near the end of 5 MiB: the header went out with
	// the first chunk; the response is aborted before its last chunk.
	e.post(t, "flipped", 5*mib, "")
	flip(t, path("flipped"), 5*mib-10)
	g := e.post(t, "flipped", 5*mib, "")
	if g.status != http.StatusOK || g.err == nil || g.n >= 5*mib {
		t.Errorf("flipped byte: got %d, %d bytes, error %v; want 200 cut short with an error", g.status, g.n, g.err)
	}

	// One byte flipped in a 100 KiB body: found before the header.
	e.post(t, "small", 100*kib, "")
	flip(t, path("small"), 50*kib)
	if g := e.post(t, "small", 100*kib, ""); g.status != http.StatusServiceUnavailable {
		t.Errorf("flipped byte in a small blob: got %d, %d bytes; want 503", g.status, g.n)
	}
	for _, key := range []string{"short", "flipped", "small"} {
		if n := e.app.count(key); n != 1 {
			t.Errorf("%s: the handler ran %d times, want 1", key, n)
		}
	}
	if n := e.blobErr(idemhttp.BlobOpRead, "corrupt"); n != 3 {
		t.Errorf("counted %d corrupt reads, want 3", n)
	}
	if n := e.outcome(idemhttp.OutcomeReplayFailed); n != 3 {
		t.Errorf("counted %d replay_failed, want 3", n)
	}
}

func flip(t *testing.T, path string, at int64) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, 1)
	f.ReadAt(b, at)
	b[0] ^= 0xff
	if _, err := f.WriteAt(b, at); err != nil {
		t.Fatal(err)
	}
}

// switchable is a blob store that can be made to fail every call, as an
// S3 server that is down does, or to hang its writes.
type switchable struct {
	idem.BlobStore
	down  atomic.Bool
	hang  atomic.Bool
	check atomic.Int64 // Check calls
}

var errDown = errors.New("dial tcp 127.0.0.1:9: connect: connection refused")

func (s *switchable) Create(ctx context.Context, name string) (idem.BlobWriter, error) {
	if s.down.Load() {
		return nil, errDown
	}
	w, err := s.BlobStore.Create(ctx, name)
	if err != nil {
		return nil, err
	}
	return &switchWriter{BlobWriter: w, s: s, ctx: ctx}, nil
}

type switchWriter struct {
	idem.BlobWriter
	s   *switchable
	ctx context.Context
}

func (w *switchWriter) Write(p []byte) (int, error) {
	if w.s.hang.Load() {
		<-w.ctx.Done() // until the middleware gives up
		return 0, w.ctx.Err()
	}
	if w.s.down.Load() {
		return 0, errDown
	}
	return w.BlobWriter.Write(p)
}

func (s *switchable) Open(ctx context.Context, name string) (io.ReadCloser, int64, error) {
	if s.down.Load() {
		return nil, 0, errDown
	}
	return s.BlobStore.Open(ctx, name)
}

func (s *switchable) Check(ctx context.Context) error {
	s.check.Add(1)
	if s.down.Load() {
		return errDown
	}
	return s.BlobStore.Check(ctx)
}

// A blob store that is down: a replay gets 503 (and a retry after it
// comes back gets the body); a new request fails closed, the handler not
// run; with FailOpen the handler runs, a small response is stored as
// usual and a large one completes without its body.
func TestBlobStoreDown(t *testing.T) {
	sw := &switchable{BlobStore: newMemBlobs()}
	e := newBlobEnv(t, "", idemhttp.Config{Blobs: sw})
	e.post(t, "before", 2*mib, "")
	e.record(t, "before") // completed, its blob written
	sw.down.Store(true)

	g := e.post(t, "before", 2*mib, "")
	if g.status != http.StatusServiceUnavailable || g.header.Get("Retry-After") != "1" ||
		!bytes.Contains(g.body, []byte(idemhttp.ProblemStoredBodyUnavailable)) {
		t.Errorf("replay while down: got %d %q (Retry-After %q), want 503 with Retry-After", g.status, g.body, g.header.Get("Retry-After"))
	}
	time.Sleep(1100 * time.Millisecond) // the gate's last verdict goes stale: the next request probes
	for _, size := range []int64{10, 2 * mib} {
		key := fmt.Sprintf("new-%d", size)
		g := e.post(t, key, size, "")
		if g.status != http.StatusServiceUnavailable || !bytes.Contains(g.body, []byte(idemhttp.ProblemBlobStoreUnavailable)) {
			t.Errorf("new request while down: got %d %s, want 503 %s", g.status, g.body, idemhttp.ProblemBlobStoreUnavailable)
		}
		if n := e.app.count(key); n != 0 {
			t.Errorf("new request while down: the handler ran %d times, want 0", n)
		}
	}
	if sw.check.Load() == 0 {
		t.Error("the blob store was never probed")
	}

	sw.down.Store(false)
	time.Sleep(1100 * time.Millisecond)
	checkBody(t, "replay once back", e.post(t, "before", 2*mib, ""), "before", 2*mib)
	checkBody(t, "new request once back", e.post(t, "new-2097152", 2*mib, ""), "new-2097152", 2*mib)
	if n := e.app.count("before"); n != 1 {
		t.Errorf("the handler ran %d times, want 1", n)
	}

	// FailOpen.
	sw2 := &switchable{BlobStore: newMemBlobs()}
	sw2.down.Store(true)
	fo := newBlobEnv(t, "", idemhttp.Config{Blobs: sw2, FailOpen: true})
	for _, size := range []int64{1000, 2 * mib} {
		key := fmt.Sprintf("open-%d", size)
		checkBody(t, key+" first", fo.post(t, key, size, ""), key, size)
		g := fo.post(t, key, size, "")
		if n := fo.app.count(key); n != 1 {
			t.Errorf("%s: the handler ran %d times, want 1", key, n)
		}
		if size <= idemhttp.DefaultMaxResponseSize {
			checkBody(t, key+" replay", g, key, size)
			continue
		}
		if g.status != http.StatusInternalServerError || g.header.Get(idemhttp.HeaderBodyOmitted) != "true" ||
			!bytes.Contains(g.body, []byte(idemhttp.ProblemResponseNotKept)) || !bytes.Contains(g.body, []byte("blob store")) {
			t.Errorf("%s replay: got %d %q, %s %q; want 500 %s naming the blob store, %s: true", key, g.status, g.body,
				idemhttp.HeaderBodyOmitted, g.header.Get(idemhttp.HeaderBodyOmitted), idemhttp.ProblemResponseNotKept, idemhttp.HeaderBodyOmitted)
		}
	}
}

// The blob store fails, or hangs, in the middle of a body: the client
// still gets the whole response, and the key completes without its body
// (never run again); BlobTimeout ends the hang.
func TestBlobStoreFailsMidWrite(t *testing.T) {
	for _, mode := range []string{"down", "hang"} {
		t.Run(mode, func(t *testing.T) {
			sw := &switchable{BlobStore: newMemBlobs()}
			e := newBlobEnv(t, "", idemhttp.Config{Blobs: sw, BlobTimeout: 300 * time.Millisecond})
			e.app.half = make(chan struct{}, 1)
			e.app.hold = make(chan struct{})
			done := make(chan got, 1)
			go func() { done <- e.post(t, "k", 4*mib, "") }()
			<-e.app.half
			if mode == "down" {
				sw.down.Store(true)
			} else {
				sw.hang.Store(true)
			}
			close(e.app.hold)
			checkBody(t, "the first answer", <-done, "k", 4*mib)
			sw.down.Store(false)
			sw.hang.Store(false)
			g := e.post(t, "k", 4*mib, "")
			if g.status != http.StatusInternalServerError || g.header.Get(idemhttp.HeaderBodyOmitted) != "true" || e.app.count("k") != 1 {
				t.Errorf("replay: got %d, %s %q, %d runs; want the body omitted, 1 run", g.status, idemhttp.HeaderBodyOmitted,
					g.header.Get(idemhttp.HeaderBodyOmitted), e.app.count("k"))
			}
			if n := e.blobErr(idemhttp.BlobOpWrite, "unavailable"); n != 1 {
				t.Errorf("counted %d failed writes, want 1", n)
			}
			if names := e.blobNames(t); len(names) != 0 {
				t.Errorf("blobs left: %v", names)
			}
		})
	}
}

// A client that drops mid-way through a large body gets the whole body
// on its retry, and the work ran once.
func TestBlobClientDropsMidBody(t *testing.T) {
	e := newBlobEnv(t, "file", idemhttp.Config{})
	const size = 20 * mib
	req, _ := http.NewRequest("POST", e.srv.URL+"/report?size="+strconv.Itoa(size), strings.NewReader("{}"))
	req.Header.Set(idemhttp.HeaderKey, "drop")
	resp, err := e.srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.CopyN(io.Discard, resp.Body, 3*mib); err != nil {
		t.Fatal(err)
	}
	resp.Body.Close() // gone, 3 MiB in
	e.srv.CloseClientConnections()
	// The retry waits for the first to finish, then replays.
	checkBody(t, "the retry", e.post(t, "drop", size, ""), "drop", size)
	if n := e.app.count("drop"); n != 1 {
		t.Errorf("the handler ran %d times, want 1", n)
	}
	if rec := e.record(t, "drop"); rec.Response.Blob == nil || rec.Response.Blob.Size != size {
		t.Errorf("stored %+v, want the whole body in a blob", rec.Response)
	}
}

// What is not stored leaves no blob: a status released by ShouldStore, a
// handler that panics halfway, a lease lost before Complete.
func TestBlobNotStoredLeavesNoBlob(t *testing.T) {
	e := newBlobEnv(t, "file", idemhttp.Config{})
	g := e.post(t, "fail", 3*mib, "&status=500")
	if g.status != 500 {
		t.Fatalf("got %d, want 500", g.status)
	}
	e.post(t, "fail", 3*mib, "&status=500")
	if n := e.app.count("fail"); n != 2 {
		t.Errorf("a released key ran %d times, want 2", n)
	}

	e.app.panic.Store(true)
	func() {
		defer func() { recover() }()
		req, _ := http.NewRequest("POST", e.srv.URL+"/report?size="+strconv.Itoa(3*mib), strings.NewReader("{}"))
		req.Header.Set(idemhttp.HeaderKey, "panic")
		if resp, err := e.srv.Client().Do(req); err == nil {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
	}()
	e.app.panic.Store(false)
	if names := e.blobNames(t); len(names) != 0 {
		t.Errorf("blobs left: %v", names)
	}
	if files := tempFiles(t, e.dir); len(files) != 0 {
		t.Errorf("temporary files left: %v", files)
	}

	// The store loses the lease: Complete fails, the blob goes.
	ll := &leaseLosing{Store: memstore.New(memstore.Options{})}
	b := newDirBlobs(filepath.Join(t.TempDir(), "b"))
	app := newBigApp()
	srv := httptest.NewServer(idemhttp.Middleware(ll, idemhttp.Config{Blobs: b, Logger: quietLogger()})(app))
	defer srv.Close()
	req, _ := http.NewRequest("POST", srv.URL+"/report?size="+strconv.Itoa(3*mib), strings.NewReader("{}"))
	req.Header.Set(idemhttp.HeaderKey, "lost")
	resp, err := srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	// The client may have its whole answer before Complete failed and the
	// blob was deleted.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		var left []string
		b.List(context.Background(), "", func(i idem.BlobInfo) error { left = append(left, i.Name); return nil })
		if len(left) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Errorf("blobs left after a lost lease: %v", left)
			break
		}
	}
}

// leaseLosing answers every Complete with ErrLeaseLost.
type leaseLosing struct{ idem.Store }

func (l *leaseLosing) Complete(ctx context.Context, lease idem.Lease, resp *idem.Response, retention time.Duration) error {
	l.Store.Release(ctx, lease)
	return idem.ErrLeaseLost
}

func tempFiles(t *testing.T, dir string) []string {
	var out []string
	filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() && strings.HasSuffix(p, ".tmp") {
			out = append(out, p)
		}
		return nil
	})
	return out
}

// Many keys at once, each stored and replayed concurrently (under -race
// in the test command).
func TestBlobConcurrent(t *testing.T) {
	e := newBlobEnv(t, "file", idemhttp.Config{MaxResponseSize: 64 * kib})
	var wg sync.WaitGroup
	for i := range 16 {
		key := "c" + strconv.Itoa(i)
		size := int64(200*kib + i*37*kib)
		for range 3 {
			wg.Go(func() {
				g := e.post(t, key, size, "")
				checkBody(t, key, g, key, size)
			})
		}
	}
	wg.Wait()
	for i := range 16 {
		if n := e.app.count("c" + strconv.Itoa(i)); n != 1 {
			t.Errorf("c%d: the handler ran %d times, want 1", i, n)
		}
	}
}

// A replay whose middleware has no blob store (a proxy restarted without
// --blob) answers 503, and does not run the work again.
func TestBlobReplayWithoutBlobStore(t *testing.T) {
	e := newBlobEnv(t, "mem", idemhttp.Config{})
	e.post(t, "k", 2*mib, "")
	e.record(t, "k")
	srv := httptest.NewServer(idemhttp.Middleware(e.store, idemhttp.Config{Logger: quietLogger(),
		Route: func(*http.Request) string { return "/report" }})(e.app))
	defer srv.Close()
	req, _ := http.NewRequest("POST", srv.URL+"/report?size="+strconv.Itoa(2*mib), strings.NewReader("{}"))
	req.Header.Set(idemhttp.HeaderKey, "k")
	resp, err := srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 503 || !bytes.Contains(body, []byte(idemhttp.ProblemStoredBodyUnavailable)) || e.app.count("k") != 1 {
		t.Errorf("got %d %s after %d runs; want 503 and 1 run", resp.StatusCode, body, e.app.count("k"))
	}
}

// BenchmarkBlobReplay replays a 10 MiB body from a directory through the
// middleware to a client on loopback (compare BenchmarkProxyBlobReplay in
// cmd/idem, through idem proxy).
func BenchmarkBlobReplay(b *testing.B) {
	e := newBlobEnv(b, "file", idemhttp.Config{})
	const size = 10 * mib
	e.post(b, "k", size, "")
	e.post(b, "k", size, "")
	b.SetBytes(size)
	b.ReportAllocs()
	for b.Loop() {
		if g := e.post(b, "k", size, ""); g.n != size || g.err != nil {
			b.Fatalf("got %d bytes, %v", g.n, g.err)
		}
	}
}
