package idemgrpc

import (
	"maps"
	"net/http"
	"slices"
	"testing"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/idemkit/idem"
)

// roundTrip encodes c, passes it through idem's stored form, and decodes it.
func roundTrip(t *testing.T, c *captured) *captured {
	t.Helper()
	r, err := encode(c, map[string]bool{"x-secret": true}, protoregistry.GlobalTypes)
	if err != nil {
		t.Fatal(err)
	}
	b, err := r.AppendBinary(nil)
	if err != nil {
		t.Fatal(err)
	}
	var stored idem.Response
	if err := stored.UnmarshalBinary(b); err != nil {
		t.Fatal(err)
	}
	got, err := decode(&stored, nil, protoregistry.GlobalTypes)
	if err != nil {
		t.Fatal(err)
	}
	return &got
}

func TestEncodingRoundTrip(t *testing.T) {
	msg, _ := structpb.NewStruct(map[string]any{"b": 2, "a": []any{"x", nil, true}, "c": map[string]any{"d": "e"}})
	header := metadata.MD{"x-a": {"1", "2"}, "x-bin-bin": {"\x00\xff"}, "x-secret": {"s"}}
	trailer := metadata.MD{"x-t": {"t"}, "x-a": {"trailer, not header"}}
	got := roundTrip(t, &captured{resp: msg, header: header, trailer: trailer})
	if !proto.Equal(got.resp.(proto.Message), msg) || got.st != nil {
		t.Fatalf("message: got %v (status %v), want %v", got.resp, got.st, msg)
	}
	delete(header, "x-secret")
	if !sameMD(got.header, header) || !sameMD(got.trailer, trailer) {
		t.Fatalf("metadata: got %q / %q, want %q / %q", got.header, got.trailer, header, trailer)
	}

	st, _ := status.New(codes.NotFound, "no such account").WithDetails(&errdetails.ResourceInfo{ResourceName: "acct_1"})
	got = roundTrip(t, &captured{st: st})
	if got.resp != nil || !proto.Equal(got.st.Proto(), st.Proto()) || got.header != nil || got.trailer != nil {
		t.Fatalf("status: got %v, %v, %v, %v; want %v and no metadata", got.resp, got.st, got.header, got.trailer, st.Proto())
	}
}

func sameMD(a, b metadata.MD) bool { return maps.EqualFunc(a, b, slices.Equal) }

func TestDecodeRefusesCorruptRecords(t *testing.T) {
	okStatus, _ := proto.Marshal(status.New(codes.NotFound, "x").Proto())
	for name, r := range map[string]*idem.Response{
		"HTTP status":           {Status: 200},
		"status past the codes": {Status: statusBase + 17},
		"no message type":       {Status: statusBase},
		"unknown type":          {Status: statusBase, Header: http.Header{headerType: {"no.such.Type"}}},
		"bad message bytes":     {Status: statusBase, Header: http.Header{headerType: {"google.protobuf.Struct"}}, Body: []byte{0xff}},
		"bad status bytes":      {Status: statusBase + int(codes.NotFound), Body: []byte{0xff}},
		"codes disagree":        {Status: statusBase + int(codes.Internal), Body: okStatus},
	} {
		if _, err := decode(r, nil, protoregistry.GlobalTypes); err == nil {
			t.Errorf("%s: got no error, want one", name)
		}
	}
}

func TestEncodeRefusesNonMessages(t *testing.T) {
	for _, resp := range []any{nil, "text", 42} {
		if _, err := encode(&captured{resp: resp}, nil, protoregistry.GlobalTypes); err == nil {
			t.Errorf("encode(%#v): got no error, want one", resp)
		}
	}
}

// TestDefaultFingerprintPooled: DefaultFingerprint, through its pooled
// buffers, gives what it gave with Marshal's own, message after message
// (a buffer reused by a shorter one, an empty one).
func TestDefaultFingerprintPooled(t *testing.T) {
	big, _ := structpb.NewStruct(map[string]any{"b": 2, "a": []any{"x", nil, true}, "c": map[string]any{"d": "e"}})
	for range 3 {
		for _, m := range []proto.Message{big, &structpb.Struct{}, structpb.NewStringValue("v"), big} {
			b, err := deterministic.Marshal(m)
			if err != nil {
				t.Fatal(err)
			}
			want := idem.SumFingerprint(b, "/p.S/M")
			got, err := DefaultFingerprint("/p.S/M", m)
			if err != nil || got != want {
				t.Fatalf("DefaultFingerprint(%v) = %v, %v; want %v", m, got, err, want)
			}
		}
	}
}

// The stored body is deterministic.Marshal's encoding byte for byte,
// whether it fits in the encoded's own array or not, and an empty
// message's is Marshal's own; the body is capped at its length.
func TestEncodeBodyIsMarshal(t *testing.T) {
	long := make([]any, 40)
	for i := range long {
		long[i] = "value"
	}
	var msgs []proto.Message
	for _, v := range []map[string]any{nil, {}, {"a": 1}, {"amount": 1000, "currency": "EUR", "z": true, "b": "x"}, {"list": long}} {
		s, err := structpb.NewStruct(v)
		if err != nil {
			t.Fatal(err)
		}
		msgs = append(msgs, s)
	}
	for _, m := range msgs {
		want, err := deterministic.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		r, err := encode(&captured{resp: m}, nil, protoregistry.GlobalTypes)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(r.Body, want) || (r.Body == nil) != (want == nil) || cap(r.Body) != len(r.Body) {
			t.Errorf("%v: body %x (cap %d), want %x", m, r.Body, cap(r.Body), want)
		}
	}
	for _, st := range []*status.Status{status.New(codes.NotFound, "no"), status.New(codes.InvalidArgument, string(make([]byte, 200)))} {
		want, err := deterministic.Marshal(st.Proto())
		if err != nil {
			t.Fatal(err)
		}
		r, err := encode(&captured{st: st}, nil, protoregistry.GlobalTypes)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(r.Body, want) || cap(r.Body) != len(r.Body) {
			t.Errorf("%v: body %x (cap %d), want %x", st, r.Body, cap(r.Body), want)
		}
	}
}
