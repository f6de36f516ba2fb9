package clients

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/idemkit/idem/idemgrpc"
	"github.com/idemkit/idem/internal/childproc"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/idemkit/idem/internal/reltest"
	"github.com/idemkit/idem/redisstore"
)

// identityPayments is a real grpc-go server on a loopback listener with
// idemgrpc's server interceptor (DefaultTenant) on a private Redis. Its
// Charge counts executions per idempotency key and sets, as a handler
// may, metadata in a metadata.MD literal with keys in upper case: a
// session cookie for the caller and a session token.
type identityPayments struct {
	addr string

	mu   sync.Mutex
	runs map[string]int // per key
	seq  int
}

func startIdentityPayments(t *testing.T, cfg idemgrpc.Config) *identityPayments {
	t.Helper()
	store := redistest.Store(t, rdb, redisstore.Options{})
	cfg.Logger = slog.New(slog.DiscardHandler)
	g := &identityPayments{runs: map[string]int{}}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(idemgrpc.UnaryServerInterceptor(store, cfg)))
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

func (g *identityPayments) Charge(ctx context.Context, in *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
	key := incomingKey(ctx)
	g.mu.Lock()
	g.runs[key]++
	g.seq++
	reply := fmt.Sprintf("ch_%d: %s", g.seq, in.GetValue())
	g.mu.Unlock()
	grpc.SetHeader(ctx, metadata.MD{"Set-Cookie": {"session=" + reply}, "X-Session-Token": {"tok-" + reply}})
	grpc.SetTrailer(ctx, metadata.MD{"SET-COOKIE": {"late=" + reply}})
	return wrapperspb.String(reply), nil
}

func (g *identityPayments) executions(key string) int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.runs[key]
}

// pyCall is one call of testdata/grpc_calls.py and what it got.
type pyCall struct {
	Value    string     `json:"value"`
	Metadata [][]string `json:"metadata"`
}

type pyResult struct {
	Status  string     `json:"status"`
	Value   string     `json:"value"`
	Error   string     `json:"error"`
	Header  [][]string `json:"header"`
	Trailer [][]string `json:"trailer"`
}

func (r pyResult) replayed() bool { return r.get("idempotent-replayed") == "true" }

// get is the first header value of key (in lower case), "" without one.
func (r pyResult) get(key string) string {
	for _, kv := range r.Header {
		if kv[0] == key {
			return kv[1]
		}
	}
	return ""
}

// cookies returns every set-cookie in the header and trailer, in any case.
func (r pyResult) cookies() []string {
	var out []string
	for _, kv := range append(append([][]string{}, r.Header...), r.Trailer...) {
		if strings.EqualFold(kv[0], "set-cookie") {
			out = append(out, kv[1])
		}
	}
	return out
}

// runGRPCCalls runs testdata/grpc_calls.py: Python's grpcio making calls
// one after another on one channel.
func runGRPCCalls(t *testing.T, addr string, calls []pyCall) []pyResult {
	t.Helper()
	arg, err := json.Marshal(calls)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), clientDeadline)
	defer cancel()
	cmd := exec.CommandContext(ctx, tool("python-grpc"), "testdata/grpc_calls.py", addr, chargeMethod, string(arg))
	cmd.SysProcAttr = childproc.SysProcAttr()
	cmd.WaitDelay = time.Second
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	var res []pyResult
	if jerr := json.Unmarshal(lastLine(out), &res); jerr != nil || len(res) != len(calls) {
		t.Fatalf("grpc_calls.py: %v, output %q, stderr %q", err, out, lastN(stderr.String(), 500))
	}
	return res
}

func withKey(key string, md ...string) [][]string {
	out := [][]string{{idemgrpc.MetadataKey, key}}
	for i := 0; i+1 < len(md); i += 2 {
		out = append(out, []string{md[i], md[i+1]})
	}
	return out
}

// TestGRPCCallersFromPython: Python grpcio clients against idemgrpc's
// defaults on Redis. Alice and Bob send one key and one request with
// their own x-api-key: each call runs, and each retry replays the
// caller's own result. One bearer token spelled five ways (scheme case,
// spaces around and inside) is one caller: one execution, four replays.
// The handler's session cookie, set in upper case, reaches the caller
// that ran it and no replay (set-cookie on the denylist); its other
// metadata replays, in lower case.
func TestGRPCCallersFromPython(t *testing.T) {
	toolPath(t, "python-grpc")
	g := startIdentityPayments(t, idemgrpc.Config{ReplayMetadataDenylist: []string{"set-cookie"}})
	req := "100 cents"

	t.Run("api keys", func(t *testing.T) {
		key := "py-apikey-" + runID
		res := runGRPCCalls(t, g.addr, []pyCall{
			{req, withKey(key, "x-api-key", "alice-secret")},
			{req, withKey(key, "x-api-key", "bob-secret")},
			{req, withKey(key, "x-api-key", "alice-secret")},
			{req, withKey(key, "x-api-key", "bob-secret")},
		})
		alice, bob := res[0], res[1]
		for i, r := range res {
			if r.Status != "OK" {
				t.Fatalf("call %d: got %s (%s), want OK", i, r.Status, r.Error)
			}
		}
		// grpcio takes field names in upper case as sent; the
		// interceptor sends the handler's metadata in lower case.
		if alice.get("x-session-token") == "" {
			t.Errorf("alice: got header %q, want x-session-token in lower case", alice.Header)
		}
		if bob.replayed() || bob.Value == alice.Value || bob.get("x-session-token") == alice.get("x-session-token") {
			t.Errorf("bob: got %q replayed=%t, token %q, want his own execution, not alice's %q", bob.Value, bob.replayed(), bob.get("x-session-token"), alice.Value)
		}
		for i, own := range map[int]pyResult{2: alice, 3: bob} {
			r := res[i]
			if !r.replayed() || r.Value != own.Value || r.get("x-session-token") != own.get("x-session-token") {
				t.Errorf("call %d: got %q replayed=%t, want the replay of %q with its token", i, r.Value, r.replayed(), own.Value)
			}
			if len(r.cookies()) != 0 {
				t.Errorf("call %d (a replay): got set-cookie %q, want none", i, r.cookies())
			}
		}
		if c := alice.cookies(); len(c) != 2 || !strings.Contains(c[0], alice.Value) {
			t.Errorf("alice's own call: got set-cookie %q, want her session cookie in the header and the trailer", c)
		}
		if n := g.executions(key); n != 2 {
			t.Errorf("executions: got %d, want 2 (alice's and bob's)", n)
		}
		reltest.Report(t, reltest.Row{
			Scenario: "hostile: gRPC callers with their own x-api-key, one idempotency key (Python grpcio)", Store: "redis (single)",
			Fault:    "alice and bob send one key and one request, each with x-api-key metadata, then retry",
			Requests: len(res), Keys: 1, Duplicates: max(0, g.executions(key)-2),
			Notes: fmt.Sprintf("executions %d (one per caller); bob replayed alice's result: %t; replays carrying set-cookie: %d",
				g.executions(key), bob.Value == alice.Value, len(res[2].cookies())+len(res[3].cookies())),
		})
	})

	t.Run("spellings", func(t *testing.T) {
		key := "py-spelled-" + runID
		spellings := []string{"Bearer tokA", "bearer tokA", "Bearer  tokA", "Bearer tokA ", "  Bearer tokA"}
		var calls []pyCall
		for _, s := range spellings {
			calls = append(calls, pyCall{req, withKey(key, "authorization", s)})
		}
		res := runGRPCCalls(t, g.addr, calls)
		replays := 0
		for i, r := range res {
			if r.Status != "OK" || r.Value != res[0].Value {
				t.Errorf("%q: got %s %q (%s), want OK %q", spellings[i], r.Status, r.Value, r.Error, res[0].Value)
			}
			if r.replayed() {
				replays++
			}
		}
		if n := g.executions(key); n != 1 || replays != len(spellings)-1 {
			t.Errorf("got %d executions and %d replays, want 1 and %d (one caller)", n, replays, len(spellings)-1)
		}
		reltest.Report(t, reltest.Row{
			Scenario: "hostile: one bearer token spelled five ways, one idempotency key (gRPC, Python grpcio)", Store: "redis (single)",
			Fault:    `authorization "Bearer tokA", "bearer tokA", "Bearer  tokA", "Bearer tokA ", "  Bearer tokA"`,
			Requests: len(res), Keys: 1, Duplicates: max(0, g.executions(key)-1),
			Notes: fmt.Sprintf("executions %d, replays %d", g.executions(key), replays),
		})
	})
}

// TestGRPCRefuseAnonymousFromPython: with RefuseAnonymous, a Python grpcio
// call with a key and no credential gets UNAUTHENTICATED and runs
// nothing, its retry too; the same key with an API key then runs once.
func TestGRPCRefuseAnonymousFromPython(t *testing.T) {
	toolPath(t, "python-grpc")
	g := startIdentityPayments(t, idemgrpc.Config{RefuseAnonymous: true})
	key := "py-anon-" + runID
	res := runGRPCCalls(t, g.addr, []pyCall{
		{"5 cents", withKey(key)},
		{"5 cents", withKey(key)},
		{"5 cents", withKey(key, "x-api-key", "carol-secret")},
	})
	refused := map[string]int{}
	for i, r := range res[:2] {
		refused[r.Status]++
		if r.Status != "UNAUTHENTICATED" || !strings.Contains(r.Error, "identify their caller") {
			t.Errorf("anonymous call %d: got %s (%q), want UNAUTHENTICATED saying the caller must be identified", i, r.Status, r.Error)
		}
	}
	if r := res[2]; r.Status != "OK" || r.replayed() {
		t.Errorf("with an API key: got %s replayed=%t (%s), want its execution", r.Status, r.replayed(), r.Error)
	}
	if n := g.executions(key); n != 1 {
		t.Errorf("executions: got %d, want 1 (the identified call's)", n)
	}
	reltest.Report(t, reltest.Row{
		Scenario: "hostile: gRPC keyed calls with no credential, RefuseAnonymous (Python grpcio)", Store: "redis (single)",
		Fault:    "two calls with a key and no credential, then one with x-api-key",
		Requests: len(res), Keys: 1, ClientErrors: refused,
		Notes: fmt.Sprintf("executions %d (the identified call's)", g.executions(key)),
	})
}
