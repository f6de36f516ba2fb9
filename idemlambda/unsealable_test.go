package idemlambda_test

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-lambda-go/events"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemlambda"
	"github.com/idemkit/idem/internal/sealtest"
)

// errorLines returns the ERROR lines of logs that say a sealed result
// cannot be opened, and forgets every line.
func errorLines(logs *bytes.Buffer) []string {
	var out []string
	for l := range strings.Lines(logs.String()) {
		if strings.Contains(l, "level=ERROR") && strings.Contains(l, "cannot be opened") {
			out = append(out, l)
		}
	}
	logs.Reset()
	return out
}

// An invocation whose key's sealed result does not open (its key id not
// in the ring, read without a Sealer, one byte altered) does not run the
// handler again and is not replayed: a *idem.SealError for a result of
// another type, 500 ProblemResponseUnreadable for an HTTP response, a
// success for an SQS record; each logged at ERROR with the key id.
func TestUnsealableResult(t *testing.T) {
	ctx := withDeadline(10 * time.Second)
	s := newStore(&clock{})
	ringA := sealtest.Ring(t, "a1")
	var logs bytes.Buffer
	log := slog.New(slog.NewTextHandler(&logs, nil))
	rings := []struct {
		name  string
		seal  idem.Sealer
		keyID string
	}{{"ring without a1", sealtest.Ring(t, "b1"), "a1"}, {"no Sealer", nil, ""}}
	wantID := func(id string) string {
		if id == "" {
			return `key_id="" `
		}
		return "key_id=" + id + " "
	}

	// A result of another type.
	f := &fn{}
	cfg := orderConfig()
	cfg.Logger, cfg.Seal = log, ringA
	if _, err := wrap(t, s, cfg, f)(ctx, order{Key: "k", Amount: 1}); err != nil {
		t.Fatal(err)
	}
	if r, err := wrap(t, s, cfg, f)(ctx, order{Key: "k", Amount: 1}); err != nil || r.ID != 1 {
		t.Fatalf("replay with the ring: %+v %v", r, err)
	}
	refused := func(name string, h func(context.Context, order) (receipt, error), keyID string) {
		t.Helper()
		_, err := h(ctx, order{Key: "k", Amount: 1})
		var se *idem.SealError
		if !errors.As(err, &se) || !errors.Is(err, idem.ErrUnsealable) || se.KeyID != keyID || f.runs.Load() != 1 {
			t.Errorf("%s: %v after %d runs; want a SealError naming %q and 1 run", name, err, f.runs.Load(), keyID)
		}
		if l := errorLines(&logs); len(l) != 1 || !strings.Contains(l[0], wantID(keyID)) || !strings.Contains(l[0], "key="+apiKey("k").String()) {
			t.Errorf("%s: ERROR lines %q; want one naming the key and %s", name, l, wantID(keyID))
		}
	}
	for _, r := range rings {
		c := cfg
		c.Seal = r.seal
		refused(r.name, wrap(t, s, c, f), r.keyID)
	}

	// An HTTP response (API Gateway REST).
	ah := &apiHandler{}
	hcfg := func(sealer idem.Sealer) idemlambda.Config[events.APIGatewayProxyRequest] {
		return idemlambda.Config[events.APIGatewayProxyRequest]{Namespace: "fn", Key: idemlambda.APIGatewayKey, Logger: log, Seal: sealer}
	}
	ha, _ := idemlambda.Wrap(s, hcfg(ringA), ah.v1)
	req := restRequest("h1", "POST", "/orders", `{"card":"4111"}`, nil)
	if r, err := ha(ctx, req); err != nil || r.StatusCode != 201 {
		t.Fatalf("first: %+v %v", r, err)
	}
	logs.Reset()
	for _, r := range rings {
		hb, _ := idemlambda.Wrap(s, hcfg(r.seal), ah.v1)
		got, err := hb(ctx, req)
		if err != nil || got.StatusCode != 500 || got.Headers["Content-Type"] != "application/problem+json" || got.Headers["Idempotent-Replayed"] != "true" ||
			!strings.Contains(got.Body, `"type":"`+idemlambda.ProblemResponseUnreadable+`"`) || strings.Contains(got.Body, "4111") || ah.runs != 1 {
			t.Errorf("%s: %+v %v after %d runs; want 500 problem+json %s, replayed, 1 run", r.name, got, err, ah.runs, idemlambda.ProblemResponseUnreadable)
		}
		if l := errorLines(&logs); len(l) != 1 || !strings.Contains(l[0], wantID(r.keyID)) {
			t.Errorf("%s: ERROR lines %q", r.name, l)
		}
	}

	// An SQS record: a success (not delivered again), not run.
	var sqsRuns atomic.Int64
	handler := func(context.Context, events.SQSMessage) error { sqsRuns.Add(1); return nil }
	ha2, _ := idemlambda.WrapSQS(s, idemlambda.SQSConfig{Namespace: "fn", Logger: log, Seal: ringA}, handler)
	ev := events.SQSEvent{Records: []events.SQSMessage{{MessageId: "m1", Body: "ok"}}}
	if resp, err := ha2(ctx, ev); err != nil || failures(resp) != "" {
		t.Fatal(resp, err)
	}
	logs.Reset()
	for _, r := range rings {
		hb, _ := idemlambda.WrapSQS(s, idemlambda.SQSConfig{Namespace: "fn", Logger: log, Seal: r.seal}, handler)
		resp, err := hb(ctx, events.SQSEvent{Records: append(ev.Records, events.SQSMessage{MessageId: "m2", Body: "ok"})})
		if err != nil || failures(resp) != "" || sqsRuns.Load() != 2 {
			t.Errorf("%s: SQS %v %v after %d runs; want no failure, 2 runs (m1 once, m2 now)", r.name, failures(resp), err, sqsRuns.Load())
		}
		sqsRuns.Store(1)
		if l := errorLines(&logs); len(l) != 1 || !strings.Contains(l[0], wantID(r.keyID)) || !strings.Contains(l[0], "messageId=m1") ||
			!strings.Contains(l[0], "key="+sqsKey("m1").String()) {
			t.Errorf("%s: SQS ERROR lines %q", r.name, l)
		}
		s.Delete(ctx, sqsKey("m2")) // m2 runs again in the next round
	}

	// One byte altered, read with the ring that sealed it.
	sealtest.Flip(t, s, apiKey("k"))
	refused("a flipped byte", wrap(t, s, cfg, f), "a1")
}
