package blobstore_test

import (
	"context"
	"crypto/rand"
	"errors"
	"net/url"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/blobstore"
	"github.com/idemkit/idem/blobstore/blobtest"
	"github.com/idemkit/idem/internal/s3test"
)

var s3srv *s3test.Server

func TestMain(m *testing.M) {
	var err error
	s3srv, err = s3test.Start()
	if err != nil {
		// Not a skip: the S3 tests need the server (see s3test.Install).
		os.Stderr.WriteString(err.Error() + "\n")
		os.Exit(1)
	}
	code := m.Run()
	s3srv.Stop()
	os.Exit(code)
}

func open(t *testing.T, rawURL string) *blobstore.Bucket {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	b, err := blobstore.Open(ctx, rawURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	return b
}

func TestMemory(t *testing.T) {
	blobtest.Run(t, func(t *testing.T) idem.BlobStore { return open(t, "mem://") })
}

func TestFile(t *testing.T) {
	blobtest.Run(t, func(t *testing.T) idem.BlobStore {
		return open(t, "file://"+filepath.Join(t.TempDir(), "blobs")) // created by Open
	})
}

func TestS3(t *testing.T) {
	bucket, err := s3srv.Bucket()
	if err != nil {
		t.Fatal(err)
	}
	blobtest.Run(t, func(t *testing.T) idem.BlobStore {
		// One bucket, a prefix per subtest.
		return open(t, s3srv.URL(bucket, "prefix="+url.QueryEscape("t-"+strings.ToLower(rand.Text()[:8])+"/")))
	})
}

// Credentials from the environment, as AWS tooling finds them, when the
// URL has none.
func TestS3CredentialsFromEnvironment(t *testing.T) {
	bucket, err := s3srv.Bucket()
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv("AWS_ACCESS_KEY_ID", s3test.AccessKey)
	t.Setenv("AWS_SECRET_ACCESS_KEY", s3test.SecretKey)
	t.Setenv("AWS_REGION", s3test.Region)
	t.Setenv("AWS_CONFIG_FILE", filepath.Join(t.TempDir(), "none"))
	t.Setenv("AWS_SHARED_CREDENTIALS_FILE", filepath.Join(t.TempDir(), "none"))
	b := open(t, "s3://"+bucket+"?endpoint="+url.QueryEscape(s3srv.Endpoint())+"&use_path_style=true")
	ctx := context.Background()
	if err := b.Check(ctx); err != nil {
		t.Fatalf("Check with credentials from the environment: %v", err)
	}
	w, err := b.Create(ctx, "idem/x")
	if err != nil {
		t.Fatal(err)
	}
	w.Write([]byte("hello"))
	if err := w.Close(); err != nil {
		t.Fatalf("write with credentials from the environment: %v", err)
	}

	// Wrong credentials in the URL win over the environment, and fail.
	u := strings.Replace(s3srv.URL(bucket), s3test.SecretKey, "wrong-secret-0000", 1)
	bad := open(t, u)
	if _, _, err := bad.Open(ctx, "idem/x"); err == nil || errors.Is(err, idem.ErrBlobNotFound) {
		t.Errorf("wrong secret in the URL: got %v, want an access error", err)
	}
}

func TestOpenErrors(t *testing.T) {
	ctx := context.Background()
	for _, u := range []string{"", "s3://", "mem://?x=1", "nope://x", "s3://k:supersecret@b?use_path_style=maybe", "s3://b?ssetype=rot13",
		"file:///dev/null/x"} {
		b, err := blobstore.Open(ctx, u)
		if err == nil {
			if err = b.Check(ctx); err == nil {
				t.Errorf("Open(%q): no error", u)
			}
			b.Close()
			continue
		}
		if strings.Contains(err.Error(), "supersecret") {
			t.Errorf("Open(%q): the error shows the password: %v", u, err)
		}
	}
	// A file URL that is not an absolute directory: file://blobs reads
	// "blobs" as the host and would write into the working directory.
	for _, u := range []string{"file://blobs", "file://blobs/x", "file:blobs", "file://", "file:", "file://./blobs", "file://host/var/x"} {
		b, err := blobstore.Open(ctx, u)
		if err == nil {
			b.Close()
			t.Errorf("Open(%q): no error, want file:///absolute/dir", u)
		} else if !strings.Contains(err.Error(), "want file:///absolute/dir") || strings.Contains(err.Error(), "\n") {
			t.Errorf("Open(%q): %v; want one line naming file:///absolute/dir", u, err)
		}
	}
	for _, u := range []string{"file://" + t.TempDir(), "file://localhost" + t.TempDir()} {
		b, err := blobstore.Open(ctx, u)
		if err != nil {
			t.Errorf("Open(%q): %v", u, err)
			continue
		}
		b.Close()
	}
	if got := blobstore.Redact("s3://AKIA:supersecret@bucket?endpoint=http://x&prefix=a/"); got != "s3://bucket?prefix=a%2F" {
		t.Errorf("Redact: got %q", got)
	}
	// A bucket that does not exist: Open succeeds (it does not call the
	// server), Check fails.
	b := open(t, s3srv.URL("no-such-bucket-here"))
	if err := b.Check(ctx); err == nil {
		t.Error("Check of a missing bucket: got nil, want an error")
	}
}

// The S3 writer holds two parts (one filling, one uploading), not the
// body: while 64 MiB are written, the live heap (measured after a full GC
// every 16 MiB) stays near 2*PartSize (10 MiB), far below what a writer that buffered the
// body would hold by the 48 MiB mark. Live heap, not total allocations:
// the SDK's garbage depends on the machine's GC timing, the bound does not.
func TestS3WriterMemory(t *testing.T) {
	bucket, err := s3srv.Bucket()
	if err != nil {
		t.Fatal(err)
	}
	b := open(t, s3srv.URL(bucket))
	ctx := context.Background()
	const size = 64 << 20
	live := func() uint64 {
		var m runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&m)
		return m.HeapAlloc
	}
	base := live()
	w, err := b.Create(ctx, "idem/big")
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 32<<10)
	var peak uint64
	for i := range size / len(buf) {
		if _, err := w.Write(buf); err != nil {
			t.Fatal(err)
		}
		if (i+1)*len(buf)%(16<<20) == 0 {
			if l := live(); l > base && l-base > peak {
				peak = l - base
			}
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	const limit = 2*blobstore.PartSize + 12<<20 // the SDK's buffers and garbage
	if peak > limit {
		t.Errorf("writing 64 MiB to S3 held %d MiB live, want at most %d", peak>>20, limit>>20)
	}
	t.Logf("peak live heap while writing 64 MiB: %d MiB", peak>>20)
	r, n, err := b.Open(ctx, "idem/big")
	if err != nil || n != size {
		t.Fatalf("Open: %d bytes, %v", n, err)
	}
	r.Close()
}
