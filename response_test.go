package idem_test

import (
	"bytes"
	"crypto/rand"
	"errors"
	"net/http"
	"reflect"
	"strings"
	"testing"

	"github.com/idemkit/idem"
)

func roundTrip(t *testing.T, r *idem.Response) (*idem.Response, int) {
	t.Helper()
	b, err := r.AppendBinary(nil)
	if err != nil {
		t.Fatalf("AppendBinary: %v", err)
	}
	var got idem.Response
	if err := got.UnmarshalBinary(b); err != nil {
		t.Fatalf("UnmarshalBinary: %v", err)
	}
	return &got, len(b)
}

func TestResponseRoundTrip(t *testing.T) {
	random := make([]byte, 8<<10)
	rand.Read(random)
	json := []byte(`{"id":"ch_1","items":[` + strings.Repeat(`{"sku":"A-100","qty":1},`, 100) + `{}]}`)
	cases := []*idem.Response{
		{Status: 200},
		{Status: 201, Header: http.Header{"Content-Type": {"application/json"}}, Body: []byte(`{"ok":true}`)},
		{Status: 0},
		{Status: 100},
		{Status: 355},
		{Status: 356},
		{Status: 999, Body: []byte{0}},
		{Status: 422, Header: http.Header{"Content-Type": {"application/problem+json"}, "X-Custom": {"a", "b", ""}, "Location": {"/x"}}, Body: []byte("{}")},
		{Status: 200, Header: http.Header{"Content-Type": {"application/json"}}, Body: json},
		{Status: 200, Header: http.Header{"Content-Type": {"application/octet-stream"}}, Body: random},
		{Status: 200, Header: http.Header{"Content-Encoding": {"gzip"}}, Body: json},
		{Status: 200, Header: http.Header{"Content-Type": {"application/json"}}, BodyOmitted: true},
	}
	for i, want := range cases {
		got, _ := roundTrip(t, want)
		if got.Status != want.Status || !bytes.Equal(got.Body, want.Body) || got.BodyOmitted != want.BodyOmitted ||
			!(len(got.Header) == 0 && len(want.Header) == 0 || reflect.DeepEqual(got.Header, want.Header)) {
			t.Errorf("case %d: got %+v, want %+v", i, got, want)
		}
	}
}

func TestResponseSize(t *testing.T) {
	// The common case costs one byte besides the body.
	small := &idem.Response{Status: 200, Header: http.Header{"Content-Type": {"application/json"}}, Body: []byte(`{"ok":true}`)}
	if _, n := roundTrip(t, small); n != 1+len(small.Body) {
		t.Errorf("JSON 200: got %d bytes, want %d", n, 1+len(small.Body))
	}
	json := []byte(strings.Repeat(`{"sku":"A-100","qty":1},`, 200))
	if _, n := roundTrip(t, &idem.Response{Status: 200, Body: json}); n >= len(json)/2 {
		t.Errorf("%d-byte JSON body: encoded in %d bytes, want it compressed", len(json), n)
	}
	// Already encoded content is left alone.
	if _, n := roundTrip(t, &idem.Response{Status: 200, Header: http.Header{"Content-Encoding": {"br"}}, Body: json}); n < len(json) {
		t.Errorf("body with Content-Encoding: encoded in %d bytes, want it stored as is", n)
	}
}

func TestResponseLimits(t *testing.T) {
	if _, err := (&idem.Response{Status: 200, Body: make([]byte, idem.MaxEncodedBody+1)}).AppendBinary(nil); err == nil {
		t.Error("body over MaxEncodedBody: got nil error, want one")
	}
	// Compression starts at CompressMinSize.
	json := func(n int) []byte { return []byte(strings.Repeat("{}", n/2)) }
	if _, n := roundTrip(t, &idem.Response{Status: 200, Body: json(idem.CompressMinSize - 2)}); n != 2+idem.CompressMinSize-2 { // flags, a zero header count, the body
		t.Errorf("body under CompressMinSize: encoded in %d bytes, want it stored as is", n)
	}
	if _, n := roundTrip(t, &idem.Response{Status: 200, Body: json(idem.CompressMinSize)}); n >= idem.CompressMinSize/2 {
		t.Errorf("body of CompressMinSize: encoded in %d bytes, want it compressed", n)
	}
	// A compressed body whose recorded length is wrong is refused.
	b, _ := (&idem.Response{Status: 200, Body: json(4096)}).AppendBinary(nil)
	b[1]++ // the uvarint length right after the flags byte
	var r idem.Response
	if err := r.UnmarshalBinary(b); !errors.Is(err, idem.ErrCorrupt) {
		t.Errorf("wrong recorded length: got %v, want ErrCorrupt", err)
	}
}

func TestResponseBadInput(t *testing.T) {
	var nilResp *idem.Response
	if _, err := nilResp.AppendBinary(nil); err == nil {
		t.Error("nil *Response: got nil error, want one")
	}
	for _, st := range []int{-1, 1000} {
		if _, err := (&idem.Response{Status: st}).AppendBinary(nil); err == nil {
			t.Errorf("status %d: got nil error, want one", st)
		}
	}
	corrupt := map[string][]byte{
		"empty":                  nil,
		"unknown version":        {0xE0},
		"truncated status":       {0x02},
		"truncated uvarint":      {0x03, 0x80},
		"status over 999":        {0x03, 0xE8, 0x07},
		"missing header count":   {0x01},
		"header count too large": {0x02, 1, 50},
		"unknown header code":    {0x00, 1, 200, 1},
		"truncated literal":      {0x00, 1, 0, 9, 'a'},
		"bad zstd body":          {0x0C, 'g', 'a', 'r', 'b'},
		"omitted body with data": {0x14, 'x'},
	}
	for name, b := range corrupt {
		var r idem.Response
		if err := r.UnmarshalBinary(b); !errors.Is(err, idem.ErrCorrupt) {
			t.Errorf("%s (%x): got %v, want an error wrapping ErrCorrupt", name, b, err)
		}
	}
}

// FuzzResponseDecode: decoding arbitrary bytes never panics, and whatever
// decodes re-encodes to something that decodes to the same response.
func FuzzResponseDecode(f *testing.F) {
	for _, r := range []*idem.Response{
		{Status: 200},
		{Status: 404, Header: http.Header{"X-A": {"b"}}, Body: []byte("nope")},
		{Status: 200, Body: bytes.Repeat([]byte("abc"), 500)},
		{Status: 200, Blob: &idem.BlobRef{Name: "idem/x/1-0123456789abcdef", Size: 1 << 30}},
	} {
		b, _ := r.AppendBinary(nil)
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		var r idem.Response
		if r.UnmarshalBinary(data) != nil {
			return
		}
		b, err := r.AppendBinary(nil)
		if err != nil {
			t.Fatalf("re-encode: %v", err)
		}
		var again idem.Response
		if err := again.UnmarshalBinary(b); err != nil {
			t.Fatalf("decode of re-encoding: %v", err)
		}
		if again.Status != r.Status || !bytes.Equal(again.Body, r.Body) || again.BodyOmitted != r.BodyOmitted ||
			!reflect.DeepEqual(again.Blob, r.Blob) ||
			!(len(again.Header) == 0 && len(r.Header) == 0 || reflect.DeepEqual(again.Header, r.Header)) {
			t.Fatalf("re-encoding changed the response: %+v vs %+v", again, r)
		}
	})
}
