package idemlambda_test

// The wrapper under the real Lambda runtime: the runtime interface
// emulator (aws-lambda-rie, which scripts/test.sh installs with go
// install) runs internal/testfn, built with -tags lambda.norpc as its
// bootstrap, on loopback ports; the store and the system of record are a
// private redis-server. One emulator runs one invocation at a time, as
// one Lambda execution environment does: concurrent instances are several
// emulators sharing the store.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"go/build"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/dynamostore"
	"github.com/idemkit/idem/internal/childproc"
	"github.com/idemkit/idem/internal/dynamotest"
	"github.com/idemkit/idem/internal/nettest"
	"github.com/idemkit/idem/internal/redisserver"
)

// rieInstall is the command that installs the emulator where the tests
// look for it.
const rieInstall = "go install github.com/aws/aws-lambda-runtime-interface-emulator/cmd/aws-lambda-rie@v0.0.0-20261030222936-bef5c4ba774d"

var bootstrap string // the built test function

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "idemlambda-fn")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	bootstrap = filepath.Join(dir, "bootstrap")
	build := exec.Command("go", "build", "-tags", "lambda.norpc", "-o", bootstrap, "./internal/testfn")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "idemlambda: building the test function: %v\n%s", err, out)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// findRIE returns the emulator's path: on PATH or in $GOPATH/bin.
func findRIE(t *testing.T) string {
	if p, err := exec.LookPath("aws-lambda-rie"); err == nil {
		return p
	}
	for _, p := range filepath.SplitList(build.Default.GOPATH) {
		bin := filepath.Join(p, "bin", "aws-lambda-rie")
		if _, err := os.Stat(bin); err == nil {
			return bin
		}
	}
	t.Fatalf("aws-lambda-rie not found on PATH nor in $GOPATH/bin; ./scripts/test.sh installs it, or run: %s", rieInstall)
	return ""
}

// instance is one emulator and its function: one execution environment.
type instance struct {
	t    *testing.T
	cmd  *exec.Cmd
	url  string
	done chan struct{}
	log  *syncBuffer
}

// startInstance starts an emulator with the function's timeout in
// seconds and extra environment (NAME=value).
func startInstance(t *testing.T, rdb string, timeout int, env ...string) *instance {
	t.Helper()
	rie := findRIE(t)
	for range 5 { // another process may take a free port first
		p1, err := nettest.FreePort()
		if err != nil {
			t.Fatal(err)
		}
		p2, err := nettest.FreePort()
		if err != nil {
			t.Fatal(err)
		}
		addr := "127.0.0.1:" + strconv.Itoa(p1)
		in := &instance{t: t, url: "http://" + addr + "/2015-03-31/functions/function/invocations", done: make(chan struct{}), log: &syncBuffer{}}
		in.cmd = exec.Command(rie, "--runtime-interface-emulator-address", addr,
			"--runtime-api-address", "127.0.0.1:"+strconv.Itoa(p2), "--log-level", "error", bootstrap)
		in.cmd.Env = append(os.Environ(), "AWS_LAMBDA_FUNCTION_NAME=payments", "AWS_EC2_METADATA_DISABLED=true",
			"AWS_LAMBDA_FUNCTION_TIMEOUT="+strconv.Itoa(timeout), "IDEMTEST_REDIS="+rdb)
		in.cmd.Env = append(in.cmd.Env, env...)
		in.cmd.Stdout, in.cmd.Stderr = in.log, in.log
		in.cmd.SysProcAttr = childproc.SysProcAttr()
		if err := in.cmd.Start(); err != nil {
			t.Fatal(err)
		}
		go func() { in.cmd.Wait(); close(in.done) }()
		if in.listening(addr) {
			t.Cleanup(in.kill)
			return in
		}
		in.kill()
	}
	t.Fatal("aws-lambda-rie did not listen on a loopback port after 5 tries")
	return nil
}

func (in *instance) listening(addr string) bool {
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		select {
		case <-in.done:
			return false
		default:
		}
		if c, err := net.DialTimeout("tcp", addr, 100*time.Millisecond); err == nil {
			c.Close()
			return true
		}
	}
	return false
}

// functionPID returns the pid of the function process the emulator runs
// (its child), waiting for it to start.
func (in *instance) functionPID() int {
	in.t.Helper()
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/children", in.cmd.Process.Pid))
		for _, f := range tasks {
			b, _ := os.ReadFile(f)
			for _, s := range strings.Fields(string(b)) {
				if pid, err := strconv.Atoi(s); err == nil {
					return pid
				}
			}
		}
	}
	in.t.Fatal("the emulator started no function process")
	return 0
}

// kill kills the function process and the emulator, at once (SIGKILL):
// an execution environment that vanishes mid-work.
func (in *instance) kill() {
	select {
	case <-in.done:
		return
	default:
	}
	tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/children", in.cmd.Process.Pid))
	for _, f := range tasks {
		b, _ := os.ReadFile(f)
		for _, s := range strings.Fields(string(b)) {
			if pid, err := strconv.Atoi(s); err == nil {
				syscall.Kill(pid, syscall.SIGKILL)
			}
		}
	}
	in.cmd.Process.Kill()
	<-in.done
}

// waitLog waits until the emulator's output (the function's included)
// holds s.
func (in *instance) waitLog(s string) {
	in.t.Helper()
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		if strings.Contains(in.log.String(), s) {
			return
		}
	}
	in.t.Fatalf("the function did not print %q within 20s; its output:\n%s", s, in.log.String())
}

// result is an invocation's answer: the function's result or its error.
type result struct {
	raw       []byte
	Key       string `json:"key"`
	Amount    int    `json:"amount"`
	Token     uint64 `json:"token"`
	Written   bool   `json:"written"`
	ErrorType string `json:"errorType"`
	ErrorMsg  string `json:"errorMessage"`
}

// invoke invokes the function as Lambda does, and waits for its answer.
// It must run on the test's goroutine; others use tryInvoke.
func (in *instance) invoke(event any) result {
	in.t.Helper()
	r, err := in.tryInvoke(event)
	if err != nil {
		in.t.Fatalf("%v\nemulator log:\n%s", err, in.log.String())
	}
	return r
}

func (in *instance) tryInvoke(event any) (result, error) {
	body, _ := json.Marshal(event)
	c := http.Client{Timeout: time.Minute}
	resp, err := c.Post(in.url, "application/json", bytes.NewReader(body))
	if err != nil {
		return result{}, fmt.Errorf("invoke: %w", err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	r := result{raw: raw}
	if resp.StatusCode != http.StatusOK {
		return r, fmt.Errorf("invoke: status %d: %s", resp.StatusCode, raw)
	}
	if strings.HasPrefix(string(raw), "Task timed out") {
		r.ErrorType = "TimedOut"
		return r, nil
	}
	if err := json.Unmarshal(raw, &r); err != nil {
		return r, fmt.Errorf("invoke: answer %q: %w", raw, err)
	}
	return r, nil
}

// syncBuffer is a bytes.Buffer safe for the emulator's output and the
// test reading it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

type event struct {
	Key     string `json:"key"`
	Amount  int    `json:"amount"`
	SleepMS int    `json:"sleep_ms,omitempty"`
	Fail    bool   `json:"fail,omitempty"`
}

// sor reads the test's system of record in Redis.
type sor struct {
	t *testing.T
	c *redis.Client
}

func startRedis(t *testing.T) (*redisserver.Server, sor) {
	t.Helper()
	s, err := redisserver.StartServer()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Stop)
	c := redis.NewClient(&redis.Options{Addr: s.Addr()})
	t.Cleanup(func() { c.Close() })
	return s, sor{t, c}
}

func (s sor) int(key string) int {
	n, err := s.c.Get(context.Background(), key).Int()
	if err != nil && err != redis.Nil {
		s.t.Fatal(err)
	}
	return n
}

func (s sor) field(key, f string) int {
	n, err := s.c.HGet(context.Background(), key, f).Int()
	if err != nil && err != redis.Nil {
		s.t.Fatal(err)
	}
	return n
}

// tokens returns the fencing tokens of the runs of key, in start order.
func (s sor) tokens(key string) []uint64 {
	vs, err := s.c.LRange(context.Background(), "started:"+key, 0, -1).Result()
	if err != nil {
		s.t.Fatal(err)
	}
	var toks []uint64
	for _, v := range vs {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			s.t.Fatal(err)
		}
		toks = append(toks, n)
	}
	return toks
}

// waitRuns waits until the function started n runs for key.
func (s sor) waitRuns(key string, n int) {
	s.t.Helper()
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		if s.int("runs:"+key) >= n {
			return
		}
	}
	s.t.Fatalf("the function did not start run %d of %s within 20s", n, key)
}

// The result is stored and replayed byte for byte; a key reused with
// another payload is refused with a recognisable errorType.
func TestRIEReplayIsByteExact(t *testing.T) {
	rs, db := startRedis(t)
	in := startInstance(t, rs.Addr(), 10)
	first := in.invoke(event{Key: "k", Amount: 7})
	if first.ErrorType != "" || !first.Written {
		t.Fatalf("first invocation: %s", first.raw)
	}
	again := in.invoke(event{Key: "k", Amount: 7})
	if !bytes.Equal(again.raw, first.raw) {
		t.Fatalf("replay %s, want the first answer byte for byte: %s", again.raw, first.raw)
	}
	if mm := in.invoke(event{Key: "k", Amount: 8}); mm.ErrorType != "MismatchError" {
		t.Fatalf("another payload under the key: %s, want errorType MismatchError", mm.raw)
	}
	if n := db.int("runs:k"); n != 1 {
		t.Fatalf("%d runs, want 1", n)
	}
}

// Three instances get the same event while the first runs it: one runs,
// one fails with InFlightError at once, and one that waits (Config.Wait)
// replays the first's result.
func TestRIEConcurrentInstances(t *testing.T) {
	rs, db := startRedis(t)
	a := startInstance(t, rs.Addr(), 10)
	b := startInstance(t, rs.Addr(), 10)
	c := startInstance(t, rs.Addr(), 10, "IDEMTEST_WAIT=8s")
	ev := event{Key: "k", Amount: 1, SleepMS: 1500}
	first := make(chan result)
	go func() { r, _ := a.tryInvoke(ev); first <- r }()
	db.waitRuns("k", 1)
	if r := b.invoke(ev); r.ErrorType != "InFlightError" {
		t.Fatalf("concurrent invocation: %s, want errorType InFlightError", r.raw)
	}
	waited := c.invoke(ev)
	ra := <-first
	if ra.ErrorType != "" || !bytes.Equal(waited.raw, ra.raw) {
		t.Fatalf("the waiting instance got %s, want the first's answer %s", waited.raw, ra.raw)
	}
	if n := db.int("runs:k"); n != 1 {
		t.Fatalf("%d runs, want 1", n)
	}
}

// Powertools' "Lambda timeouts": an invocation that times out is killed
// by the runtime; its key stays in flight until the lease it took (its
// deadline plus the margin) ends, then the next invocation runs the work
// once more, with a larger fencing token.
func TestRIETimeoutFreesKeyAfterLease(t *testing.T) {
	rs, db := startRedis(t)
	a := startInstance(t, rs.Addr(), 2)
	b := startInstance(t, rs.Addr(), 10)
	if r := a.invoke(event{Key: "k", Amount: 1, SleepMS: 5000}); r.ErrorType != "TimedOut" {
		t.Fatalf("a 5s run in a 2s function: %s, want a timeout", r.raw)
	}
	// The lease lasts until the deadline plus the 2s margin: still held.
	if r := b.invoke(event{Key: "k", Amount: 1}); r.ErrorType != "InFlightError" {
		t.Fatalf("right after the timeout: %s, want InFlightError (the lease outlives the invocation)", r.raw)
	}
	var r result
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		if r = b.invoke(event{Key: "k", Amount: 1}); r.ErrorType != "InFlightError" || time.Now().After(deadline) {
			break
		}
	}
	if r.ErrorType != "" || !r.Written {
		t.Fatalf("after the lease: %s, want a run that writes", r.raw)
	}
	if n := db.int("runs:k"); n != 2 {
		t.Fatalf("%d runs, want 2 (the timed-out one and the retry)", n)
	}
	toks := db.tokens("k")
	if len(toks) != 2 || toks[1] <= toks[0] {
		t.Fatalf("tokens %v, want the retry's larger", toks)
	}
	if w := db.field("sor:k", "writes"); w != 1 {
		t.Fatalf("%d writes in the system of record, want 1 (the killed run never wrote)", w)
	}
	if again := b.invoke(event{Key: "k", Amount: 1}); !bytes.Equal(again.raw, r.raw) {
		t.Fatalf("then: %s, want the replay of %s", again.raw, r.raw)
	}
}

// An execution environment killed mid-work (SIGKILL of the emulator and
// the function: out of memory, a host failure) on a long function, whose
// lease (1s) is renewed while it runs: its key is free once the lease
// ends, not at its deadline (30s away), and the next invocation runs the
// work once more.
func TestRIEKilledMidWork(t *testing.T) {
	rs, db := startRedis(t)
	a := startInstance(t, rs.Addr(), 30, "IDEMTEST_LEASE=1s")
	b := startInstance(t, rs.Addr(), 30, "IDEMTEST_LEASE=1s")
	go a.tryInvoke(event{Key: "k", Amount: 1, SleepMS: 20000}) // never answers: killed
	db.waitRuns("k", 1)
	time.Sleep(1500 * time.Millisecond) // past one lease: kept by renewal
	if r := b.invoke(event{Key: "k", Amount: 1}); r.ErrorType != "InFlightError" {
		t.Fatalf("while the first instance works past its lease: %s, want InFlightError (renewed)", r.raw)
	}
	a.kill()
	var r result
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		if r = b.invoke(event{Key: "k", Amount: 1}); r.ErrorType != "InFlightError" || time.Now().After(deadline) {
			break
		}
	}
	if r.ErrorType != "" || !r.Written || db.int("runs:k") != 2 || db.field("sor:k", "writes") != 1 {
		t.Fatalf("after the kill: %s, %d runs, %d writes; want one more run that writes", r.raw, db.int("runs:k"), db.field("sor:k", "writes"))
	}
}

// An instance that stops mid-work (SIGSTOP: a frozen host, a long pause)
// loses its lease; another runs the work; when the first resumes, its
// write carries the older fencing token and the system of record refuses
// it, and it cannot complete the key: the replay is the second's result.
func TestRIEStaleInvocationIsFenced(t *testing.T) {
	rs, db := startRedis(t)
	a := startInstance(t, rs.Addr(), 30, "IDEMTEST_LEASE=1s")
	b := startInstance(t, rs.Addr(), 30, "IDEMTEST_LEASE=1s")
	stale := make(chan result)
	go func() { r, _ := a.tryInvoke(event{Key: "k", Amount: 1, SleepMS: 1500}); stale <- r }()
	a.waitLog("idemtest: working on k") // past its own Redis calls
	fn, err := os.FindProcess(a.functionPID())
	if err != nil {
		t.Fatal(err)
	}
	if err := childproc.Pause(fn, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	var r result
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		if r = b.invoke(event{Key: "k", Amount: 1}); r.ErrorType != "InFlightError" || time.Now().After(deadline) {
			break
		}
	}
	if r.ErrorType != "" || !r.Written {
		t.Fatalf("while the first instance is stopped, after its lease: %s, want a run that writes", r.raw)
	}
	fn.Signal(syscall.SIGCONT)
	s := <-stale
	if s.Written || db.field("sor:k", "refused") != 1 || db.field("sor:k", "writes") != 1 {
		t.Fatalf("the stale run: %s with %d refused and %d accepted writes; want its write refused", s.raw, db.field("sor:k", "refused"), db.field("sor:k", "writes"))
	}
	if s.Token >= r.Token {
		t.Fatalf("stale token %d, new token %d: want the new one larger", s.Token, r.Token)
	}
	if again := b.invoke(event{Key: "k", Amount: 1}); !bytes.Equal(again.raw, r.raw) {
		t.Fatalf("replay %s, want the second run's %s (the stale one did not complete)", again.raw, r.raw)
	}
}

// The store is paused (SIGSTOP of redis-server) while the handler works:
// the lease, bounded by the deadline, needs no renewal and is not lost;
// the result is stored once the store answers, and replayed.
func TestRIEStorePausedDuringWork(t *testing.T) {
	rs, db := startRedis(t)
	a := startInstance(t, rs.Addr(), 10)
	first := make(chan result)
	go func() { r, _ := a.tryInvoke(event{Key: "k", Amount: 1, SleepMS: 2500}); first <- r }()
	a.waitLog("idemtest: working on k") // past its own Redis calls
	if err := rs.Pause(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(1500 * time.Millisecond)
	if err := rs.Resume(); err != nil {
		t.Fatal(err)
	}
	r := <-first
	if r.ErrorType != "" || !r.Written {
		t.Fatalf("run across the pause: %s", r.raw)
	}
	if again := a.invoke(event{Key: "k", Amount: 1}); !bytes.Equal(again.raw, r.raw) {
		t.Fatalf("then: %s, want the replay of %s", again.raw, r.raw)
	}
	if n := db.int("runs:k"); n != 1 {
		t.Fatalf("%d runs, want 1", n)
	}
}

// The store is paused when the invocation arrives: it fails with a store
// error and the handler does not run (fail closed); once the store is
// back, the work runs once.
func TestRIEStorePausedBeforeWork(t *testing.T) {
	rs, db := startRedis(t)
	a := startInstance(t, rs.Addr(), 10)
	if err := rs.Pause(); err != nil {
		t.Fatal(err)
	}
	r := a.invoke(event{Key: "k", Amount: 1})
	rs.Resume()
	if r.ErrorType != "StoreError" || db.int("runs:k") != 0 {
		t.Fatalf("with the store paused: %s after %d runs, want errorType StoreError and no run", r.raw, db.int("runs:k"))
	}
	if r := a.invoke(event{Key: "k", Amount: 1}); r.ErrorType != "" || db.int("runs:k") != 1 {
		t.Fatalf("after: %s, want one run", r.raw)
	}
}

// SQS batch events with partial batch responses through the runtime:
// the failed record is reported in batchItemFailures; redelivering the
// batch runs only that one.
func TestRIESQSPartialBatchResponse(t *testing.T) {
	rs, db := startRedis(t)
	a := startInstance(t, rs.Addr(), 10, "IDEMTEST_MODE=sqs")
	batch := map[string]any{"Records": []map[string]any{
		{"messageId": "m1", "body": "ok", "eventSource": "aws:sqs"},
		{"messageId": "m2", "body": "fail", "eventSource": "aws:sqs"},
		{"messageId": "m3", "body": "ok", "eventSource": "aws:sqs"},
	}}
	want := `{"batchItemFailures":[{"itemIdentifier":"m2"}]}`
	for round := 1; round <= 2; round++ {
		r := a.invoke(batch)
		if string(r.raw) != want {
			t.Fatalf("round %d: %s, want %s", round, r.raw, want)
		}
		if db.int("runs:m1") != 1 || db.int("runs:m3") != 1 || db.int("runs:m2") != round {
			t.Fatalf("round %d: runs m1=%d m2=%d m3=%d, want 1, %d, 1", round, db.int("runs:m1"), db.int("runs:m2"), db.int("runs:m3"), round)
		}
	}
}

// The same function over dynamostore, DynamoDB being the natural store
// on Lambda (a private dynalite): concurrent instances, one run, the
// replay byte for byte, and a timed-out invocation's key free after its
// lease.
func TestRIEDynamoDB(t *testing.T) {
	ddb, err := dynamotest.Start()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ddb.Stop)
	if err := dynamostore.CreateTable(context.Background(), ddb.Client(), "idem"); err != nil {
		t.Fatal(err)
	}
	rs, db := startRedis(t)
	env := "IDEMTEST_DYNAMODB=" + ddb.Addr()
	a := startInstance(t, rs.Addr(), 2, env)
	b := startInstance(t, rs.Addr(), 10, env)
	ev := event{Key: "k", Amount: 1, SleepMS: 1000}
	first := make(chan result)
	go func() { r, _ := b.tryInvoke(ev); first <- r }()
	db.waitRuns("k", 1)
	if r := a.invoke(ev); r.ErrorType != "InFlightError" {
		t.Fatalf("concurrent invocation: %s, want InFlightError", r.raw)
	}
	r := <-first
	if r.ErrorType != "" || !r.Written {
		t.Fatalf("first: %s", r.raw)
	}
	if again := a.invoke(ev); !bytes.Equal(again.raw, r.raw) {
		t.Fatalf("replay %s, want %s", again.raw, r.raw)
	}
	// A 5s run in a 2s function times out; the key is free after the
	// deadline plus the margin, and runs once more.
	if r := a.invoke(event{Key: "t", Amount: 1, SleepMS: 5000}); r.ErrorType != "TimedOut" {
		t.Fatalf("%s, want a timeout", r.raw)
	}
	if r := b.invoke(event{Key: "t", Amount: 1}); r.ErrorType != "InFlightError" {
		t.Fatalf("right after the timeout: %s, want InFlightError", r.raw)
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		if r = b.invoke(event{Key: "t", Amount: 1}); r.ErrorType != "InFlightError" || time.Now().After(deadline) {
			break
		}
	}
	if r.ErrorType != "" || db.int("runs:t") != 2 || db.int("runs:k") != 1 {
		t.Fatalf("after the lease: %s, runs t=%d k=%d; want t run twice, k once", r.raw, db.int("runs:t"), db.int("runs:k"))
	}
}
