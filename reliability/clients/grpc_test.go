package clients

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/stats"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemgrpc"
	"github.com/idemkit/idem/internal/childproc"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/idemkit/idem/internal/reltest"
	"github.com/idemkit/idem/redisstore"
)

// chargeMethod is the unary method of the gRPC payments service: a
// google.protobuf.StringValue in (what to charge), a StringValue out (the
// charge), so that clients in any language need no generated code.
const chargeMethod = "/payments.Payments/Charge"

// grpcServiceConfig is the retry policy both gRPC clients are configured
// with, as gRPC's service config documents it: up to 5 attempts of a call,
// resent on UNAVAILABLE and ABORTED (what idemgrpc answers while the key is
// in flight) after a random backoff of up to 0.1 s, doubling up to 1 s.
// Every attempt fits in the call's one deadline. grpc-go ignores the
// RetryInfo delay that idemgrpc puts in its ABORTED details (it honours only
// grpc-retry-pushback-ms), and so does grpcio.
const grpcServiceConfig = `{"methodConfig": [{
	"name": [{"service": "payments.Payments"}],
	"retryPolicy": {
		"maxAttempts": 5,
		"initialBackoff": "0.1s",
		"maxBackoff": "1s",
		"backoffMultiplier": 2,
		"retryableStatusCodes": ["UNAVAILABLE", "ABORTED"]
	}
}]}`

// grpcDeadline is the clients' deadline per call, shorter than the
// handler's work (workTime, 1 s).
const grpcDeadline = 300 * time.Millisecond

// grpcPayments is a real grpc-go server on a loopback listener, with
// idemgrpc's server interceptor on a private Redis (a prefix of its own).
// Its Charge handler acts at once (counted per idempotency key) and then
// takes workTime to answer, whatever the client does meanwhile.
type grpcPayments struct {
	addr string
	seq  atomic.Int64

	mu       sync.Mutex
	effects  map[string][]string // per key, the reply of each execution
	running  map[string]int      // per key, handlers still running
	outcomes map[string][]string // per key, what the interceptor did with each call
}

type paymentsServer interface {
	Charge(context.Context, *wrapperspb.StringValue) (*wrapperspb.StringValue, error)
}

var paymentsDesc = grpc.ServiceDesc{
	ServiceName: "payments.Payments",
	HandlerType: (*paymentsServer)(nil),
	Methods: []grpc.MethodDesc{{
		MethodName: "Charge",
		Handler: func(srv any, ctx context.Context, dec func(any) error, interceptor grpc.UnaryServerInterceptor) (any, error) {
			in := new(wrapperspb.StringValue)
			if err := dec(in); err != nil {
				return nil, err
			}
			handler := func(ctx context.Context, req any) (any, error) {
				return srv.(paymentsServer).Charge(ctx, req.(*wrapperspb.StringValue))
			}
			if interceptor == nil {
				return handler(ctx, in)
			}
			return interceptor(ctx, in, &grpc.UnaryServerInfo{Server: srv, FullMethod: chargeMethod}, handler)
		},
	}},
}

func startGRPCPayments(t *testing.T) *grpcPayments {
	t.Helper()
	store := redistest.Store(t, rdb, redisstore.Options{})
	g := &grpcPayments{effects: map[string][]string{}, running: map[string]int{}, outcomes: map[string][]string{}}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(idemgrpc.UnaryServerInterceptor(store, idemgrpc.Config{
		// ABORTED at once: the case is the clients' retryPolicy resending
		// ABORTED within a 0.3 s deadline, shorter than the default wait.
		Wait:   -1,
		Logger: slog.New(slog.DiscardHandler),
		OnOutcome: func(ctx context.Context, _ string, o idemgrpc.Outcome) {
			key := incomingKey(ctx)
			g.mu.Lock()
			defer g.mu.Unlock()
			g.outcomes[key] = append(g.outcomes[key], string(o))
		},
	})))
	srv.RegisterService(&paymentsDesc, g)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g.addr = lis.Addr().String()
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	return g
}

func incomingKey(ctx context.Context) string {
	vs := metadata.ValueFromIncomingContext(ctx, idemgrpc.MetadataKey)
	if len(vs) == 0 {
		return ""
	}
	return vs[0]
}

// Charge makes the charge at once, then takes workTime to answer; the
// reply names the execution, so a second execution would show.
func (g *grpcPayments) Charge(ctx context.Context, in *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
	key := incomingKey(ctx)
	lease, _ := idem.LeaseFromContext(ctx)
	reply := fmt.Sprintf("ch_%d_%s: %s (key %s, token %d)", g.seq.Add(1), randomHex(4), in.GetValue(), key, lease.Token)
	g.mu.Lock()
	g.effects[key] = append(g.effects[key], reply)
	g.running[key]++
	g.mu.Unlock()
	time.Sleep(workTime)
	g.mu.Lock()
	g.running[key]--
	g.mu.Unlock()
	return wrapperspb.String(reply), nil
}

// snapshot returns the executions of key, how many still run, and the
// interceptor's outcomes.
func (g *grpcPayments) snapshot(key string) (effects []string, running int, outcomes []string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return slices.Clone(g.effects[key]), g.running[key], slices.Clone(g.outcomes[key])
}

// grpcResult is where a gRPC client ended.
type grpcResult struct {
	Client   string   `json:"-"`
	Status   string   `json:"status"`   // the final code's name: "OK", "DEADLINE_EXCEEDED", ...
	Value    string   `json:"value"`    // the reply
	Replayed string   `json:"replayed"` // the idempotent-replayed header metadata
	Seen     []string `json:"seen"`     // per call of the client's loop: the code
	Error    string   `json:"error"`
	key      string   // the key it sent
	value    string   // the request it sent
}

// codeName is the gRPC spelling of c ("DEADLINE_EXCEEDED").
func codeName(c codes.Code) string {
	var b strings.Builder
	prev := 'A'
	for _, r := range c.String() {
		if r >= 'A' && r <= 'Z' && prev >= 'a' && prev <= 'z' {
			b.WriteByte('_')
		}
		b.WriteRune(r)
		prev = r
	}
	return strings.ToUpper(b.String())
}

// attemptLog is a stats.Handler: grpc-go calls it for every attempt of a
// call, so it sees the attempts the retry policy makes inside one call.
type attemptLog struct {
	mu       sync.Mutex
	attempts map[string][]string // per key, the code of each attempt
}

type attemptKey struct{}

func (a *attemptLog) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context {
	md, _ := metadata.FromOutgoingContext(ctx)
	key := ""
	if vs := md.Get(idemgrpc.MetadataKey); len(vs) > 0 {
		key = vs[0]
	}
	return context.WithValue(ctx, attemptKey{}, key)
}

func (a *attemptLog) HandleRPC(ctx context.Context, s stats.RPCStats) {
	if end, ok := s.(*stats.End); ok {
		key, _ := ctx.Value(attemptKey{}).(string)
		a.mu.Lock()
		defer a.mu.Unlock()
		a.attempts[key] = append(a.attempts[key], codeName(status.Code(end.Error)))
	}
}

func (a *attemptLog) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context { return ctx }
func (a *attemptLog) HandleConn(context.Context, stats.ConnStats)                       {}

func (a *attemptLog) of(key string) []string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return slices.Clone(a.attempts[key])
}

// runGRPCGo is a grpc-go client configured with grpcServiceConfig's retry
// policy and a deadline per call, in the loop a user writes around it:
// after DEADLINE_EXCEEDED (or an ABORTED or UNAVAILABLE the policy gave up
// on) it calls again with the same idempotency-key metadata, after 0.1 s
// doubling up to 1 s, at most attempts calls.
func runGRPCGo(ctx context.Context, conn *grpc.ClientConn, key, value string, attempts int) grpcResult {
	ctx, cancel := context.WithTimeout(ctx, clientDeadline)
	defer cancel()
	ctx = metadata.AppendToOutgoingContext(ctx, idemgrpc.MetadataKey, key)
	var res grpcResult
	backoff := 100 * time.Millisecond
	for range attempts {
		callCtx, cancelCall := context.WithTimeout(ctx, grpcDeadline)
		var header metadata.MD
		reply := new(wrapperspb.StringValue)
		err := conn.Invoke(callCtx, chargeMethod, wrapperspb.String(value), reply, grpc.Header(&header))
		cancelCall()
		code := status.Code(err)
		res.Status, res.Error = codeName(code), ""
		res.Seen = append(res.Seen, res.Status)
		if err == nil {
			res.Value = reply.GetValue()
			res.Replayed = strings.Join(header.Get(idemgrpc.MetadataReplayed), ",")
			return res
		}
		res.Error = status.Convert(err).Message()
		if code != codes.DeadlineExceeded && code != codes.Aborted && code != codes.Unavailable {
			return res
		}
		select {
		case <-ctx.Done():
			return res
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, time.Second)
	}
	return res
}

// runGRPCPython runs testdata/grpc_client.py: Python's grpcio with the same
// service config (grpc.service_config channel option), a timeout= per call
// and the same loop around it.
func runGRPCPython(ctx context.Context, addr, key, value string, attempts int) grpcResult {
	ctx, cancel := context.WithTimeout(ctx, clientDeadline)
	defer cancel()
	cmd := exec.CommandContext(ctx, tool("python-grpc"), "testdata/grpc_client.py", addr, chargeMethod, key, value,
		seconds(grpcDeadline), strconv.Itoa(attempts), grpcServiceConfig)
	cmd.SysProcAttr = childproc.SysProcAttr()
	cmd.WaitDelay = time.Second
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	var res grpcResult
	if jerr := json.Unmarshal(lastLine(out), &res); jerr != nil {
		return grpcResult{Error: fmt.Sprintf("grpc_client.py: %v, output %q, stderr %q", err, out, lastN(stderr.String(), 500))}
	}
	return res
}

// TestGRPCClientsRetry: grpc-go and Python grpcio clients call a unary
// Charge whose handler acts at once and answers after 1 s, behind
// idemgrpc's server interceptor on Redis. Each client has a retry policy
// (maxAttempts 5, UNAVAILABLE and ABORTED) and a 0.3 s deadline per call,
// and its own loop calls again with the same idempotency-key after
// DEADLINE_EXCEEDED: the first call's deadline passes during the work,
// the next calls meet the key in flight (ABORTED, which the policy resends
// within the call until its deadline), and once the work is done the call
// gets the stored reply, marked idempotent-replayed: true. The handler must
// run exactly once per key.
func TestGRPCClientsRetry(t *testing.T) {
	toolPath(t, "python-grpc")
	g := startGRPCPayments(t)
	al := &attemptLog{attempts: map[string][]string{}}
	conn, err := grpc.NewClient(g.addr,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultServiceConfig(grpcServiceConfig),
		grpc.WithStatsHandler(al),
	)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })

	type grpcClient struct {
		name, short string
		run         func(ctx context.Context, key, value string) grpcResult
	}
	clients := []grpcClient{
		{"grpc-go retryPolicy + deadline loop", "go", func(ctx context.Context, key, value string) grpcResult {
			return runGRPCGo(ctx, conn, key, value, 12)
		}},
		{"Python grpcio service_config retryPolicy + timeout loop", "py", func(ctx context.Context, key, value string) grpcResult {
			return runGRPCPython(ctx, g.addr, key, value, 12)
		}},
	}
	for _, c := range clients {
		t.Run(c.short, func(t *testing.T) {
			t.Parallel()
			n := reltest.Scale(2, 8)
			results := make([]grpcResult, n)
			var wg sync.WaitGroup
			for i := range n {
				wg.Go(func() {
					key := fmt.Sprintf("grpc-%s-%d-%s", c.short, i, runID)
					value := fmt.Sprintf("%d cents", 100+i)
					results[i] = c.run(context.Background(), key, value)
					results[i].Client, results[i].key, results[i].value = c.name, key, value
				})
			}
			wg.Wait()
			seen := map[string]int{}
			outcomes := map[string]int{}
			var effectsPerKey, callsPerKey []int
			var paths []string
			requests, duplicates, lost, attempts, served := 0, 0, 0, 0, 0
			for _, r := range results {
				if !waitFor(15*time.Second, func() bool { _, running, _ := g.snapshot(r.key); return running == 0 }) {
					t.Errorf("key %s: got the handler still running after 15s, want it done", r.key)
				}
				effects, _, outs := g.snapshot(r.key)
				effectsPerKey = append(effectsPerKey, len(effects))
				callsPerKey = append(callsPerKey, len(outs))
				duplicates += max(0, len(effects)-1)
				requests += len(r.Seen)
				attempts += len(al.of(r.key))
				for _, o := range outs {
					outcomes[o]++
				}
				for i, s := range r.Seen {
					if i < len(r.Seen)-1 || s != "OK" {
						seen[s]++
					}
				}
				paths = append(paths, strings.Join(r.Seen, "→"))
				if len(effects) != 1 {
					t.Errorf("key %s: got %d executions of the handler, want 1", r.key, len(effects))
					continue
				}
				// grpcio may see the deadline as CANCELLED: the server's
				// RST_STREAM, sent when the deadline passed, can beat its
				// own timer (see testdata/grpc_client.py).
				if len(r.Seen) == 0 || (r.Seen[0] != "DEADLINE_EXCEEDED" && r.Seen[0] != "CANCELLED") {
					t.Errorf("%s, key %s: got calls %v, want the first to pass its deadline during the work", r.Client, r.key, r.Seen)
				}
				if r.Status != "OK" || r.Replayed != "true" || r.Value != effects[0] {
					t.Errorf("%s, key %s: got the final %s %q (replayed %q, error %q; calls %v), want OK with the replay of %q",
						r.Client, r.key, r.Status, r.Value, r.Replayed, r.Error, r.Seen, effects[0])
					lost++
				}
				if !slices.Contains(outs, string(idemgrpc.OutcomeInFlight)) {
					t.Errorf("key %s: got interceptor outcomes %v, want calls that met the key in flight (conflict)", r.key, outs)
				}
				// A later call gets the same replay.
				later := runGRPCGo(context.Background(), conn, r.key, r.value, 1)
				if later.Status != "OK" || later.Replayed != "true" || later.Value != effects[0] {
					t.Errorf("key %s: got a later call %s %q (replayed %q), want the replay of %q", r.key, later.Status, later.Value, later.Replayed, effects[0])
				}
				served += len(outs) // the client's attempts, before the later call
			}
			// More attempts reached the server than the loop made calls: the
			// retry policy resent ABORTED within calls.
			if served <= requests {
				t.Errorf("got %d attempts reaching the interceptor for %d calls of the clients' loops, want more: the retry policy resending ABORTED within calls", served, requests)
			}
			notes := fmt.Sprintf("executions per key %v; attempts reaching the interceptor per key %v, %d for %d calls of the loops; interceptor outcomes: %s; calls per key: %s",
				effectsPerKey, callsPerKey, served, requests, reltest.FormatErrors(outcomes), strings.Join(paths, "; "))
			if c.short == "go" {
				// grpc-go's stats handler sees each attempt on the client side.
				notes += fmt.Sprintf("; attempts grpc-go's stats handler saw: %d", attempts)
			}
			reltest.Report(t, reltest.Row{
				Scenario: fmt.Sprintf("clients: gRPC %s (idemgrpc server interceptor)", c.name), Store: "redis (single)",
				Fault:    "unary handler acts at once, answers after 1 s; 0.3 s deadline per call; retryPolicy maxAttempts 5 on UNAVAILABLE and ABORTED (backoff 0.1 s doubling to 1 s); the client's loop calls again with the same idempotency-key after DEADLINE_EXCEEDED",
				Requests: requests, Keys: len(results), Duplicates: duplicates, Lost: lost, ClientErrors: seen, Notes: notes,
			})
		})
	}
}
