package idemmsg_test

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemmsg"
	"github.com/idemkit/idem/internal/sealtest"
)

type lockedLog struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

// lines returns the log lines that contain s, and forgets every line.
func (l *lockedLog) lines(s string) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for line := range strings.Lines(l.b.String()) {
		if strings.Contains(line, s) {
			out = append(out, line)
		}
	}
	l.b.Reset()
	return out
}

// A delivery whose key completed with a sealed result that does not open
// (its key id not in the ring, read without a Sealer, one byte altered)
// is not handled again: Handle and HandleBatch give NoOutcome and the
// *idem.SealError (permanent: with InOrder the batch goes on), log one
// ERROR line with the key id, and count the outcome unsealable.
func TestUnsealableResult(t *testing.T) {
	batchStores(t, func(t *testing.T, store idem.Store, batched bool) {
		ctx := context.Background()
		ns := "unsealable/" + t.Name()
		ringA := sealtest.Ring(t, "a1")
		a := newDedup(t, store, idemmsg.Config{Namespace: ns, Seal: ringA})
		handle(t, a, idemmsg.Delivery{Key: "m1", Attempt: 1}, ok)
		handle(t, a, idemmsg.Delivery{Key: "m2", Attempt: 1}, ok)
		key, _ := a.Key("m1")

		var runs atomic.Int64
		count := func(context.Context) error { runs.Add(1); return nil }
		check := func(name string, d *idemmsg.Deduplicator, logs *lockedLog, keyID string) {
			t.Helper()
			res, err := d.Handle(ctx, idemmsg.Delivery{Key: "m1", Attempt: 2}, count)
			var se *idem.SealError
			if res.Outcome != idemmsg.NoOutcome || !errors.As(err, &se) || !errors.Is(err, idem.ErrUnsealable) || se.KeyID != keyID ||
				errors.As(err, new(*idem.StoreError)) {
				t.Errorf("%s: Handle = %+v, %v; want NoOutcome and a SealError naming %q, not a StoreError", name, res, err, keyID)
			}
			// A batch: m1 first, InOrder; fresh after it still runs.
			var got settlements
			if err := d.HandleBatch(ctx, deliveries("m1", "fresh-"+name), idemmsg.BatchOptions{InOrder: true},
				func(ctx context.Context, _ int) error { return count(ctx) }, got.settle); err != nil {
				t.Fatal(err)
			}
			by := got.byIndex(t)
			if s := by[0]; s.Result.Outcome != idemmsg.NoOutcome || !errors.Is(s.Err, idem.ErrUnsealable) {
				t.Errorf("%s: batch m1 = %+v; want NoOutcome, ErrUnsealable", name, s)
			}
			if s := by[1]; s.Result.Outcome != idemmsg.Executed {
				t.Errorf("%s: batch delivery after m1 = %+v; want Executed (an unsealable key does not stop an InOrder batch)", name, s)
			}
			if n := runs.Load(); n != 1 {
				t.Errorf("%s: the handler ran %d times, want 1 (the fresh key only)", name, n)
			}
			runs.Store(0)
			wantID := "key_id=" + keyID + " "
			if keyID == "" {
				wantID = `key_id="" `
			}
			lines := logs.lines("cannot be opened")
			if len(lines) != 2 || !strings.Contains(lines[0], "level=ERROR") || !strings.Contains(lines[0], wantID) ||
				!strings.Contains(lines[0], "key="+key.String()) || !strings.Contains(lines[1], wantID) {
				t.Errorf("%s: log lines %q; want 2 ERROR lines naming the key and %s", name, lines, wantID)
			}
		}
		reader := sdkmetric.NewManualReader()
		var logs lockedLog
		b := newDedup(t, store, idemmsg.Config{Namespace: ns, Seal: sealtest.Ring(t, "b1"), Logger: slog.New(slog.NewTextHandler(&logs, nil)),
			MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))})
		check("ring without a1", b, &logs, "a1")
		if n := sealtest.Outcomes(t, reader, "", "unsealable"); n != 2 {
			t.Errorf("idem.outcomes unsealable = %d, want 2 (Handle and HandleBatch)", n)
		}
		none := newDedup(t, store, idemmsg.Config{Namespace: ns, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
		check("no Sealer", none, &logs, "")
		sealtest.Flip(t, store, key)
		a2 := newDedup(t, store, idemmsg.Config{Namespace: ns, Seal: ringA, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
		check("a flipped byte", a2, &logs, "a1")
		if res := handle(t, a2, idemmsg.Delivery{Key: "m2", Attempt: 2}, count); res.Outcome != idemmsg.Replayed {
			t.Errorf("m2, not altered: %v, want Replayed", res.Outcome)
		}
	})
}
