package idemgrpc

import (
	"fmt"
	"net/http"
	"slices"
	"strings"

	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	"github.com/idemkit/idem"
)

// How a call's outcome is kept in an idem.Response (encoding version 1; see
// the package documentation, "What is stored and replayed"):
//
//	Status  statusBase + the gRPC code (900 for OK ... 916 for Unauthenticated)
//	Header  ":type"           the response message's full name (OK only)
//	        "<key>"           the header metadata the handler set, values in order
//	        ":trailer:<key>"  the trailer metadata the handler set, values in order
//	Body    OK:    the response message, proto-encoded (deterministic)
//	        error: the google.rpc.Status (code, message, details), proto-encoded
//
// gRPC metadata keys are lower-case letters, digits, '-', '_' and '.', so
// the names starting with ':' can never be a handler's. A later version
// would use another status range.
const (
	statusBase    = 900
	headerType    = ":type"
	trailerPrefix = ":trailer:"
)

var deterministic = proto.MarshalOptions{Deterministic: true}

// captured is what a handler produced: its response or its status, and the
// metadata it set.
type captured struct {
	resp    any
	st      *status.Status // nil for OK
	header  metadata.MD
	trailer metadata.MD
}

// encoded is the idem.Response encode makes, with the value of its
// ":type" header and, when it is short, its body: one allocation for
// all. The value's slice and the body are capped, so that an append to
// them never writes here.
type encoded struct {
	resp idem.Response
	typ  [1]string
	body [inlineBody]byte
}

// inlineBody is the longest encoding kept in an encoded itself.
const inlineBody = 64

// marshal is deterministic.Marshal(m), into e's own array when it fits
// (the same bytes; an empty encoding is Marshal's own).
func (e *encoded) marshal(m proto.Message) ([]byte, error) {
	b, err := deterministic.MarshalAppend(e.body[:0], m)
	if err != nil || len(b) == 0 {
		return deterministic.Marshal(m)
	}
	return slices.Clip(b), nil
}

// encode maps c into an idem.Response. deny names metadata keys never
// stored; types must resolve the response's message type, or it could not
// be replayed.
func encode(c *captured, deny map[string]bool, types protoregistry.MessageTypeResolver) (*idem.Response, error) {
	h := make(http.Header, len(c.header)+len(c.trailer)+1)
	for k, vs := range c.header {
		if storable(k, deny) {
			addValues(h, strings.ToLower(k), vs)
		}
	}
	for k, vs := range c.trailer {
		if storable(k, deny) {
			addValues(h, trailerPrefix+strings.ToLower(k), vs)
		}
	}
	e := &encoded{resp: idem.Response{Header: h}}
	r := &e.resp
	if c.st != nil {
		r.Status = statusBase + int(c.st.Code())
		body, err := e.marshal(c.st.Proto())
		if err != nil {
			return nil, fmt.Errorf("idemgrpc: encoding the status: %w", err)
		}
		r.Body = body
		return r, nil
	}
	m := messageV2Of(c.resp)
	if m == nil {
		return nil, fmt.Errorf("idemgrpc: the handler returned %T, not a proto message", c.resp)
	}
	name := m.ProtoReflect().Descriptor().FullName()
	if _, err := types.FindMessageByName(name); err != nil {
		return nil, fmt.Errorf("idemgrpc: response type %s cannot be resolved for a replay (Config.Types): %w", name, err)
	}
	body, err := e.marshal(m)
	if err != nil {
		return nil, fmt.Errorf("idemgrpc: encoding the %T response: %w", c.resp, err)
	}
	r.Status = statusBase + int(codes.OK)
	e.typ[0] = string(name)
	h[headerType] = e.typ[:1:1]
	r.Body = body
	return r, nil
}

// storable reports whether metadata key k (in any case) is stored, or
// replayed.
func storable(k string, deny map[string]bool) bool {
	return k != "" && k[0] != ':' && !deny[strings.ToLower(k)]
}

// addValues sets m[k] to vs, or to a new slice of its values and vs'
// when k already has values (two keys that differ only in case): vs may
// be a stored record's, which is never written to.
func addValues[M ~map[string][]string](m M, k string, vs []string) {
	if prev, ok := m[k]; ok {
		m[k] = slices.Concat(prev, vs)
		return
	}
	m[k] = vs
}

// decode maps a stored idem.Response back: the response (or nil and the
// status) and the metadata to send, in lower case and without the keys
// deny names now (a record stored before they joined the denylist, or by
// v1.0 with keys in upper case). types resolves the response's message
// type. A replay whose body was omitted gets a DataLoss status (OK) or its
// code with a note (errors).
func decode(r *idem.Response, deny map[string]bool, types protoregistry.MessageTypeResolver) (captured, error) {
	code := r.Status - statusBase
	if code < 0 || code > int(codes.Unauthenticated) {
		return captured{}, fmt.Errorf("idemgrpc: stored status %d is not a gRPC code in encoding version 1 (%d to %d)",
			r.Status, statusBase, statusBase+int(codes.Unauthenticated))
	}
	var c captured // by value: no allocation of its own
	var typeName string
	for k, vs := range r.Header {
		switch {
		case k == headerType:
			if len(vs) == 1 {
				typeName = vs[0]
			}
		case strings.HasPrefix(k, trailerPrefix):
			k = k[len(trailerPrefix):]
			if !storable(k, deny) {
				continue
			}
			if c.trailer == nil {
				c.trailer = metadata.MD{}
			}
			addValues(c.trailer, strings.ToLower(k), vs)
		case storable(k, deny):
			if c.header == nil {
				c.header = metadata.MD{}
			}
			addValues(c.header, strings.ToLower(k), vs)
		}
	}
	switch {
	case r.BodyOmitted && code == int(codes.OK):
		c.st = status.New(codes.DataLoss, "idemgrpc: the call with this idempotency key completed, but its response was larger than "+
			"Config.MaxResponseSize and was not stored; it ran once and will not run again for this key")
		c.st = withReason(c.st, ReasonResponseOmitted)
	case r.BodyOmitted:
		c.st = status.New(codes.Code(code), "idemgrpc: the call with this idempotency key failed with this code; "+
			"its status message and details were larger than Config.MaxResponseSize and were not stored")
	case code != int(codes.OK):
		sp := new(spb.Status)
		if err := proto.Unmarshal(r.Body, sp); err != nil {
			return captured{}, fmt.Errorf("idemgrpc: decoding the stored status: %w", err)
		}
		if sp.GetCode() != int32(code) {
			return captured{}, fmt.Errorf("idemgrpc: stored status has code %d, its record says %d", sp.GetCode(), code)
		}
		c.st = status.FromProto(sp)
	default:
		if typeName == "" {
			return captured{}, fmt.Errorf("idemgrpc: stored response has no message type")
		}
		mt, err := types.FindMessageByName(protoreflect.FullName(typeName))
		if err != nil {
			return captured{}, fmt.Errorf("idemgrpc: stored response of type %s: %w", typeName, err)
		}
		m := mt.New().Interface()
		if err := proto.Unmarshal(r.Body, m); err != nil {
			return captured{}, fmt.Errorf("idemgrpc: decoding the stored %s: %w", typeName, err)
		}
		c.resp = m
	}
	return c, nil
}

// withReason adds an ErrorInfo with reason to st.
func withReason(st *status.Status, reason string) *status.Status {
	if s, ok := status.FromError(errorStatus(st.Code(), reason, st.Message(), 0)); ok {
		return s
	}
	return st
}
