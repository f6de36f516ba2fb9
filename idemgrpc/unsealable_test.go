package idemgrpc_test

import (
	"context"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemgrpc"
	"github.com/idemkit/idem/internal/sealtest"
)

// A completed record whose sealed outcome does not open (its key id not
// in the reader's ring, read without a Sealer, one byte altered in the
// store) is DataLoss with reason ReasonUnsealable on every retry, never
// replayed, never run again (FailOpen changes nothing), logged at ERROR
// with the key id, and counted as unsealable.
func TestUnsealableRecord(t *testing.T) {
	eachStore(t, func(t *testing.T, store idem.Store) {
		ctx := t.Context()
		var stored atomic.Value // the record's idem.Key, from the lease
		charge := func(ctx context.Context, _ string, req *structpb.Struct) (*wrapperspb.StringValue, error) {
			l, _ := idem.LeaseFromContext(ctx)
			stored.Store(l.Key)
			return wrapperspb.String("charged " + req.Fields["card"].GetStringValue()), nil
		}
		req := map[string]any{"card": "4111"}
		a := newServer(t, store, idemgrpc.Config{Seal: sealtest.Ring(t, "a1")}, charge)
		if got := a.call(ctx, methodCharge, "k1", req); got.err != nil || got.reply != "charged 4111" {
			t.Fatalf("first: %+v", got)
		}
		if got := a.call(ctx, methodCharge, "k1", req); got.err != nil || !got.replayed() {
			t.Fatalf("replay with the ring: %+v", got)
		}
		key := stored.Load().(idem.Key)

		refused := func(name string, s *server, keyID string, logs *syncBuffer, outcomes *atomic.Int64, reader *sdkmetric.ManualReader, wantRuns int64) {
			t.Helper()
			for range 2 {
				got := s.call(ctx, methodCharge, "k1", req)
				if status.Code(got.err) != codes.DataLoss || idemgrpc.ErrorReason(got.err) != idemgrpc.ReasonUnsealable || !got.replayed() ||
					!strings.Contains(status.Convert(got.err).Message(), "will not be executed again") {
					t.Errorf("%s: got %+v (reason %q); want DataLoss %s, replayed", name, got, idemgrpc.ErrorReason(got.err), idemgrpc.ReasonUnsealable)
				}
				if _, ok := idemgrpc.RetryDelay(got.err); ok {
					t.Errorf("%s: a RetryInfo on %v", name, got.err)
				}
			}
			if n := s.runs.Load(); n != wantRuns {
				t.Errorf("%s: the handler ran %d times, want %d", name, n, wantRuns)
			}
			wantID := "key_id=" + keyID + " "
			if keyID == "" {
				wantID = `key_id="" `
			}
			var lines []string
			for l := range strings.Lines(logs.String()) {
				if strings.Contains(l, "cannot be opened") {
					lines = append(lines, l)
				}
			}
			if len(lines) != 2 || !strings.Contains(lines[0], "level=ERROR") || !strings.Contains(lines[0], wantID) ||
				!strings.Contains(lines[0], "key="+key.String()) || !strings.Contains(lines[0], "method="+methodCharge) || strings.Contains(lines[0], "4111") {
				t.Errorf("%s: log lines %q; want 2 ERROR naming the method, the key and key_id=%s", name, lines, keyID)
			}
			if n := outcomes.Load(); n != 2 {
				t.Errorf("%s: OnOutcome unsealable %d times, want 2", name, n)
			}
			if reader != nil {
				if n := sealtest.Outcomes(t, reader, "grpc", "unsealable"); n != 2 {
					t.Errorf("%s: idem.outcomes grpc/unsealable = %d, want 2", name, n)
				}
			}
		}
		cfg := func(ring idem.Sealer, logs *syncBuffer, n *atomic.Int64) idemgrpc.Config {
			c := idemgrpc.Config{FailOpen: true, Logger: slog.New(slog.NewTextHandler(logs, nil)),
				OnOutcome: func(_ context.Context, _ string, o idemgrpc.Outcome) {
					if o == idemgrpc.OutcomeUnsealable {
						n.Add(1)
					}
				}}
			if ring != nil {
				c.Seal = ring
			}
			return c
		}
		var logsB, logsN, logsA syncBuffer
		var nB, nN, nA atomic.Int64
		reader := sdkmetric.NewManualReader()
		cb := cfg(sealtest.Ring(t, "b1"), &logsB, &nB)
		cb.MeterProvider = sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
		refused("ring without a1", newServer(t, store, cb, charge), "a1", &logsB, &nB, reader, 0)
		refused("no Sealer", newServer(t, store, cfg(nil, &logsN, &nN), charge), "", &logsN, &nN, nil, 0)

		ringA := sealtest.Ring(t, "a1")
		a2 := newServer(t, store, cfg(ringA, &logsA, &nA), charge)
		if got := a2.call(ctx, methodCharge, "k2", req); got.err != nil {
			t.Fatal(got.err)
		}
		key = stored.Load().(idem.Key)
		sealtest.Flip(t, store, key)
		// k2 with its own ring, one byte altered.
		for range 2 {
			got := a2.call(ctx, methodCharge, "k2", req)
			if status.Code(got.err) != codes.DataLoss || idemgrpc.ErrorReason(got.err) != idemgrpc.ReasonUnsealable {
				t.Errorf("a flipped byte: got %+v, want DataLoss %s", got, idemgrpc.ReasonUnsealable)
			}
		}
		if n := a2.runs.Load(); n != 1 {
			t.Errorf("a flipped byte: the handler ran %d times, want 1 (the first call)", n)
		}
		if n := nA.Load(); n != 2 || !strings.Contains(logsA.String(), "key_id=a1 ") {
			t.Errorf("a flipped byte: %d unsealable, logs %s", n, logsA.String())
		}
	})
}
