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

// attempt acquires key on store and writes its blob, named with the
// store's namespace as idemhttp names it; it returns the lease and the
// blob's reference.
func attempt(t *testing.T, store idem.Store, bs idem.BlobStore, client string, lease time.Duration) (idem.Lease, idem.BlobRef) {
	t.Helper()
	return attemptNS(t, store, bs, client, lease, store.(idem.Namespacer).Namespace())
}

// attemptNS is attempt with the blob named for namespace ns ("": none, as
// names were before namespaces).
func attemptNS(t *testing.T, store idem.Store, bs idem.BlobStore, client string, lease time.Duration, ns string) (idem.Lease, idem.BlobRef) {
	t.Helper()
	ctx := context.Background()
	key, _ := idem.Scope{Route: "sweep"}.Key(client)
	acq, err := store.Acquire(ctx, idem.AcquireRequest{Key: key, LeaseID: idem.NewLeaseID(), TTL: lease})
	if err != nil || acq.Outcome != idem.Acquired {
		t.Fatalf("acquire %s: %v, %v", client, acq.Outcome, err)
	}
	body := bytes.Repeat([]byte(client), 1000)
	name := idem.NewBlobName(ns, acq.Lease)
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
	// Another store's blobs (another namespace: another Redis prefix),
	// completed there, or orphans there: this store has no record of
	// them, and leaves them alone whatever they are.
	other := nsStore{memstore.New(memstore.Options{Clock: clk.Now}), `redis prefix "other:"`}
	l, otherLive := attempt(t, other, bs, "other-live", lease)
	if err := other.Complete(ctx, l, &idem.Response{Status: 200, Blob: &otherLive}, time.Hour); err != nil {
		t.Fatal(err)
	}
	_, otherOrphan := attempt(t, other, bs, "other-orphan", 5*time.Second)
	// Names without a namespace, as written before namespaces: left alone
	// unless SweepOptions.Unqualified, which judges them against the store.
	l, oldLive := attemptNS(t, store, bs, "old-live", lease, "")
	if err := store.Complete(ctx, l, &idem.Response{Status: 200, Blob: &oldLive}, time.Hour); err != nil {
		t.Fatal(err)
	}
	_, oldOrphan := attemptNS(t, store, bs, "old-orphan", 5*time.Second, "")
	clk.Add(30 * time.Second)
	// Names idem does not write are left alone.
	w, _ := bs.Create(ctx, "idem/README")
	w.Write([]byte("not a blob of idem's"))
	w.Close()
	w, _ = bs.Create(ctx, "elsewhere/x")
	w.Close()

	all := names(t, bs)
	if len(all) != 14 {
		t.Fatalf("before the sweep: %d blobs, want 14: %v", len(all), all)
	}
	// A dry run deletes nothing; MinAge spares everything just written.
	res, err := blobstore.Sweep(ctx, bs, store, blobstore.SweepOptions{MinAge: -1, DryRun: true})
	if err != nil || res.Orphans != 5 || res.Other != 2 || res.Unqualified != 2 {
		t.Errorf("dry run: got %+v, %v; want 5 orphans, 2 of another namespace, 2 unqualified", res, err)
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
	want := SweepCounts{Scanned: 13, Kept: 3, Orphans: 5, Foreign: 1, Other: 2, Unqualified: 2}
	if got := (SweepCounts{res.Scanned, res.Kept, res.Orphans, res.Foreign, res.Other, res.Unqualified, res.Errors}); got != want {
		t.Errorf("sweep: got %+v, want %+v", got, want)
	}
	otherNS := idem.BlobNamespace(other.ns)
	if res.BlobNamespace != idem.BlobNamespace(store.Namespace()) || len(res.OtherNamespaces) != 1 || res.OtherNamespaces[otherNS] != 2 {
		t.Errorf("sweep: namespace %q, others %v; want %q, {%s: 2}", res.BlobNamespace, res.OtherNamespaces,
			idem.BlobNamespace(store.Namespace()), otherNS)
	}
	left := names(t, bs)
	wantLeft := []string{completed.Name, inFlight.Name, taken.Name, otherLive.Name, otherOrphan.Name, oldLive.Name, oldOrphan.Name,
		"idem/README", "elsewhere/x"}
	slices.Sort(wantLeft)
	if !slices.Equal(left, wantLeft) {
		t.Errorf("after the sweep: %v, want %v", left, wantLeft)
	}
	for _, gone := range []idem.BlobRef{released, lost, inline, expired, crashed} {
		if slices.Contains(left, gone.Name) {
			t.Errorf("orphan %s survived", gone.Name)
		}
	}

	// Told that the names without a namespace are this store's, the
	// sweep still leaves them while another store writes here: the other
	// namespace shows that they may be its.
	res, err = blobstore.Sweep(ctx, bs, store, blobstore.SweepOptions{MinAge: -1, Unqualified: true})
	want = SweepCounts{Scanned: 8, Kept: 3, Foreign: 1, Other: 2, Unqualified: 2}
	if got := (SweepCounts{res.Scanned, res.Kept, res.Orphans, res.Foreign, res.Other, res.Unqualified, res.Errors}); err != nil || got != want ||
		!res.UnqualifiedRefused {
		t.Errorf("sweep with Unqualified, another namespace present: got %+v, %v, refused %v; want %+v, refused", got, err, res.UnqualifiedRefused, want)
	}
	// The other store's own sweep judges its blobs.
	res, err = blobstore.Sweep(ctx, bs, other, blobstore.SweepOptions{MinAge: -1})
	if err != nil || res.Kept != 1 || res.Orphans != 1 || res.Other != 3 || res.Unqualified != 2 {
		t.Errorf("the other store's sweep: got %+v, %v; want 1 kept, 1 orphan, 3 of another namespace, 2 unqualified", res, err)
	}
	if got := names(t, bs); slices.Contains(got, otherOrphan.Name) || !slices.Contains(got, otherLive.Name) {
		t.Errorf("after the other store's sweep: %v; want %s gone, %s there", got, otherOrphan.Name, otherLive.Name)
	}
	// Once no other store writes here (its live blob moved away), the
	// names without a namespace are judged: the orphan goes, the live one
	// stays.
	if err := bs.Delete(ctx, otherLive.Name); err != nil {
		t.Fatal(err)
	}
	res, err = blobstore.Sweep(ctx, bs, store, blobstore.SweepOptions{MinAge: -1, Unqualified: true})
	want = SweepCounts{Scanned: 6, Kept: 4, Orphans: 1, Foreign: 1}
	if got := (SweepCounts{res.Scanned, res.Kept, res.Orphans, res.Foreign, res.Other, res.Unqualified, res.Errors}); err != nil || got != want ||
		res.UnqualifiedRefused {
		t.Errorf("sweep with Unqualified: got %+v, %v, refused %v; want %+v", got, err, res.UnqualifiedRefused, want)
	}
	if got := names(t, bs); slices.Contains(got, oldOrphan.Name) || !slices.Contains(got, oldLive.Name) {
		t.Errorf("after the sweep with Unqualified: %v; want %s gone, %s there", got, oldOrphan.Name, oldLive.Name)
	}

	// The replays still read their blobs.
	for _, ref := range []idem.BlobRef{completed, taken, oldLive} {
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
type SweepCounts struct{ Scanned, Kept, Orphans, Foreign, Other, Unqualified, Errors int }

// nsStore is a store with another namespace: a memstore standing for a
// store of another prefix.
type nsStore struct {
	idem.Store
	ns string
}

func (s nsStore) Namespace() string { return s.ns }

// failingStore fails every Get.
type failingStore struct{ *memstore.Store }

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
	name := idem.NewBlobName(store.Namespace(), idem.Lease{Key: key, Token: 42})
	// Another store's, and one without a namespace: left alone.
	otherName := idem.NewBlobName(`redis prefix "other:"`, idem.Lease{Key: key, Token: 42})
	oldName := idem.NewBlobName("", idem.Lease{Key: key, Token: 42})

	dir := t.TempDir()
	bs := open(t, "file://"+dir)
	var tmps []string
	for _, n := range []string{name, otherName, oldName} {
		tmp := filepath.Join(dir, filepath.FromSlash(n)+".18a2b3c4d5e6f.tmp")
		os.MkdirAll(filepath.Dir(tmp), 0o755)
		if err := os.WriteFile(tmp, []byte("half a body"), 0o644); err != nil {
			t.Fatal(err)
		}
		tmps = append(tmps, tmp)
	}
	res, err := blobstore.Sweep(ctx, bs, store, blobstore.SweepOptions{MinAge: -1})
	if err != nil || res.Partial != 1 || res.Other != 1 || res.Unqualified != 1 {
		t.Errorf("file: got %+v, %v; want 1 partial write removed, 1 of another namespace and 1 unqualified left", res, err)
	}
	if _, err := os.Stat(tmps[0]); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the temporary file is still there: %v", err)
	}
	for _, tmp := range tmps[1:] {
		if _, err := os.Stat(tmp); err != nil {
			t.Errorf("another store's temporary file: %v", err)
		}
	}
	res, err = blobstore.Sweep(ctx, bs, store, blobstore.SweepOptions{MinAge: -1, Unqualified: true})
	if err != nil || res.Partial != 0 || res.Other != 1 || res.Unqualified != 1 || !res.UnqualifiedRefused {
		t.Errorf("file, with Unqualified and another namespace: got %+v, %v; want nothing removed, refused", res, err)
	}
	os.Remove(tmps[1])
	res, err = blobstore.Sweep(ctx, bs, store, blobstore.SweepOptions{MinAge: -1, Unqualified: true})
	if err != nil || res.Partial != 1 || res.Unqualified != 0 {
		t.Errorf("file, with Unqualified: got %+v, %v; want 1 partial write removed", res, err)
	}

	bucket, err := s3srv.Bucket()
	if err != nil {
		t.Fatal(err)
	}
	client := s3srv.Client()
	for _, n := range []string{name, otherName} {
		up, err := client.CreateMultipartUpload(ctx, &s3.CreateMultipartUploadInput{Bucket: aws.String(bucket), Key: aws.String(n)})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := client.UploadPart(ctx, &s3.UploadPartInput{Bucket: aws.String(bucket), Key: aws.String(n), UploadId: up.UploadId,
			PartNumber: aws.Int32(1), Body: bytes.NewReader(make([]byte, 5<<20))}); err != nil {
			t.Fatal(err)
		}
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
	if got := uploadKeys(out.Uploads); !slices.Equal(got, []string{otherName}) {
		t.Errorf("incomplete uploads left: %v, want only the other store's, %s", got, otherName)
	}
}

// A store without a namespace can judge no blob of a namespace: Sweep
// refuses it, unless told to judge the names without one.
func TestSweepStoreWithoutNamespace(t *testing.T) {
	ctx := context.Background()
	bs := open(t, "mem://")
	mem := memstore.New(memstore.Options{})
	_, ref := attempt(t, mem, bs, "x", time.Minute)
	store := struct{ idem.Store }{mem} // hides Namespace
	if res, err := blobstore.Sweep(ctx, bs, store, blobstore.SweepOptions{MinAge: -1}); err == nil || res.Scanned != 0 {
		t.Errorf("got %+v, %v; want an error and nothing scanned", res, err)
	}
	res, err := blobstore.Sweep(ctx, bs, store, blobstore.SweepOptions{MinAge: -1, Unqualified: true})
	if err != nil || res.Other != 1 || res.Orphans != 0 {
		t.Errorf("with Unqualified: got %+v, %v; want the blob of a namespace left alone", res, err)
	}
	if got := names(t, bs); !slices.Equal(got, []string{ref.Name}) {
		t.Errorf("left %v, want %s", got, ref.Name)
	}
}

func uploadKeys(ups []s3types.MultipartUpload) []string {
	var keys []string
	for _, u := range ups {
		keys = append(keys, aws.ToString(u.Key))
	}
	return keys
}
