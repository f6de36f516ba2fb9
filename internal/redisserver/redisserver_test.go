package redisserver

import (
	"bufio"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// newTestServer starts a server that is stopped when the test ends.
func newTestServer(t *testing.T, opts ...Option) *Server {
	t.Helper()
	s, err := StartServer(opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Stop)
	return s
}

// mustDo runs a command and fails the test on any error.
func mustDo(t *testing.T, s *Server, args ...string) string {
	t.Helper()
	reply, err := s.Do(args...)
	if err != nil {
		t.Fatalf("%s on %s: %v", strings.Join(args, " "), s.Addr(), err)
	}
	return reply
}

// pid returns the process id of the running server.
func pid(t *testing.T, s *Server) int {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc == nil {
		t.Fatalf("%s: no process", s.Addr())
	}
	return s.proc.cmd.Process.Pid
}

// assertGone fails the test if process pid still exists.
func assertGone(t *testing.T, pid int) {
	t.Helper()
	if err := syscall.Kill(pid, 0); !errors.Is(err, syscall.ESRCH) {
		t.Errorf("process %d still exists (kill 0: %v)", pid, err)
	}
}

// assertClosed fails the test if something listens on port.
func assertClosed(t *testing.T, port int) {
	t.Helper()
	if conn, err := net.DialTimeout("tcp", loopback(port), time.Second); err == nil {
		conn.Close()
		t.Errorf("port %d still accepts connections", port)
	}
}

func TestServerLifecycle(t *testing.T) {
	t.Parallel()
	s := newTestServer(t)

	if want := fmt.Sprintf("127.0.0.1:%d", s.Port()); s.Addr() != want {
		t.Fatalf("Addr() = %q, want %q", s.Addr(), want)
	}
	if got := mustDo(t, s, "SET", "greeting", "hello world\r\n"); got != "OK" {
		t.Errorf("SET = %q, want OK", got)
	}
	if got := mustDo(t, s, "GET", "greeting"); got != "hello world\r\n" {
		t.Errorf("GET = %q, want %q", got, "hello world\r\n")
	}
	if got, err := s.Do("GET", "missing"); !errors.Is(err, ErrNil) || got != "" {
		t.Errorf("GET missing = %q, %v; want \"\", ErrNil", got, err)
	}
	if got := mustDo(t, s, "INCRBY", "n", "-7"); got != "-7" {
		t.Errorf("INCRBY = %q, want -7", got)
	}
	mustDo(t, s, "RPUSH", "list", "a", "b", "c")
	if got := mustDo(t, s, "LRANGE", "list", "0", "-1"); got != "a\nb\nc" {
		t.Errorf("LRANGE = %q, want %q", got, "a\nb\nc")
	}
	var replyErr ReplyError
	if _, err := s.Do("LPUSH", "greeting", "x"); !errors.As(err, &replyErr) || !strings.HasPrefix(string(replyErr), "WRONGTYPE") {
		t.Errorf("LPUSH on a string: err = %v, want a WRONGTYPE ReplyError", err)
	}
	if v, _ := InfoField(mustDo(t, s, "INFO", "server"), "redis_version"); !strings.HasPrefix(v, "7.") {
		t.Errorf("redis_version = %q, want 7.x", v)
	}

	// Kill: the server is gone but keeps its address.
	addr, firstPID := s.Addr(), pid(t, s)
	s.Kill()
	assertGone(t, firstPID)
	if _, err := s.Do("PING"); err == nil {
		t.Fatal("PING after Kill succeeded")
	}
	s.Kill() // no-op

	// Restart: same address, new process, empty data set.
	if err := s.Restart(); err != nil {
		t.Fatal(err)
	}
	if s.Addr() != addr {
		t.Errorf("Addr after Restart = %q, want %q", s.Addr(), addr)
	}
	if got := mustDo(t, s, "PING"); got != "PONG" {
		t.Errorf("PING after Restart = %q, want PONG", got)
	}
	if _, err := s.Do("GET", "greeting"); !errors.Is(err, ErrNil) {
		t.Errorf("GET after Restart: err = %v, want ErrNil (nothing persisted)", err)
	}

	// Restart of a running server replaces the process.
	secondPID := pid(t, s)
	if err := s.Restart(); err != nil {
		t.Fatal(err)
	}
	assertGone(t, secondPID)

	// Stop, twice: process, port and directory are gone.
	thirdPID := pid(t, s)
	s.Stop()
	s.Stop()
	assertGone(t, thirdPID)
	assertClosed(t, s.Port())
	if _, err := os.Stat(s.dir); !os.IsNotExist(err) {
		t.Errorf("temp dir %s still exists after Stop (stat: %v)", s.dir, err)
	}
	if err := s.Restart(); err == nil {
		t.Error("Restart after Stop succeeded")
	}
	if err := s.Pause(); err == nil {
		t.Error("Pause after Stop succeeded")
	}
}

func TestRestartAfterShutdown(t *testing.T) {
	t.Parallel()
	s := newTestServer(t)
	if _, err := s.Do("SHUTDOWN", "NOSAVE"); err == nil {
		t.Error("SHUTDOWN returned no error, want a closed connection")
	}
	if err := s.Restart(); err != nil {
		t.Fatal(err)
	}
	if got := mustDo(t, s, "PING"); got != "PONG" {
		t.Errorf("PING = %q, want PONG", got)
	}
}

func TestPauseResume(t *testing.T) {
	t.Parallel()
	s := newTestServer(t)
	if err := s.Pause(); err != nil {
		t.Fatal(err)
	}
	var netErr net.Error
	if _, err := do(s.Addr(), 300*time.Millisecond, "PING"); !errors.As(err, &netErr) || !netErr.Timeout() {
		t.Errorf("PING on a paused server: err = %v, want a timeout", err)
	}
	if err := s.Resume(); err != nil {
		t.Fatal(err)
	}
	if got := mustDo(t, s, "PING"); got != "PONG" {
		t.Errorf("PING after Resume = %q, want PONG", got)
	}

	// Stop must not hang on a paused server.
	if err := s.Pause(); err != nil {
		t.Fatal(err)
	}
	p := pid(t, s)
	s.Stop()
	assertGone(t, p)
}

func TestWithArgs(t *testing.T) {
	t.Parallel()
	s := newTestServer(t, WithArgs("--maxmemory", "10mb", "--maxmemory-policy", "allkeys-lru"))
	if got := mustDo(t, s, "CONFIG", "GET", "maxmemory"); got != "maxmemory\n10485760" {
		t.Errorf("CONFIG GET maxmemory = %q", got)
	}
	mustDo(t, s, "SET", "k", strings.Repeat("x", 1000))
	if got, err := strconv.Atoi(mustDo(t, s, "MEMORY", "USAGE", "k")); err != nil || got < 1000 {
		t.Errorf("MEMORY USAGE = %d, %v; want at least 1000", got, err)
	}
	if got := mustDo(t, s, "FLUSHALL"); got != "OK" {
		t.Errorf("FLUSHALL = %q, want OK", got)
	}
	if got := mustDo(t, s, "DBSIZE"); got != "0" {
		t.Errorf("DBSIZE after FLUSHALL = %q, want 0", got)
	}
}

func TestStartFailureShowsLog(t *testing.T) {
	t.Parallel()
	s, err := StartServer(WithArgs("--maxmemory", "bogus"))
	if err == nil {
		s.Stop()
		t.Fatal("StartServer with a bad argument succeeded")
	}
	if !strings.Contains(err.Error(), "argument must be a memory value") {
		t.Errorf("error does not show the log tail:\n%v", err)
	}
}

func TestMissingBinary(t *testing.T) {
	t.Setenv("PATH", t.TempDir())
	_, err := StartServer()
	if want := "redisserver: redis-server not found on PATH; install it (apt-get install redis-server)"; err == nil || err.Error() != want {
		t.Errorf("StartServer error = %v, want %q", err, want)
	}
	if _, err := StartCluster(3, 0); err == nil || !strings.Contains(err.Error(), "not found on PATH") {
		t.Errorf("StartCluster error = %v, want a not-found error", err)
	}
}

func TestCluster(t *testing.T) {
	t.Parallel()
	start := time.Now()
	c, err := StartCluster(3, 1)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Stop)
	t.Logf("3 primaries + 3 replicas ready in %v", time.Since(start).Round(time.Millisecond))

	nodes, addrs := c.Nodes(), c.Addrs()
	if len(nodes) != 6 || len(addrs) != 6 {
		t.Fatalf("got %d nodes and %d addrs, want 6", len(nodes), len(addrs))
	}
	for i, s := range nodes {
		if addrs[i] != s.Addr() {
			t.Errorf("Addrs()[%d] = %s, want %s", i, addrs[i], s.Addr())
		}
		info := mustDo(t, s, "CLUSTER", "INFO")
		for field, want := range map[string]string{"cluster_state": "ok", "cluster_size": "3"} {
			if got, _ := InfoField(info, field); got != want {
				t.Errorf("%s: %s = %q, want %q", s.Addr(), field, got, want)
			}
		}
		wantRole := "master"
		if i >= 3 {
			wantRole = "slave"
		}
		if role, _, _ := strings.Cut(mustDo(t, s, "ROLE"), "\n"); role != wantRole {
			t.Errorf("node %d (%s) has role %q, want %q", i, s.Addr(), role, wantRole)
		}
	}

	masters, slaves := 0, 0
	sc := bufio.NewScanner(strings.NewReader(mustDo(t, nodes[0], "CLUSTER", "NODES")))
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 3 {
			t.Fatalf("malformed CLUSTER NODES line %q", sc.Text())
		}
		for flag := range strings.SplitSeq(fields[2], ",") {
			switch flag {
			case "master":
				masters++
			case "slave":
				slaves++
			}
		}
	}
	if masters != 3 || slaves != 3 {
		t.Errorf("CLUSTER NODES lists %d masters and %d slaves, want 3 and 3", masters, slaves)
	}

	// Exactly one primary owns a key; the others redirect.
	owners := 0
	for _, s := range nodes[:3] {
		_, err := s.Do("SET", "key", "value")
		var replyErr ReplyError
		switch {
		case err == nil:
			owners++
		case !errors.As(err, &replyErr) || !strings.HasPrefix(string(replyErr), "MOVED "):
			t.Errorf("SET on %s: %v, want OK or MOVED", s.Addr(), err)
		}
	}
	if owners != 1 {
		t.Errorf("%d primaries accepted SET key, want 1", owners)
	}

	pids := make([]int, len(nodes))
	for i, s := range nodes {
		pids[i] = pid(t, s)
	}
	c.Stop()
	c.Stop()
	for i, s := range nodes {
		assertGone(t, pids[i])
		assertClosed(t, s.Port())
		assertClosed(t, s.Port()+clusterBusOffset)
	}
}

func TestReadReply(t *testing.T) {
	tests := []struct {
		in      string
		want    string
		wantErr error
	}{
		{"+OK\r\n", "OK", nil},
		{"-ERR unknown command\r\n", "", ReplyError("ERR unknown command")},
		{":-42\r\n", "-42", nil},
		{"$5\r\nhe\r\no\r\n", "he\r\no", nil},
		{"$0\r\n\r\n", "", nil},
		{"$-1\r\n", "", ErrNil},
		{"*-1\r\n", "", ErrNil},
		{"*0\r\n", "", nil},
		{"*4\r\n$1\r\na\r\n*2\r\n:1\r\n+b\r\n$-1\r\n-ERR x\r\n", "a\n1\nb\n\nERR x", nil},
	}
	for _, tt := range tests {
		got, err := readReply(bufio.NewReader(strings.NewReader(tt.in)))
		if got != tt.want || !errors.Is(err, tt.wantErr) {
			t.Errorf("readReply(%q) = %q, %v; want %q, %v", tt.in, got, err, tt.want, tt.wantErr)
		}
	}
	for _, in := range []string{"", "OK\r\n", "+OK\n", ":x\r\n", "$3\r\nab\r\n", "$2\r\nabc\r\n", "$-2\r\n", "*2\r\n+a\r\n", "?\r\n"} {
		if got, err := readReply(bufio.NewReader(strings.NewReader(in))); err == nil {
			t.Errorf("readReply(%q) = %q, nil; want an error", in, got)
		}
	}
}

func TestEncodeCommand(t *testing.T) {
	got := string(encodeCommand([]string{"SET", "k", ""}))
	if want := "*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$0\r\n\r\n"; got != want {
		t.Errorf("encodeCommand = %q, want %q", got, want)
	}
}

func TestInfoField(t *testing.T) {
	info := "# Server\r\nredis_version:7.0.15\r\nrole:master\r\nempty:\r\n"
	for field, want := range map[string]string{"redis_version": "7.0.15", "role": "master", "empty": ""} {
		if got, ok := InfoField(info, field); !ok || got != want {
			t.Errorf("InfoField(%q) = %q, %v; want %q, true", field, got, ok, want)
		}
	}
	if got, ok := InfoField(info, "missing"); ok {
		t.Errorf("InfoField(missing) = %q, true; want false", got)
	}
}

func TestParseKinds(t *testing.T) {
	for _, tc := range []struct {
		list string
		want []Kind
	}{
		{"", nil},
		{" , ", nil},
		{"valkey-9.1", []Kind{Valkey9}},
		{" redis-8.6 , valkey-9.1,redis-8.6", []Kind{Redis8, Valkey9}},
		{"all", Kinds},
	} {
		got, err := ParseKinds(tc.list)
		if err != nil || fmt.Sprint(got) != fmt.Sprint(tc.want) {
			t.Errorf("ParseKinds(%q) = %v, %v; want %v", tc.list, got, err, tc.want)
		}
	}
	if _, err := ParseKinds("valkey-9.1,valkey"); err == nil || !strings.Contains(err.Error(), `"valkey"`) {
		t.Errorf("ParseKinds with an unknown kind: got %v, want an error naming it", err)
	}
}
