package caddyidem

import (
	"context"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/idemkit/idem/idemgrpc"
	"github.com/idemkit/idem/internal/upstreamtest"
)

// grpcUpstream is a grpc-go server on h2c: every method counts an
// execution per idempotency key; "status:N" fails with code N, anything
// else is answered "reply:MSG:RUN" with trailing metadata x-run.
type grpcUpstream struct {
	mu        sync.Mutex
	runs      map[string]int
	deadlines int // keyed executions that saw a deadline (a grpc-timeout)
}

func startGRPCUpstream(t *testing.T) (*grpcUpstream, string) {
	u := &grpcUpstream{runs: map[string]int{}}
	srv := grpc.NewServer(grpc.ForceServerCodec(upstreamtest.RawCodec{}), grpc.UnknownServiceHandler(func(_ any, stream grpc.ServerStream) error {
		var req []byte
		if err := stream.RecvMsg(&req); err != nil {
			return err
		}
		md, _ := metadata.FromIncomingContext(stream.Context())
		key := strings.Join(md.Get("idempotency-key"), ",")
		_, deadline := stream.Context().Deadline()
		u.mu.Lock()
		u.runs[key]++
		n := u.runs[key]
		if deadline {
			u.deadlines++
		}
		u.mu.Unlock()
		stream.SetTrailer(metadata.Pairs("x-run", fmt.Sprint(n)))
		if c, ok := strings.CutPrefix(string(req), "status:"); ok {
			var code int
			fmt.Sscan(c, &code)
			return status.Error(codes.Code(code), "failed "+string(req))
		}
		out := []byte(fmt.Sprintf("reply:%s:%d", req, n))
		return stream.SendMsg(&out)
	}))
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(ln)
	t.Cleanup(srv.Stop)
	return u, ln.Addr().String()
}

func (u *grpcUpstream) count(key string) int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.runs[key]
}

// TestGRPC: through a real Caddy serving h2c (servers { protocols h1 h2
// h2c }), the idempotency handler and reverse_proxy to an h2c upstream
// (transport http { versions h2c }): docs/caddy.md's gRPC Caddyfile, on
// the private Redis. A keyed grpc-go call runs once per
// key and its repeat gets the same message and trailing metadata, with
// idempotent-replayed; another message under the key gets
// FailedPrecondition; a stored InvalidArgument replays, a released
// Unavailable runs again; the upstream never sees the client's deadline.
func TestGRPC(t *testing.T) {
	up, addr := startGRPCUpstream(t)
	_, cf := docCaddyfiles(t) // docs/caddy.md's, as written but for the addresses
	base := loadDocCaddyfile(t, cf, docGRPCApp, addr, docRedisURL, "redis://"+rdb.Addr())
	conn, err := grpc.NewClient(strings.TrimPrefix(base, "http://"), grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.ForceCodec(upstreamtest.RawCodec{})))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	type result struct {
		code           codes.Code
		msg            string
		replayed, xrun string
		statusMessage  string
		reason         string // idemgrpc.ErrorReason
	}
	call := func(key, msg string) result {
		t.Helper()
		ctx, cancel := context.WithTimeout(metadata.AppendToOutgoingContext(context.Background(), "idempotency-key", key), 20*time.Second)
		defer cancel()
		req := []byte(msg)
		var resp []byte
		var header, trailer metadata.MD
		err := conn.Invoke(ctx, "/idem.Test/Do", &req, &resp, grpc.Header(&header), grpc.Trailer(&trailer))
		st := status.Convert(err)
		first := func(md metadata.MD, k string) string {
			if vs := md.Get(k); len(vs) > 0 {
				return vs[0]
			}
			return ""
		}
		// A trailers-only answer (an error status, no header metadata)
		// has all its metadata in the trailer, idempotent-replayed too.
		replayed := first(header, "idempotent-replayed") + first(trailer, "idempotent-replayed")
		return result{st.Code(), string(resp), replayed, first(trailer, "x-run"), st.Message(), idemgrpc.ErrorReason(err)}
	}
	key := "grpc-" + runID
	first, again := call(key, "pay"), call(key, "pay")
	if first.code != codes.OK || first.msg != "reply:pay:1" || first.xrun != "1" || first.replayed != "" {
		t.Fatalf("first call: got %+v, want reply:pay:1 with x-run 1", first)
	}
	if again != (result{codes.OK, first.msg, "true", "1", "", ""}) {
		t.Errorf("repeat: got %+v, want the replay of %+v", again, first)
	}
	if other := call(key, "refund"); other.code != codes.FailedPrecondition || other.reason != idemgrpc.ReasonMismatch {
		t.Errorf("another message under the key: got %+v, want FailedPrecondition, reason %s", other, idemgrpc.ReasonMismatch)
	}
	if n := up.count(key); n != 1 {
		t.Errorf("the key ran %d times, want 1", n)
	}
	for _, c := range []struct {
		msg  string
		code codes.Code
		runs int
	}{{"status:3", codes.InvalidArgument, 1}, {"status:14", codes.Unavailable, 2}} {
		k := key + c.msg
		a, b := call(k, c.msg), call(k, c.msg)
		if a.code != c.code || b.code != c.code || a.statusMessage != "failed "+c.msg || b.statusMessage != a.statusMessage {
			t.Errorf("%s: got %+v then %+v, want %v", c.msg, a, b, c.code)
		}
		if n := up.count(k); n != c.runs {
			t.Errorf("%s ran %d times, want %d", c.msg, n, c.runs)
		}
		if c.runs == 1 && b.replayed != "true" {
			t.Errorf("%s: the repeat is no replay: %+v", c.msg, b)
		}
	}
	up.mu.Lock()
	defer up.mu.Unlock()
	if up.deadlines != 0 {
		t.Errorf("the upstream saw the client's deadline on %d keyed calls, want none", up.deadlines)
	}
}
