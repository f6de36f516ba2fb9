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

// TestSealedRecordIsCorruptToUnsealedIdem: an idem that does not know
// sealing finds a sealed record corrupt, never a response it would replay.
func TestSealedRecordIsCorruptToUnsealedIdem(t *testing.T) {
	ring, err := seal.ParseRing("k1 " + base64.StdEncoding.EncodeToString(make([]byte, seal.KeySize)))
	if err != nil {
		t.Fatal(err)
	}
	for name, b := range clearRecords(t) {
		sealed := ring.Seal(nil, b, []byte(name))
		var r idem.Response
		if err := r.UnmarshalBinary(sealed); !errors.Is(err, idem.ErrCorrupt) {
			t.Errorf("%s: UnmarshalBinary(sealed record): error %v; want ErrCorrupt", name, err)
		}
		opened, err := ring.Open(nil, sealed, []byte(name))
		if err != nil || !bytes.Equal(opened, b) {
			t.Errorf("%s: Open(Seal(record)) = %x, %v; want the record", name, opened, err)
		}
	}
}
