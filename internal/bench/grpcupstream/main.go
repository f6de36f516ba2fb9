// Command grpcupstream is the gRPC upstream of scripts/proxybench-h2.sh:
// a grpc-go server on cleartext HTTP/2 (h2c) whose one unary method,
// bench.Bench/Charge, answers at once, so that what the benchmark
// measures is the proxy in front of it. It listens on the address given
// (127.0.0.1:0 by default) and prints that address on stdout once it
// serves.
//
//	go run ./internal/bench/grpcupstream 127.0.0.1:0
//
// bench.proto beside this file describes the service for load tools
// (ghz --proto). The service is registered by hand with well-known types
// (Int64Value in, StringValue out: the same wire form as bench.proto's
// messages), so no protoc is needed.
package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"strconv"
	"sync/atomic"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// charger is the service's one method; the reply names the call's
// sequence number, as a real service's new resource id would differ per
// call.
type charger struct{ n atomic.Int64 }

func (c *charger) Charge(_ context.Context, in *wrapperspb.Int64Value) (*wrapperspb.StringValue, error) {
	return wrapperspb.String("ch_" + strconv.FormatInt(c.n.Add(1), 10) + " " + strconv.FormatInt(in.GetValue(), 10)), nil
}

type chargeServer interface {
	Charge(context.Context, *wrapperspb.Int64Value) (*wrapperspb.StringValue, error)
}

var benchDesc = grpc.ServiceDesc{
	ServiceName: "bench.Bench",
	HandlerType: (*chargeServer)(nil),
	Methods: []grpc.MethodDesc{{
		MethodName: "Charge",
		Handler: func(srv any, ctx context.Context, dec func(any) error, interceptor grpc.UnaryServerInterceptor) (any, error) {
			in := new(wrapperspb.Int64Value)
			if err := dec(in); err != nil {
				return nil, err
			}
			if interceptor == nil {
				return srv.(chargeServer).Charge(ctx, in)
			}
			return interceptor(ctx, in, &grpc.UnaryServerInfo{Server: srv, FullMethod: "/bench.Bench/Charge"}, func(ctx context.Context, req any) (any, error) {
				return srv.(chargeServer).Charge(ctx, req.(*wrapperspb.Int64Value))
			})
		},
	}},
	Metadata: "bench.proto",
}

func main() {
	addr := "127.0.0.1:0"
	if len(os.Args) > 1 {
		addr = os.Args[1]
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		fmt.Fprintln(os.Stderr, "grpcupstream:", err)
		os.Exit(1)
	}
	srv := grpc.NewServer()
	srv.RegisterService(&benchDesc, &charger{})
	fmt.Println(ln.Addr().String())
	if err := srv.Serve(ln); err != nil {
		fmt.Fprintln(os.Stderr, "grpcupstream:", err)
		os.Exit(1)
	}
}
