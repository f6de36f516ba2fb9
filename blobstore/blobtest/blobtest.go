// Package blobtest is the conformance suite for idem.BlobStore
// implementations, as storetest is for stores: a backend's test hands Run
// a Harness that makes a fresh, empty store, and Run checks the contract
// of idem.BlobStore in named parallel subtests.
//
//	func TestConformance(t *testing.T) {
//		blobtest.Run(t, func(t *testing.T) idem.BlobStore {
//			b, err := blobstore.Open(ctx, "file://"+t.TempDir())
//			if err != nil {
//				t.Fatal(err)
//			}
//			t.Cleanup(func() { b.Close() })
//			return b
//		})
//	}
package blobtest

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// Harness makes a fresh store that holds no blob, isolated from the
// stores of other calls (its own directory, bucket or prefix).
type Harness func(t *testing.T) idem.BlobStore

// timeout bounds each subtest's calls.
const timeout = 30 * time.Second

// Options adapts the suite to a store.
type Options struct {
	// ListedSize, when set, is the size List reports for a blob of n
	// bytes written, for a store that keeps more than it is given (one
	// of idem.SealBlobs: a header and each chunk's overhead). Nil: n.
	ListedSize func(n int64) int64
	// Authenticated says that the store authenticates its blobs itself,
	// as idem.SealBlobs does, and idem.OpenBlob does not hash them: a
	// BlobRef's wrong digest is then not expected to be caught (its
	// wrong size still is).
	Authenticated bool
}

// Run runs the suite in subtests of t, in parallel, each with a fresh
// store from h.
func Run(t *testing.T, h Harness) { RunOptions(t, h, Options{}) }

// RunOptions is Run for a store that Options describe.
func RunOptions(t *testing.T, h Harness, o Options) {
	if o.ListedSize == nil {
		o.ListedSize = func(n int64) int64 { return n }
	}
	tests := []struct {
		name string
		fn   func(*testing.T, idem.BlobStore)
	}{
		{"WriteRead", testWriteRead},
		{"Empty", testEmpty},
		{"Large", testLarge},
		{"InvisibleUntilClose", testInvisibleUntilClose},
		{"Abort", testAbort},
		{"CancelledContext", testCancelledContext},
		{"Missing", testMissing},
		{"Delete", testDelete},
		{"List", func(t *testing.T, s idem.BlobStore) { testList(t, s, o) }},
		{"Concurrent", testConcurrent},
		{"Verify", func(t *testing.T, s idem.BlobStore) { testVerify(t, s, o) }},
		{"Check", testCheck},
	}
	t.Run("blobtest", func(t *testing.T) {
		for _, tt := range tests {
			t.Run(tt.name, func(t *testing.T) {
				t.Parallel()
				tt.fn(t, h(t))
			})
		}
	})
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	t.Cleanup(cancel)
	return ctx
}

// name returns a blob name in idem's layout.
func name(t *testing.T, token uint64) string {
	key, err := idem.Scope{Route: t.Name()}.Key(fmt.Sprint(token))
	if err != nil {
		t.Fatal(err)
	}
	return idem.NewBlobName("blobtest", idem.Lease{Key: key, Token: token})
}

func random(n int) []byte {
	b := make([]byte, n)
	rand.Read(b)
	return b
}

// write stores body in chunks of chunk bytes and commits it.
func write(t *testing.T, ctx context.Context, s idem.BlobStore, name string, body []byte, chunk int) {
	t.Helper()
	w, err := s.Create(ctx, name)
	if err != nil {
		t.Fatalf("Create(%s): %v", name, err)
	}
	for p := body; len(p) > 0; {
		n := min(chunk, len(p))
		if k, err := w.Write(p[:n]); err != nil || k != n {
			t.Fatalf("Write: got %d, %v; want %d, nil", k, err, n)
		}
		p = p[n:]
	}
	if err := w.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
}

// read returns the blob's bytes and the size Open reported.
func read(t *testing.T, ctx context.Context, s idem.BlobStore, name string) ([]byte, int64) {
	t.Helper()
	r, size, err := s.Open(ctx, name)
	if err != nil {
		t.Fatalf("Open(%s): %v", name, err)
	}
	defer r.Close()
	b, err := io.ReadAll(r)
	if err != nil {
		t.Fatalf("reading %s: %v", name, err)
	}
	return b, size
}

func testWriteRead(t *testing.T, s idem.BlobStore) {
	ctx := ctxT(t)
	body := random(300_000)
	n := name(t, 1)
	write(t, ctx, s, n, body, 7_000)
	got, size := read(t, ctx, s, n)
	if !bytes.Equal(got, body) || size != int64(len(body)) {
		t.Errorf("read back %d bytes (size %d), equal: %v; want the %d bytes written", len(got), size, bytes.Equal(got, body), len(body))
	}
	// A second reader, while the first is open, reads the same.
	r1, _, err := s.Open(ctx, n)
	if err != nil {
		t.Fatal(err)
	}
	defer r1.Close()
	got2, _ := read(t, ctx, s, n)
	if !bytes.Equal(got2, body) {
		t.Error("a second reader got other bytes")
	}
}

func testEmpty(t *testing.T, s idem.BlobStore) {
	ctx := ctxT(t)
	n := name(t, 1)
	write(t, ctx, s, n, nil, 1)
	got, size := read(t, ctx, s, n)
	if len(got) != 0 || size != 0 {
		t.Errorf("empty blob: got %d bytes, size %d; want 0, 0", len(got), size)
	}
}

// A 12 MiB blob written in 32 KiB writes (what a proxy's copy loop does)
// crosses several upload parts on S3.
func testLarge(t *testing.T, s idem.BlobStore) {
	ctx := ctxT(t)
	body := random(12 << 20)
	n := name(t, 1)
	write(t, ctx, s, n, body, 32<<10)
	r, err := idem.OpenBlob(ctx, s, idem.BlobRef{Name: n, Size: int64(len(body)), SHA256: sha256.Sum256(body)})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	h := sha256.New()
	if _, err := io.Copy(h, r); err != nil {
		t.Fatalf("reading 12 MiB back: %v", err)
	}
}

func testInvisibleUntilClose(t *testing.T, s idem.BlobStore) {
	ctx := ctxT(t)
	n := name(t, 1)
	w, err := s.Create(ctx, n)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.Write(random(100_000)); err != nil {
		t.Fatal(err)
	}
	if _, _, err := s.Open(ctx, n); !errors.Is(err, idem.ErrBlobNotFound) {
		t.Errorf("Open before Close: got %v, want ErrBlobNotFound", err)
	}
	if names := list(t, ctx, s, idem.BlobPrefix); slices.Contains(names, n) {
		t.Errorf("List before Close shows %s", n)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if names := list(t, ctx, s, idem.BlobPrefix); !slices.Contains(names, n) {
		t.Errorf("List after Close: got %v, want %s among them", names, n)
	}
}

func testAbort(t *testing.T, s idem.BlobStore) {
	ctx := ctxT(t)
	n := name(t, 1)
	w, err := s.Create(ctx, n)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.Write(random(6 << 20)); err != nil { // past one S3 part
		t.Fatal(err)
	}
	if err := w.Abort(); err != nil {
		t.Errorf("Abort: %v", err)
	}
	if _, _, err := s.Open(ctx, n); !errors.Is(err, idem.ErrBlobNotFound) {
		t.Errorf("Open after Abort: got %v, want ErrBlobNotFound", err)
	}
	if names := list(t, ctx, s, ""); len(names) != 0 {
		t.Errorf("List after Abort: got %v, want nothing", names)
	}
}

func testCancelledContext(t *testing.T, s idem.BlobStore) {
	ctx := ctxT(t)
	n := name(t, 1)
	wctx, cancel := context.WithCancel(ctx)
	w, err := s.Create(wctx, n)
	if err != nil {
		t.Fatal(err)
	}
	w.Write(random(1000)) // may fail already
	cancel()
	if err := w.Close(); err == nil {
		t.Error("Close after the context ended: got nil, want an error")
	}
	if _, _, err := s.Open(ctx, n); !errors.Is(err, idem.ErrBlobNotFound) {
		t.Errorf("Open after a cancelled write: got %v, want ErrBlobNotFound", err)
	}
	if _, _, err := s.Open(wctx, name(t, 2)); err == nil {
		t.Error("Open with an ended context: got nil error, want one")
	}
}

func testMissing(t *testing.T, s idem.BlobStore) {
	ctx := ctxT(t)
	n := name(t, 1)
	if _, _, err := s.Open(ctx, n); !errors.Is(err, idem.ErrBlobNotFound) {
		t.Errorf("Open of a missing blob: got %v, want ErrBlobNotFound", err)
	}
	if err := s.Delete(ctx, n); !errors.Is(err, idem.ErrBlobNotFound) {
		t.Errorf("Delete of a missing blob: got %v, want ErrBlobNotFound", err)
	}
	if _, err := idem.OpenBlob(ctx, s, idem.BlobRef{Name: n, Size: 1}); !errors.Is(err, idem.ErrBlobNotFound) {
		t.Errorf("OpenBlob of a missing blob: got %v, want ErrBlobNotFound", err)
	}
}

func testDelete(t *testing.T, s idem.BlobStore) {
	ctx := ctxT(t)
	a, b := name(t, 1), name(t, 2)
	write(t, ctx, s, a, []byte("a"), 1)
	write(t, ctx, s, b, []byte("b"), 1)
	if err := s.Delete(ctx, a); err != nil {
		t.Fatalf("Delete: %v", err)
	}
	if _, _, err := s.Open(ctx, a); !errors.Is(err, idem.ErrBlobNotFound) {
		t.Errorf("Open after Delete: got %v, want ErrBlobNotFound", err)
	}
	if got, _ := read(t, ctx, s, b); string(got) != "b" {
		t.Errorf("the other blob: got %q, want %q", got, "b")
	}
	if names := list(t, ctx, s, ""); !slices.Equal(names, []string{b}) {
		t.Errorf("List after Delete: got %v, want [%s]", names, b)
	}
}

func list(t *testing.T, ctx context.Context, s idem.BlobStore, prefix string) []string {
	t.Helper()
	var names []string
	if err := s.List(ctx, prefix, func(i idem.BlobInfo) error {
		names = append(names, i.Name)
		return nil
	}); err != nil {
		t.Fatalf("List(%q): %v", prefix, err)
	}
	slices.Sort(names)
	return names
}

func testList(t *testing.T, s idem.BlobStore, o Options) {
	ctx := ctxT(t)
	start := time.Now().Add(-time.Minute) // file systems and servers round times
	sizes := map[string]int{}
	var names []string
	for i := range 5 {
		n := name(t, uint64(i+1))
		sizes[n] = i * 1000
		names = append(names, n)
		write(t, ctx, s, n, random(i*1000), 4096)
	}
	write(t, ctx, s, "other/x", []byte("x"), 1)
	slices.Sort(names)
	var infos []idem.BlobInfo
	if err := s.List(ctx, idem.BlobPrefix, func(i idem.BlobInfo) error {
		infos = append(infos, i)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, i := range infos {
		got = append(got, i.Name)
		if want, ok := sizes[i.Name]; ok && i.Size != o.ListedSize(int64(want)) {
			t.Errorf("%s: listed size %d, want %d (%d bytes written)", i.Name, i.Size, o.ListedSize(int64(want)), want)
		}
		if i.ModTime.Before(start) || i.ModTime.After(time.Now().Add(time.Minute)) {
			t.Errorf("%s: ModTime %v, want about now", i.Name, i.ModTime)
		}
	}
	slices.Sort(got)
	if !slices.Equal(got, names) {
		t.Errorf("List(%q): got %v, want %v", idem.BlobPrefix, got, names)
	}
	if all := list(t, ctx, s, ""); len(all) != len(names)+1 {
		t.Errorf("List(\"\"): got %d names, want %d", len(all), len(names)+1)
	}
	// fn's error stops the listing and comes back.
	stop := errors.New("stop")
	calls := 0
	err := s.List(ctx, idem.BlobPrefix, func(idem.BlobInfo) error { calls++; return stop })
	if !errors.Is(err, stop) || calls != 1 {
		t.Errorf("List with fn failing: got %v after %d calls, want stop after 1", err, calls)
	}
}

func testConcurrent(t *testing.T, s idem.BlobStore) {
	ctx := ctxT(t)
	const writers = 8
	bodies := make([][]byte, writers)
	names := make([]string, writers)
	var wg sync.WaitGroup
	for i := range writers {
		bodies[i], names[i] = random(200_000+i), name(t, uint64(i+1))
		wg.Go(func() {
			w, err := s.Create(ctx, names[i])
			if err != nil {
				t.Error(err)
				return
			}
			for p := bodies[i]; len(p) > 0; p = p[min(len(p), 10_000):] {
				if _, err := w.Write(p[:min(len(p), 10_000)]); err != nil {
					t.Error(err)
					w.Abort()
					return
				}
			}
			if err := w.Close(); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	for i := range writers {
		if got, _ := read(t, ctx, s, names[i]); !bytes.Equal(got, bodies[i]) {
			t.Errorf("writer %d: read back %d bytes, not the %d written", i, len(got), len(bodies[i]))
		}
	}
}

// OpenBlob over the store catches a blob that is not the one recorded.
func testVerify(t *testing.T, s idem.BlobStore, o Options) {
	ctx := ctxT(t)
	body := random(100_000)
	n := name(t, 1)
	write(t, ctx, s, n, body, 8192)
	if o.Authenticated {
		if _, err := idem.OpenBlob(ctx, s, idem.BlobRef{Name: n, Size: int64(len(body)) + 1}); !errors.Is(err, idem.ErrBlobCorrupt) {
			t.Errorf("size mismatch: got %v, want ErrBlobCorrupt", err)
		}
		return
	}
	other := bytes.Clone(body)
	other[len(other)/2] ^= 0xff
	r, err := idem.OpenBlob(ctx, s, idem.BlobRef{Name: n, Size: int64(len(body)), SHA256: sha256.Sum256(other)})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if _, err := io.Copy(io.Discard, r); !errors.Is(err, idem.ErrBlobCorrupt) {
		t.Errorf("digest mismatch: got %v, want ErrBlobCorrupt", err)
	}
	if _, err := idem.OpenBlob(ctx, s, idem.BlobRef{Name: n, Size: int64(len(body)) + 1}); !errors.Is(err, idem.ErrBlobCorrupt) {
		t.Errorf("size mismatch: got %v, want ErrBlobCorrupt", err)
	}
}

func testCheck(t *testing.T, s idem.BlobStore) {
	if err := s.Check(ctxT(t)); err != nil {
		t.Errorf("Check: %v", err)
	}
	if !strings.HasPrefix(idem.BlobPrefix, "idem/") {
		t.Fatal("idem.BlobPrefix changed: blob names in existing records would no longer be swept")
	}
}
