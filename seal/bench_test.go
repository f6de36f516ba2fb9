package seal_test

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"net/http"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/seal"
)

var benchSizes = []struct {
	name string
	n    int
}{{"1KiB", 1 << 10}, {"10MiB", 10 << 20}}

func benchRing(b *testing.B) *seal.Ring {
	b.Helper()
	k1 := make([]byte, seal.KeySize)
	k2 := make([]byte, seal.KeySize)
	rand.Read(k1)
	rand.Read(k2)
	r, err := seal.ParseRing("k2 " + base64.StdEncoding.EncodeToString(k2) + "\nk1 " + base64.StdEncoding.EncodeToString(k1))
	if err != nil {
		b.Fatal(err)
	}
	return r
}

// benchAD is about what a record's associated data will be: a tag, a
// namespace and a 16-byte record key.
var benchAD = []byte("idem/seal/v1\x00redis:idem:\x00\x01\x02\x03\x04\x05\x06\x07\x08\x09\x0a\x0b\x0c\x0d\x0e\x0f\x10")

func BenchmarkSeal(b *testing.B) {
	r := benchRing(b)
	for _, s := range benchSizes {
		b.Run(s.name, func(b *testing.B) {
			plain := make([]byte, s.n)
			rand.Read(plain)
			dst := make([]byte, 0, s.n+r.Overhead())
			b.SetBytes(int64(s.n))
			b.ReportAllocs()
			for b.Loop() {
				dst = r.Seal(dst[:0], plain, benchAD)
			}
		})
	}
}

func BenchmarkOpen(b *testing.B) {
	r := benchRing(b)
	for _, s := range benchSizes {
		b.Run(s.name, func(b *testing.B) {
			plain := make([]byte, s.n)
			rand.Read(plain)
			sealed := r.Seal(nil, plain, benchAD)
			dst := make([]byte, 0, s.n)
			b.SetBytes(int64(s.n))
			b.ReportAllocs()
			for b.Loop() {
				var err error
				if dst, err = r.Open(dst[:0], sealed, benchAD); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkReplay1KiB is a 1 KiB response's replay decode side by side,
// unsealed (UnmarshalBinary) and sealed (Open, then UnmarshalBinary): the
// issue's 10 µs bound is on the difference.
func BenchmarkReplay1KiB(b *testing.B) {
	r := benchRing(b)
	body := make([]byte, 1<<10)
	rand.Read(body) // incompressible: stored as is
	enc, err := (&idem.Response{Status: 200, Header: http.Header{"Content-Type": {"application/json"}, "X-Session-Token": {"tok-for-canary"}}, Body: body}).AppendBinary(nil)
	if err != nil {
		b.Fatal(err)
	}
	sealed := r.Seal(nil, enc, benchAD)
	b.Run("clear", func(b *testing.B) {
		b.SetBytes(int64(len(enc)))
		b.ReportAllocs()
		for b.Loop() {
			var resp idem.Response
			if err := resp.UnmarshalBinary(enc); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("sealed", func(b *testing.B) {
		b.SetBytes(int64(len(enc)))
		b.ReportAllocs()
		var buf []byte
		for b.Loop() {
			var err error
			if buf, err = r.Open(buf[:0], sealed, benchAD); err != nil {
				b.Fatal(err)
			}
			var resp idem.Response
			if err := resp.UnmarshalBinary(buf); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkBlobCheck10MiB is what an unsealed blob replay does with every
// byte (OpenBlob's SHA-256), the yardstick for Open/10MiB: a sealed replay
// does both.
func BenchmarkBlobCheck10MiB(b *testing.B) {
	p := make([]byte, 10<<20)
	rand.Read(p)
	b.SetBytes(int64(len(p)))
	b.ReportAllocs()
	for b.Loop() {
		sha256.Sum256(p)
	}
}
