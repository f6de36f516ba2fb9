package idem_test

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"io"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/blobstore"
)

// BenchmarkSealedBlob is the replay of a 10 MiB body from a file:// blob
// store (OpenBlob, read in the 64 KiB pieces idemhttp's replay reads),
// clear and sealed side by side (issue 34: sealed at least 0.9× of clear).
func BenchmarkSealedBlob(b *testing.B) {
	const size = 10 << 20
	body := make([]byte, size)
	rand.Read(body)
	ctx := context.Background()
	for _, mode := range []string{"clear", "sealed"} {
		b.Run(mode, func(b *testing.B) {
			bucket, err := blobstore.Open(ctx, "file://"+b.TempDir())
			if err != nil {
				b.Fatal(err)
			}
			defer bucket.Close()
			var bs idem.BlobStore = bucket
			if mode == "sealed" {
				bs = idem.SealBlobs(bucket, testRing(b, "k1"), false)
			}
			ref := idem.BlobRef{Name: "idem/bench", Size: size, SHA256: sha256.Sum256(body)}
			w, err := bs.Create(ctx, ref.Name)
			if err != nil {
				b.Fatal(err)
			}
			if _, err := w.Write(body); err != nil {
				b.Fatal(err)
			}
			if err := w.Close(); err != nil {
				b.Fatal(err)
			}
			buf := make([]byte, 64<<10)
			b.SetBytes(size)
			b.ReportAllocs()
			for b.Loop() {
				r, err := idem.OpenBlob(ctx, bs, ref)
				if err != nil {
					b.Fatal(err)
				}
				var n int64
				for {
					k, err := io.ReadFull(r, buf)
					n += int64(k)
					if err == io.EOF || err == io.ErrUnexpectedEOF {
						break
					}
					if err != nil {
						b.Fatal(err)
					}
				}
				r.Close()
				if n != size {
					b.Fatalf("read %d bytes, want %d", n, size)
				}
			}
		})
	}
}
