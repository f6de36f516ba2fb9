package blobstore_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	s3types "github.com/aws/aws-sdk-go-v2/service/s3/types"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/blobstore"
	"github.com/idemkit/idem/memstore"
)

// clock is a settable clock for memstore.
type clock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *clock) Add(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

// attempt acquires key on store and writes its blob; it returns the lease
// and the blob's reference.
func attempt(t *testing.T, store idem.Store, bs idem.BlobStore, client string, lease time.Duration) (idem.Lease, idem.BlobRef) {
	t.Helper()
	ctx := context.Background()
	key, _ := idem.Scope{Route: "sweep"}.Key(client)
	acq, err := store.Acquire(ctx, idem.AcquireRequest{Key: key, LeaseID: idem.NewLeaseID(), TTL: lease})
	if err != nil || acq.Outcome != idem.Acquired {
		t.Fatalf("acquire %s: %v, %v", client, acq.Outcome, err)
	}
	body := bytes.Repeat([]byte(client), 1000)
	name := idem.NewBlobName(acq.Lease)
	w, err := bs.Create(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	w.Write(body)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return acq.Lease, idem.BlobRef{Name: name, Size: int64(len(body)), SHA256: sha256.Sum256(body)}
}

func names(t *testing.T, bs idem.BlobStore) []string {
	t.Helper()
	var out []string
	if err := bs.List(context.Background(), "", func(i idem.BlobInfo) error {
		out = append(out, i.Name)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	slices.Sort(out)
	return out
}

func TestSweep(t *testing.T) {
	for _, backend := range []string{"mem", "file", "s3"} {
		t.Run(backend, func(t *testing.T) {
			var bs *blobstore.Bucket
			switch backend {
			case "mem":
				bs = open(t, "mem://")
			case "file":
				bs = open(t, "file://"+t.TempDir())
			case "s3":
				bucket, err := s3srv.Bucket()
				if err != nil {
					t.Fatal(err)
				}
				bs = open(t, s3srv.URL(bucket))
			}
			testSweep(t, bs)
		})
	}
}

func testSweep(t *testing.T, bs *blobstore.Bucket) {
	ctx := context.Background()
	clk := &clock{now: time.Now()}
	store := memstore.New(memstore.Options{Clock: clk.Now})
	const lease = time.Minute

	// Completed, referring to its blob: kept.
	l, completed := attempt(t, store, bs, "completed", lease)
	if err := store.Complete(ctx, l, &idem.Response{Status: 200, Blob: &completed}, time.Hour); err != nil {
		t.Fatal(err)
	}
	// In flight, its blob written, Complete not yet called: kept.
	_, inFlight := attempt(t, store, bs, "in-flight", lease)
	// Released after its blob was written (a 5xx, a panic): orphan.
	l, released := attempt(t, store, bs, "released", lease)
	if err := store.Release(ctx, l); err != nil {
		t.Fatal(err)
	}
	// The attempt whose lease was lost wrote a blob; the new holder
	// completed with its own: the first is an orphan, the second kept.
	_, lost := attempt(t, store, bs, "lost", time.Second)
	clk.Add(2 * time.Second)
	l, taken := attempt(t, store, bs, "lost", lease)
	if err := store.Complete(ctx, l, &idem.Response{Status: 200, Blob: &taken}, time.Hour); err != nil {
		t.Fatal(err)
	}
	// Completed inline (the blob was written, then something else was
	// stored): orphan.
	l, inline := attempt(t, store, bs, "inline", lease)
	if err := store.Complete(ctx, l, &idem.Response{Status: 200, Body: []byte("x")}, time.Hour); err != nil {
		t.Fatal(err)
	}
	// Completed with a short retention that has run out: orphan.
	l, expired := attempt(t, store, bs, "expired", lease)
	if err := store.Complete(ctx, l, &idem.Response{Status: 200, Blob: &expired}, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	// A crashed holder: its lease ran out: orphan.
	_, crashed := attempt(t, store, bs, "crashed", 5*time.Second)
	clk.Add(30 * time.Second)
	// Names idem does not write are left alone.
	w, _ := bs.Create(ctx, "idem/README")
	w.Write([]byte("not a blob of idem's"))
	w.Close()
	w, _ = bs.Create(ctx, "elsewhere/x")
	w.Close()

	all := names(t, bs)
	if len(all) != 10 {
		t.Fatalf("before the sweep: %d blobs, want 10: %v", len(all), all)
	}
	// A dry run deletes nothing; MinAge spares everything just written.
	res, err := blobstore.Sweep(ctx, bs, store, blobstore.SweepOptions{MinAge: -1, DryRun: true})
	if err != nil || res.Orphans != 5 {
		t.Errorf("dry run: got %+v, %v; want 5 orphans", res, err)
	}
	res, err = blobstore.Sweep(ctx, bs, store, blobstore.SweepOptions{})
	if err != nil || res.Young != 8 || res.Orphans != 0 {
		t.Errorf("with the default MinAge: got %+v, %v; want 8 young, nothing deleted", res, err)
	}
	if got := names(t, bs); !slices.Equal(got, all) {
		t.Fatalf("after a dry run and a young sweep: %v, want %v", got, all)
	}

	res, err = blobstore.Sweep(ctx, bs, store, blobstore.SweepOptions{MinAge: -1})
	if err != nil {
		t.Fatal(err)
	}
	want := SweepCounts{Scanned: 9, Kept: 3, Orphans: 5, Foreign: 1}
	if got := (SweepCounts{res.Scanned, res.Kept, res.Orphans, res.Foreign, res.Errors}); got != want {
		t.Errorf("sweep: got %+v, want %+v", got, want)
	}
	left := names(t, bs)
	wantLeft := []string{completed.Name, inFlight.Name, taken.Name, "idem/README", "elsewhere/x"}
	slices.Sort(wantLeft)
	if !slices.Equal(left, wantLeft) {
		t.Errorf("after the sweep: %v, want %v", left, wantLeft)
	}
	for _, gone := range []idem.BlobRef{released, lost, inline, expired, crashed} {
		if slices.Contains(left, gone.Name) {
			t.Errorf("orphan %s survived", gone.Name)
		}
	}
	// The replays still read their blobs.
	for _, ref := range []idem.BlobRef{completed, taken} {
		r, err := idem.OpenBlob(ctx, bs, ref)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := r.Read(make([]byte, 1)); err != nil {
			t.Errorf("%s: %v", ref.Name, err)
		}
		r.Close()
	}
}

// SweepCounts are the SweepResult fields the test compares.
type SweepCounts struct{ Scanned, Kept, Orphans, Foreign, Errors int }

// failingStore fails every Get.
type failingStore struct{ idem.Store }

func (failingStore) Get(context.Context, idem.Key) (idem.Record, bool, error) {
	return idem.Record{}, false, errors.New("store down")
}

// A blob whose record cannot be read is kept.
func TestSweepKeepsWhatItCannotCheck(t *testing.T) {
	bs := open(t, "mem://")
	store := memstore.New(memstore.Options{})
	_, ref := attempt(t, store, bs, "x", time.Minute)
	res, err := blobstore.Sweep(context.Background(), bs, failingStore{store}, blobstore.SweepOptions{MinAge: -1})
	if err != nil || res.Errors != 1 || res.Orphans != 0 {
		t.Errorf("got %+v, %v; want 1 error, nothing deleted", res, err)
	}
	if got := names(t, bs); !slices.Equal(got, []string{ref.Name}) {
		t.Errorf("left %v, want %s", got, ref.Name)
	}
}

// The leftovers of writes cut short by a crash: a temporary file next to
// the blob's name (file://), an incomplete multipart upload (S3).
func TestSweepPartialWrites(t *testing.T) {
	ctx := context.Background()
	store := memstore.New(memstore.Options{})
	key, _ := idem.Scope{}.Key("k")
	name := idem.NewBlobName(idem.Lease{Key: key, Token: 42})

	dir := t.TempDir()
	bs := open(t, "file://"+dir)
	tmp := filepath.Join(dir, filepath.FromSlash(name)+".18a2b3c4d5e6f.tmp")
	os.MkdirAll(filepath.Dir(tmp), 0o755)
	if err := os.WriteFile(tmp, []byte("half a body"), 0o644); err != nil {
		t.Fatal(err)
	}
	res, err := blobstore.Sweep(ctx, bs, store, blobstore.SweepOptions{MinAge: -1})
	if err != nil || res.Partial != 1 {
		t.Errorf("file: got %+v, %v; want 1 partial write removed", res, err)
	}
	if _, err := os.Stat(tmp); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the temporary file is still there: %v", err)
	}

	bucket, err := s3srv.Bucket()
	if err != nil {
		t.Fatal(err)
	}
	client := s3srv.Client()
	up, err := client.CreateMultipartUpload(ctx, &s3.CreateMultipartUploadInput{Bucket: aws.String(bucket), Key: aws.String(name)})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := client.UploadPart(ctx, &s3.UploadPartInput{Bucket: aws.String(bucket), Key: aws.String(name), UploadId: up.UploadId,
		PartNumber: aws.Int32(1), Body: bytes.NewReader(make([]byte, 5<<20))}); err != nil {
		t.Fatal(err)
	}
	s3bs := open(t, s3srv.URL(bucket))
	if res, err := blobstore.Sweep(ctx, s3bs, store, blobstore.SweepOptions{}); err != nil || res.Aborted != 0 {
		t.Errorf("s3, a young upload: got %+v, %v; want it left alone", res, err)
	}
	res, err = blobstore.Sweep(ctx, s3bs, store, blobstore.SweepOptions{MinAge: -1})
	if err != nil || res.Aborted != 1 {
		t.Errorf("s3: got %+v, %v; want 1 incomplete upload aborted", res, err)
	}
	out, err := client.ListMultipartUploads(ctx, &s3.ListMultipartUploadsInput{Bucket: aws.String(bucket)})
	if err != nil {
		t.Fatal(err)
	}
	if len(out.Uploads) != 0 {
		t.Errorf("incomplete uploads left: %v", uploadKeys(out.Uploads))
	}
}

func uploadKeys(ups []s3types.MultipartUpload) []string {
	var keys []string
	for _, u := range ups {
		keys = append(keys, aws.ToString(u.Key))
	}
	return keys
}
