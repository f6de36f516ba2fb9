// Package sealtest helps the layers' tests of sealed records: key rings of
// fresh random keys, and a completed record whose sealed response is
// altered by one byte in the store.
package sealtest

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"strings"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/seal"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
)

// Ring returns a key ring of a fresh random key for each id, the first
// the primary, parsed by seal.ParseRing from its file form.
func Ring(t testing.TB, ids ...string) *seal.Ring {
	t.Helper()
	var lines []string
	for _, id := range ids {
		lines = append(lines, id+" "+base64.StdEncoding.EncodeToString(key()))
	}
	r, err := seal.ParseRing(strings.Join(lines, "\n"))
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func key() []byte {
	k := make([]byte, seal.KeySize)
	rand.Read(k)
	return k
}

// Flip alters one byte of the sealed response of key's completed record
// in s (in the AEAD tag, at its end), and stores it back as it is, under
// the same key and fingerprint: what an operator, or a broken disk, who
// changes one byte of the stored value leaves. The record must be sealed.
func Flip(t testing.TB, s idem.Store, key idem.Key) {
	t.Helper()
	ctx := context.Background()
	rec, ok, err := s.Get(ctx, key)
	switch {
	case err != nil:
		t.Fatal(err)
	case !ok || rec.State != idem.StateCompleted:
		t.Fatalf("sealtest.Flip: %s has no completed record (found %t, state %v)", key, ok, rec.State)
	case !rec.Response.Sealed():
		t.Fatalf("sealtest.Flip: the record of %s is not sealed", key)
	}
	b, err := rec.Response.AppendBinary(nil)
	if err != nil {
		t.Fatal(err)
	}
	b[len(b)-1] ^= 0x01
	var flipped idem.Response
	if err := flipped.UnmarshalBinary(b); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Delete(ctx, key); err != nil {
		t.Fatal(err)
	}
	g, err := idem.New(s, idem.Config{})
	if err != nil {
		t.Fatal(err)
	}
	att, acq, err := g.Begin(ctx, key, rec.Fingerprint)
	if err != nil || acq.Outcome != idem.Acquired {
		t.Fatalf("sealtest.Flip: re-acquiring %s: %v, %v", key, acq.Outcome, err)
	}
	if err := att.Complete(ctx, &flipped); err != nil {
		t.Fatal(err)
	}
}

// Outcomes is the idem.outcomes counter's value in reader for outcome, in
// layer (every layer when layer is "").
func Outcomes(t testing.TB, reader *sdkmetric.ManualReader, layer, outcome string) int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	var n int64
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != "idem.outcomes" {
				continue
			}
			for _, p := range m.Data.(metricdata.Sum[int64]).DataPoints {
				l, _ := p.Attributes.Value("idem.layer")
				o, _ := p.Attributes.Value("idem.outcome")
				if (layer == "" || l.AsString() == layer) && o.AsString() == outcome {
					n += p.Value
				}
			}
		}
	}
	return n
}
