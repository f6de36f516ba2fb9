package main

// gRPC through idem proxy, from outside: the built binary between real gRPC
// clients and servers over loopback h2c, each pair in one language:
// grpc-go, Python's grpcio (testdata/grpc_peer.py, Debian's
// /usr/bin/python3 with python3-grpcio) and Node's @grpc/grpc-js
// (testdata/grpc_peer.js, installed by scripts/test.sh into
// $(go env GOPATH)/idem-grpc-js). No generated stubs: generic methods on
// raw bytes.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"go/build"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/upstreamtest"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// grpcSpec is one call a test client makes.
type grpcSpec struct {
	Method  string  `json:"method"`
	Key     string  `json:"key,omitempty"`
	Msg     string  `json:"msg"`
	Timeout float64 `json:"timeout,omitempty"` // seconds; 0: none
}

// grpcResult is what a client got: the status code and message, the
// response messages, and the header and trailer metadata (-bin keys left
// out).
type grpcResult struct {
	Code    int               `json:"code"`
	Message string            `json:"message"`
	Msgs    [][]byte          `json:"msgs"`
	Header  map[string]string `json:"header"`
	Trailer map[string]string `json:"trailer"`
}

func (r grpcResult) String() string {
	return fmt.Sprintf("code %d %q msgs %q header %v trailer %v", r.Code, r.Message, r.Msgs, r.Header, r.Trailer)
}

// grpcPeer is a gRPC server of one language (its address and how many
// times Do ran per key) and that language's client.
type grpcPeer struct {
	addr string
	runs func(key string) int
	call func(t *testing.T, addr string, c grpcSpec) grpcResult
}

// goGRPCServer serves idem.Test with grpc-go as testdata/grpc_peer.py
// does; deadlines counts the executions of Do that saw a deadline.
type goGRPCServer struct {
	mu        sync.Mutex
	runs      map[string]int
	gates     map[string]chan struct{}
	deadlines int
}

func (s *goGRPCServer) gate(name string) chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.gates[name] == nil {
		s.gates[name] = make(chan struct{})
	}
	return s.gates[name]
}

func (s *goGRPCServer) handle(_ any, stream grpc.ServerStream) error {
	method, _ := grpc.MethodFromServerStream(stream)
	var req []byte
	if err := stream.RecvMsg(&req); err != nil {
		return err
	}
	msg := string(req)
	send := func(b string) error { out := []byte(b); return stream.SendMsg(&out) }
	switch method {
	case "/idem.Test/Open":
		close(s.gate(msg))
		return send("opened")
	case "/idem.Test/Watch":
		for i := range 3 {
			if err := send(fmt.Sprintf("%s:%d", msg, i)); err != nil {
				return err
			}
		}
		return nil
	case "/idem.Test/Chat":
		for {
			if err := send("chat:" + msg); err != nil {
				return err
			}
			if err := stream.RecvMsg(&req); errors.Is(err, io.EOF) {
				return nil
			} else if err != nil {
				return err
			}
			msg = string(req)
		}
	}
	md, _ := metadata.FromIncomingContext(stream.Context())
	key := strings.Join(md.Get("idempotency-key"), ",")
	_, deadline := stream.Context().Deadline()
	s.mu.Lock()
	s.runs[key]++
	n := s.runs[key]
	if deadline && key != "" {
		s.deadlines++
	}
	s.mu.Unlock()
	stream.SetHeader(metadata.Pairs("x-server", "go"))
	stream.SetTrailer(metadata.Pairs("x-run", fmt.Sprint(n), "x-deadline", map[bool]string{true: "yes", false: "no"}[deadline]))
	if name, ok := strings.CutPrefix(msg, "hold:"); ok {
		<-s.gate(name)
	}
	if c, ok := strings.CutPrefix(msg, "status:"); ok {
		var code int
		fmt.Sscan(c, &code)
		return status.Error(codes.Code(code), "failed "+msg)
	}
	return send(fmt.Sprintf("reply:%s:%d", msg, n))
}

func startGoGRPC(t *testing.T) (*goGRPCServer, string) {
	s := &goGRPCServer{runs: map[string]int{}, gates: map[string]chan struct{}{}}
	srv := grpc.NewServer(grpc.ForceServerCodec(upstreamtest.RawCodec{}), grpc.UnknownServiceHandler(s.handle))
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(ln)
	t.Cleanup(srv.Stop)
	return s, ln.Addr().String()
}

// goGRPCCall makes c with grpc-go.
func goGRPCCall(t *testing.T, addr string, c grpcSpec) grpcResult {
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.ForceCodec(upstreamtest.RawCodec{})))
	if err != nil {
		t.Error(err)
		return grpcResult{Code: -1}
	}
	defer conn.Close()
	ctx := context.Background()
	if c.Key != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "idempotency-key", c.Key)
	}
	if c.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, time.Duration(c.Timeout*float64(time.Second)))
		defer cancel()
	}
	var header, trailer metadata.MD
	var res grpcResult
	req := []byte(c.Msg)
	var err2 error
	if strings.HasSuffix(c.Method, "/Watch") {
		var stream grpc.ClientStream
		stream, err2 = conn.NewStream(ctx, &grpc.StreamDesc{ServerStreams: true}, c.Method)
		if err2 == nil {
			stream.SendMsg(&req)
			stream.CloseSend()
			for {
				var m []byte
				if err2 = stream.RecvMsg(&m); err2 != nil {
					break
				}
				res.Msgs = append(res.Msgs, m)
			}
			if errors.Is(err2, io.EOF) {
				err2 = nil
			}
			header, _ = stream.Header()
			trailer = stream.Trailer()
		}
	} else {
		var resp []byte
		err2 = conn.Invoke(ctx, c.Method, &req, &resp, grpc.Header(&header), grpc.Trailer(&trailer))
		if err2 == nil {
			res.Msgs = [][]byte{resp}
		}
	}
	st := status.Convert(err2)
	res.Code, res.Message = int(st.Code()), st.Message()
	if err2 == nil {
		res.Message = ""
	}
	res.Header, res.Trailer = mdMap(header), mdMap(trailer)
	return res
}

func mdMap(md metadata.MD) map[string]string {
	m := map[string]string{}
	for k, vs := range md {
		if !strings.HasSuffix(k, "-bin") && len(vs) > 0 {
			m[k] = vs[0]
		}
	}
	return m
}

// scriptCall makes c with a client script (grpc_peer.py, .js), which
// prints its result as one JSON line.
func scriptCall(prog string, args ...string) func(t *testing.T, addr string, c grpcSpec) grpcResult {
	return func(t *testing.T, addr string, c grpcSpec) grpcResult {
		spec, _ := json.Marshal(c)
		cmd := exec.Command(prog, append(args, "client", addr, string(spec))...)
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		var res grpcResult
		if err == nil {
			err = json.Unmarshal(out, &res)
		}
		if err != nil {
			t.Errorf("%s client %s: %v\n%s%s", prog, spec, err, out, stderr.String())
			return grpcResult{Code: -1}
		}
		return res
	}
}

// grpcJS is where scripts/test.sh installs @grpc/grpc-js.
func grpcJS(t *testing.T) string {
	for _, p := range filepath.SplitList(build.Default.GOPATH) {
		dir := filepath.Join(p, "idem-grpc-js", "node_modules")
		if _, err := os.Stat(filepath.Join(dir, "@grpc", "grpc-js", "package.json")); err == nil {
			return dir
		}
	}
	t.Fatal("@grpc/grpc-js is not installed in $(go env GOPATH)/idem-grpc-js (scripts/test.sh installs it)")
	return ""
}

func grpcPeers(t *testing.T) map[string]func(t *testing.T) (grpcPeer, func() int) {
	return map[string]func(t *testing.T) (grpcPeer, func() int){
		"go": func(t *testing.T) (grpcPeer, func() int) {
			s, addr := startGoGRPC(t)
			runs := func(key string) int { s.mu.Lock(); defer s.mu.Unlock(); return s.runs[key] }
			return grpcPeer{addr: addr, runs: runs, call: goGRPCCall},
				func() int { s.mu.Lock(); defer s.mu.Unlock(); return s.deadlines }
		},
		"python": func(t *testing.T) (grpcPeer, func() int) {
			u := startScriptUpstream(t, "/usr/bin/python3", "testdata/grpc_peer.py", "server")
			return grpcPeer{addr: strings.TrimPrefix(u.url, "http://"), runs: u.runsOf, call: scriptCall("/usr/bin/python3", "testdata/grpc_peer.py")}, nil
		},
		"node": func(t *testing.T) (grpcPeer, func() int) {
			t.Setenv("NODE_PATH", grpcJS(t))
			u := startScriptUpstream(t, "node", "testdata/grpc_peer.js", "server")
			return grpcPeer{addr: strings.TrimPrefix(u.url, "http://"), runs: u.runsOf, call: scriptCall("node", "testdata/grpc_peer.js")}, nil
		},
	}
}

// awaitRuns waits until the server ran key n times (bounded).
func awaitRuns(t *testing.T, p grpcPeer, key string, n int) {
	t.Helper()
	for deadline := time.Now().Add(20 * time.Second); p.runs(key) < n; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the server did not run %s %d times within 20s (ran %d)", key, n, p.runs(key))
		}
	}
}

// TestProxyGRPC: a keyed unary call runs once per key through idem proxy
// and its replay is the same message and metadata; another message under
// the key gets FailedPrecondition; a client deadline shorter than the work
// does not cancel it, and the retry gets the stored answer; a copy in
// flight waits for the answer, or past --wait gets Aborted; past
// --max-execution the work is cut and its key released; a stored error
// status replays and a released one runs again; streaming calls pass
// through. With grpc-go, Python grpcio and Node grpc-js, client and
// server of one language each.
func TestProxyGRPC(t *testing.T) {
	const do = "/idem.Test/Do"
	for name, start := range grpcPeers(t) {
		t.Run(name, func(t *testing.T) {
			peer, deadlines := start(t)
			// Chat, bidirectional, is on a route that covers no method:
			// it passes through even with a key.
			conf := filepath.Join(t.TempDir(), "routes.yaml")
			if err := os.WriteFile(conf, []byte("routes:\n  - match: \"/idem.Test/Chat\"\n    methods: []\n"), 0o600); err != nil {
				t.Fatal(err)
			}
			p := startProxy(t, nil, "--upstream", "h2c://"+peer.addr, "--wait", "30s", "--config", conf)
			noWait := startProxy(t, nil, "--upstream", "h2c://"+peer.addr, "--wait", "0")
			call := func(px *proxyProc, c grpcSpec) grpcResult { return peer.call(t, px.addr, c) }

			// Once per key, identical answers.
			first := call(p, grpcSpec{Method: do, Key: "k1", Msg: "pay"})
			again := call(p, grpcSpec{Method: do, Key: "k1", Msg: "pay"})
			if first.Code != 0 || len(first.Msgs) != 1 || string(first.Msgs[0]) != "reply:pay:1" || first.Trailer["x-run"] != "1" || first.Header["x-server"] != name {
				t.Fatalf("first call: got %v, want reply:pay:1 with x-run 1 and x-server %s", first, name)
			}
			if again.Code != 0 || !bytes.Equal(bytes.Join(again.Msgs, nil), first.Msgs[0]) || again.Trailer["x-run"] != "1" || again.Header["x-server"] != name {
				t.Errorf("repeat: got %v, want the first answer %v", again, first)
			}
			if again.Header["idempotent-replayed"] != "true" || first.Header["idempotent-replayed"] != "" {
				t.Errorf("idempotent-replayed: first %q, repeat %q, want none and true", first.Header["idempotent-replayed"], again.Header["idempotent-replayed"])
			}
			if n := peer.runs("k1"); n != 1 {
				t.Errorf("k1 ran %d times, want 1", n)
			}

			// Another message under the key.
			if other := call(p, grpcSpec{Method: do, Key: "k1", Msg: "refund"}); other.Code != int(codes.FailedPrecondition) {
				t.Errorf("another message under k1: got %v, want FailedPrecondition", other)
			}
			if n := peer.runs("k1"); n != 1 {
				t.Errorf("k1 ran %d times after the mismatch, want 1", n)
			}

			// A client deadline shorter than the work: the work goes on
			// (held until the client gave up), the retry gets its answer.
			short := call(p, grpcSpec{Method: do, Key: "k2", Msg: "hold:g2", Timeout: 0.3})
			if short.Code != int(codes.DeadlineExceeded) {
				t.Errorf("call past its deadline: got %v, want DeadlineExceeded", short)
			}
			call(p, grpcSpec{Method: "/idem.Test/Open", Msg: "g2"})
			retry := call(p, grpcSpec{Method: do, Key: "k2", Msg: "hold:g2"})
			if retry.Code != 0 || len(retry.Msgs) != 1 || string(retry.Msgs[0]) != "reply:hold:g2:1" || retry.Trailer["x-deadline"] != "no" {
				t.Errorf("retry after the deadline: got %v, want reply:hold:g2:1, the upstream without a deadline (x-deadline no)", retry)
			}
			if n := peer.runs("k2"); n != 1 {
				t.Errorf("k2 ran %d times, want 1", n)
			}

			// In flight: with --wait the copy gets the answer; with
			// --wait 0, Aborted at once. (With --wait, the gate may open
			// before the copy reaches the proxy, nothing tells the test
			// that it waits: it then gets the replay, one execution and
			// the same answer all the same. --wait 0 proves the copy met
			// the key in flight.)
			for _, c := range []struct {
				px        *proxyProc
				key, gate string
				code      codes.Code
			}{{p, "k3", "g3", codes.OK}, {noWait, "k4", "g4", codes.Aborted}} {
				held := make(chan grpcResult, 1)
				go func() { held <- call(c.px, grpcSpec{Method: do, Key: c.key, Msg: "hold:" + c.gate}) }()
				awaitRuns(t, peer, c.key, 1)
				copies := make(chan grpcResult, 1)
				go func() { copies <- call(c.px, grpcSpec{Method: do, Key: c.key, Msg: "hold:" + c.gate}) }()
				if c.code != codes.OK {
					if cp := <-copies; cp.Code != int(c.code) {
						t.Errorf("copy of %s in flight, --wait 0: got %v, want %v", c.key, cp, c.code)
					}
				}
				call(p, grpcSpec{Method: "/idem.Test/Open", Msg: c.gate})
				h := <-held
				if h.Code != 0 {
					t.Errorf("held call %s: got %v, want OK", c.key, h)
				}
				if c.code == codes.OK {
					if cp := <-copies; cp.Code != 0 || !bytes.Equal(bytes.Join(cp.Msgs, nil), bytes.Join(h.Msgs, nil)) {
						t.Errorf("copy of %s that waited: got %v, want %v", c.key, cp, h)
					}
				}
				if n := peer.runs(c.key); n != 1 {
					t.Errorf("%s ran %d times, want 1", c.key, n)
				}
			}

			// --max-execution cuts the work (DEADLINE_EXCEEDED when the
			// upstream has not answered yet; a reset stream when it sent
			// its header metadata) and releases the key: the retry runs.
			cut := startProxy(t, nil, "--upstream", "h2c://"+peer.addr, "--max-execution", "200ms")
			// (grpc-go's server sends its header metadata with the first
			// message: the proxy answers it.)
			if c := call(cut, grpcSpec{Method: do, Key: "k7", Msg: "hold:g7"}); c.Code == 0 || (name == "go" && c.Code != int(codes.DeadlineExceeded)) {
				t.Errorf("call past --max-execution: got %v, want an error (DEADLINE_EXCEEDED from grpc-go)", c)
			}
			call(p, grpcSpec{Method: "/idem.Test/Open", Msg: "g7"})
			if c := call(cut, grpcSpec{Method: do, Key: "k7", Msg: "hold:g7"}); c.Code != 0 || peer.runs("k7") != 2 {
				t.Errorf("retry after --max-execution: got %v after %d runs, want OK after 2", c, peer.runs("k7"))
			}

			// Stored and released statuses (idemgrpc.DefaultShouldStore).
			for _, c := range []struct {
				key, msg string
				code     codes.Code
				runs     int
			}{{"k5", "status:3", codes.InvalidArgument, 1}, {"k6", "status:14", codes.Unavailable, 2}} {
				a := call(p, grpcSpec{Method: do, Key: c.key, Msg: c.msg})
				b := call(p, grpcSpec{Method: do, Key: c.key, Msg: c.msg})
				if a.Code != int(c.code) || b.Code != int(c.code) || a.Message != "failed "+c.msg || b.Message != a.Message {
					t.Errorf("%s: got %v then %v, want %v, failed %s", c.msg, a, b, c.code, c.msg)
				}
				if n := peer.runs(c.key); n != c.runs {
					t.Errorf("%s ran %d times, want %d", c.msg, n, c.runs)
				}
				if c.runs == 1 && (b.Header["idempotent-replayed"] != "true" || b.Trailer["x-run"] != "1") {
					t.Errorf("%s: the repeat is no replay of the first: %v", c.msg, b)
				}
			}

			// Server streaming passes through (no key); with a key, its
			// whole answer is stored and replayed.
			w := call(p, grpcSpec{Method: "/idem.Test/Watch", Msg: "w"})
			if w.Code != 0 || len(w.Msgs) != 3 || string(w.Msgs[2]) != "w:2" {
				t.Errorf("server streaming: got %v, want w:0, w:1, w:2", w)
			}
			kw := call(p, grpcSpec{Method: "/idem.Test/Watch", Key: "kw", Msg: "w"})
			kw2 := call(p, grpcSpec{Method: "/idem.Test/Watch", Key: "kw", Msg: "w"})
			if kw.Code != 0 || kw2.Code != 0 || len(kw2.Msgs) != 3 || string(kw2.Msgs[2]) != "w:2" || kw2.Header["idempotent-replayed"] != "true" {
				t.Errorf("keyed server streaming: got %v then %v, want w:0, w:1, w:2 and its replay", kw, kw2)
			}
			if deadlines != nil {
				if n := deadlines(); n != 0 {
					t.Errorf("the upstream saw a deadline on %d keyed calls, want none (grpc-timeout dropped)", n)
				}
			}
			// Bidirectional streaming passes through, message by message,
			// without a key and, on its route, with one.
			testChat(t, p.addr, "")
			testChat(t, p.addr, "chat-key")
		})
	}
}

// testChat runs an interactive bidi call with grpc-go: each message is
// answered before the next is sent, so a proxy that held the stream
// would stall it.
func testChat(t *testing.T, addr, key string) {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithDefaultCallOptions(grpc.ForceCodec(upstreamtest.RawCodec{})))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if key != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "idempotency-key", key)
	}
	stream, err := conn.NewStream(ctx, &grpc.StreamDesc{ServerStreams: true, ClientStreams: true}, "/idem.Test/Chat")
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range []string{"a", "b", "c"} {
		out := []byte(m)
		if err := stream.SendMsg(&out); err != nil {
			t.Fatal(err)
		}
		var in []byte
		if err := stream.RecvMsg(&in); err != nil || string(in) != "chat:"+m {
			t.Fatalf("bidi (key %q): sent %q, got %q, %v; want chat:%s", key, m, in, err, m)
		}
	}
	stream.CloseSend()
	var in []byte
	if err := stream.RecvMsg(&in); !errors.Is(err, io.EOF) {
		t.Errorf("bidi after CloseSend: got %q, %v; want io.EOF", in, err)
	}
}
