package idemgrpc

import (
	"context"
	"strings"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// errHeaderSent is what grpc-go answers to SetHeader or SendHeader after
// the header was sent.
var errHeaderSent = status.Error(codes.Internal, "transport: SendHeader called multiple times")

// captureStream stands in for the call's grpc.ServerTransportStream while
// the handler runs, so that grpc.SetHeader, grpc.SendHeader and
// grpc.SetTrailer reach it: it forwards each to the real stream and keeps
// what was set, for the store. Once the client is gone, the real stream
// refuses them; the copy is still kept and the handler sees no error, so
// the response stored for the retry is the one the handler made.
//
// Keys are made lower case first (lowerKeys), in what it forwards and in
// what it keeps: grpc-go sends a key of a metadata.MD literal as written,
// and an HTTP/2 client refuses a field name in upper case (grpc-go's
// answers the call Internal, "invalid header field name"), so that the
// call and its replays would fail after the handler ran. In lower case,
// the denylist and the replay see one key however the handler spelled it.
type captureStream struct {
	next grpc.ServerTransportStream // nil when the interceptor runs outside a grpc-go server
	req  context.Context            // the call's own context: done once the client is gone

	mu         sync.Mutex
	header     metadata.MD
	trailer    metadata.MD
	headerSent bool
}

func (s *captureStream) Method() string {
	if s.next == nil {
		return ""
	}
	return s.next.Method()
}

func (s *captureStream) SetHeader(md metadata.MD) error {
	if md.Len() == 0 {
		return nil
	}
	md = lowerKeys(md)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.headerSent {
		return errHeaderSent
	}
	if s.next != nil {
		if err := s.forward(s.next.SetHeader(md)); err != nil {
			return err
		}
	}
	s.header = metadata.Join(s.header, md)
	return nil
}

func (s *captureStream) SendHeader(md metadata.MD) error {
	md = lowerKeys(md)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.headerSent {
		return errHeaderSent
	}
	if s.next != nil {
		if err := s.forward(s.next.SendHeader(md)); err != nil {
			return err
		}
	}
	s.headerSent = true
	s.header = metadata.Join(s.header, md)
	return nil
}

func (s *captureStream) SetTrailer(md metadata.MD) error {
	if md.Len() == 0 {
		return nil
	}
	md = lowerKeys(md)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.next != nil {
		if err := s.forward(s.next.SetTrailer(md)); err != nil {
			return err
		}
	}
	s.trailer = metadata.Join(s.trailer, md)
	return nil
}

// forward passes on the real stream's error, unless the client is gone.
func (s *captureStream) forward(err error) error {
	if err != nil && s.req.Err() != nil {
		return nil
	}
	return err
}

// metadata returns copies of what was set.
func (s *captureStream) metadata() (header, trailer metadata.MD) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.header != nil {
		header = s.header.Copy()
	}
	if s.trailer != nil {
		trailer = s.trailer.Copy()
	}
	return header, trailer
}

// lowerKeys returns md with its keys in lower case, as metadata.New and
// metadata.Pairs make them; md itself when they are already (no copy).
// The values of keys that differ only in case are joined.
func lowerKeys(md metadata.MD) metadata.MD {
	upper := false
	for k := range md {
		if hasUpper(k) {
			upper = true
			break
		}
	}
	if !upper {
		return md
	}
	out := make(metadata.MD, len(md))
	for k, vs := range md {
		lk := strings.ToLower(k)
		out[lk] = append(out[lk], vs...)
	}
	return out
}

func hasUpper(s string) bool {
	for i := 0; i < len(s); i++ {
		if 'A' <= s[i] && s[i] <= 'Z' {
			return true
		}
	}
	return false
}
