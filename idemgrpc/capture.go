package idemgrpc

import (
	"context"
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
