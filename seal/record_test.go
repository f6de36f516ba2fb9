package seal_test

import (
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"net/http"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/seal"
)

// clearRecords returns the root package's own encoding of responses of
// every form its first byte can take: each status form, the JSON-only
// header set, a plain, a compressed, an omitted and a blob body.
func clearRecords(t *testing.T) map[string][]byte {
	t.Helper()
	big := bytes.Repeat([]byte(`{"card":"4111 1111 1111 1111","cvv":"123"}`), 100)
	resps := map[string]*idem.Response{
		"200 json":       {Status: 200, Header: http.Header{"Content-Type": {"application/json"}}, Body: []byte(`{"ok":true}`)},
		"201 no header":  {Status: 201},
		"404 headers":    {Status: 404, Header: http.Header{"Content-Type": {"text/plain"}, "X-Session-Token": {"tok-for-canary"}}, Body: []byte("not found")},
		"999 uvarint":    {Status: 999, Body: []byte{0xFF, 'S', 'L', 1}},
		"0 status":       {Status: 0},
		"200 zstd":       {Status: 200, Header: http.Header{"Content-Type": {"application/json"}}, Body: big},
		"500 omitted":    {Status: 500, Header: http.Header{"Retry-After": {"1"}}, BodyOmitted: true},
		"200 blob":       {Status: 200, Header: http.Header{"Content-Type": {"application/octet-stream"}}, Blob: &idem.BlobRef{Name: "idem/x/y/1-0123456789abcdef", Size: 10 << 20, SHA256: sha256.Sum256(big)}},
		"201 json blob":  {Status: 201, Header: http.Header{"Content-Type": {"application/json"}}, Blob: &idem.BlobRef{Name: "n", Size: 1}},
		"302 json empty": {Status: 302, Header: http.Header{"Content-Type": {"application/json"}}},
	}
	out := map[string][]byte{}
	for name, r := range resps {
		b, err := r.AppendBinary(nil)
		if err != nil {
			t.Fatalf("%s: AppendBinary: %v", name, err)
		}
		out[name] = b
	}
	return out
}

// TestClearRecordsAreNotSealed: sealing turned on over existing records
// must read them as they are, so IsSealed is false for every clear one.
func TestClearRecordsAreNotSealed(t *testing.T) {
	for name, b := range clearRecords(t) {
		if seal.IsSealed(b) {
			t.Errorf("%s: IsSealed(clear record %x) = true; want false", name, b[:min(len(b), 8)])
		}
	}
}

// A Ring is the Sealer the Guard takes.
var _ idem.Sealer = (*seal.Ring)(nil)

// TestSealedRecordIsACarrier: a sealed record read from a store is kept as
// it is (a carrier: Sealed, AppendBinary writes it back unchanged), opens
// with idem.OpenResponse under its own key and fingerprint to the response
// sealed, and is, to an idem built before sealing, a record of the
// reserved encoding version 8 (corrupt, never a response it would replay).
func TestSealedRecordIsACarrier(t *testing.T) {
	ring, err := seal.ParseRing("k1 " + base64.StdEncoding.EncodeToString(make([]byte, seal.KeySize)))
	if err != nil {
		t.Fatal(err)
	}
	key, fp := idem.Key{1}, idem.Fingerprint{2}
	ad := []byte("idem/record/v1\x00" + string(key[:]) + string(fp[:]))
	for name, b := range clearRecords(t) {
		sealed, err := ring.Seal(nil, b, ad)
		if err != nil {
			t.Fatal(err)
		}
		if v := sealed[0]>>5 + 1; v != 8 {
			t.Errorf("%s: a sealed record's first byte says encoding version %d; want the reserved 8", name, v)
		}
		var r idem.Response
		if err := r.UnmarshalBinary(sealed); err != nil || !r.Sealed() {
			t.Fatalf("%s: UnmarshalBinary(sealed record): Sealed %t, error %v; want a carrier", name, r.Sealed(), err)
		}
		if r.Status != 0 || r.Header != nil || r.Body != nil || r.Blob != nil || r.BodyOmitted {
			t.Errorf("%s: the carrier has fields set: %+v", name, r)
		}
		if again, err := r.AppendBinary(nil); err != nil || !bytes.Equal(again, sealed) {
			t.Errorf("%s: AppendBinary(carrier) = %d bytes, %v; want the sealed value as it is", name, len(again), err)
		}
		opened, err := idem.OpenResponse(ring, key, fp, &r)
		if err != nil {
			t.Fatalf("%s: OpenResponse: %v", name, err)
		}
		if enc, err := opened.AppendBinary(nil); err != nil || !bytes.Equal(enc, b) {
			t.Errorf("%s: OpenResponse gave a response that encodes to %x, %v; want %x", name, enc, err, b)
		}
		if _, err := idem.OpenResponse(ring, idem.Key{3}, fp, &r); !errors.Is(err, idem.ErrUnsealable) || !errors.Is(err, seal.ErrTampered) {
			t.Errorf("%s: OpenResponse under another key: error %v; want ErrUnsealable wrapping ErrTampered", name, err)
		}
	}
}

func TestKeyID(t *testing.T) {
	ring, err := seal.ParseRing("key-2026.1 " + base64.StdEncoding.EncodeToString(make([]byte, seal.KeySize)))
	if err != nil {
		t.Fatal(err)
	}
	sealed, err := ring.Seal(nil, []byte("x"), nil)
	if err != nil {
		t.Fatal(err)
	}
	if id, ok := ring.KeyID(sealed); !ok || id != "key-2026.1" {
		t.Errorf("KeyID(sealed) = %q, %t; want key-2026.1, true", id, ok)
	}
	for name, b := range map[string][]byte{
		"clear record":   {0x04, 'x'},
		"other envelope": {0xFF, 'S', 'K', 1, 1, 'k'},
		"version 2":      append([]byte{0xFF, 'S', 'L', 2}, sealed[4:]...),
		"truncated id":   sealed[:6],
		"bad id":         {0xFF, 'S', 'L', 1, 2, 'k', ' '},
		"empty":          nil,
	} {
		if id, ok := ring.KeyID(b); ok {
			t.Errorf("KeyID(%s) = %q, true; want false", name, id)
		}
	}
}
