package main

// idem proxy with --blob: responses too large for the record stream to a
// blob store (S3 on a private versitygw, or a directory) and replay from
// it, byte for byte, on Redis and PostgreSQL; the proxy's memory stays
// bounded; crashes leave nothing completed that points to a missing blob,
// and idem gc removes what they leave behind.

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/s3"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/blobstore"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/internal/proctest"
	"github.com/idemkit/idem/internal/s3test"
)

const (
	kib = 1 << 10
	mib = 1 << 20
)

// bigBody is the deterministic body of n bytes for key: the upstream
// streams it without holding it, and a test checks a replay by digest.
func bigBody(key string, n int64) io.Reader {
	seed := sha256.Sum256([]byte(key))
	return io.LimitReader(rand.NewChaCha8(seed), n)
}

func bodyDigest(key string, n int64) [32]byte {
	h := sha256.New()
	io.Copy(h, bigBody(key, n))
	var sum [32]byte
	h.Sum(sum[:0])
	return sum
}

// bigUpstream answers POST /export?size=N with bigBody(key, N), in 32 KiB
// writes, and counts its runs per Idempotency-Key. stallAt (when set)
// holds each request after that many bytes until release is closed, and
// says so on stalled; beforeEnd (when set) runs before the last piece.
type bigUpstream struct {
	*httptest.Server
	mu        sync.Mutex
	runs      map[string]int
	stallAt   int64
	stalled   chan string
	release   chan struct{}
	beforeEnd func(key string)
}

func newBigUpstream(t *testing.T) *bigUpstream {
	u := &bigUpstream{runs: map[string]int{}, stalled: make(chan string, 16), release: make(chan struct{})}
	u.Server = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get(idemhttp.HeaderKey)
		io.Copy(io.Discard, r.Body)
		u.mu.Lock()
		u.runs[key]++
		stallAt, beforeEnd := u.stallAt, u.beforeEnd
		u.mu.Unlock()
		size, _ := strconv.ParseInt(r.URL.Query().Get("size"), 10, 64)
		w.Header().Set("Content-Type", "application/octet-stream")
		w.Header().Set("Content-Length", strconv.FormatInt(size, 10))
		src := bigBody(key, size)
		buf := make([]byte, 32*kib)
		var sent int64
		for sent < size {
			n := int64(len(buf))
			if stallAt > 0 && sent < stallAt && sent+n > stallAt {
				n = stallAt - sent
			}
			if size-sent <= n && beforeEnd != nil {
				beforeEnd(key)
			}
			n = min(n, size-sent)
			io.ReadFull(src, buf[:n])
			if _, err := w.Write(buf[:n]); err != nil {
				return
			}
			sent += n
			if stallAt > 0 && sent == stallAt {
				http.NewResponseController(w).Flush()
				u.stalled <- key
				<-u.release
			}
		}
	}))
	u.Config.ErrorLog = nil
	u.Start()
	t.Cleanup(u.Close)
	return u
}

func (u *bigUpstream) runsOf(key string) int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.runs[key]
}

// fetched is a response read to its end into a digest.
type fetched struct {
	status int
	header http.Header
	sum    [32]byte
	n      int64
	err    error
	body   []byte // for answers other than 2xx
}

var bigClient = &http.Client{Timeout: 2 * time.Minute, Transport: &http.Transport{MaxIdleConnsPerHost: 16}}

func fetch(t *testing.T, base, key string, size int64) fetched {
	t.Helper()
	req, _ := http.NewRequest("POST", base+"/export?size="+strconv.FormatInt(size, 10), strings.NewReader(`{"report":"q3"}`))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(idemhttp.HeaderKey, key)
	resp, err := bigClient.Do(req)
	if err != nil {
		t.Fatalf("POST %s: %v", key, err)
	}
	defer resp.Body.Close()
	f := fetched{status: resp.StatusCode, header: resp.Header}
	if resp.StatusCode >= 300 {
		f.body, f.err = io.ReadAll(resp.Body)
		return f
	}
	h := sha256.New()
	f.n, f.err = io.Copy(h, resp.Body)
	h.Sum(f.sum[:0])
	return f
}

func wantWhole(t *testing.T, what string, f fetched, key string, size int64) {
	t.Helper()
	if f.status != http.StatusOK || f.err != nil || f.n != size || f.sum != bodyDigest(key, size) {
		t.Fatalf("%s: got %d, %d bytes (error %v), digest match %v; want 200 and the %d bytes of the original %s",
			what, f.status, f.n, f.err, f.sum == bodyDigest(key, size), size, f.body)
	}
}

func wantProblem(t *testing.T, what string, f fetched, status int, typ string) {
	t.Helper()
	var p idemhttp.Problem
	if f.status != status || json.Unmarshal(f.body, &p) != nil || p.Type != typ {
		t.Fatalf("%s: got %d %s, want %d %s", what, f.status, f.body, status, typ)
	}
}

// blobProxy is an idem proxy (built without -race: it is the system under
// test, in its own process) and its admin address.
type blobProxy struct {
	*proctest.Proxy
	admin string
}

func startBlobProxy(t testing.TB, args ...string) *blobProxy {
	t.Helper()
	p := &blobProxy{Proxy: proctest.StartProxy(t, append([]string{"--admin-listen", "127.0.0.1:0", "--wait", "30s"}, args...)...)}
	for line := range strings.Lines(p.LogText()) {
		var rec struct{ Msg, Admin string }
		if json.Unmarshal([]byte(line), &rec) == nil && rec.Msg == "idem proxy listening" {
			p.admin = rec.Admin
		}
	}
	if p.admin == "" {
		t.Fatalf("no admin address in the log:\n%s", p.LogText())
	}
	return p
}

func (p *blobProxy) base() string { return "http://" + p.Addr }

// metric reads one series of the proxy's /metrics.
func (p *blobProxy) metric(t *testing.T, series string) float64 {
	t.Helper()
	resp, err := bigClient.Get("http://" + p.admin + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	text, _ := io.ReadAll(resp.Body)
	for line := range strings.Lines(string(text)) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), series+" "); ok {
			f, _ := strconv.ParseFloat(v, 64)
			return f
		}
	}
	t.Fatalf("/metrics: no series %s", series)
	return 0
}

// peakRSS is the process's VmHWM (peak resident set) in bytes.
func peakRSS(t testing.TB, pid int) int64 {
	t.Helper()
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.Lines(string(b)) {
		if rest, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return kb << 10
		}
	}
	t.Fatal("no VmHWM in /proc/PID/status")
	return 0
}

// blobBackend is a blob store for the proxy: its --blob URL and a way to
// look inside from the test.
type blobBackend struct {
	name string
	url  string
	open *blobstore.Bucket
	s3   *s3test.Server
	dir  string // file: the directory
}

func newBlobBackend(t testing.TB, kind string) *blobBackend {
	t.Helper()
	b := &blobBackend{name: kind}
	switch kind {
	case "file":
		b.dir = filepath.Join(t.TempDir(), "blobs")
		b.url = "file://" + b.dir
	case "s3":
		srv, err := s3test.Start()
		if err != nil {
			t.Fatal(err) // not a skip: scripts/test.sh installs versitygw
		}
		t.Cleanup(srv.Stop)
		bucket, err := srv.Bucket()
		if err != nil {
			t.Fatal(err)
		}
		b.s3, b.url = srv, srv.URL(bucket)
	}
	bs, err := blobstore.Open(context.Background(), b.url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { bs.Close() })
	b.open = bs
	return b
}

// names lists the blobs under idem/ (temporary files of interrupted
// writes included).
func (b *blobBackend) names(t *testing.T) []string {
	t.Helper()
	var out []string
	if err := b.open.List(context.Background(), idem.BlobPrefix, func(i idem.BlobInfo) error {
		out = append(out, i.Name)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	slices.Sort(out)
	return out
}

// uploads counts the incomplete multipart uploads of an S3 backend.
func (b *blobBackend) uploads(t *testing.T) int {
	t.Helper()
	if b.s3 == nil {
		return 0
	}
	u, _ := url.Parse(b.url)
	out, err := b.s3.Client().ListMultipartUploads(context.Background(), &s3.ListMultipartUploadsInput{Bucket: aws.String(u.Host)})
	if err != nil {
		t.Fatal(err)
	}
	return len(out.Uploads)
}

// recordOf reads the record of clientKey on POST /export through the
// store at storeURL.
func recordOf(t *testing.T, storeURL, clientKey string) (idem.Record, bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, closeStore, err := openStore(ctx, storeURL, "")
	if err != nil {
		t.Fatal(err)
	}
	defer closeStore()
	key, _ := idem.Scope{Method: "POST", Route: "/export"}.Key(clientKey)
	rec, ok, err := s.Get(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	return rec, ok
}

// completedRecord waits (bounded) for the record of clientKey to be
// completed and returns it: a client reads a streamed body to its end
// before the proxy completes the key.
func completedRecord(t *testing.T, storeURL, clientKey string) idem.Record {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		rec, ok := recordOf(t, storeURL, clientKey)
		if ok && rec.State == idem.StateCompleted {
			return rec
		}
		if time.Now().After(deadline) {
			t.Fatalf("record of %s: %+v after 10s, want it completed", clientKey, rec)
		}
	}
}

func storedKey(clientKey string) idem.Key {
	k, _ := idem.Scope{Method: "POST", Route: "/export"}.Key(clientKey)
	return k
}

// pgURL creates a private PostgreSQL database and returns its URL.
func pgURL(t *testing.T) string {
	pool := pgtest.New(t)
	u, err := url.Parse(pgtest.URL())
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/" + pool.Config().ConnConfig.Database
	return u.String()
}

// Byte-identical replays of 1, 10 and 100 MiB through idem proxy, on
// Redis with the file system and on PostgreSQL with S3 (and the two other
// pairings for 1 and 10 MiB), with the proxy's peak RSS measured across
// the 100 MiB store and replay. The Redis record of a 10 MiB response
// stays under 300 bytes.
func TestProxyBlobReplays(t *testing.T) {
	redis := proxyRedis(t)
	redisURL := "redis://" + redis.Addr()
	pg := pgURL(t)
	for _, tc := range []struct {
		store, blob string
		big         bool // 100 MiB too, with the RSS bound
	}{
		{"redis", "file", true},
		{"postgres", "s3", true},
		{"redis", "s3", false},
		{"postgres", "file", false},
	} {
		t.Run(tc.store+"-"+tc.blob, func(t *testing.T) {
			storeURL := map[string]string{"redis": redisURL, "postgres": pg}[tc.store]
			bb := newBlobBackend(t, tc.blob)
			up := newBigUpstream(t)
			p := startBlobProxy(t, "--upstream", up.URL, "--store", storeURL, "--blob", bb.url)
			sizes := []int64{1 * mib, 10 * mib}
			if tc.big {
				sizes = append(sizes, 100*mib)
			}
			prefix := tc.store + "-" + tc.blob + "-"
			wantWhole(t, "warm-up", fetch(t, p.base(), prefix+"warm", 2*mib), prefix+"warm", 2*mib)
			wantWhole(t, "warm-up replay", fetch(t, p.base(), prefix+"warm", 2*mib), prefix+"warm", 2*mib)
			rssBefore := peakRSS(t, p.Cmd.Process.Pid)
			for _, size := range sizes {
				key := prefix + strconv.FormatInt(size>>20, 10) + "MiB"
				start := time.Now()
				wantWhole(t, key+" first", fetch(t, p.base(), key, size), key, size)
				stored := time.Since(start)
				start = time.Now()
				for i := range 2 {
					f := fetch(t, p.base(), key, size)
					wantWhole(t, fmt.Sprintf("%s replay %d", key, i), f, key, size)
					if f.header.Get(idemhttp.HeaderReplayed) != "true" || f.header.Get("Content-Length") != strconv.FormatInt(size, 10) {
						t.Errorf("%s replay: header %v, want Idempotent-Replayed and Content-Length %d", key, f.header, size)
					}
				}
				t.Logf("%s: stored in %v, 2 replays in %v", key, stored.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
				if n := up.runsOf(key); n != 1 {
					t.Errorf("%s: the upstream ran %d times, want 1", key, n)
				}
				rec, ok := recordOf(t, storeURL, key)
				switch {
				case !ok || rec.State != idem.StateCompleted:
					t.Errorf("%s: record %+v, want completed", key, rec)
				case size <= idemhttp.DefaultMaxResponseSize && rec.Response.Blob != nil:
					t.Errorf("%s: in the blob store, want it in the record (the inline limit is 1 MiB)", key)
				case size > idemhttp.DefaultMaxResponseSize && (rec.Response.Blob == nil || rec.Response.Blob.Size != size):
					t.Errorf("%s: stored %+v, want a blob of %d bytes", key, rec.Response, size)
				}
				if tc.store == "redis" && size == 10*mib {
					usage, err := redis.Do("MEMORY", "USAGE", "idem:{"+storedKey(key).String()+"}")
					n, _ := strconv.Atoi(usage)
					t.Logf("%s: Redis MEMORY USAGE %d bytes, record %d bytes", key, n, rec.Size)
					if err != nil || n == 0 || n > 300 {
						t.Errorf("%s: MEMORY USAGE %q (%v), want at most 300 bytes", key, usage, err)
					}
				}
			}
			if tc.big {
				rss := peakRSS(t, p.Cmd.Process.Pid)
				t.Logf("proxy peak RSS: %.1f MiB after warm-up, %.1f MiB after storing and replaying 100 MiB (%+.1f MiB)",
					float64(rssBefore)/mib, float64(rss)/mib, float64(rss-rssBefore)/mib)
				if rss > 100*mib || rss-rssBefore > 48*mib {
					t.Errorf("proxy peak RSS %.1f MiB (%+.1f MiB over the 100 MiB store and replay), want under 100 MiB and at most 48 MiB more",
						float64(rss)/mib, float64(rss-rssBefore)/mib)
				}
			}
			if got := len(bb.names(t)); got != len(sizes) { // the warm-up's and every size's but the inline 1 MiB
				t.Errorf("%d blobs in the store, want %d", got, len(sizes))
			}
		})
	}
}

// A blob deleted behind idem's back: 503 with its own problem type, the
// upstream not run again, counted in /metrics. idem inspect shows where
// the body lived and that it is missing; idem purge deletes the record and
// its blob.
func TestProxyBlobMissingInspectPurge(t *testing.T) {
	redis := proxyRedis(t)
	storeURL := "redis://" + redis.Addr()
	bb := newBlobBackend(t, "file")
	up := newBigUpstream(t)
	p := startBlobProxy(t, "--upstream", up.URL, "--store", storeURL, "--blob", bb.url)

	wantWhole(t, "first", fetch(t, p.base(), "gone", 3*mib), "gone", 3*mib)
	wantWhole(t, "kept", fetch(t, p.base(), "kept", 3*mib), "kept", 3*mib)
	wantWhole(t, "replay", fetch(t, p.base(), "kept", 3*mib), "kept", 3*mib)
	wantWhole(t, "replay", fetch(t, p.base(), "gone", 3*mib), "gone", 3*mib) // completed now
	rec, _ := recordOf(t, storeURL, "gone")

	code, out := runIdemOut(t, "inspect", "--store", storeURL, "--stored-key", storedKey("gone").String(), "--blob", bb.url)
	if code != 0 || !strings.Contains(out, "in the blob store: "+rec.Response.Blob.Name) || !strings.Contains(out, "present, 3145728 bytes") {
		t.Errorf("inspect: exit %d\n%s", code, out)
	}
	if err := bb.open.Delete(context.Background(), rec.Response.Blob.Name); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		wantProblem(t, "replay of a deleted blob", fetch(t, p.base(), "gone", 3*mib), http.StatusServiceUnavailable,
			idemhttp.ProblemStoredBodyUnavailable)
	}
	if n := up.runsOf("gone"); n != 1 {
		t.Errorf("the upstream ran %d times, want 1", n)
	}
	if got := p.metric(t, `idem_blob_errors_total{op="read",reason="missing"}`); got != 2 {
		t.Errorf("idem_blob_errors_total{op=read,reason=missing}: %v, want 2", got)
	}
	if got := p.metric(t, `idem_requests_total{outcome="replay_failed"}`); got != 2 {
		t.Errorf("idem_requests_total{outcome=replay_failed}: %v, want 2", got)
	}
	if !strings.Contains(p.LogText(), `"outcome":"replay_failed"`) {
		t.Error(`no request logged with "outcome":"replay_failed"`)
	}
	code, out = runIdemOut(t, "inspect", "--store", storeURL, "--stored-key", storedKey("gone").String(), "--blob", bb.url, "--json")
	var js struct {
		Response struct {
			Blob struct {
				Name  string
				Found struct{ Present bool }
			}
		}
	}
	if code != 0 || json.Unmarshal([]byte(out), &js) != nil || js.Response.Blob.Name != rec.Response.Blob.Name || js.Response.Blob.Found.Present {
		t.Errorf("inspect --json of the missing blob: exit %d\n%s", code, out)
	}

	// purge deletes the record, then its blob.
	kept, _ := recordOf(t, storeURL, "kept")
	code, out = runIdemOut(t, "purge", "--store", storeURL, "--stored-key", storedKey("kept").String(), "--blob", bb.url, "--yes")
	if code != 0 || !strings.Contains(out, "deleted its blob "+kept.Response.Blob.Name) {
		t.Errorf("purge: exit %d\n%s", code, out)
	}
	if names := bb.names(t); slices.Contains(names, kept.Response.Blob.Name) {
		t.Errorf("the purged record's blob is still there: %v", names)
	}
	wantWhole(t, "after the purge, the work runs again", fetch(t, p.base(), "kept", 3*mib), "kept", 3*mib)
	if n := up.runsOf("kept"); n != 2 {
		t.Errorf("after the purge the upstream ran %d times, want 2", n)
	}
}

// runIdemOut runs the idem binary (without -race) and returns its exit
// status and stdout plus stderr.
func runIdemOut(t *testing.T, args ...string) (int, string) {
	t.Helper()
	bin, err := proctest.BuildIdem()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Env = proxyEnv(nil)
	out, _ := cmd.CombinedOutput()
	return cmd.ProcessState.ExitCode(), string(out)
}

// The blob server down: a replay gets 503 (with Retry-After), a new keyed
// request fails closed (503, the upstream not reached), /readyz says so;
// once it is back, the replay is whole. With --fail-open, a new request
// runs, and a body too large for the record completes without it.
func TestProxyBlobServerDown(t *testing.T) {
	redis := proxyRedis(t)
	storeURL := "redis://" + redis.Addr()
	bb := newBlobBackend(t, "s3")
	up := newBigUpstream(t)
	p := startBlobProxy(t, "--upstream", up.URL, "--store", storeURL, "--blob", bb.url, "--blob-timeout", "2s")
	open := startBlobProxy(t, "--upstream", up.URL, "--store", storeURL, "--blob", bb.url, "--blob-timeout", "2s", "--fail-open")

	wantWhole(t, "first", fetch(t, p.base(), "before", 3*mib), "before", 3*mib)
	wantWhole(t, "replay", fetch(t, p.base(), "before", 3*mib), "before", 3*mib)

	// A server that hangs (SIGSTOP): the replay gives up after
	// --blob-timeout and answers 503.
	if err := bb.s3.Pause(); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	f := fetch(t, p.base(), "before", 3*mib)
	bb.s3.Resume()
	wantProblem(t, "replay while the blob server hangs", f, http.StatusServiceUnavailable, idemhttp.ProblemStoredBodyUnavailable)
	if d := time.Since(start); d > 10*time.Second {
		t.Errorf("the replay took %v against a hung blob server, want about --blob-timeout (2s)", d)
	}

	bb.s3.Kill()
	f = fetch(t, p.base(), "before", 3*mib)
	wantProblem(t, "replay while the blob server is down", f, http.StatusServiceUnavailable, idemhttp.ProblemStoredBodyUnavailable)
	if f.header.Get("Retry-After") == "" {
		t.Error("503 without Retry-After")
	}
	time.Sleep(1100 * time.Millisecond) // the proxy probes again
	wantProblem(t, "new request while the blob server is down", fetch(t, p.base(), "new", 10), http.StatusServiceUnavailable,
		idemhttp.ProblemBlobStoreUnavailable)
	if n := up.runsOf("new"); n != 0 {
		t.Errorf("the upstream ran %d times for a new request while the blob server was down, want 0", n)
	}
	resp, err := bigClient.Get("http://" + p.admin + "/readyz")
	if err != nil || resp.StatusCode != http.StatusServiceUnavailable {
		t.Errorf("/readyz while the blob server is down: %v %v, want 503", resp, err)
	}
	if resp != nil {
		resp.Body.Close()
	}
	if p.metric(t, `idem_blob_errors_total{op="check",reason="unavailable"}`) < 1 ||
		p.metric(t, `idem_blob_errors_total{op="read",reason="unavailable"}`) != 2 {
		t.Error("the blob store's failures are not counted")
	}

	// --fail-open: the request runs; a small answer is stored as usual, a
	// large one completes without its body.
	wantWhole(t, "fail-open, small", fetch(t, open.base(), "open-small", 100*kib), "open-small", 100*kib)
	wantWhole(t, "fail-open, small, replay", fetch(t, open.base(), "open-small", 100*kib), "open-small", 100*kib)
	wantWhole(t, "fail-open, large", fetch(t, open.base(), "open-large", 3*mib), "open-large", 3*mib)
	f = fetch(t, open.base(), "open-large", 3*mib)
	wantProblem(t, "fail-open, large, replay", f, http.StatusInternalServerError, idemhttp.ProblemResponseNotKept)
	if f.header.Get(idemhttp.HeaderBodyOmitted) != "true" || f.header.Get(idemhttp.HeaderOriginalStatus) != "200" {
		t.Errorf("fail-open, large, replay: got %v, want %s and %s: 200", f.header, idemhttp.HeaderBodyOmitted, idemhttp.HeaderOriginalStatus)
	}
	if n := open.metric(t, "idem_responses_not_kept_total"); n != 1 {
		t.Errorf("idem_responses_not_kept_total: got %v, want 1", n)
	}
	if up.runsOf("open-small") != 1 || up.runsOf("open-large") != 1 {
		t.Errorf("fail-open: the upstream ran %d and %d times, want 1 and 1", up.runsOf("open-small"), up.runsOf("open-large"))
	}

	if err := bb.s3.Restart(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(1100 * time.Millisecond)
	wantWhole(t, "replay once the blob server is back", fetch(t, p.base(), "before", 3*mib), "before", 3*mib)
	wantWhole(t, "new request once back", fetch(t, p.base(), "new", 3*mib), "new", 3*mib)
	if n := up.runsOf("before"); n != 1 {
		t.Errorf("the upstream ran %d times, want 1", n)
	}
}

// A client that drops mid-way through a large body: the proxy reads the
// upstream's response to its end into the blob store, and the retry gets
// all of it; the upstream ran once.
func TestProxyBlobClientDrops(t *testing.T) {
	redis := proxyRedis(t)
	bb := newBlobBackend(t, "s3")
	up := newBigUpstream(t)
	p := startBlobProxy(t, "--upstream", up.URL, "--store", "redis://"+redis.Addr(), "--blob", bb.url)
	const size = 40 * mib
	req, _ := http.NewRequest("POST", p.base()+"/export?size="+strconv.Itoa(size), strings.NewReader(`{"report":"q3"}`))
	req.Header.Set("Content-Type", "application/json") // as fetch sends it: the same fingerprint
	req.Header.Set(idemhttp.HeaderKey, "drop")
	resp, err := bigClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.CopyN(io.Discard, resp.Body, 5*mib); err != nil {
		t.Fatal(err)
	}
	resp.Body.Close() // the client gives up 5 MiB in
	wantWhole(t, "the retry", fetch(t, p.base(), "drop", size), "drop", size)
	if n := up.runsOf("drop"); n != 1 {
		t.Errorf("the upstream ran %d times, want 1", n)
	}
}

// SIGKILL during the blob write: the record stays in flight (nothing
// completed), the retry after the lease runs the work again (at least
// once, as any crash before Complete) and completes with a whole blob,
// and idem gc removes what the killed write left: a temporary file, or an
// incomplete multipart upload on S3.
func TestProxyBlobKilledDuringWrite(t *testing.T) {
	for _, kind := range []string{"file", "s3"} {
		t.Run(kind, func(t *testing.T) {
			redis := proxyRedis(t)
			storeURL := "redis://" + redis.Addr()
			bb := newBlobBackend(t, kind)
			up := newBigUpstream(t)
			up.stallAt = 12 * mib // past two 5 MiB parts on S3
			args := []string{"--upstream", up.URL, "--store", storeURL, "--blob", bb.url, "--lease", "1s"}
			p := startBlobProxy(t, args...)
			const size = 20 * mib
			go func() {
				req, _ := http.NewRequest("POST", p.base()+"/export?size="+strconv.Itoa(size), strings.NewReader(`{"report":"q3"}`))
				req.Header.Set("Content-Type", "application/json")
				req.Header.Set(idemhttp.HeaderKey, "crash")
				if resp, err := bigClient.Do(req); err == nil {
					io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
				}
			}()
			<-up.stalled
			awaitPartial(t, bb)
			killProxy(t, p)
			up.mu.Lock()
			up.stallAt = 0
			up.mu.Unlock()
			close(up.release)

			if rec, ok := recordOf(t, storeURL, "crash"); ok && rec.State == idem.StateCompleted {
				t.Fatalf("after a SIGKILL during the blob write: record %+v, want it not completed", rec)
			}
			p2 := startBlobProxy(t, args...)
			f := untilNot409(t, p2, "crash", size)
			wantWhole(t, "the retry after the lease", f, "crash", size)
			wantWhole(t, "its replay", fetch(t, p2.base(), "crash", size), "crash", size)
			if n := up.runsOf("crash"); n != 2 {
				t.Errorf("the upstream ran %d times, want 2 (the killed attempt and the retry)", n)
			}
			rec, _ := recordOf(t, storeURL, "crash")
			code, out := runIdemOut(t, "gc", "--store", storeURL, "--blob", bb.url, "--min-age", "0")
			if code != 0 {
				t.Fatalf("idem gc: exit %d\n%s", code, out)
			}
			t.Logf("idem gc: %s", strings.TrimSpace(out))
			if names := bb.names(t); !slices.Equal(names, []string{rec.Response.Blob.Name}) {
				t.Errorf("after idem gc: %v, want only the completed record's blob %s", names, rec.Response.Blob.Name)
			}
			if n := bb.uploads(t); n != 0 {
				t.Errorf("after idem gc: %d incomplete uploads, want 0", n)
			}
			wantWhole(t, "the replay after idem gc", fetch(t, p2.base(), "crash", size), "crash", size)
		})
	}
}

// killProxy sends SIGKILL to the proxy and waits until its port refuses
// connections.
func killProxy(t *testing.T, p *blobProxy) {
	t.Helper()
	p.Cmd.Process.Kill()
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		c, err := net.DialTimeout("tcp", p.Addr, time.Second)
		if err != nil {
			return
		}
		c.Close()
	}
	t.Fatal("the killed proxy still accepts connections after 10s")
}

// awaitPartial waits until the interrupted write shows in the blob store:
// a temporary file with bytes in it, or a multipart upload.
func awaitPartial(t *testing.T, bb *blobBackend) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if bb.s3 != nil && bb.uploads(t) > 0 {
			return
		}
		if bb.dir != "" && slices.ContainsFunc(bb.names(t), func(n string) bool { return strings.HasSuffix(n, ".tmp") }) {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatal("no partial write in the blob store after 10s")
}

// untilNot409 repeats the request while the key is in flight.
func untilNot409(t *testing.T, p *blobProxy, key string, size int64) fetched {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		f := fetch(t, p.base(), key, size)
		if f.status != http.StatusConflict || time.Now().After(deadline) {
			return f
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// SIGKILL between the blob write and Complete: Redis refuses writes for a
// while (CLIENT PAUSE WRITE) just before the upstream's last bytes, so the
// proxy writes the whole blob and then waits on Complete; it is killed
// there. Nothing completed points to the blob; the retry after the lease
// runs the work again and completes with a blob of its own; idem gc
// deletes the first (an orphan) and keeps the second.
func TestProxyBlobKilledBeforeComplete(t *testing.T) {
	for _, kind := range []string{"file", "s3"} {
		t.Run(kind, func(t *testing.T) {
			redis := proxyRedis(t)
			storeURL := "redis://" + redis.Addr()
			bb := newBlobBackend(t, kind)
			up := newBigUpstream(t)
			var pauseOnce sync.Once
			up.beforeEnd = func(string) {
				pauseOnce.Do(func() {
					if _, err := redis.Do("CLIENT", "PAUSE", "20000", "WRITE"); err != nil {
						t.Error(err)
					}
				})
			}
			args := []string{"--upstream", up.URL, "--store", storeURL, "--blob", bb.url, "--lease", "1s"}
			p := startBlobProxy(t, args...)
			const size = 12 * mib
			first := fetch(t, p.base(), "crash", size) // the client has it all before Complete
			wantWhole(t, "the first answer", first, "crash", size)
			var written string
			for deadline := time.Now().Add(10 * time.Second); written == "" && time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
				for _, n := range bb.names(t) {
					if _, ok := idem.ParseBlobName(n); ok {
						written = n
					}
				}
			}
			if written == "" {
				t.Fatal("the blob was not written within 10s")
			}
			killProxy(t, p)
			if _, err := redis.Do("CLIENT", "UNPAUSE"); err != nil {
				t.Fatal(err)
			}
			up.mu.Lock()
			up.beforeEnd = nil
			up.mu.Unlock()
			if rec, ok := recordOf(t, storeURL, "crash"); ok && rec.State == idem.StateCompleted {
				t.Fatalf("killed before Complete: record completed (%+v), want in flight", rec)
			}

			p2 := startBlobProxy(t, args...)
			wantWhole(t, "the retry after the lease", untilNot409(t, p2, "crash", size), "crash", size)
			rec := completedRecord(t, storeURL, "crash") // the client may have it all before Complete
			if rec.Response == nil || rec.Response.Blob == nil || rec.Response.Blob.Name == written {
				t.Fatalf("after the retry: %+v, want a blob of its own", rec.Response)
			}
			if n := up.runsOf("crash"); n != 2 {
				t.Errorf("the upstream ran %d times, want 2", n)
			}
			if names := bb.names(t); len(names) != 2 {
				t.Errorf("before idem gc: %v, want the orphan and the record's blob", names)
			}
			code, out := runIdemOut(t, "gc", "--store", storeURL, "--blob", bb.url, "--min-age", "0", "--json")
			var res blobstore.SweepResult
			if code != 0 || json.Unmarshal([]byte(out), &res) != nil || res.Orphans != 1 || res.Kept != 1 {
				t.Errorf("idem gc: exit %d, %+v\n%s", code, res, out)
			}
			if names := bb.names(t); !slices.Equal(names, []string{rec.Response.Blob.Name}) {
				t.Errorf("after idem gc: %v, want only %s", names, rec.Response.Blob.Name)
			}
			wantWhole(t, "the replay after idem gc", fetch(t, p2.base(), "crash", size), "crash", size)
		})
	}
}

// The proxy's own sweep (--blob-sweep) removes the blobs of records that
// expired, and leaves the others.
func TestProxyBlobSweep(t *testing.T) {
	redis := proxyRedis(t)
	storeURL := "redis://" + redis.Addr()
	bb := newBlobBackend(t, "file")
	up := newBigUpstream(t)
	cfg := filepath.Join(t.TempDir(), "routes.yaml")
	// Short retention on one route, and a small inline limit there.
	if err := os.WriteFile(cfg, []byte("routes:\n  - match: \"POST /short/\"\n    retention: 2s\n    max_response: 64KiB\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	p := startBlobProxy(t, "--upstream", up.URL, "--store", storeURL, "--blob", bb.url, "--config", cfg,
		"--blob-sweep", "300ms", "--blob-sweep-min-age", "0")
	wantWhole(t, "long", fetch(t, p.base(), "long", 2*mib), "long", 2*mib)
	req, _ := http.NewRequest("POST", p.base()+"/short/export?size=100000", strings.NewReader("{}"))
	req.Header.Set(idemhttp.HeaderKey, "short")
	resp, err := bigClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	deadline := time.Now().Add(15 * time.Second)
	for {
		names := bb.names(t)
		if len(names) == 1 {
			rec, _ := recordOf(t, storeURL, "long")
			if rec.Response == nil || rec.Response.Blob == nil || names[0] != rec.Response.Blob.Name {
				t.Fatalf("the sweep left %v, want the long-lived record's blob", names)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("blobs after 15s: %v, want the expired record's blob swept", names)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if got := p.metric(t, "idem_blob_sweep_deleted_total"); got != 1 {
		t.Errorf("idem_blob_sweep_deleted_total: %v, want 1", got)
	}
	wantWhole(t, "the long-lived replay", fetch(t, p.base(), "long", 2*mib), "long", 2*mib)
}

// Usage errors of the blob flags and of idem gc.
func TestProxyBlobUsage(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"proxy", "--upstream", "http://127.0.0.1:1", "--blob", "ftp://x"}, "unknown scheme"},
		{[]string{"proxy", "--upstream", "http://127.0.0.1:1", "--blob-sweep", "1m"}, "--blob-sweep needs --blob"},
		{[]string{"proxy", "--upstream", "http://127.0.0.1:1", "--blob", "s3://k:topsecret@b?use_path_style=perhaps"}, "use_path_style"},
		{[]string{"gc", "--store", "memory"}, "--blob is required"},
		// Without the proxies' store every blob would look like an orphan.
		{[]string{"gc", "--blob", "mem://"}, "--store is required"},
		{[]string{"gc", "--store", "memory", "--blob", "mem://"}, "--store memory: a memory store lives inside one process"},
	} {
		code, out := runIdemOut(t, tc.args...)
		if code != 2 || !strings.Contains(out, tc.want) || strings.Contains(out, "topsecret") {
			t.Errorf("idem %q: exit %d, want 2 and %q:\n%s", tc.args, code, tc.want, out)
		}
	}
}
