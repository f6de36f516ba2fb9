package idemhttp_test

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/memstore"
)

// syncBuffer is a bytes.Buffer safe for the handler's goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// nsHidden is a store that does not say its namespace.
type nsHidden struct{ idem.Store }

// The blob of a large response is named with the store's namespace
// (idem.Namespacer), or without one when the store has none. A replay
// that finds the blob missing logs one line naming the stored key and
// the idem purge that runs the key again.
func TestBlobNameNamespaceAndMissingLog(t *testing.T) {
	mem := memstore.New(memstore.Options{})
	for _, tc := range []struct {
		name  string
		store idem.Store
		ns    string
	}{{"namespaced", mem, idem.BlobNamespace(mem.Namespace())}, {"none", nsHidden{mem}, ""}} {
		t.Run(tc.name, func(t *testing.T) {
			blobs := newMemBlobs()
			var logs syncBuffer
			app := newBigApp()
			srv := httptest.NewServer(idemhttp.Middleware(tc.store, idemhttp.Config{Blobs: blobs, MaxResponseSize: 1024,
				Route:  func(*http.Request) string { return "/report" },
				Logger: slog.New(slog.NewJSONHandler(&logs, nil))})(app))
			defer srv.Close()
			post := func() *http.Response {
				req, _ := http.NewRequest("POST", srv.URL+"/report?size=5000", strings.NewReader("{}"))
				req.Header.Set(idemhttp.HeaderKey, "k-"+tc.name)
				resp, err := srv.Client().Do(req)
				if err != nil {
					t.Fatal(err)
				}
				resp.Body.Close()
				return resp
			}
			if resp := post(); resp.StatusCode != http.StatusOK {
				t.Fatalf("first: %d", resp.StatusCode)
			}
			key, _ := idem.Scope{Method: "POST", Route: "/report"}.Key("k-" + tc.name)
			var rec idem.Record
			for deadline := time.Now().Add(10 * time.Second); rec.State != idem.StateCompleted; time.Sleep(5 * time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatalf("record: %+v after 10s, want it completed", rec)
				}
				rec, _, _ = mem.Get(context.Background(), key)
			}
			n, ok := idem.ParseBlobName(rec.Response.Blob.Name)
			if !ok || n.Namespace != tc.ns || n.Key != key {
				t.Errorf("blob name %s: %+v, %v; want namespace %q and key %s", rec.Response.Blob.Name, n, ok, tc.ns, key)
			}
			if err := blobs.Delete(context.Background(), rec.Response.Blob.Name); err != nil {
				t.Fatal(err)
			}
			if resp := post(); resp.StatusCode != http.StatusServiceUnavailable {
				t.Errorf("replay of a missing blob: %d, want 503", resp.StatusCode)
			}
			var line struct{ Level, Msg, Key, Blob, Fix string }
			for l := range strings.Lines(logs.String()) {
				if strings.Contains(l, "missing from the blob store") {
					json.Unmarshal([]byte(l), &line)
				}
			}
			if line.Level != "ERROR" || line.Key != key.String() || line.Blob != rec.Response.Blob.Name ||
				!strings.Contains(line.Fix, "idem purge --stored-key "+key.String()+" --blob ") {
				t.Errorf("the missing-blob log line: %+v; want ERROR, key %s, and the idem purge that runs it again\n%s", line, key, logs.String())
			}
		})
	}
}
