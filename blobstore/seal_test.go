package blobstore_test

// Blobs sealed at rest (idem.SealBlobs): the conformance suite over each
// store, and what a sealed blob refuses.

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/s3"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/blobstore"
	"github.com/idemkit/idem/blobstore/blobtest"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/seal"
)

// sealChunk is the plaintext size of a sealed blob's chunks, and
// sealHeader the size of its header.
const (
	sealChunk  = 64 << 10
	sealHeader = 12
)

// newRing returns a ring of fresh random keys; the first id is the
// primary. keys holds their base64 forms, which no error may repeat.
func newRing(t testing.TB, ids ...string) (r *seal.Ring, keys []string) {
	t.Helper()
	var lines []string
	for _, id := range ids {
		k := make([]byte, seal.KeySize)
		rand.Read(k)
		keys = append(keys, base64.StdEncoding.EncodeToString(k))
		lines = append(lines, id+" "+keys[len(keys)-1])
	}
	r, err := seal.ParseRing(strings.Join(lines, "\n"))
	if err != nil {
		t.Fatal(err)
	}
	return r, keys
}

// sealedSize is the stored size of a sealed blob of n bytes.
func sealedSize(r *seal.Ring, n int64) int64 {
	return sealHeader + (n/sealChunk+1)*int64(r.Overhead()) + n
}

func runSealed(t *testing.T, h blobtest.Harness) {
	r, _ := newRing(t, "k1")
	blobtest.RunOptions(t, func(t *testing.T) idem.BlobStore {
		return idem.SealBlobs(h(t), r, false)
	}, blobtest.Options{ListedSize: func(n int64) int64 { return sealedSize(r, n) }, Authenticated: true})
}

func TestSealedMemory(t *testing.T) {
	runSealed(t, func(t *testing.T) idem.BlobStore { return open(t, "mem://") })
}

func TestSealedFile(t *testing.T) {
	runSealed(t, func(t *testing.T) idem.BlobStore { return open(t, "file://"+filepath.Join(t.TempDir(), "blobs")) })
}

func TestSealedS3(t *testing.T) {
	bucket, err := s3srv.Bucket()
	if err != nil {
		t.Fatal(err)
	}
	runSealed(t, func(t *testing.T) idem.BlobStore {
		return open(t, s3srv.URL(bucket, "prefix="+url.QueryEscape("t-"+strings.ToLower(rand.Text()[:8])+"/")))
	})
}

// sealEnv is a file:// store, sealed and not, over one directory.
type sealEnv struct {
	dir    string
	clear  *blobstore.Bucket
	sealed idem.BlobStore
	ring   *seal.Ring
	keys   []string
}

func newSealEnv(t *testing.T) *sealEnv {
	e := &sealEnv{dir: t.TempDir()}
	e.clear = open(t, "file://"+e.dir)
	e.ring, e.keys = newRing(t, "k1")
	e.sealed = idem.SealBlobs(e.clear, e.ring, false)
	return e
}

func (e *sealEnv) path(name string) string { return filepath.Join(e.dir, filepath.FromSlash(name)) }

// blobName is a fresh name in idem's layout.
func blobName(t *testing.T) string {
	key, err := idem.Scope{Route: t.Name()}.Key(rand.Text())
	if err != nil {
		t.Fatal(err)
	}
	return idem.NewBlobName("sealtest", idem.Lease{Key: key, Token: 7})
}

// canaryBody is n bytes that repeat a canary (a card number), so that any
// 64 bytes of it, in clear, hold it.
func canaryBody(n int) []byte {
	const canary = "4111 1111 1111 1111 "
	return []byte(strings.Repeat(canary, n/len(canary)+1)[:n])
}

func writeBlob(t *testing.T, bs idem.BlobStore, name string, body []byte) {
	t.Helper()
	ctx := context.Background()
	w, err := bs.Create(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	for p := body; len(p) > 0; p = p[min(len(p), 10_000):] { // writes that cross chunks
		if _, err := w.Write(p[:min(len(p), 10_000)]); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
}

// readBlob reads the blob through OpenBlob, in reads of step bytes.
func readBlob(bs idem.BlobStore, name string, body []byte, step int) ([]byte, error) {
	r, err := idem.OpenBlob(context.Background(), bs, idem.BlobRef{Name: name, Size: int64(len(body)), SHA256: sha256.Sum256(body)})
	if err != nil {
		return nil, err
	}
	defer r.Close()
	var out []byte
	buf := make([]byte, step)
	for {
		n, err := r.Read(buf)
		out = append(out, buf[:n]...)
		if errors.Is(err, io.EOF) {
			return out, nil
		}
		if err != nil {
			return out, err
		}
	}
}

func TestSealedRoundTrip(t *testing.T) {
	e := newSealEnv(t)
	ctx := context.Background()
	for _, n := range []int{0, 1, sealChunk - 1, sealChunk, sealChunk + 1, 3 << 20} {
		body := canaryBody(n)
		name := blobName(t)
		writeBlob(t, e.sealed, name, body)
		onDisk, err := os.ReadFile(e.path(name))
		if err != nil {
			t.Fatal(err)
		}
		if int64(len(onDisk)) != sealedSize(e.ring, int64(n)) || !bytes.HasPrefix(onDisk, []byte{0xFF, 'S', 'B', 1}) {
			t.Errorf("%d bytes: %d on disk, starting %x; want %d, starting ff534201", n, len(onDisk), onDisk[:min(4, len(onDisk))], sealedSize(e.ring, int64(n)))
		}
		if n > 0 && bytes.Contains(onDisk, []byte("4111 1111")) {
			t.Errorf("%d bytes: the canary is on disk in clear", n)
		}
		r, size, err := e.sealed.Open(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		r.Close()
		if size != int64(n) {
			t.Errorf("%d bytes: Open says %d", n, size)
		}
		// Reads of a chunk and more (opened in place), and of less.
		for _, step := range []int{sealChunk, 3 * sealChunk, 1000, 1} {
			if step == 1 && n > sealChunk+1 {
				continue
			}
			got, err := readBlob(e.sealed, name, body, step)
			if err != nil || !bytes.Equal(got, body) {
				t.Errorf("%d bytes, reads of %d: got %d bytes, equal %v, error %v", n, step, len(got), bytes.Equal(got, body), err)
			}
		}
	}
}

// wantRefused fails unless reading name through bs fails (at Open or at
// a read) with an error that is ErrUnsealable and ErrBlobCorrupt, says
// key id want (when not ""), and repeats no key.
func (e *sealEnv) wantRefused(t *testing.T, what string, bs idem.BlobStore, name string, body []byte, keyID string) {
	t.Helper()
	got, err := readBlob(bs, name, body, sealChunk)
	if err == nil {
		t.Errorf("%s: read %d bytes and no error; want it refused", what, len(got))
		return
	}
	if !errors.Is(err, idem.ErrUnsealable) || !errors.Is(err, idem.ErrBlobCorrupt) {
		t.Errorf("%s: error %v; want ErrUnsealable and ErrBlobCorrupt", what, err)
	}
	var se *idem.BlobSealError
	if !errors.As(err, &se) || se.Name != name {
		t.Errorf("%s: error %v; want a *BlobSealError naming %s", what, err, name)
	} else if keyID != "" && se.KeyID != keyID {
		t.Errorf("%s: key id %q, want %q", what, se.KeyID, keyID)
	}
	for _, k := range e.keys {
		if strings.Contains(err.Error(), k) {
			t.Errorf("%s: the error repeats a key", what)
		}
	}
	if len(got) >= len(body) && len(body) > 0 {
		t.Errorf("%s: %d bytes returned before the error, the whole body", what, len(got))
	}
}

func TestSealedTampered(t *testing.T) {
	e := newSealEnv(t)
	ov := e.ring.Overhead()
	unit := int64(sealChunk + ov)
	body := canaryBody(3*sealChunk + 100) // chunks 0-2 full, 3 the last
	fresh := func() string {
		name := blobName(t)
		writeBlob(t, e.sealed, name, body)
		return name
	}
	// One byte flipped: in the header, in a chunk, in the last.
	for _, at := range []int64{5, 10, sealHeader + 100, sealHeader + unit + 40, sealHeader + 3*unit + 50, sealedSize(e.ring, int64(len(body))) - 1} {
		name := fresh()
		flip(t, e.path(name), at)
		e.wantRefused(t, fmt.Sprintf("byte %d flipped", at), e.sealed, name, body, "")
	}
	// The last chunk dropped: at a chunk's end, so the size looks whole.
	name := fresh()
	if err := os.Truncate(e.path(name), sealHeader+3*unit); err != nil {
		t.Fatal(err)
	}
	e.wantRefused(t, "last chunk dropped", e.sealed, name, body[:3*sealChunk], "")
	// The last two dropped and the one before cut, its end looking like a
	// last chunk: the final flag refuses it.
	name = fresh()
	if err := os.Truncate(e.path(name), sealHeader+unit+int64(ov)+500); err != nil {
		t.Fatal(err)
	}
	e.wantRefused(t, "truncated in a chunk", e.sealed, name, body[:sealChunk+500], "k1")
	// Two chunks swapped.
	name = fresh()
	b, _ := os.ReadFile(e.path(name))
	c0 := bytes.Clone(b[sealHeader : sealHeader+unit])
	copy(b[sealHeader:], b[sealHeader+unit:sealHeader+2*unit])
	copy(b[sealHeader+unit:], c0)
	os.WriteFile(e.path(name), b, 0o600)
	e.wantRefused(t, "chunks swapped", e.sealed, name, body, "k1")
	// A chunk dropped in the middle, the rest moved up.
	name = fresh()
	b, _ = os.ReadFile(e.path(name))
	os.WriteFile(e.path(name), append(b[:sealHeader+unit:sealHeader+unit], b[sealHeader+2*unit:]...), 0o600)
	e.wantRefused(t, "a chunk dropped", e.sealed, name, append(bytes.Clone(body[:sealChunk]), body[2*sealChunk:]...), "k1")
	// Bytes appended after the last chunk.
	name = fresh()
	b, _ = os.ReadFile(e.path(name))
	os.WriteFile(e.path(name), append(b, make([]byte, unit)...), 0o600)
	e.wantRefused(t, "a chunk appended", e.sealed, name, append(bytes.Clone(body), make([]byte, sealChunk)...), "k1")

	// Copied, whole, under another name.
	name = fresh()
	b, _ = os.ReadFile(e.path(name))
	other := blobName(t)
	writeBlob(t, e.clear, other, b)
	e.wantRefused(t, "copied under another name", e.sealed, other, body, "k1")

	// Sealed under a key the ring no longer holds: the error names it.
	name = fresh()
	ring2, keys2 := newRing(t, "k2")
	e.keys = append(e.keys, keys2...)
	e.wantRefused(t, "under a key not in the ring", idem.SealBlobs(e.clear, ring2, false), name, body, "k1")
	if _, err := readBlob(idem.SealBlobs(e.clear, ring2, false), name, body, sealChunk); !errors.Is(err, seal.ErrUnknownKey) {
		t.Errorf("key not in the ring: %v, want seal.ErrUnknownKey", err)
	}
	// Read without sealing: the sealed bytes, which OpenBlob refuses
	// (size), never a clear body.
	if _, err := readBlob(e.clear, name, body, sealChunk); !errors.Is(err, idem.ErrBlobCorrupt) {
		t.Errorf("a sealed blob read without a Sealer: %v, want ErrBlobCorrupt", err)
	}
}

// Blobs written before sealing are read in clear, with their digest
// checked; with openOnly new blobs are clear and sealed ones still open.
func TestSealedClearAndOpenOnly(t *testing.T) {
	e := newSealEnv(t)
	body := canaryBody(200_000)
	old := blobName(t)
	writeBlob(t, e.clear, old, body)
	for _, step := range []int{1000, sealChunk} {
		if got, err := readBlob(e.sealed, old, body, step); err != nil || !bytes.Equal(got, body) {
			t.Errorf("a clear blob, reads of %d: %d bytes, error %v; want it whole", step, len(got), err)
		}
	}
	tiny := blobName(t)
	writeBlob(t, e.clear, tiny, []byte("ab"))
	if got, err := readBlob(e.sealed, tiny, []byte("ab"), 10); err != nil || string(got) != "ab" {
		t.Errorf("a clear blob of 2 bytes: %q, %v", got, err)
	}
	flip(t, e.path(old), 150_000)
	if _, err := readBlob(e.sealed, old, body, sealChunk); !errors.Is(err, idem.ErrBlobCorrupt) || errors.Is(err, idem.ErrUnsealable) {
		t.Errorf("a clear blob altered: %v; want ErrBlobCorrupt (its digest), not ErrUnsealable", err)
	}

	sealedName := blobName(t)
	writeBlob(t, e.sealed, sealedName, body)
	openOnly := idem.SealBlobs(e.clear, e.ring, true)
	clearName := blobName(t)
	writeBlob(t, openOnly, clearName, body)
	if b, _ := os.ReadFile(e.path(clearName)); !bytes.Equal(b, body) {
		t.Errorf("openOnly wrote %d bytes, not the body in clear", len(b))
	}
	for _, name := range []string{sealedName, clearName} {
		if got, err := readBlob(openOnly, name, body, sealChunk); err != nil || !bytes.Equal(got, body) {
			t.Errorf("openOnly reading %s: %d bytes, error %v", name, len(got), err)
		}
	}
}

func TestSealBlobsWrapping(t *testing.T) {
	e := newSealEnv(t)
	if got := idem.SealBlobs(e.clear, nil, false); got != idem.BlobStore(e.clear) {
		t.Errorf("SealBlobs with a nil Sealer: %T, want the store itself", got)
	}
	u, ok := e.sealed.(interface{ Unwrap() idem.BlobStore })
	if !ok || u.Unwrap() != idem.BlobStore(e.clear) {
		t.Fatalf("Unwrap: %v", ok)
	}
	// Wrapped again: sealed once.
	twice := idem.SealBlobs(e.sealed, e.ring, false)
	if twice.(interface{ Unwrap() idem.BlobStore }).Unwrap() != idem.BlobStore(e.clear) {
		t.Error("SealBlobs of a sealed store wraps the sealed one")
	}
	body := canaryBody(1000)
	name := blobName(t)
	writeBlob(t, twice, name, body)
	if got, err := readBlob(e.sealed, name, body, 100); err != nil || !bytes.Equal(got, body) {
		t.Errorf("written through SealBlobs twice, read through once: %v", err)
	}
}

// Sweep over a sealed S3 store judges the names (unchanged) and aborts
// the incomplete uploads of the store underneath.
func TestSweepSealed(t *testing.T) {
	ctx := context.Background()
	store := memstore.New(memstore.Options{})
	key, _ := idem.Scope{}.Key("k")
	bucket, err := s3srv.Bucket()
	if err != nil {
		t.Fatal(err)
	}
	ring, _ := newRing(t, "k1")
	bs := idem.SealBlobs(open(t, s3srv.URL(bucket)), ring, false)
	orphan := idem.NewBlobName(store.Namespace(), idem.Lease{Key: key, Token: 1})
	writeBlob(t, bs, orphan, canaryBody(100_000))
	partial := idem.NewBlobName(store.Namespace(), idem.Lease{Key: key, Token: 2})
	client := s3srv.Client()
	up, err := client.CreateMultipartUpload(ctx, &s3.CreateMultipartUploadInput{Bucket: aws.String(bucket), Key: aws.String(partial)})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := client.UploadPart(ctx, &s3.UploadPartInput{Bucket: aws.String(bucket), Key: aws.String(partial), UploadId: up.UploadId,
		PartNumber: aws.Int32(1), Body: bytes.NewReader(make([]byte, 5<<20))}); err != nil {
		t.Fatal(err)
	}
	res, err := blobstore.Sweep(ctx, bs, store, blobstore.SweepOptions{MinAge: -1, Now: func() time.Time { return time.Now().Add(time.Minute) }})
	if err != nil || res.Orphans != 1 || res.Aborted != 1 || res.Reclaimed != sealedSize(ring, 100_000) {
		t.Errorf("sweep: %+v, %v; want 1 orphan of %d bytes deleted and 1 upload aborted", res, err, sealedSize(ring, 100_000))
	}
}

// flip inverts the byte at offset at of the file.
func flip(t *testing.T, path string, at int64) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, 1)
	if _, err := f.ReadAt(b, at); err != nil {
		t.Fatal(err)
	}
	b[0] ^= 0xff
	if _, err := f.WriteAt(b, at); err != nil {
		t.Fatal(err)
	}
}
