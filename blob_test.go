package idem_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"net/http"
	"reflect"
	"strings"
	"sync"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
)

func TestResponseBlobRoundTrip(t *testing.T) {
	ref := &idem.BlobRef{Name: "idem/AAAAAAAAAAAAAAAAAAAAAA/1700000000000-0123456789abcdef", Size: 100 << 20,
		SHA256: sha256.Sum256([]byte("body"))}
	for _, want := range []*idem.Response{
		{Status: 200, Blob: ref},
		{Status: 201, Header: http.Header{"Content-Type": {"application/json"}}, Blob: ref},
		{Status: 404, Header: http.Header{"Content-Type": {"text/csv"}, "Content-Disposition": {`attachment; filename="r.csv"`}}, Blob: ref},
		{Status: 200, Blob: &idem.BlobRef{Name: "n", Size: 0}},
	} {
		got, n := roundTrip(t, want)
		if got.Status != want.Status || !reflect.DeepEqual(got.Blob, want.Blob) || len(got.Body) != 0 || got.BodyOmitted ||
			!(len(got.Header) == 0 && len(want.Header) == 0 || reflect.DeepEqual(got.Header, want.Header)) {
			t.Errorf("got %+v (blob %+v), want %+v (blob %+v)", got, got.Blob, want, want.Blob)
		}
		if n > 200 {
			t.Errorf("a blob reference encodes in %d bytes, want at most 200", n)
		}
	}
}

func TestResponseBlobBadInput(t *testing.T) {
	ref := &idem.BlobRef{Name: "x", Size: 1}
	for name, r := range map[string]*idem.Response{
		"blob and body":      {Status: 200, Blob: ref, Body: []byte("x")},
		"blob and omitted":   {Status: 200, Blob: ref, BodyOmitted: true},
		"empty name":         {Status: 200, Blob: &idem.BlobRef{Size: 1}},
		"name too long":      {Status: 200, Blob: &idem.BlobRef{Name: strings.Repeat("n", idem.MaxBlobNameLen+1)}},
		"negative blob size": {Status: 200, Blob: &idem.BlobRef{Name: "x", Size: -1}},
	} {
		if _, err := r.AppendBinary(nil); err == nil {
			t.Errorf("%s: got nil error, want one", name)
		}
	}
	good, _ := (&idem.Response{Status: 200, Blob: &idem.BlobRef{Name: "abc", Size: 5}}).AppendBinary(nil)
	corrupt := map[string][]byte{
		"truncated digest":  good[:10],
		"name past the end": append(bytes.Clone(good[:len(good)-3]), 9, 'a'),
		"trailing bytes":    append(bytes.Clone(good), 'x'),
		"no name":           good[:len(good)-4],
	}
	for name, b := range corrupt {
		var r idem.Response
		if err := r.UnmarshalBinary(b); !errors.Is(err, idem.ErrCorrupt) {
			t.Errorf("%s (%x): got %v, want an error wrapping ErrCorrupt", name, b, err)
		}
	}
}

// An idem built before blob references read such a record as an omitted
// body with bytes after it: corrupt, so it answers as for a store failure,
// never with an empty body. The check below is that older decoder's.
func TestResponseBlobOldDecoder(t *testing.T) {
	b, _ := (&idem.Response{Status: 200, Blob: &idem.BlobRef{Name: "abc", Size: 5}}).AppendBinary(nil)
	if b[0]&0x10 == 0 || len(b) == 1 {
		t.Fatalf("flags %08b, %d bytes: want the omitted bit set and bytes after it", b[0], len(b))
	}
}

func TestBlobNames(t *testing.T) {
	key, _ := idem.Scope{Method: "POST", Route: "/r"}.Key("k")
	l := idem.Lease{Key: key, Token: 1700000000123}
	const ns = `redis prefix "idem:"`
	a, b := idem.NewBlobName(ns, l), idem.NewBlobName(ns, l)
	if a == b {
		t.Errorf("two names for one lease: both %q, want them different", a)
	}
	seg := idem.BlobNamespace(ns)
	if len(seg) != 16 || seg == idem.BlobNamespace(`redis prefix "other:"`) || idem.BlobNamespace("") != "" {
		t.Errorf("BlobNamespace(%q) = %q: want 16 hex digits, another for another namespace, none for none", ns, seg)
	}
	if !strings.HasPrefix(a, idem.BlobPrefix+seg+"/"+key.String()+"/1700000000123-") {
		t.Errorf("name %q: want idem/<ns>/<key>/<token>-<random>", a)
	}
	n, ok := idem.ParseBlobName(a)
	if want := (idem.BlobName{Namespace: seg, Key: key, Token: l.Token}); !ok || n != want {
		t.Errorf("ParseBlobName(%q) = %+v, %v; want %+v, true", a, n, ok, want)
	}
	// Without a namespace: the names written before namespaces.
	old := idem.NewBlobName("", l)
	if !strings.HasPrefix(old, idem.BlobPrefix+key.String()+"/1700000000123-") {
		t.Errorf("name %q: want idem/<key>/<token>-<random>", old)
	}
	n, ok = idem.ParseBlobName(old)
	if want := (idem.BlobName{Key: key, Token: l.Token}); !ok || n != want {
		t.Errorf("ParseBlobName(%q) = %+v, %v; want %+v, true", old, n, ok, want)
	}
	for _, bad := range []string{"", "idem/", "idem/x/1-0123456789abcdef", a + ".1a2b.tmp", strings.Replace(a, "idem/", "other/", 1),
		"idem/" + key.String() + "/01-0123456789abcdef", "idem/" + key.String() + "/1-0123456789ABCDEF",
		"idem/" + key.String() + "/-0123456789abcdef", "idem/" + key.String() + "/1-0123",
		"idem/" + seg + "/1-0123456789abcdef", "idem/" + strings.ToUpper(seg) + "/" + key.String() + "/1-0123456789abcdef",
		"idem/" + seg + "/" + seg + "/" + key.String() + "/1-0123456789abcdef", "idem/" + seg[:15] + "/" + key.String() + "/1-0123456789abcdef"} {
		if _, ok := idem.ParseBlobName(bad); ok {
			t.Errorf("ParseBlobName(%q): ok, want not", bad)
		}
	}
}

// mapBlobs is a minimal idem.BlobStore for the core's tests (package
// blobstore has the real ones, and blobtest their suite).
type mapBlobs struct {
	mu sync.Mutex
	m  map[string][]byte
}

type mapWriter struct {
	s    *mapBlobs
	name string
	buf  bytes.Buffer
}

func (w *mapWriter) Write(p []byte) (int, error) { return w.buf.Write(p) }
func (w *mapWriter) Abort() error                { return nil }
func (w *mapWriter) Close() error {
	w.s.mu.Lock()
	defer w.s.mu.Unlock()
	w.s.m[w.name] = w.buf.Bytes()
	return nil
}

func (s *mapBlobs) Create(_ context.Context, name string) (idem.BlobWriter, error) {
	return &mapWriter{s: s, name: name}, nil
}

func (s *mapBlobs) Open(_ context.Context, name string) (io.ReadCloser, int64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	b, ok := s.m[name]
	if !ok {
		return nil, 0, fmt.Errorf("%w: %s", idem.ErrBlobNotFound, name)
	}
	return io.NopCloser(bytes.NewReader(b)), int64(len(b)), nil
}

func (s *mapBlobs) Delete(_ context.Context, name string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.m, name)
	return nil
}

func (s *mapBlobs) List(_ context.Context, prefix string, fn func(idem.BlobInfo) error) error {
	return nil
}

func (s *mapBlobs) Check(context.Context) error { return nil }

func TestOpenBlobVerifies(t *testing.T) {
	ctx := context.Background()
	s := &mapBlobs{m: map[string][]byte{}}
	body := bytes.Repeat([]byte("0123456789"), 100_000)
	s.m["good"] = body
	s.m["flipped"] = bytes.Clone(body)
	s.m["flipped"][len(body)-1] ^= 1
	s.m["short"] = body[:len(body)-1]
	ref := func(name string) idem.BlobRef {
		return idem.BlobRef{Name: name, Size: int64(len(body)), SHA256: sha256.Sum256(body)}
	}
	r, err := idem.OpenBlob(ctx, s, ref("good"))
	if err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(r)
	if err != nil || !bytes.Equal(got, body) {
		t.Errorf("good blob: got %d bytes, %v; want %d bytes, nil", len(got), err, len(body))
	}
	r.Close()

	r, err = idem.OpenBlob(ctx, s, ref("flipped"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(io.Discard, r); !errors.Is(err, idem.ErrBlobCorrupt) {
		t.Errorf("a flipped bit: got %v, want ErrBlobCorrupt", err)
	}
	if _, err := idem.OpenBlob(ctx, s, ref("short")); !errors.Is(err, idem.ErrBlobCorrupt) {
		t.Errorf("a short blob: got %v, want ErrBlobCorrupt at once", err)
	}
	if _, err := idem.OpenBlob(ctx, s, ref("missing")); !errors.Is(err, idem.ErrBlobNotFound) {
		t.Errorf("a missing blob: got %v, want ErrBlobNotFound", err)
	}
}

// A Guard completes a response with a Blob as it is: the reference is
// replayed, not omitted for its size.
func TestGuardCompletesBlobReference(t *testing.T) {
	ctx := context.Background()
	g, err := idem.New(memstore.New(memstore.Options{}), idem.Config{MaxResponseSize: 10})
	if err != nil {
		t.Fatal(err)
	}
	key, _ := idem.Scope{Route: "r"}.Key("k")
	ref := &idem.BlobRef{Name: "idem/x", Size: 1 << 30}
	if _, err := g.Do(ctx, key, idem.Fingerprint{}, func(context.Context) (*idem.Response, error) {
		return &idem.Response{Status: 200, Blob: ref}, nil
	}); err != nil {
		t.Fatal(err)
	}
	res, err := g.Do(ctx, key, idem.Fingerprint{}, func(context.Context) (*idem.Response, error) {
		t.Error("the work ran again")
		return nil, nil
	})
	if err != nil || !res.Replayed || !reflect.DeepEqual(res.Response.Blob, ref) || res.Response.BodyOmitted {
		t.Errorf("replay: got %+v, %v; want the blob reference %+v", res.Response, err, ref)
	}
}
