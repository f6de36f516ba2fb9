package idem

import (
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"io"
	"strings"
	"sync"
	"testing"

	"github.com/idemkit/idem/seal"
)

// mapBlobs is a BlobStore in a map, for the tests of the sealed format.
type mapBlobs struct {
	mu sync.Mutex
	m  map[string][]byte
}

type mapWriter struct {
	b    *mapBlobs
	name string
	buf  bytes.Buffer
}

func (w *mapWriter) Write(p []byte) (int, error) { return w.buf.Write(p) }
func (w *mapWriter) Abort() error                { return nil }
func (w *mapWriter) Close() error {
	w.b.mu.Lock()
	defer w.b.mu.Unlock()
	w.b.m[w.name] = w.buf.Bytes()
	return nil
}

func (b *mapBlobs) Create(_ context.Context, name string) (BlobWriter, error) {
	return &mapWriter{b: b, name: name}, nil
}

func (b *mapBlobs) Open(_ context.Context, name string) (io.ReadCloser, int64, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	v, ok := b.m[name]
	if !ok {
		return nil, 0, ErrBlobNotFound
	}
	return io.NopCloser(bytes.NewReader(v)), int64(len(v)), nil
}

func (b *mapBlobs) Delete(context.Context, string) error                     { return nil }
func (b *mapBlobs) List(context.Context, string, func(BlobInfo) error) error { return nil }
func (b *mapBlobs) Check(context.Context) error                              { return nil }

func internalRing(t *testing.T) *seal.Ring {
	t.Helper()
	r, err := seal.ParseRing("k1 " + base64.StdEncoding.EncodeToString(bytes.Repeat([]byte{7}, seal.KeySize)))
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// A short chunk sealed as not the last (what a writer cut short between
// chunks of a smaller chunk size would leave) is refused by the final
// flag alone: the layout and every other byte are right.
func TestSealedBlobFinalFlag(t *testing.T) {
	r := internalRing(t)
	bs := &mapBlobs{m: map[string][]byte{}}
	sb := SealBlobs(bs, r, false).(*sealedBlobs)
	const name = "idem/x"
	w, err := sb.Create(context.Background(), name)
	if err != nil {
		t.Fatal(err)
	}
	sw := w.(*sealedBlobWriter)
	body := []byte("a short body")
	for _, final := range []bool{true, false} {
		out := append([]byte(nil), sw.hdr[:]...)
		out, _ = r.Seal(out, body, chunkAD(sw.ad, 0, final))
		bs.m[name] = out
		rc, size, err := sb.Open(context.Background(), name)
		if final {
			if err != nil || size != int64(len(body)) {
				t.Fatalf("sealed as the last chunk: size %d, %v", size, err)
			}
			got, err := io.ReadAll(rc)
			if err != nil || !bytes.Equal(got, body) {
				t.Errorf("sealed as the last chunk: %q, %v", got, err)
			}
			continue
		}
		var se *BlobSealError
		if !errors.As(err, &se) || se.KeyID != "k1" || !errors.Is(err, ErrUnsealable) {
			t.Errorf("sealed as not the last: %v; want a *BlobSealError with key id k1", err)
		}
	}
}

// overheadless hides seal.Ring's Overhead: SealBlobs learns it from a
// probe. growing adds a byte more to each value than the one before.
type overheadless struct{ s Sealer }

func (o overheadless) Seal(dst, p, ad []byte) ([]byte, error) { return o.s.Seal(dst, p, ad) }
func (o overheadless) Open(dst, v, ad []byte) ([]byte, error) { return o.s.Open(dst, v, ad) }
func (o overheadless) KeyID(v []byte) (string, bool)          { return o.s.KeyID(v) }

type growing struct {
	overheadless
	n int
}

func (g *growing) Seal(dst, p, ad []byte) ([]byte, error) {
	g.n++
	out, err := g.s.Seal(dst, p, ad)
	return append(out, make([]byte, g.n)...), err
}

func TestSealedBlobOverhead(t *testing.T) {
	r := internalRing(t)
	bs := &mapBlobs{m: map[string][]byte{}}
	ctx := context.Background()
	body := bytes.Repeat([]byte("0123456789"), 20_000)
	sb := SealBlobs(bs, overheadless{r}, false)
	w, _ := sb.Create(ctx, "idem/probe")
	w.Write(body)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	rc, size, err := sb.Open(ctx, "idem/probe")
	if err != nil || size != int64(len(body)) {
		t.Fatalf("a Sealer without Overhead: size %d, %v", size, err)
	}
	if got, err := io.ReadAll(rc); err != nil || !bytes.Equal(got, body) {
		t.Errorf("a Sealer without Overhead: %d bytes, %v", len(got), err)
	}

	w, err = SealBlobs(bs, &growing{overheadless: overheadless{r}}, false).Create(ctx, "idem/growing")
	if err != nil {
		t.Fatal(err)
	}
	_, werr := w.Write(body)
	cerr := w.Close()
	if werr == nil || cerr == nil || !strings.Contains(werr.Error(), "want the same for every chunk") {
		t.Errorf("a Sealer whose overhead changes: Write %v, Close %v; want both to fail", werr, cerr)
	}
	if _, ok := bs.m["idem/growing"]; ok {
		t.Error("a failed sealed write was committed")
	}
}
