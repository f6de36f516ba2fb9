package main

// idem proxy in front of third-party Python servers bound to unix
// sockets, as they are deployed: uvicorn (--uds) serving an ASGI app and
// gunicorn (--bind unix:) serving a WSGI app (testdata/sock_app.py), from
// Debian's packages (python3-uvicorn, gunicorn; scripts/test.sh installs
// them). Each is reached with --upstream unix:///path by the built binary,
// once behind a TCP listener and once behind --listen unix:///path driven
// by curl --unix-socket.

import (
	"bufio"
	"encoding/json"
	"io"
	"net/http"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/proctest"
)

// debianPython is Debian's interpreter, which python3-uvicorn installs
// into; a python3 earlier on PATH (pyenv) does not see Debian's packages.
const debianPython = "/usr/bin/python3"

// startSockServer runs the third-party server name ("uvicorn" or
// "gunicorn") with testdata/sock_app.py on a unix socket in a fresh
// directory and returns the socket's path once the server says it
// listens. A server that is not installed fails the test: scripts/test.sh
// installs both.
func startSockServer(t *testing.T, name string) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), name+".sock")
	app, err := filepath.Abs("testdata")
	if err != nil {
		t.Fatal(err)
	}
	var cmd *exec.Cmd
	var ready string // the line of its log that says it listens
	switch name {
	case "uvicorn":
		if err := exec.Command(debianPython, "-c", "import uvicorn").Run(); err != nil {
			t.Fatalf("uvicorn is not installed for %s (scripts/test.sh installs python3-uvicorn): %v", debianPython, err)
		}
		cmd = exec.Command(debianPython, "-m", "uvicorn", "--uds", sock, "--app-dir", app, "--no-access-log", "sock_app:asgi")
		ready = "Uvicorn running on unix socket " + sock
	case "gunicorn":
		path, err := exec.LookPath("gunicorn")
		if err != nil {
			t.Fatalf("gunicorn is not installed (scripts/test.sh installs Debian's gunicorn): %v", err)
		}
		cmd = exec.Command(path, "--bind", "unix:"+sock, "--workers", "1", "--chdir", app, "sock_app:wsgi")
		ready = "Listening at: unix:" + sock
	default:
		t.Fatalf("no server %q", name)
	}
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var log strings.Builder
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
		if t.Failed() {
			mu.Lock()
			t.Logf("%s log:\n%s", name, log.String())
			mu.Unlock()
		}
	})
	listening := make(chan bool, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		said := false
		for sc.Scan() {
			mu.Lock()
			log.WriteString(sc.Text() + "\n")
			mu.Unlock()
			if !said && strings.Contains(sc.Text(), ready) {
				said = true
				listening <- true
			}
		}
		if !said {
			listening <- false // it exited without listening
		}
		io.Copy(io.Discard, stderr)
	}()
	select {
	case ok := <-listening:
		if !ok {
			mu.Lock()
			defer mu.Unlock()
			t.Fatalf("%s exited without listening on %s:\n%s", name, sock, log.String())
		}
	case <-time.After(20 * time.Second):
		t.Fatalf("%s did not listen on %s within 20s", name, sock)
	}
	return sock
}

// sockAnswer is testdata/sock_app.py's answer to a POST.
type sockAnswer struct {
	Server, Key, Path, Host, Body string
	Executions                    int
}

func decodeSockAnswer(t *testing.T, b string) sockAnswer {
	t.Helper()
	var a sockAnswer
	if err := json.Unmarshal([]byte(b), &a); err != nil {
		t.Fatalf("the app's answer %q: %v", b, err)
	}
	return a
}

// upstreamRuns asks the app, through the proxy at base (an unkeyed GET,
// passed through), how often it ran key.
func upstreamRuns(t *testing.T, base, key string) string {
	t.Helper()
	resp, err := testClient.Get(base + "/runs?key=" + key)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /runs through the proxy: %d %s", resp.StatusCode, b)
	}
	return string(b)
}

func TestProxyUvicornUnix(t *testing.T)  { testProxyPythonServerUnix(t, "uvicorn") }
func TestProxyGunicornUnix(t *testing.T) { testProxyPythonServerUnix(t, "gunicorn") }

// testProxyPythonServerUnix: behind --upstream unix:///path, a keyed POST
// runs once in the server's app and its repeat is the replay, byte for
// byte; another body under the key gets 422 and does not run; and with
// --listen unix:///path too, curl --unix-socket gets the same guarantee.
func testProxyPythonServerUnix(t *testing.T, server string) {
	proctest.RequireTool(t, "curl")
	sock := startSockServer(t, server)
	p := startProxy(t, nil, "--upstream", "unix://"+sock)
	base := "http://" + p.addr
	key := server + "-a"
	got := decodeSockAnswer(t, keyedTwice(t, base, key, "amount=7"))
	want := sockAnswer{Server: server, Key: key, Path: "/orders?x=1", Host: "localhost", Body: "amount=7", Executions: 1}
	if got != want {
		t.Errorf("the app answered %+v, want %+v", got, want)
	}
	r := mustSend(t, http.MethodPost, base+"/orders?x=1", key, "amount=99")
	wantStatus(t, "another body under "+key, r, http.StatusUnprocessableEntity, "")
	if n := upstreamRuns(t, base, key); n != "1" {
		t.Errorf("%s ran %s %s times, want 1", server, key, n)
	}

	// Both ends on unix sockets: curl --unix-socket to the proxy, the
	// proxy to the server.
	front := filepath.Join(t.TempDir(), "idem.sock")
	q := startProxy(t, nil, "--upstream", "unix://"+sock, "--listen", "unix://"+front)
	key = server + "-b"
	var bodies []string
	for i := range 2 {
		c := runCurl(t, "--unix-socket", front, "-H", "Idempotency-Key: "+key, "-d", "amount=3", "http://localhost/pay")
		if c.code != 0 || c.status != http.StatusCreated {
			t.Fatalf("curl --unix-socket %s, POST %d: exit %d, %s %d", front, i+1, c.code, c.proto, c.status)
		}
		if replayed := c.header.Get(idemhttp.HeaderReplayed) == "true"; replayed != (i == 1) {
			t.Errorf("curl POST %d: replayed %v", i+1, replayed)
		}
		bodies = append(bodies, string(c.body))
	}
	if bodies[0] != bodies[1] {
		t.Errorf("replay differs:\n%s\n%s", bodies[0], bodies[1])
	}
	if a := decodeSockAnswer(t, bodies[0]); a.Server != server || a.Executions != 1 || a.Path != "/pay" {
		t.Errorf("through the socket proxy %s, the app answered %+v", q.addr, a)
	}
	if n := upstreamRuns(t, base, key); n != "1" {
		t.Errorf("%s ran %s %s times, want 1", server, key, n)
	}
}
