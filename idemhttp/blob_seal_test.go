package idemhttp_test

import (
	"bytes"
	"crypto/rand"
	"encoding/base64"
	"io"
	"io/fs"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/seal"
)

// lockedBuffer is a log sink safe for the server's goroutines.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// A response over MaxResponseSize, offloaded to a file blob with sealing
// on, is sealed on disk (its canary nowhere in the directory) and replays
// byte for byte; without sealing (the control) the canary is on disk. A
// sealed blob altered by one byte is never replayed nor run again: 503,
// an ERROR line naming the key id.
func TestBlobSealedOnDisk(t *testing.T) {
	const canary = "4111 1111 1111 1111"
	body := []byte(strings.Repeat(`{"card":"`+canary+`","cvv":"123"},`, 20_000)) // about 700 KiB
	k := make([]byte, seal.KeySize)
	rand.Read(k)
	ring, err := seal.ParseRing("blobkey " + base64.StdEncoding.EncodeToString(k))
	if err != nil {
		t.Fatal(err)
	}
	for _, sealed := range []bool{true, false} {
		name := map[bool]string{true: "sealed", false: "clear"}[sealed]
		t.Run(name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "blobs")
			var logs lockedBuffer
			var runs atomic.Int64
			cfg := idemhttp.Config{Blobs: newDirBlobs(dir), MaxResponseSize: 16 * kib, Wait: 10 * time.Second,
				Logger: slog.New(slog.NewTextHandler(&logs, nil))}
			if sealed {
				cfg.Seal = ring
			}
			store := memstore.New(memstore.Options{})
			srv := httptest.NewServer(idemhttp.Middleware(store, cfg)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				runs.Add(1)
				w.Header().Set("Content-Type", "application/json")
				for p := body; len(p) > 0; p = p[min(len(p), 32*kib):] {
					w.Write(p[:min(len(p), 32*kib)])
				}
			})))
			defer srv.Close()
			post := func(key string) (int, []byte) {
				t.Helper()
				req, _ := http.NewRequest("POST", srv.URL+"/pay", strings.NewReader("{}"))
				req.Header.Set(idemhttp.HeaderKey, key)
				resp, err := srv.Client().Do(req)
				if err != nil {
					t.Fatal(err)
				}
				defer resp.Body.Close()
				b, _ := io.ReadAll(resp.Body)
				return resp.StatusCode, b
			}
			for _, key := range []string{"a", "b"} {
				if st, got := post(key); st != 200 || !bytes.Equal(got, body) {
					t.Fatalf("first %s: %d, %d bytes", key, st, len(got))
				}
			}
			deadline := time.Now().Add(10 * time.Second)
			var files []string
			for len(files) < 2 && time.Now().Before(deadline) { // the blobs are committed as the keys complete
				files = files[:0]
				filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
					if err == nil && !d.IsDir() && !strings.HasSuffix(p, ".tmp") {
						files = append(files, p)
					}
					return nil
				})
				time.Sleep(5 * time.Millisecond)
			}
			if len(files) != 2 {
				t.Fatalf("%d blob files, want 2: %v", len(files), files)
			}
			for _, f := range files {
				b, err := os.ReadFile(f)
				if err != nil {
					t.Fatal(err)
				}
				if has := bytes.Contains(b, []byte(canary)); has == sealed {
					t.Errorf("%s: canary on disk %v, want %v", f, has, !sealed)
				}
				if sealed && !bytes.HasPrefix(b, []byte{0xFF, 'S', 'B', 1}) {
					t.Errorf("%s: starts %x, want the sealed blob header", f, b[:4])
				}
			}
			for range 2 {
				if st, got := post("a"); st != 200 || !bytes.Equal(got, body) {
					t.Errorf("replay: %d, %d bytes, byte-identical %v", st, len(got), bytes.Equal(got, body))
				}
			}
			if !sealed {
				return
			}
			// One byte flipped in the first chunk of b's blob.
			key, _ := idem.Scope{Method: "POST", Route: "/pay"}.Key("b")
			for {
				rec, _, _ := store.Get(t.Context(), key)
				if rec.State == idem.StateCompleted {
					break
				}
				time.Sleep(5 * time.Millisecond)
			}
			for _, f := range files {
				b, _ := os.ReadFile(f)
				if !strings.Contains(f, key.String()) {
					continue
				}
				b[1000] ^= 0xff
				os.WriteFile(f, b, 0o600)
			}
			if st, got := post("b"); st != http.StatusServiceUnavailable || !bytes.Contains(got, []byte(idemhttp.ProblemStoredBodyUnavailable)) {
				t.Errorf("a sealed blob altered: %d %.200s, want 503 %s", st, got, idemhttp.ProblemStoredBodyUnavailable)
			}
			if n := runs.Load(); n != 2 {
				t.Errorf("the handler ran %d times, want 2 (once per key)", n)
			}
			if l := logs.String(); !strings.Contains(l, "level=ERROR") || !strings.Contains(l, "key_id=blobkey") || strings.Contains(l, canary) {
				t.Errorf("log %q: want an ERROR line with key_id=blobkey, without the canary", l)
			}
		})
	}
}
