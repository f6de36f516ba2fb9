package awskms_test

import (
	"crypto/rand"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/kmstest"
	"github.com/idemkit/idem/seal/awskms"
)

// benchAD is the associated data the Guard seals a record with (its tag,
// key and fingerprint).
var benchAD = []byte("idem/record/v1\x00" + string(make([]byte, len(idem.Key{})+len(idem.Fingerprint{}))))

// BenchmarkSeal and BenchmarkOpen seal and open 1 KiB with the data key
// cached (no KMS call in the loop: the counts are checked).
func BenchmarkSeal(b *testing.B) {
	srv := kmstest.Start(b)
	c := &counting{c: srv.Client()}
	s := mustNew(b, c, srv.KeyARN(), awskms.Options{})
	plain := make([]byte, 1<<10)
	rand.Read(plain)
	var dst []byte
	n := 0
	b.SetBytes(int64(len(plain)))
	b.ReportAllocs()
	for b.Loop() {
		var err error
		if dst, err = s.Seal(dst[:0], plain, benchAD); err != nil {
			b.Fatal(err)
		}
		n++
	}
	// A new data key every DefaultMaxSeals values, none else.
	if g, d := c.counts(); g != 1+int64((n-1)/awskms.DefaultMaxSeals) || d != 0 {
		b.Fatalf("%d Seals: %d GenerateDataKey, %d Decrypt; want %d, 0", n, g, d, 1+(n-1)/awskms.DefaultMaxSeals)
	}
}

func BenchmarkOpen(b *testing.B) {
	srv := kmstest.Start(b)
	c := &counting{c: srv.Client()}
	s := mustNew(b, c, srv.KeyARN(), awskms.Options{})
	plain := make([]byte, 1<<10)
	rand.Read(plain)
	sealed := mustSeal(b, s, nil, plain, benchAD)
	dst := make([]byte, 0, len(plain))
	b.SetBytes(int64(len(plain)))
	b.ReportAllocs()
	for b.Loop() {
		var err error
		if dst, err = s.Open(dst[:0], sealed, benchAD); err != nil {
			b.Fatal(err)
		}
	}
	if g, d := c.counts(); g != 1 || d != 0 {
		b.Fatalf("%d GenerateDataKey, %d Decrypt; want 1, 0", g, d)
	}
}
