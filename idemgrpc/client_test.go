package idemgrpc_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemgrpc"
	"github.com/idemkit/idem/memstore"
)

// keys records the idempotency key of every attempt that reaches the
// handler, or "" for none.
type keys struct {
	mu   sync.Mutex
	seen []string
}

func (k *keys) record(ctx context.Context) {
	md, _ := metadata.FromIncomingContext(ctx)
	k.mu.Lock()
	defer k.mu.Unlock()
	k.seen = append(k.seen, append(md.Get(idemgrpc.MetadataKey), "")[0])
}

func (k *keys) get() []string {
	k.mu.Lock()
	defer k.mu.Unlock()
	return append([]string(nil), k.seen...)
}

// The client adds a UUIDv4 key per call, keeps one that is there, and
// leaves calls of methods not covered alone.
func TestClientKeys(t *testing.T) {
	var k keys
	s := startServer(t, func(ctx context.Context, m string, req *structpb.Struct) (*wrapperspb.StringValue, error) {
		k.record(ctx)
		return wrapperspb.String("ok"), nil
	}, nil, idemgrpc.UnaryClientInterceptor(idemgrpc.ClientConfig{Methods: []string{methodCharge}}))
	s.call(t.Context(), methodCharge, "", nil)
	s.call(t.Context(), methodCharge, "", nil)
	s.call(t.Context(), methodCharge, "mine", nil)
	s.call(idemgrpc.WithKey(t.Context(), "with-key"), methodCharge, "", nil)
	s.call(t.Context(), methodRefund, "", nil)
	got := k.get()
	for i, key := range got[:2] {
		if id, err := uuid.Parse(key); err != nil || id.Version() != 4 {
			t.Fatalf("generated key %d: got %q, want a UUIDv4", i, key)
		}
	}
	if got[0] == got[1] || got[2] != "mine" || got[3] != "with-key" || got[4] != "" {
		t.Fatalf("keys: got %q, want two distinct UUIDs, mine, with-key, none", got)
	}
}

// A duplicate sent while the first call runs gets Aborted; the client
// retries it, with its key, until the replay. One execution.
func TestClientRetriesAbortedUntilReplay(t *testing.T) {
	eachStore(t, func(t *testing.T, store idem.Store) {
		var k keys
		started := make(chan struct{})
		var once sync.Once
		s := newServer(t, store, idemgrpc.Config{}, func(ctx context.Context, m string, req *structpb.Struct) (*wrapperspb.StringValue, error) {
			k.record(ctx)
			once.Do(func() { close(started) })
			time.Sleep(300 * time.Millisecond)
			return charge(ctx, m, req)
		}, idemgrpc.UnaryClientInterceptor(idemgrpc.ClientConfig{MinBackoff: 20 * time.Millisecond, MaxAttempts: 50}))
		ctx := idemgrpc.WithKey(t.Context(), "retry-me")
		first := make(chan answer)
		go func() { first <- s.call(ctx, methodCharge, "", map[string]any{"amount": 3}) }()
		<-started
		dup := s.call(ctx, methodCharge, "", map[string]any{"amount": 3})
		a := <-first
		if a.err != nil || dup.err != nil || !dup.replayed() || dup.reply != a.reply {
			t.Fatalf("duplicate: got %q (%v, replayed %t), want the first's %q (%v) replayed", dup.reply, dup.err, dup.replayed(), a.reply, a.err)
		}
		wantRuns(t, s, 1)
		if got := k.get(); len(got) != 1 || got[0] != "retry-me" {
			t.Fatalf("keys seen by the handler: got %q", got)
		}
	})
}

// AttemptTimeout: the first attempt is abandoned, its work runs on; the
// retries, with the same key, end with its stored reply. One execution.
func TestClientAttemptTimeout(t *testing.T) {
	var outcomes sync.Map
	var mu sync.Mutex
	var attempts []string
	logAttempts := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		t0 := time.Now()
		err := invoker(ctx, method, req, reply, cc, opts...)
		dl, _ := ctx.Deadline()
		mu.Lock()
		attempts = append(attempts, fmt.Sprintf("after %v (deadline %v from the start): %v", time.Since(t0), dl.Sub(t0), err))
		mu.Unlock()
		return err
	}
	s := newServer(t, memstore.New(memstore.Options{}), idemgrpc.Config{OnOutcome: func(_ context.Context, _ string, o idemgrpc.Outcome) {
		n, _ := outcomes.LoadOrStore(o, new(atomic.Int64))
		n.(*atomic.Int64).Add(1)
	}}, func(ctx context.Context, m string, req *structpb.Struct) (*wrapperspb.StringValue, error) {
		time.Sleep(500 * time.Millisecond)
		return charge(ctx, m, req)
	}, idemgrpc.UnaryClientInterceptor(idemgrpc.ClientConfig{AttemptTimeout: 150 * time.Millisecond, MaxAttempts: 20, MinBackoff: 10 * time.Millisecond, MaxBackoff: 100 * time.Millisecond}),
		logAttempts)
	a := s.call(t.Context(), methodCharge, "", map[string]any{"amount": 9})
	mu.Lock()
	defer mu.Unlock()
	if a.err != nil || !a.replayed() {
		t.Fatalf("got %q (%v, replayed %t), want the first attempt's reply, replayed; attempts:\n%s", a.reply, a.err, a.replayed(), strings.Join(attempts, "\n"))
	}
	wantRuns(t, s, 1)
	n, _ := outcomes.Load(idemgrpc.OutcomeExecuted)
	if n == nil || n.(*atomic.Int64).Load() != 1 {
		t.Fatal("want exactly one executed outcome")
	}
}

// failing answers the first failures attempts with err, then OK.
func failing(failures int64, err error, k *keys) handlerFunc {
	var n atomic.Int64
	return func(ctx context.Context, m string, req *structpb.Struct) (*wrapperspb.StringValue, error) {
		k.record(ctx)
		if n.Add(1) <= failures {
			return nil, err
		}
		return wrapperspb.String("ok"), nil
	}
}

// Unavailable releases the key on the server; the client retries with the
// same key until the handler succeeds.
func TestClientRetriesUnavailable(t *testing.T) {
	var k keys
	s := newServer(t, memstore.New(memstore.Options{}), idemgrpc.Config{}, failing(2, status.Error(codes.Unavailable, "busy"), &k),
		idemgrpc.UnaryClientInterceptor(idemgrpc.ClientConfig{MinBackoff: time.Millisecond}))
	if a := s.call(t.Context(), methodCharge, "", nil); a.err != nil || a.reply != "ok" {
		t.Fatalf("got %q, %v; want ok", a.reply, a.err)
	}
	got := k.get()
	if len(got) != 3 || got[0] != got[1] || got[1] != got[2] || got[0] == "" {
		t.Fatalf("keys of the attempts: got %q, want one key three times", got)
	}
}

// Other codes are not retried; MaxAttempts bounds the attempts.
func TestClientGivesUp(t *testing.T) {
	for _, c := range []struct {
		name        string
		err         error
		maxAttempts int
		want        int
	}{
		{"InvalidArgument", status.Error(codes.InvalidArgument, "no"), 5, 1},
		{"Internal", status.Error(codes.Internal, "no"), 5, 1},
		{"Unavailable", status.Error(codes.Unavailable, "down"), 3, 3},
		{"MaxAttempts 1", status.Error(codes.Unavailable, "down"), 1, 1},
	} {
		t.Run(c.name, func(t *testing.T) {
			var k keys
			s := startServer(t, failing(100, c.err, &k), nil,
				idemgrpc.UnaryClientInterceptor(idemgrpc.ClientConfig{MaxAttempts: c.maxAttempts, MinBackoff: time.Millisecond}))
			a := s.call(t.Context(), methodCharge, "", nil)
			if status.Code(a.err) != status.Code(c.err) || len(k.get()) != c.want {
				t.Fatalf("got %v after %d attempts, want %v after %d", a.err, len(k.get()), c.err, c.want)
			}
		})
	}
}

// The client waits at least the RetryInfo delay; a context cancelled
// during the wait ends the call at once.
func TestClientRetryInfo(t *testing.T) {
	st, _ := status.New(codes.Unavailable, "later").WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(300 * time.Millisecond)})
	var k keys
	s := startServer(t, failing(1, st.Err(), &k), nil,
		idemgrpc.UnaryClientInterceptor(idemgrpc.ClientConfig{MinBackoff: time.Millisecond}))
	t0 := time.Now()
	if a := s.call(t.Context(), methodCharge, "", nil); a.err != nil {
		t.Fatal(a.err)
	}
	if took := time.Since(t0); took < 300*time.Millisecond {
		t.Fatalf("took %v, want at least the 300ms RetryInfo asked for", took)
	}

	// A cancellation ends a RetryInfo wait at once: with 5s asked for,
	// a cancel at 100ms must end the call well before the wait would.
	long, _ := status.New(codes.Unavailable, "much later").WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(5 * time.Second)})
	s = startServer(t, failing(100, long.Err(), &k), nil,
		idemgrpc.UnaryClientInterceptor(idemgrpc.ClientConfig{MinBackoff: time.Millisecond}))
	ctx, cancel := context.WithCancel(t.Context())
	time.AfterFunc(100*time.Millisecond, cancel)
	t0 = time.Now()
	a := s.call(ctx, methodCharge, "", nil)
	if status.Code(a.err) != codes.Canceled || time.Since(t0) > 2*time.Second {
		t.Fatalf("cancelled during the wait: got %v after %v, want Canceled at once", a.err, time.Since(t0))
	}
}

// attemptsOf calls the client interceptor with an invoker that answers
// attempt n (from 1) with answer(ctx, n), and returns the number of
// attempts and the error.
func attemptsOf(t *testing.T, ctx context.Context, cfg idemgrpc.ClientConfig, answer func(ctx context.Context, n int) error) (int, error) {
	t.Helper()
	n := 0
	invoker := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, opts ...grpc.CallOption) error {
		n++
		return answer(ctx, n)
	}
	err := idemgrpc.UnaryClientInterceptor(cfg)(ctx, methodCharge, nil, nil, nil, invoker)
	return n, err
}

// Which DeadlineExceeded counts as the attempt's timeout, and is retried.
func TestClientAttemptTimeoutCases(t *testing.T) {
	cfg := idemgrpc.ClientConfig{AttemptTimeout: 50 * time.Millisecond, MinBackoff: time.Millisecond}
	deadlineExceeded := status.Error(codes.DeadlineExceeded, "stream terminated by RST_STREAM with error code: CANCEL")

	// The server's copy of the deadline answered first, the attempt's
	// deadline being past: retried.
	n, err := attemptsOf(t, t.Context(), cfg, func(ctx context.Context, n int) error {
		if n == 1 {
			time.Sleep(60 * time.Millisecond) // past the attempt's deadline, whatever its timer did
			return deadlineExceeded
		}
		return nil
	})
	if err != nil || n != 2 {
		t.Fatalf("attempt past its deadline: got %v after %d attempts, want success on the 2nd", err, n)
	}

	// The handler's own DeadlineExceeded, well before the attempt's
	// deadline: not retried.
	n, err = attemptsOf(t, t.Context(), cfg, func(context.Context, int) error { return deadlineExceeded })
	if status.Code(err) != codes.DeadlineExceeded || n != 1 {
		t.Fatalf("handler's DeadlineExceeded: got %v after %d attempts, want it after 1", err, n)
	}

	// The call's own deadline comes before the attempt's: not retried.
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Millisecond)
	defer cancel()
	n, err = attemptsOf(t, ctx, cfg, func(ctx context.Context, _ int) error {
		<-ctx.Done()
		return status.FromContextError(ctx.Err()).Err()
	})
	if status.Code(err) != codes.DeadlineExceeded || n != 1 {
		t.Fatalf("call's own deadline: got %v after %d attempts, want DeadlineExceeded after 1", err, n)
	}
}
