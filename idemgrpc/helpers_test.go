package idemgrpc_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"os"
	"slices"
	"sync/atomic"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemgrpc"
	"github.com/idemkit/idem/internal/redisserver"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/redisstore"
)

var redisSrv *redisserver.Server

func TestMain(m *testing.M) { os.Exit(redistest.Run(m, &redisSrv)) }

// eachStore runs f against memstore and against the real Redis store.
func eachStore(t *testing.T, f func(t *testing.T, store idem.Store)) {
	t.Run("memstore", func(t *testing.T) { f(t, memstore.New(memstore.Options{})) })
	t.Run("redis", func(t *testing.T) { f(t, redistest.Store(t, redisSrv, redisstore.Options{})) })
}

// The test service, registered by hand (no protoc): two unary methods that
// take a google.protobuf.Struct and answer a google.protobuf.StringValue,
// with grpc-go's standard handler shape.
const (
	serviceName  = "idemgrpc.test.Payments"
	methodCharge = "/" + serviceName + "/Charge"
	methodRefund = "/" + serviceName + "/Refund"
)

type handlerFunc func(ctx context.Context, method string, req *structpb.Struct) (*wrapperspb.StringValue, error)

type paymentsServer interface {
	serve(ctx context.Context, method string, req *structpb.Struct) (*wrapperspb.StringValue, error)
}

func unaryHandler(method string) grpc.MethodHandler {
	return func(srv any, ctx context.Context, dec func(any) error, interceptor grpc.UnaryServerInterceptor) (any, error) {
		in := new(structpb.Struct)
		if err := dec(in); err != nil {
			return nil, err
		}
		handler := func(ctx context.Context, req any) (any, error) {
			return srv.(paymentsServer).serve(ctx, method, req.(*structpb.Struct))
		}
		if interceptor == nil {
			return handler(ctx, in)
		}
		return interceptor(ctx, in, &grpc.UnaryServerInfo{Server: srv, FullMethod: method}, handler)
	}
}

var paymentsDesc = grpc.ServiceDesc{
	ServiceName: serviceName,
	HandlerType: (*paymentsServer)(nil),
	Methods: []grpc.MethodDesc{
		{MethodName: "Charge", Handler: unaryHandler(methodCharge)},
		{MethodName: "Refund", Handler: unaryHandler(methodRefund)},
	},
}

// server is the test service on a real loopback listener behind the
// interceptor; runs counts handler executions.
type server struct {
	runs atomic.Int64
	h    handlerFunc
	conn *grpc.ClientConn
	addr string
}

func (s *server) serve(ctx context.Context, method string, req *structpb.Struct) (*wrapperspb.StringValue, error) {
	s.runs.Add(1)
	return s.h(ctx, method, req)
}

// recoverPanics is the outermost interceptor of the test servers: grpc-go
// does not recover a handler's panic, which would end the test binary.
func recoverPanics(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (resp any, err error) {
	defer func() {
		if p := recover(); p != nil {
			err = status.Errorf(codes.Internal, "panic: %v", p)
		}
	}()
	return handler(ctx, req)
}

// newServer starts the test service with the idemgrpc interceptor (and
// extra client interceptors on its connection).
func newServer(t testing.TB, store idem.Store, cfg idemgrpc.Config, h handlerFunc, clientInterceptors ...grpc.UnaryClientInterceptor) *server {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = quietLogger()
	}
	icpt, err := idemgrpc.NewUnaryServerInterceptor(store, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return startServer(t, h, []grpc.UnaryServerInterceptor{recoverPanics, icpt}, clientInterceptors...)
}

func startServer(t testing.TB, h handlerFunc, interceptors []grpc.UnaryServerInterceptor, clientInterceptors ...grpc.UnaryClientInterceptor) *server {
	t.Helper()
	s := &server{h: h}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer(grpc.ChainUnaryInterceptor(interceptors...))
	gs.RegisterService(&paymentsDesc, s)
	go gs.Serve(lis)
	t.Cleanup(gs.Stop)
	s.addr = lis.Addr().String()
	s.conn, err = grpc.NewClient(s.addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithChainUnaryInterceptor(clientInterceptors...))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.conn.Close() })
	return s
}

// answer is what a call got: the reply's value and its raw bytes on the
// wire, the header and trailer metadata, and the error.
type answer struct {
	reply   string
	raw     []byte
	header  metadata.MD
	trailer metadata.MD
	err     error
}

func (a answer) replayed() bool {
	return slices.Equal(a.header.Get(idemgrpc.MetadataReplayed), []string{"true"})
}

// call invokes method with key (none when "") and the request fields, on
// ctx; extra metadata pairs follow the fields as md.
func (s *server) call(ctx context.Context, method, key string, req map[string]any, md ...string) answer {
	if key != "" {
		md = append(md, idemgrpc.MetadataKey, key)
	}
	if len(md) > 0 {
		ctx = metadata.AppendToOutgoingContext(ctx, md...)
	}
	in, err := structpb.NewStruct(req)
	if err != nil {
		return answer{err: err}
	}
	var a answer
	out := &rawReply{}
	a.err = s.conn.Invoke(ctx, method, in, out, grpc.Header(&a.header), grpc.Trailer(&a.trailer), grpc.ForceCodecV2(rawCodec{}))
	a.raw = out.raw
	if a.err == nil {
		v := new(wrapperspb.StringValue)
		if err := proto.Unmarshal(out.raw, v); err != nil {
			a.err = err
		}
		a.reply = v.GetValue()
	}
	return a
}

// rawReply keeps a reply's bytes as they came over the wire.
type rawReply struct{ raw []byte }

// rawCodec is the proto codec, except that it decodes into *rawReply by
// keeping the bytes.
type rawCodec struct{}

func (rawCodec) Marshal(v any) (mem.BufferSlice, error) {
	b, err := proto.Marshal(v.(proto.Message))
	return mem.BufferSlice{mem.SliceBuffer(b)}, err
}

func (rawCodec) Unmarshal(data mem.BufferSlice, v any) error {
	if r, ok := v.(*rawReply); ok {
		r.raw = data.Materialize()
		return nil
	}
	return proto.Unmarshal(data.Materialize(), v.(proto.Message))
}

func (rawCodec) Name() string { return "proto" }

// charge answers "charged <amount> token <fencing token>", with metadata.
func charge(ctx context.Context, method string, req *structpb.Struct) (*wrapperspb.StringValue, error) {
	lease, _ := idem.LeaseFromContext(ctx)
	return wrapperspb.String(fmt.Sprintf("%s %v token %d", method, req.AsMap()["amount"], lease.Token)), nil
}

// sameMD compares metadata by value (MD.String redacts values).
func sameMD(a, b metadata.MD) bool { return maps.EqualFunc(a, b, slices.Equal) }

func quietLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// wantCode fails unless err has code and, when reason is not "", the
// interceptor's reason.
func wantCode(t testing.TB, what string, err error, code codes.Code, reason string) {
	t.Helper()
	if got := status.Code(err); got != code {
		t.Fatalf("%s: got code %v (%v), want %v", what, got, err, code)
	}
	if got := idemgrpc.ErrorReason(err); got != reason {
		t.Fatalf("%s: got reason %q, want %q", what, got, reason)
	}
}

func wantRuns(t testing.TB, s *server, want int64) {
	t.Helper()
	if got := s.runs.Load(); got != want {
		t.Fatalf("handler executions: got %d, want %d", got, want)
	}
}
