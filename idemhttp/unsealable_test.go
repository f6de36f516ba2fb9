package idemhttp_test

import (
	"encoding/json"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/sealtest"
)

// outcomeCounts counts OnOutcome's calls by outcome.
type outcomeCounts struct{ m sync.Map }

func (c *outcomeCounts) on(_ *http.Request, o idemhttp.Outcome) {
	n, _ := c.m.LoadOrStore(o, new(atomic.Int64))
	n.(*atomic.Int64).Add(1)
}

func (c *outcomeCounts) get(o idemhttp.Outcome) int64 {
	if n, ok := c.m.Load(o); ok {
		return n.(*atomic.Int64).Load()
	}
	return 0
}

// A completed record whose sealed response does not open (its key id not
// in the reader's ring, read without a Sealer, one byte altered in the
// store) is answered 500 ProblemResponseUnreadable every time, without
// Retry-After, never replayed, never run again (FailOpen changes
// nothing), logged at ERROR with the key id, and counted as unsealable.
func TestUnsealableRecord(t *testing.T) {
	eachStore(t, func(t *testing.T, store idem.Store) {
		var stored idem.Key // the record's key, from the lease
		a := newServer(t, store, idemhttp.Config{Seal: sealtest.Ring(t, "a1"), Logger: quietLogger()}, func(w http.ResponseWriter, r *http.Request) {
			l, _ := idem.LeaseFromContext(r.Context())
			stored = l.Key
			charge(w, r)
		})
		if got := a.do(t, "POST", "/pay", "k1", `{"card":"4111"}`); got.status != http.StatusCreated {
			t.Fatalf("first: %d %s", got.status, got.body)
		}
		if got := a.do(t, "POST", "/pay", "k1", `{"card":"4111"}`); got.status != http.StatusCreated || got.header.Get(idemhttp.HeaderReplayed) != "true" {
			t.Fatalf("replay with the ring: %d %v", got.status, got.header)
		}

		refused := func(name string, s *server, keyID string, logs *logRecorder, outcomes *outcomeCounts, reader *sdkmetric.ManualReader) {
			t.Helper()
			for range 2 {
				got := s.do(t, "POST", "/pay", "k1", `{"card":"4111"}`)
				var p idemhttp.Problem
				json.Unmarshal([]byte(got.body), &p)
				if got.status != http.StatusInternalServerError || got.header.Get("Content-Type") != "application/problem+json" ||
					p.Type != idemhttp.ProblemResponseUnreadable || p.Status != 500 || !strings.Contains(p.Detail, "will not be executed again") ||
					got.header.Get("Retry-After") != "" || got.header.Get(idemhttp.HeaderReplayed) != "true" || strings.Contains(got.body, "charged") {
					t.Errorf("%s: got %d %v %s; want 500 %s, replayed, no Retry-After", name, got.status, got.header, got.body, idemhttp.ProblemResponseUnreadable)
				}
			}
			if n := s.runs.Load(); n != 0 {
				t.Errorf("%s: the handler ran %d times, want 0", name, n)
			}
			errs := logs.matching(slog.LevelError, "cannot be opened")
			if len(errs) != 2 || errs[0]["key_id"] != keyID || errs[0]["key"] != stored.String() || strings.Contains(errs[0]["error"], "4111") {
				t.Errorf("%s: ERROR lines %v; want 2 naming the key and key_id %q (all: %v)", name, errs, keyID, logs.all())
			}
			if outcomes.get(idemhttp.OutcomeUnsealable) != 2 || outcomes.get(idemhttp.OutcomeStoreError) != 0 {
				t.Errorf("%s: outcomes unsealable %d, store_error %d; want 2, 0", name, outcomes.get(idemhttp.OutcomeUnsealable), outcomes.get(idemhttp.OutcomeStoreError))
			}
			if reader != nil {
				if n := sealtest.Outcomes(t, reader, "http", "unsealable"); n != 2 {
					t.Errorf("%s: idem.outcomes http/unsealable = %d, want 2", name, n)
				}
			}
		}
		reader := sdkmetric.NewManualReader()
		var logsB logRecorder
		var outB outcomeCounts
		b := newServer(t, store, idemhttp.Config{Seal: sealtest.Ring(t, "b1"), FailOpen: true, Logger: slog.New(&logsB), OnOutcome: outB.on,
			MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))}, charge)
		refused("ring without a1", b, "a1", &logsB, &outB, reader)

		var logsN logRecorder
		var outN outcomeCounts
		none := newServer(t, store, idemhttp.Config{Logger: slog.New(&logsN), OnOutcome: outN.on}, charge)
		refused("no Sealer", none, "", &logsN, &outN, nil)

		var logsA logRecorder
		var outA outcomeCounts
		a2 := newServer(t, store, idemhttp.Config{Seal: sealtest.Ring(t, "a1"), Logger: slog.New(&logsA), OnOutcome: outA.on}, charge)
		// a2 holds a fresh key under the id a1: not a1's key, it does not
		// authenticate either. a itself, with the right key, meets the
		// flipped byte.
		refused("another key under a1", a2, "a1", &logsA, &outA, nil)
		sealtest.Flip(t, store, stored)
		if got := a.do(t, "POST", "/pay", "k1", `{"card":"4111"}`); got.status != http.StatusInternalServerError || !strings.Contains(got.body, idemhttp.ProblemResponseUnreadable) {
			t.Errorf("a flipped byte: got %d %s, want 500 %s", got.status, got.body, idemhttp.ProblemResponseUnreadable)
		}
		if n := a.runs.Load(); n != 1 {
			t.Errorf("the handler ran %d times in all, want 1", n)
		}
	})
}
