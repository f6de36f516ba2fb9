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

// benchKey and benchFP are a record's key and fingerprint, and benchAD the
// associated data the Guard seals its response with.
var (
	benchKey = idem.Key{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16}
	benchFP  = idem.Fingerprint{16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1}
	benchAD  = []byte("idem/record/v1\x00" + string(benchKey[:]) + string(benchFP[:]))
)

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
				var err error
				if dst, err = r.Seal(dst[:0], plain, benchAD); err != nil {
					b.Fatal(err)
				}
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
			sealed, err := r.Seal(nil, plain, benchAD)
			if err != nil {
				b.Fatal(err)
			}
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
// unsealed (UnmarshalBinary) and sealed (idem.OpenResponse of the carrier
// UnmarshalBinary keeps): the 10 µs bound is on the difference. The
// root package's BenchmarkGuardReplaySealed measures it through Guard.Do.
func BenchmarkReplay1KiB(b *testing.B) {
	r := benchRing(b)
	body := make([]byte, 1<<10)
	rand.Read(body) // incompressible: stored as is
	enc, err := (&idem.Response{Status: 200, Header: http.Header{"Content-Type": {"application/json"}, "X-Session-Token": {"tok-for-canary"}}, Body: body}).AppendBinary(nil)
	if err != nil {
		b.Fatal(err)
	}
	sealed, err := r.Seal(nil, enc, benchAD)
	if err != nil {
		b.Fatal(err)
	}
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
		for b.Loop() {
			var carrier idem.Response
			if err := carrier.UnmarshalBinary(sealed); err != nil {
				b.Fatal(err)
			}
			if _, err := idem.OpenResponse(r, benchKey, benchFP, &carrier); err != nil {
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
