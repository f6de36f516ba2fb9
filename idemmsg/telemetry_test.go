package idemmsg_test

import (
	"context"
	"errors"
	"testing"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/idemkit/idem/idemmsg"
	"github.com/idemkit/idem/memstore"
)

// Each delivery's outcome is counted (layer "msg"), and a message
// dead-lettered now, not replayed as dead-lettered, in idem.dead_letters.
func TestDeduplicatorTelemetry(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	d, err := idemmsg.New(memstore.New(memstore.Options{}), idemmsg.Config{MaxFailures: 2,
		MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	ok := func(context.Context) error { return nil }
	boom := func(context.Context) error { return errors.New("poison") }
	d.Handle(ctx, idemmsg.Delivery{Key: "m1", Attempt: 1}, ok)  // executed
	d.Handle(ctx, idemmsg.Delivery{Key: "m1", Attempt: 2}, ok)  // replayed
	d.Handle(ctx, idemmsg.Delivery{Key: "p", Attempt: 1}, boom) // released
	d.Handle(ctx, idemmsg.Delivery{Key: "p", Attempt: 2}, boom) // dead-lettered now
	d.Handle(ctx, idemmsg.Delivery{Key: "p", Attempt: 3}, boom) // dead-lettered before
	d.Handle(ctx, idemmsg.Delivery{Key: "", Attempt: 1}, ok)    // invalid key: rejected

	var rm metricdata.ResourceMetrics
	if err := reader.Collect(ctx, &rm); err != nil {
		t.Fatal(err)
	}
	got := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			sum, isSum := m.Data.(metricdata.Sum[int64])
			if !isSum {
				continue
			}
			for _, p := range sum.DataPoints {
				outcome, _ := p.Attributes.Value("idem.outcome")
				got[m.Name+"/"+outcome.AsString()] += p.Value
			}
		}
	}
	want := map[string]int64{"idem.outcomes/executed": 1, "idem.outcomes/replayed": 1, "idem.outcomes/released": 1,
		"idem.outcomes/dead_lettered": 2, "idem.outcomes/rejected": 1, "idem.dead_letters/": 1}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s: got %d, want %d (all: %v)", k, got[k], v, got)
		}
	}
}

// HandleBatch counts each delivery's outcome as Handle does.
func TestDeduplicatorTelemetryBatch(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	d, err := idemmsg.New(memstore.New(memstore.Options{}), idemmsg.Config{MaxFailures: 2,
		MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	dls := []idemmsg.Delivery{{Key: "m1", Attempt: 1}, {Key: "m1", Attempt: 2}, {Key: "f", Attempt: 1}, {Key: "p", Attempt: 2}, {Key: ""}}
	err = d.HandleBatch(ctx, dls, idemmsg.BatchOptions{}, func(_ context.Context, i int) error {
		if dls[i].Key != "m1" {
			return errors.New("poison")
		}
		return nil
	}, func([]idemmsg.Settled) error { return nil })
	if err != nil {
		t.Fatal(err)
	}
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(ctx, &rm); err != nil {
		t.Fatal(err)
	}
	got := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if sum, isSum := m.Data.(metricdata.Sum[int64]); isSum {
				for _, p := range sum.DataPoints {
					outcome, _ := p.Attributes.Value("idem.outcome")
					got[m.Name+"/"+outcome.AsString()] += p.Value
				}
			}
		}
	}
	want := map[string]int64{"idem.outcomes/executed": 1, "idem.outcomes/replayed": 1, "idem.outcomes/released": 1,
		"idem.outcomes/dead_lettered": 1, "idem.outcomes/rejected": 1, "idem.dead_letters/": 1}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s: got %d, want %d (all: %v)", k, got[k], v, got)
		}
	}
}
