package idemgrpc_test

import (
	"context"
	"testing"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/idemkit/idem/idemgrpc"
	"github.com/idemkit/idem/memstore"
)

// Each covered call's outcome is counted in idem.outcomes, layer "grpc",
// and the store calls under it in idem.store.duration.
func TestTelemetry(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	s := newServer(t, memstore.New(memstore.Options{}), idemgrpc.Config{
		MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))}, charge)
	for range 2 {
		if a := s.call(t.Context(), methodCharge, "k1", map[string]any{"amount": 1}); a.err != nil {
			t.Fatal(a.err)
		}
	}
	s.call(t.Context(), methodCharge, "k1", map[string]any{"amount": 2}) // mismatch

	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	got := map[string]int64{}
	var storeCalls uint64
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			switch d := m.Data.(type) {
			case metricdata.Sum[int64]:
				for _, p := range d.DataPoints {
					layer, _ := p.Attributes.Value("idem.layer")
					outcome, _ := p.Attributes.Value("idem.outcome")
					got[m.Name+"/"+layer.AsString()+"/"+outcome.AsString()] += p.Value
				}
			case metricdata.Histogram[float64]:
				for _, p := range d.DataPoints {
					storeCalls += p.Count
				}
			}
		}
	}
	for k, want := range map[string]int64{"idem.outcomes/grpc/executed": 1, "idem.outcomes/grpc/replayed": 1, "idem.outcomes/grpc/mismatch": 1} {
		if got[k] != want {
			t.Errorf("%s: got %d, want %d (all: %v)", k, got[k], want, got)
		}
	}
	if storeCalls < 4 { // three acquires and a complete
		t.Errorf("idem.store.duration: got %d store calls, want at least 4", storeCalls)
	}
}
