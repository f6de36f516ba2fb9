package idemgrpc_test

import (
	"context"
	"slices"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/rueidis"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemgrpc"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/redisstore"
)

// noop is the benchmarks' handler: it does nothing but answer.
func noop(context.Context, string, *structpb.Struct) (*wrapperspb.StringValue, error) {
	return wrapperspb.String(`{"id":"ch_1"}`), nil
}

// pingNoop answers like noop after one Redis PING through a client set up
// as redisstore.Open sets its own: the Redis round trip as a handler pays
// it, with Redis idle between calls as it is in the other cases.
func pingNoop(b *testing.B) handlerFunc {
	c, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: []string{redisSrv.Addr()}, DisableCache: true, MaxFlushDelay: 20 * time.Microsecond})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(c.Close)
	return func(ctx context.Context, m string, req *structpb.Struct) (*wrapperspb.StringValue, error) {
		if err := c.Do(ctx, c.B().Ping().Build()).Error(); err != nil {
			return nil, err
		}
		return noop(ctx, m, req)
	}
}

var benchSeq atomic.Int64

// invoke makes one Charge call; key "" sends none, "new" a fresh one.
func invoke(b *testing.B, conn *grpc.ClientConn, req *structpb.Struct, key string) {
	ctx := context.Background()
	switch key {
	case "":
	case "new":
		ctx = metadata.AppendToOutgoingContext(ctx, idemgrpc.MetadataKey, "k"+strconv.FormatInt(benchSeq.Add(1), 10))
	default:
		ctx = metadata.AppendToOutgoingContext(ctx, idemgrpc.MetadataKey, key)
	}
	out := new(wrapperspb.StringValue)
	if err := conn.Invoke(ctx, methodCharge, req, out); err != nil {
		b.Fatal(err)
	}
}

func reportLatency(b *testing.B, lat []time.Duration) {
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds())/1e3, "p50-µs")
	b.ReportMetric(float64(lat[len(lat)*99/100].Nanoseconds())/1e3, "p99-µs")
}

// BenchmarkLatency makes unary calls one at a time over loopback TCP and
// reports p50/p99 per call: without the interceptor, without it but with
// one Redis PING in the handler (the round trip as a handler pays it), and
// first calls (new keys) and replays through the interceptor on the
// package's private redis-server (as redisstore.Open sets it up) and on
// memstore. Allocations are per call, client included.
//
//	go test -run '^$' -bench Latency -benchtime 5000x ./idemgrpc/
func BenchmarkLatency(b *testing.B) {
	cases := []struct {
		name    string
		store   func(b *testing.B) idem.Store // nil: no interceptor
		handler func(b *testing.B) handlerFunc
		key     string
		tracing bool // the SDK's tracer and meter providers in the interceptor
	}{
		{"no-layer", nil, func(*testing.B) handlerFunc { return noop }, "", false},
		{"no-layer+ping", nil, pingNoop, "", false},
		{"first/redis", func(b *testing.B) idem.Store { return redistest.Store(b, redisSrv, redisstore.Options{}) }, func(*testing.B) handlerFunc { return noop }, "new", false},
		{"replay/redis", func(b *testing.B) idem.Store { return redistest.Store(b, redisSrv, redisstore.Options{}) }, func(*testing.B) handlerFunc { return noop }, "same", false},
		{"first/memstore", func(*testing.B) idem.Store { return memstore.New(memstore.Options{}) }, func(*testing.B) handlerFunc { return noop }, "new", false},
		{"replay/memstore", func(*testing.B) idem.Store { return memstore.New(memstore.Options{}) }, func(*testing.B) handlerFunc { return noop }, "same", false},
		{"first/memstore+otel", func(*testing.B) idem.Store { return memstore.New(memstore.Options{}) }, func(*testing.B) handlerFunc { return noop }, "new", true},
		{"replay/memstore+otel", func(*testing.B) idem.Store { return memstore.New(memstore.Options{}) }, func(*testing.B) handlerFunc { return noop }, "same", true},
	}
	req, _ := structpb.NewStruct(map[string]any{"amount": 1000, "currency": "EUR"})
	for _, c := range cases {
		b.Run(c.name, func(b *testing.B) {
			var s *server
			if c.store == nil {
				s = startServer(b, c.handler(b), nil)
			} else {
				cfg := idemgrpc.Config{}
				if c.tracing { // spans sampled, then dropped; metrics to a manual reader
					cfg.TracerProvider = sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.AlwaysSample()))
					cfg.MeterProvider = sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
				}
				s = newServer(b, c.store(b), cfg, c.handler(b))
			}
			invoke(b, s.conn, req, c.key) // warm: connection, scripts, the replayed key
			lat := make([]time.Duration, 0, b.N)
			b.ReportAllocs()
			for b.Loop() {
				t0 := time.Now()
				invoke(b, s.conn, req, c.key)
				lat = append(lat, time.Since(t0))
			}
			reportLatency(b, lat)
		})
	}
}
