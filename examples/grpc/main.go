// Command grpc shows idem's gRPC interceptors on a payments service that
// takes longer than its client is willing to wait. It starts the service on
// 127.0.0.1 (on the embedded in-memory store) and makes one Charge call
// whose client gives each attempt 200ms: the first attempt times out while
// the charge goes on, the retry with the same key is told the charge is in
// flight, and the retry after that gets the stored reply. One charge.
//
//	go run ./examples/grpc
//
// The service is registered by hand (grpc.ServiceDesc with well-known
// types), so the example needs no protoc; generated code works the same.
package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemgrpc"
	"github.com/idemkit/idem/memstore"
)

func main() {
	if err := run(context.Background(), os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "grpc example:", err)
		os.Exit(1)
	}
}

const chargeMethod = "/payments.Payments/Charge"

// payments charges an amount; the provider takes 600ms.
type payments struct{ charges atomic.Int64 }

func (p *payments) Charge(ctx context.Context, amount *wrapperspb.Int64Value) (*wrapperspb.StringValue, error) {
	time.Sleep(600 * time.Millisecond) // the payment provider is slow today
	n := p.charges.Add(1)
	lease, _ := idem.LeaseFromContext(ctx) // the fencing token, for the ledger
	return wrapperspb.String(fmt.Sprintf("ch_%d: %d cents for %s (token %d)", n, amount.GetValue(), account(ctx), lease.Token)), nil
}

type paymentsServer interface {
	Charge(context.Context, *wrapperspb.Int64Value) (*wrapperspb.StringValue, error)
}

var paymentsDesc = grpc.ServiceDesc{
	ServiceName: "payments.Payments",
	HandlerType: (*paymentsServer)(nil),
	Methods: []grpc.MethodDesc{{
		MethodName: "Charge",
		Handler: func(srv any, ctx context.Context, dec func(any) error, interceptor grpc.UnaryServerInterceptor) (any, error) {
			in := new(wrapperspb.Int64Value)
			if err := dec(in); err != nil {
				return nil, err
			}
			handler := func(ctx context.Context, req any) (any, error) {
				return srv.(paymentsServer).Charge(ctx, req.(*wrapperspb.Int64Value))
			}
			if interceptor == nil {
				return handler(ctx, in)
			}
			return interceptor(ctx, in, &grpc.UnaryServerInfo{Server: srv, FullMethod: chargeMethod}, handler)
		},
	}},
}

type accountKey struct{}

// authenticate stands for a real authentication interceptor: it puts the
// caller's account in the context, for idemgrpc's Tenant.
func authenticate(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	token, ok := strings.CutPrefix(strings.Join(md.Get("authorization"), ""), "Bearer ")
	if !ok {
		return nil, status.Error(codes.Unauthenticated, "no bearer token")
	}
	return handler(context.WithValue(ctx, accountKey{}, token), req)
}

// account scopes idempotency keys by the authenticated account.
func account(ctx context.Context) string {
	a, _ := ctx.Value(accountKey{}).(string)
	return a
}

// logAttempts prints each attempt the idemgrpc client interceptor makes.
func logAttempts(w io.Writer) grpc.UnaryClientInterceptor {
	n := 0
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		n++
		var header metadata.MD
		start := time.Now()
		err := invoker(ctx, method, req, reply, cc, append(opts, grpc.Header(&header))...)
		took := time.Since(start).Round(100 * time.Millisecond)
		switch {
		case err == nil && header.Get(idemgrpc.MetadataReplayed) != nil:
			fmt.Fprintf(w, "attempt %d: OK, replayed from the store: %s\n", n, reply.(*wrapperspb.StringValue).GetValue())
		case err == nil:
			fmt.Fprintf(w, "attempt %d: OK: %s\n", n, reply.(*wrapperspb.StringValue).GetValue())
		case status.Code(err) == codes.DeadlineExceeded:
			fmt.Fprintf(w, "attempt %d: %v after %v; the charge goes on on the server\n", n, status.Code(err), took)
		default:
			delay, _ := idemgrpc.RetryDelay(err)
			fmt.Fprintf(w, "attempt %d: %v (%s), retry in %v\n", n, status.Code(err), idemgrpc.ErrorReason(err), delay)
		}
		return err
	}
}

func run(ctx context.Context, w io.Writer) error {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	addr := lis.Addr().String()
	svc := &payments{}

	store := memstore.New(memstore.Options{}) // or redisstore.Open("redis://localhost:6379", redisstore.Options{})
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(
		authenticate, // first: idemgrpc's Tenant needs the caller's identity
		idemgrpc.UnaryServerInterceptor(store, idemgrpc.Config{Tenant: account}),
	))
	srv.RegisterService(&paymentsDesc, svc)
	go srv.Serve(lis)
	defer srv.Stop()

	conn, err := grpc.NewClient(addr,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithChainUnaryInterceptor(
			idemgrpc.UnaryClientInterceptor(idemgrpc.ClientConfig{AttemptTimeout: 200 * time.Millisecond}),
			logAttempts(w), // after it: sees every attempt
		),
	)
	if err != nil {
		return err
	}
	defer conn.Close()

	ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer acct_42")
	reply := new(wrapperspb.StringValue)
	if err := conn.Invoke(ctx, chargeMethod, wrapperspb.Int64(4200), reply); err != nil {
		return err
	}
	fmt.Fprintf(w, "charges made: %d, for one call\n", svc.charges.Load())
	return nil
}
