package idemgrpc_test

import (
	"context"
	"sync"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/idemkit/idem/idemgrpc"
	"github.com/idemkit/idem/memstore"
)

// The outcome of a call that ran the handler is reported once the key is
// completed or released: executed for a stored outcome, released for a
// transient code (the default policy releases it) and for a panic.
func TestOutcomeReleased(t *testing.T) {
	var mu sync.Mutex
	var got []idemgrpc.Outcome
	fail := true
	s := newServer(t, memstore.New(memstore.Options{}), idemgrpc.Config{OnOutcome: func(_ context.Context, _ string, o idemgrpc.Outcome) {
		mu.Lock()
		got = append(got, o)
		mu.Unlock()
	}}, func(ctx context.Context, m string, req *structpb.Struct) (*wrapperspb.StringValue, error) {
		mu.Lock()
		f := fail
		fail = false
		mu.Unlock()
		if f {
			return nil, status.Error(codes.Unavailable, "try later")
		}
		return charge(ctx, m, req)
	})
	if a := s.call(t.Context(), methodCharge, "r", nil); status.Code(a.err) != codes.Unavailable {
		t.Fatalf("first call: got %v, want Unavailable", a.err)
	}
	if a := s.call(t.Context(), methodCharge, "r", nil); a.err != nil || a.replayed() {
		t.Fatalf("retry: got %v (replayed %t), want a new execution", a.err, a.replayed())
	}
	if a := s.call(t.Context(), methodCharge, "r", nil); a.err != nil || !a.replayed() {
		t.Fatalf("third call: got %v (replayed %t), want the replay", a.err, a.replayed())
	}
	mu.Lock()
	defer mu.Unlock()
	want := []idemgrpc.Outcome{idemgrpc.OutcomeReleased, idemgrpc.OutcomeExecuted, idemgrpc.OutcomeReplayed}
	if len(got) != len(want) || got[0] != want[0] || got[1] != want[1] || got[2] != want[2] {
		t.Errorf("outcomes: got %v, want %v", got, want)
	}
	wantRuns(t, s, 2)
}
