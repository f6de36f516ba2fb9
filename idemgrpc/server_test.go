package idemgrpc_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemgrpc"
	"github.com/idemkit/idem/internal/redisserver"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/redisstore"
)

// Fifty identical calls at once: one execution, and every caller gets the
// same reply, byte for byte; all but one are marked replayed.
func TestStorm(t *testing.T) {
	eachStore(t, func(t *testing.T, store idem.Store) {
		s := newServer(t, store, idemgrpc.Config{Wait: 10 * time.Second}, func(ctx context.Context, m string, req *structpb.Struct) (*wrapperspb.StringValue, error) {
			time.Sleep(50 * time.Millisecond)
			return charge(ctx, m, req)
		})
		const n = 50
		answers := make([]answer, n)
		var wg sync.WaitGroup
		for i := range n {
			wg.Go(func() { answers[i] = s.call(t.Context(), methodCharge, "storm", map[string]any{"amount": 4200}) })
		}
		wg.Wait()
		wantRuns(t, s, 1)
		replays := 0
		for i, a := range answers {
			if a.err != nil {
				t.Fatalf("call %d: %v", i, a.err)
			}
			if !bytes.Equal(a.raw, answers[0].raw) {
				t.Fatalf("call %d: got reply %q, want %q", i, a.raw, answers[0].raw)
			}
			if a.replayed() {
				replays++
			}
		}
		if replays != n-1 {
			t.Fatalf("replays: got %d, want %d", replays, n-1)
		}
	})
}

// The reply, the header metadata (set with SetHeader or sent with
// SendHeader, binary values included) and the trailer metadata replay byte
// for byte.
func TestReplayByteForByte(t *testing.T) {
	binary := string([]byte{0, 1, 0xfe, 0xff, '\n'})
	eachStore(t, func(t *testing.T, store idem.Store) {
		s := newServer(t, store, idemgrpc.Config{}, func(ctx context.Context, m string, req *structpb.Struct) (*wrapperspb.StringValue, error) {
			header := metadata.Pairs("x-charge", "ch_1", "x-multi", "one", "x-multi", "two", "x-blob-bin", binary)
			var err error
			if req.AsMap()["send"] == true {
				err = grpc.SendHeader(ctx, header)
			} else {
				err = errors.Join(grpc.SetHeader(ctx, header), grpc.SetHeader(ctx, metadata.Pairs("x-late", "set second")))
			}
			if err != nil {
				return nil, err
			}
			if err := grpc.SetTrailer(ctx, metadata.Pairs("x-receipt", "r-1", "x-sig-bin", binary)); err != nil {
				return nil, err
			}
			return wrapperspb.String("charged " + strings.Repeat("é", 600)), nil // long enough to be compressed in the store
		})
		for _, send := range []bool{false, true} {
			key := fmt.Sprintf("bytes-%t", send)
			first := s.call(t.Context(), methodCharge, key, map[string]any{"amount": 1, "send": send})
			replay := s.call(t.Context(), methodCharge, key, map[string]any{"amount": 1, "send": send})
			if first.err != nil || replay.err != nil {
				t.Fatalf("send=%t: errors %v, %v", send, first.err, replay.err)
			}
			if first.replayed() || !replay.replayed() {
				t.Fatalf("send=%t: replayed marks: first %v, replay %v; want only the replay marked", send, first.header, replay.header)
			}
			if !bytes.Equal(first.raw, replay.raw) {
				t.Fatalf("send=%t: reply bytes: got %x, want %x", send, replay.raw, first.raw)
			}
			delete(replay.header, idemgrpc.MetadataReplayed)
			if !sameMD(replay.header, first.header) || len(first.header) < 4 {
				t.Fatalf("send=%t: header metadata: got %q, want %q", send, map[string][]string(replay.header), map[string][]string(first.header))
			}
			if got := first.header.Get("x-blob-bin"); len(got) != 1 || got[0] != binary {
				t.Fatalf("send=%t: binary header: got %q, want %q", send, got, binary)
			}
			if !sameMD(replay.trailer, first.trailer) || first.trailer.Get("x-sig-bin")[0] != binary {
				t.Fatalf("send=%t: trailer metadata: got %q, want %q", send, map[string][]string(replay.trailer), map[string][]string(first.trailer))
			}
		}
		wantRuns(t, s, 2)
	})
}

// A stored error replays with its code, message and details, and the
// metadata the handler set with it.
func TestStoredErrorReplays(t *testing.T) {
	eachStore(t, func(t *testing.T, store idem.Store) {
		s := newServer(t, store, idemgrpc.Config{}, func(ctx context.Context, m string, req *structpb.Struct) (*wrapperspb.StringValue, error) {
			grpc.SetHeader(ctx, metadata.Pairs("x-rule", "amount"))
			grpc.SetTrailer(ctx, metadata.Pairs("x-receipt", "none"))
			st, _ := status.New(codes.InvalidArgument, "amount must be positive").WithDetails(&errdetails.BadRequest{
				FieldViolations: []*errdetails.BadRequest_FieldViolation{{Field: "amount", Description: "must be positive"}},
			})
			return nil, st.Err()
		})
		first := s.call(t.Context(), methodCharge, "bad-amount", map[string]any{"amount": -1})
		replay := s.call(t.Context(), methodCharge, "bad-amount", map[string]any{"amount": -1})
		wantRuns(t, s, 1)
		wantCode(t, "replay", replay.err, codes.InvalidArgument, "")
		if !replay.replayed() {
			t.Fatalf("replay header: got %v, want %s: true", replay.header, idemgrpc.MetadataReplayed)
		}
		if got, want := status.Convert(replay.err).Proto(), status.Convert(first.err).Proto(); !proto.Equal(got, want) || len(got.Details) != 1 {
			t.Fatalf("replayed status: got %v, want %v (with its one detail)", got, want)
		}
		delete(replay.header, idemgrpc.MetadataReplayed)
		if !sameMD(replay.header, first.header) || !sameMD(replay.trailer, first.trailer) || first.trailer.Get("x-receipt")[0] != "none" {
			t.Fatalf("replayed metadata: got %q / %q, want %q / %q", map[string][]string(replay.header), map[string][]string(replay.trailer),
				map[string][]string(first.header), map[string][]string(first.trailer))
		}
	})
}

// DefaultShouldStore: deterministic failures are stored, transient ones
// release the key, so a retry runs the handler again.
func TestStoragePolicy(t *testing.T) {
	stored := map[codes.Code]bool{codes.OK: true, codes.InvalidArgument: true, codes.NotFound: true, codes.AlreadyExists: true,
		codes.PermissionDenied: true, codes.FailedPrecondition: true, codes.OutOfRange: true}
	var fail atomic.Pointer[error]
	s := newServer(t, memstore.New(memstore.Options{}), idemgrpc.Config{}, func(ctx context.Context, m string, req *structpb.Struct) (*wrapperspb.StringValue, error) {
		if err := *fail.Load(); err != nil {
			return nil, err
		}
		return wrapperspb.String("ok"), nil
	})
	type tc struct {
		name string
		err  error
		code codes.Code
	}
	cases := []tc{{"plain error", errors.New("boom"), codes.Unknown}, {"context deadline", context.DeadlineExceeded, codes.DeadlineExceeded}}
	for c := codes.Canceled; c <= codes.Unauthenticated; c++ {
		cases = append(cases, tc{c.String(), status.Error(c, "handler says "+c.String()), c})
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if got := idemgrpc.DefaultShouldStore(t.Context(), c.code); got != stored[c.code] {
				t.Fatalf("DefaultShouldStore(%v): got %t, want %t", c.code, got, stored[c.code])
			}
			fail.Store(&c.err)
			before := s.runs.Load()
			key := "policy-" + strings.ReplaceAll(c.name, " ", "-")
			first := s.call(t.Context(), methodCharge, key, nil)
			second := errors.New("second run")
			fail.Store(&second)
			retry := s.call(t.Context(), methodCharge, key, nil)
			wantCode(t, "first", first.err, c.code, "")
			if stored[c.code] {
				wantRuns(t, s, before+1)
				wantCode(t, "retry (stored)", retry.err, c.code, "")
			} else {
				wantRuns(t, s, before+2)
				if status.Convert(retry.err).Message() != "second run" {
					t.Fatalf("retry (released): got %v, want the handler's second run", retry.err)
				}
			}
		})
	}
}

// The same key with another request: FailedPrecondition, the handler not
// run. The same request with its map built in another order is the same
// request (deterministic encoding).
func TestMismatch(t *testing.T) {
	eachStore(t, func(t *testing.T, store idem.Store) {
		s := newServer(t, store, idemgrpc.Config{}, charge)
		if a := s.call(t.Context(), methodCharge, "order-1", map[string]any{"amount": 4200}); a.err != nil {
			t.Fatal(a.err)
		}
		a := s.call(t.Context(), methodCharge, "order-1", map[string]any{"amount": 9900})
		wantCode(t, "other request", a.err, codes.FailedPrecondition, idemgrpc.ReasonMismatch)
		// The same key on another method is another operation.
		if a := s.call(t.Context(), methodRefund, "order-1", map[string]any{"amount": 9900}); a.err != nil || a.replayed() {
			t.Fatalf("same key, other method: got %v (replayed %t), want a first execution", a.err, a.replayed())
		}
		wantRuns(t, s, 2)

		big := map[string]any{}
		for i := range 40 {
			big[fmt.Sprintf("field-%02d", i)] = map[string]any{"n": i, "tags": []any{"a", "b"}}
		}
		for i := range 10 {
			a := s.call(t.Context(), methodCharge, "big-map", big)
			if a.err != nil || a.replayed() != (i > 0) {
				t.Fatalf("map request, call %d: got %v (replayed %t), want OK, replayed after the first", i, a.err, a.replayed())
			}
		}
	})
}

// Malformed keys get InvalidArgument and run nothing.
func TestMalformedKey(t *testing.T) {
	s := newServer(t, memstore.New(memstore.Options{}), idemgrpc.Config{}, charge)
	for name, md := range map[string][]string{
		"empty":      {idemgrpc.MetadataKey, ""},
		"too long":   {idemgrpc.MetadataKey, strings.Repeat("k", 256)},
		"two values": {idemgrpc.MetadataKey, "a", idemgrpc.MetadataKey, "b"},
	} {
		a := s.call(t.Context(), methodCharge, "", nil, md...)
		wantCode(t, name, a.err, codes.InvalidArgument, idemgrpc.ReasonKeyInvalid)
	}
	if a := s.call(t.Context(), methodCharge, strings.Repeat("k", 255), nil); a.err != nil {
		t.Fatalf("255 characters: %v", a.err)
	}
	// One rule with idemhttp (idem.ValidateKey): an interior space is
	// printable ASCII, as in the quoted form of the Idempotency-Key header.
	if a := s.call(t.Context(), methodCharge, "order 1", nil); a.err != nil {
		t.Fatalf("interior space: %v", a.err)
	}
	wantRuns(t, s, 2)
	for _, bad := range []string{"", "a\x00b", "ключ"} {
		ctx := metadata.NewIncomingContext(t.Context(), metadata.Pairs(idemgrpc.MetadataKey, bad))
		if _, err := idemgrpc.ParseKey(ctx); !errors.Is(err, idem.ErrInvalidKey) || errors.Is(err, idem.ErrMissingKey) {
			t.Fatalf("ParseKey(%q): got %v, want idem.ErrInvalidKey", bad, err)
		}
	}
	if _, err := idemgrpc.ParseKey(t.Context()); !errors.Is(err, idem.ErrMissingKey) || errors.Is(err, idem.ErrInvalidKey) {
		t.Fatalf("ParseKey without the metadata: got %v, want idem.ErrMissingKey", err)
	}
}

// RequireKey: a call without a key gets InvalidArgument; otherwise it
// passes through untouched.
func TestRequireKey(t *testing.T) {
	s := newServer(t, memstore.New(memstore.Options{}), idemgrpc.Config{
		RequireKeyFunc: func(_ context.Context, method string) bool { return method == methodCharge },
	}, charge)
	a := s.call(t.Context(), methodCharge, "", nil)
	wantCode(t, "no key, required", a.err, codes.InvalidArgument, idemgrpc.ReasonKeyMissing)
	wantRuns(t, s, 0)
	for range 2 {
		if a := s.call(t.Context(), methodRefund, "", nil); a.err != nil || a.replayed() {
			t.Fatalf("no key, not required: got %v (replayed %t), want the handler's answer", a.err, a.replayed())
		}
	}
	wantRuns(t, s, 2)
}

// Methods not covered pass through untouched, key or not.
func TestMethods(t *testing.T) {
	s := newServer(t, memstore.New(memstore.Options{}), idemgrpc.Config{Methods: []string{methodCharge}, RequireKey: true}, charge)
	for range 2 {
		if a := s.call(t.Context(), methodRefund, "same", nil); a.err != nil || a.replayed() {
			t.Fatalf("uncovered method: got %v (replayed %t), want the handler's answer", a.err, a.replayed())
		}
	}
	if a := s.call(t.Context(), methodRefund, "", nil); a.err != nil {
		t.Fatalf("uncovered method without a key, RequireKey: got %v, want it to pass", a.err)
	}
	for range 2 {
		s.call(t.Context(), methodCharge, "same", nil)
	}
	wantRuns(t, s, 4)
}

// AIP-155: the key from the request's request_id wins over the metadata;
// the metadata is used when the request has none.
func TestKeyFromMessage(t *testing.T) {
	s := newServer(t, memstore.New(memstore.Options{}), idemgrpc.Config{
		Key: func(_ context.Context, _ string, req any) (string, bool) {
			id := req.(*structpb.Struct).GetFields()["request_id"].GetStringValue()
			return id, id != ""
		},
	}, charge)
	req := map[string]any{"request_id": "4bd9bc0b-0d53-4a5e-8b64-3a8c1d0f6f1e", "amount": 5}
	if a := s.call(t.Context(), methodCharge, "metadata-1", req); a.err != nil || a.replayed() {
		t.Fatalf("first: %v", a.err)
	}
	if a := s.call(t.Context(), methodCharge, "metadata-2", req); a.err != nil || !a.replayed() {
		t.Fatalf("same request_id, other metadata key: got %v (replayed %t), want the replay", a.err, a.replayed())
	}
	noID := map[string]any{"amount": 5}
	s.call(t.Context(), methodCharge, "metadata-3", noID)
	if a := s.call(t.Context(), methodCharge, "metadata-3", noID); !a.replayed() {
		t.Fatalf("no request_id: got %v (replayed %t), want the metadata key's replay", a.err, a.replayed())
	}
	a := s.call(t.Context(), methodCharge, "", map[string]any{"request_id": "ключ"})
	wantCode(t, "malformed request_id", a.err, codes.InvalidArgument, idemgrpc.ReasonKeyInvalid)
	wantRuns(t, s, 2)
}

// One tenant never receives another's replay.
func TestTenantIsolation(t *testing.T) {
	eachStore(t, func(t *testing.T, store idem.Store) {
		s := newServer(t, store, idemgrpc.Config{} /* the default tenant: DefaultTenant */, func(ctx context.Context, m string, req *structpb.Struct) (*wrapperspb.StringValue, error) {
			md, _ := metadata.FromIncomingContext(ctx)
			return wrapperspb.String("for " + md.Get("authorization")[0]), nil
		})
		for range 2 {
			for _, who := range []string{"Bearer alice", "Bearer bob"} {
				a := s.call(t.Context(), methodCharge, "shared-key", nil, "authorization", who)
				if a.err != nil || a.reply != "for "+who {
					t.Fatalf("%s: got %q (%v), want %q", who, a.reply, a.err, "for "+who)
				}
			}
		}
		wantRuns(t, s, 2)
	})
}

// With the store down: Unavailable with RetryInfo, the handler not run
// (FailOpen: run unprotected); back up: served again.
func TestStoreDown(t *testing.T) {
	srv, err := redisserver.StartServer()
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Stop()
	for _, failOpen := range []bool{false, true} {
		t.Run(fmt.Sprintf("FailOpen=%t", failOpen), func(t *testing.T) {
			var outcomes sync.Map
			s := newServer(t, redistest.Store(t, srv, redisstore.Options{}), idemgrpc.Config{FailOpen: failOpen, OnOutcome: func(_ context.Context, _ string, o idemgrpc.Outcome) {
				outcomes.Store(o, true)
			}}, charge)
			if a := s.call(t.Context(), methodCharge, "before", nil); a.err != nil {
				t.Fatalf("Redis up: %v", a.err)
			}
			srv.Kill()
			runs := s.runs.Load()
			a := s.call(t.Context(), methodCharge, "during", nil)
			if failOpen {
				if a.err != nil || s.runs.Load() != runs+1 {
					t.Fatalf("Redis down, fail-open: got %v, want the handler's answer", a.err)
				}
			} else {
				wantCode(t, "Redis down", a.err, codes.Unavailable, idemgrpc.ReasonStoreUnavailable)
				if d, ok := idemgrpc.RetryDelay(a.err); !ok || d != time.Second {
					t.Fatalf("Redis down: RetryInfo %v (%t), want 1s", d, ok)
				}
				wantRuns(t, s, runs)
			}
			if _, ok := outcomes.Load(idemgrpc.OutcomeStoreError); !ok {
				t.Fatal("Redis down: no store_error outcome")
			}
			if err := srv.Restart(); err != nil {
				t.Fatal(err)
			}
			deadline := time.Now().Add(10 * time.Second)
			for s.call(t.Context(), methodCharge, "after", nil).err != nil {
				if time.Now().After(deadline) {
					t.Fatal("Redis back: still failing after 10s")
				}
				time.Sleep(50 * time.Millisecond)
			}
		})
	}
}

// The client gives up (deadline 100ms) while the handler (500ms) runs: the
// handler runs to its end with a live context, metadata it sets after the
// client left is kept, the retry meanwhile gets Aborted with RetryInfo
// (without a wait: Config.Wait negative), and the retry after gets the
// replay. One execution.
func TestClientTimeoutThenRetry(t *testing.T) {
	eachStore(t, func(t *testing.T, store idem.Store) {
		type end struct {
			ctxErr, setErr error
			deadline       bool
		}
		ended := make(chan end, 1)
		s := newServer(t, store, idemgrpc.Config{Wait: -1}, func(ctx context.Context, m string, req *structpb.Struct) (*wrapperspb.StringValue, error) {
			time.Sleep(500 * time.Millisecond)
			_, hasDeadline := ctx.Deadline()
			setErr := errors.Join(grpc.SetHeader(ctx, metadata.Pairs("x-after", "left")), grpc.SetTrailer(ctx, metadata.Pairs("x-t", "1")))
			ended <- end{ctx.Err(), setErr, hasDeadline}
			return charge(ctx, m, req)
		})
		ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
		defer cancel()
		a := s.call(ctx, methodCharge, "timeout", map[string]any{"amount": 7})
		wantCode(t, "first call", a.err, codes.DeadlineExceeded, "")
		a = s.call(t.Context(), methodCharge, "timeout", map[string]any{"amount": 7})
		wantCode(t, "retry while it runs", a.err, codes.Aborted, idemgrpc.ReasonInFlight)
		if d, ok := idemgrpc.RetryDelay(a.err); !ok || d <= 0 || d > time.Second {
			t.Fatalf("retry while it runs: RetryInfo %v (%t), want (0, 1s]", d, ok)
		}
		e := <-ended
		if e.ctxErr != nil || e.setErr != nil || e.deadline {
			t.Fatalf("handler after the client left: ctx.Err %v, SetHeader/SetTrailer %v, deadline %t; want nil, nil, false", e.ctxErr, e.setErr, e.deadline)
		}
		var replay answer
		for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
			if replay = s.call(t.Context(), methodCharge, "timeout", map[string]any{"amount": 7}); status.Code(replay.err) != codes.Aborted || time.Now().After(deadline) {
				break
			}
		}
		if replay.err != nil || !replay.replayed() || !strings.HasPrefix(replay.reply, methodCharge+" 7 token ") {
			t.Fatalf("retry after: got %q (%v, replayed %t), want the replay", replay.reply, replay.err, replay.replayed())
		}
		if replay.header.Get("x-after")[0] != "left" || replay.trailer.Get("x-t")[0] != "1" {
			t.Fatalf("metadata set after the client left: got %v / %v", replay.header, replay.trailer)
		}
		wantRuns(t, s, 1)
	})
}

// slowStore delays Acquire.
type slowStore struct {
	idem.Store
	delay time.Duration
}

func (s slowStore) Acquire(ctx context.Context, req idem.AcquireRequest) (idem.Acquisition, error) {
	time.Sleep(s.delay)
	return s.Store.Acquire(ctx, req)
}

// A client gone before the key is acquired runs nothing, and the key is
// free for its retry.
func TestClientGoneBeforeAcquire(t *testing.T) {
	mem := memstore.New(memstore.Options{})
	gone := make(chan struct{}, 1)
	cfg := idemgrpc.Config{OnOutcome: func(_ context.Context, _ string, o idemgrpc.Outcome) {
		if o == idemgrpc.OutcomeGone {
			gone <- struct{}{}
		}
	}}
	slow := newServer(t, slowStore{mem, 300 * time.Millisecond}, cfg, charge)
	ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
	defer cancel()
	a := slow.call(ctx, methodCharge, "gone", nil)
	wantCode(t, "call", a.err, codes.DeadlineExceeded, "")
	select {
	case <-gone:
	case <-time.After(5 * time.Second):
		t.Fatal("no gone outcome")
	}
	wantRuns(t, slow, 0)
	fast := newServer(t, mem, idemgrpc.Config{}, charge)
	if a := fast.call(t.Context(), methodCharge, "gone", nil); a.err != nil || a.replayed() {
		t.Fatalf("retry: got %v (replayed %t), want a first execution", a.err, a.replayed())
	}
}

// Config.Wait: a duplicate waits for the holder's outcome, woken as soon
// as it is stored; past the bound it gets Aborted.
func TestWait(t *testing.T) {
	for _, c := range []struct {
		wait     time.Duration
		wantCode codes.Code
	}{{3 * time.Second, codes.OK}, {50 * time.Millisecond, codes.Aborted}} {
		t.Run(c.wait.String(), func(t *testing.T) {
			started := make(chan struct{})
			s := newServer(t, memstore.New(memstore.Options{}), idemgrpc.Config{Wait: c.wait}, func(ctx context.Context, m string, req *structpb.Struct) (*wrapperspb.StringValue, error) {
				close(started)
				time.Sleep(300 * time.Millisecond)
				return charge(ctx, m, req)
			})
			done := make(chan answer)
			go func() { done <- s.call(t.Context(), methodCharge, "wait", nil) }()
			<-started
			t0 := time.Now()
			a := s.call(t.Context(), methodCharge, "wait", nil)
			took := time.Since(t0)
			first := <-done
			if status.Code(a.err) != c.wantCode {
				t.Fatalf("duplicate: got %v, want %v", a.err, c.wantCode)
			}
			if c.wantCode == codes.OK && (!a.replayed() || !bytes.Equal(a.raw, first.raw) || took >= c.wait) {
				t.Fatalf("duplicate: got %q replayed %t after %v, want the first reply %q before the wait's end", a.raw, a.replayed(), took, first.raw)
			}
			wantRuns(t, s, 1)
		})
	}
}

// A panicking handler releases the key, and the panic goes on (here to the
// outer recovering interceptor): a retry runs the handler again.
func TestPanicReleases(t *testing.T) {
	var panicked atomic.Bool
	s := newServer(t, memstore.New(memstore.Options{}), idemgrpc.Config{}, func(ctx context.Context, m string, req *structpb.Struct) (*wrapperspb.StringValue, error) {
		if !panicked.Swap(true) {
			panic("boom")
		}
		return charge(ctx, m, req)
	})
	a := s.call(t.Context(), methodCharge, "panic", nil)
	wantCode(t, "panicking handler", a.err, codes.Internal, "")
	if !strings.Contains(a.err.Error(), "boom") {
		t.Fatalf("panic: got %v, want the recovering interceptor's answer", a.err)
	}
	if a := s.call(t.Context(), methodCharge, "panic", nil); a.err != nil || a.replayed() {
		t.Fatalf("retry: got %v (replayed %t), want a new execution", a.err, a.replayed())
	}
	wantRuns(t, s, 2)
}

// MaxExecution and StopContext cancel the handler's context with their
// cause; its DeadlineExceeded / Canceled answer releases the key.
func TestMaxExecutionAndStop(t *testing.T) {
	stop, cancelStop := context.WithCancel(context.Background())
	defer cancelStop()
	causes := make(chan error, 2)
	s := newServer(t, memstore.New(memstore.Options{}), idemgrpc.Config{MaxExecution: 100 * time.Millisecond, StopContext: stop},
		func(ctx context.Context, m string, req *structpb.Struct) (*wrapperspb.StringValue, error) {
			if req.AsMap()["fast"] == true {
				return charge(ctx, m, req)
			}
			<-ctx.Done()
			causes <- context.Cause(ctx)
			return nil, ctx.Err()
		})
	a := s.call(t.Context(), methodCharge, "slow", nil)
	wantCode(t, "past MaxExecution", a.err, codes.DeadlineExceeded, "")
	if got := <-causes; !errors.Is(got, idem.ErrMaxExecution) {
		t.Fatalf("cause: got %v, want ErrMaxExecution", got)
	}
	if a := s.call(t.Context(), methodCharge, "slow", map[string]any{"fast": true}); a.err != nil && status.Code(a.err) == codes.FailedPrecondition {
		t.Fatalf("after MaxExecution: the key was not released (%v)", a.err)
	}
	time.AfterFunc(20*time.Millisecond, cancelStop)
	a = s.call(t.Context(), methodCharge, "stopped", nil)
	wantCode(t, "StopContext", a.err, codes.Canceled, "")
	if got := <-causes; !errors.Is(got, idem.ErrStopped) {
		t.Fatalf("cause: got %v, want ErrStopped", got)
	}
}

// The handler's context carries the lease and the call's method.
func TestHandlerContext(t *testing.T) {
	type seen struct {
		lease  idem.Lease
		ok     bool
		method string
	}
	ch := make(chan seen, 1)
	s := newServer(t, memstore.New(memstore.Options{}), idemgrpc.Config{}, func(ctx context.Context, m string, req *structpb.Struct) (*wrapperspb.StringValue, error) {
		l, ok := idem.LeaseFromContext(ctx)
		method, _ := grpc.Method(ctx)
		ch <- seen{l, ok, method}
		return wrapperspb.String(""), nil
	})
	s.call(t.Context(), methodCharge, "ctx-key", nil)
	sn := <-ch
	want, _ := idem.Scope{Method: methodCharge}.Key("ctx-key")
	if !sn.ok || sn.lease.Key != want || sn.lease.Token == 0 || sn.method != methodCharge {
		t.Fatalf("handler context: got lease %+v (ok %t), method %q; want key %s, a token, method %s", sn.lease, sn.ok, sn.method, want, methodCharge)
	}
}

// An outcome over MaxResponseSize completes the key without being stored:
// the client gets it once, a replay gets DataLoss and the metadata.
func TestResponseTooLarge(t *testing.T) {
	s := newServer(t, memstore.New(memstore.Options{}), idemgrpc.Config{MaxResponseSize: 1024}, func(ctx context.Context, m string, req *structpb.Struct) (*wrapperspb.StringValue, error) {
		grpc.SetHeader(ctx, metadata.Pairs("x-size", "large"))
		return wrapperspb.String(strings.Repeat("x", 4096)), nil
	})
	if a := s.call(t.Context(), methodCharge, "large", nil); a.err != nil || len(a.reply) != 4096 {
		t.Fatalf("first: got %d bytes (%v), want 4096", len(a.reply), a.err)
	}
	a := s.call(t.Context(), methodCharge, "large", nil)
	wantCode(t, "replay", a.err, codes.DataLoss, idemgrpc.ReasonResponseOmitted)
	if a.header.Get(idemgrpc.MetadataBodyOmitted)[0] != "true" || a.header.Get("x-size")[0] != "large" || !a.replayed() {
		t.Fatalf("replay header: got %v", a.header)
	}
	wantRuns(t, s, 1)
}

// toggleTypes resolves message types while on is true.
type toggleTypes struct{ on *atomic.Bool }

func (r toggleTypes) FindMessageByName(name protoreflect.FullName) (protoreflect.MessageType, error) {
	if !r.on.Load() {
		return nil, protoregistry.NotFound
	}
	return protoregistry.GlobalTypes.FindMessageByName(name)
}

func (r toggleTypes) FindMessageByURL(url string) (protoreflect.MessageType, error) {
	return protoregistry.GlobalTypes.FindMessageByURL(url)
}

// A response whose type cannot be resolved is not stored (a retry runs
// again); a stored one that no longer resolves gets Internal, and nothing
// runs.
func TestUnresolvableType(t *testing.T) {
	var on atomic.Bool
	s := newServer(t, memstore.New(memstore.Options{}), idemgrpc.Config{Types: toggleTypes{&on}}, charge)
	for range 2 {
		if a := s.call(t.Context(), methodCharge, "untyped", nil); a.err != nil || a.replayed() {
			t.Fatalf("type unknown: got %v (replayed %t), want an execution", a.err, a.replayed())
		}
	}
	wantRuns(t, s, 2)
	on.Store(true)
	s.call(t.Context(), methodCharge, "typed", nil)
	on.Store(false)
	a := s.call(t.Context(), methodCharge, "typed", nil)
	wantCode(t, "stored type unknown on replay", a.err, codes.Internal, idemgrpc.ReasonUnreplayable)
	wantRuns(t, s, 3)
}

// The interceptor works outside a grpc-go server too (no transport stream
// in the context), as in a handler's unit test.
func TestWithoutServer(t *testing.T) {
	icpt := idemgrpc.UnaryServerInterceptor(memstore.New(memstore.Options{}), idemgrpc.Config{Logger: quietLogger()})
	ctx := metadata.NewIncomingContext(t.Context(), metadata.Pairs(idemgrpc.MetadataKey, "direct"))
	runs := 0
	handler := func(ctx context.Context, req any) (any, error) {
		runs++
		if err := grpc.SetHeader(ctx, metadata.Pairs("x", "y")); err != nil {
			return nil, err
		}
		return wrapperspb.String("done"), nil
	}
	info := &grpc.UnaryServerInfo{FullMethod: methodCharge}
	for range 2 {
		resp, err := icpt(ctx, wrapperspb.String("req"), info, handler)
		if err != nil || resp.(*wrapperspb.StringValue).GetValue() != "done" {
			t.Fatalf("got %v, %v; want done", resp, err)
		}
	}
	if runs != 1 {
		t.Fatalf("runs: got %d, want 1", runs)
	}
	if _, err := icpt(ctx, "not a message", info, handler); status.Code(err) != codes.Internal || idemgrpc.ErrorReason(err) != idemgrpc.ReasonNotFingerprinted {
		t.Fatalf("non-proto request: got %v, want Internal %s", err, idemgrpc.ReasonNotFingerprinted)
	}
}

func TestConfigValidation(t *testing.T) {
	s := memstore.New(memstore.Options{})
	var nilRedis *redisstore.Store
	for name, c := range map[string]struct {
		store idem.Store
		cfg   idemgrpc.Config
	}{
		"nil store":            {nil, idemgrpc.Config{}},
		"typed nil store":      {nilRedis, idemgrpc.Config{}},
		"negative MaxExec":     {s, idemgrpc.Config{MaxExecution: -time.Second}},
		"negative MaxResponse": {s, idemgrpc.Config{MaxResponseSize: -1}},
		"huge MaxResponse":     {s, idemgrpc.Config{MaxResponseSize: idem.MaxEncodedBody + 1}},
		"short method":         {s, idemgrpc.Config{Methods: []string{"Charge"}}},
		"lease":                {s, idemgrpc.Config{Lease: time.Millisecond}},
	} {
		if _, err := idemgrpc.NewUnaryServerInterceptor(c.store, c.cfg); err == nil {
			t.Errorf("%s: got no error, want one", name)
		}
	}
	if _, err := idemgrpc.NewUnaryServerInterceptor(s, idemgrpc.Config{}); err != nil {
		t.Fatalf("zero Config: %v", err)
	}
}

// With the zero Config, a call that meets its key in flight waits up to
// DefaultWait: it gets the replay of work that ends within it, and Aborted
// only for work that outlasts it. Wait negative is Aborted at once.
func TestDefaultWait(t *testing.T) {
	eachStore(t, func(t *testing.T, store idem.Store) {
		started, finish := make(chan struct{}, 1), make(chan struct{})
		h := func(ctx context.Context, m string, req *structpb.Struct) (*wrapperspb.StringValue, error) {
			started <- struct{}{}
			<-finish
			return charge(ctx, m, req)
		}
		s := newServer(t, store, idemgrpc.Config{}, h)
		args := map[string]any{"amount": 3}

		// Work that ends within the wait: the copy gets its replay.
		first := make(chan answer, 1)
		go func() { first <- s.call(t.Context(), methodCharge, "short", args) }()
		<-started
		copyDone := make(chan answer, 1)
		go func() { copyDone <- s.call(t.Context(), methodCharge, "short", args) }()
		time.Sleep(idemgrpc.DefaultWait / 5) // the copy waits
		finish <- struct{}{}
		f, c := <-first, <-copyDone
		if f.err != nil || c.err != nil || !c.replayed() || c.reply != f.reply {
			t.Fatalf("copy while the work runs: got %q (%v, replayed %t), want the replay of %q (%v)", c.reply, c.err, c.replayed(), f.reply, f.err)
		}

		// Work that outlasts the wait: Aborted, after the wait.
		long := make(chan answer, 1)
		go func() { long <- s.call(t.Context(), methodCharge, "long", args) }()
		<-started
		begin := time.Now()
		a := s.call(t.Context(), methodCharge, "long", args)
		wantCode(t, "copy of long work", a.err, codes.Aborted, idemgrpc.ReasonInFlight)
		if waited := time.Since(begin); waited < idemgrpc.DefaultWait {
			t.Fatalf("copy of long work: Aborted after %v, want after the %v wait", waited, idemgrpc.DefaultWait)
		}

		// Wait negative: Aborted at once, while the same work still runs
		// (one store check; a waiting copy of this other interceptor,
		// which does not see the holder, would ask again and again).
		counted := &inFlightCounter{Store: store}
		now := newServer(t, counted, idemgrpc.Config{Wait: -1}, h)
		a = now.call(t.Context(), methodCharge, "long", args)
		wantCode(t, "Wait -1", a.err, codes.Aborted, idemgrpc.ReasonInFlight)
		if n := counted.inFlight.Load(); n != 1 {
			t.Fatalf("Wait -1: %d store checks, want one", n)
		}
		finish <- struct{}{}
		if l := <-long; l.err != nil {
			t.Fatal(l.err)
		}
	})
}

// inFlightCounter counts the Acquires that found the key in flight.
type inFlightCounter struct {
	idem.Store
	inFlight atomic.Int64
}

func (s *inFlightCounter) Acquire(ctx context.Context, req idem.AcquireRequest) (idem.Acquisition, error) {
	acq, err := s.Store.Acquire(ctx, req)
	if err == nil && acq.Outcome == idem.InFlight {
		s.inFlight.Add(1)
	}
	return acq, err
}
