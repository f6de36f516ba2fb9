package main

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/proctest"
)

// scriptUpstream is an upstream written in another language
// (testdata/upstream.py, testdata/upstream.js), run as a process: it
// prints one JSON line per execution on stdout and its parse errors on
// stderr.
type scriptUpstream struct {
	url    string
	mu     sync.Mutex
	runs   map[string]int
	stderr bytes.Buffer
}

func startScriptUpstream(t *testing.T, name string, args ...string) *scriptUpstream {
	t.Helper()
	path := proctest.RequireTool(t, name)
	u := &scriptUpstream{runs: map[string]int{}}
	cmd := exec.Command(path, args...)
	cmd.Stderr = &lockedWriter{mu: &u.mu, w: &u.stderr}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	port := make(chan int, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			var line struct {
				Listen int
				Key    string
			}
			if json.Unmarshal(sc.Bytes(), &line) != nil {
				continue
			}
			if line.Listen != 0 {
				port <- line.Listen
				continue
			}
			u.mu.Lock()
			u.runs[line.Key]++
			u.mu.Unlock()
		}
	}()
	select {
	case p := <-port:
		u.url = fmt.Sprintf("http://127.0.0.1:%d", p)
	case <-time.After(20 * time.Second):
		t.Fatalf("%s %v did not start within 20s", name, args)
	}
	return u
}

func (u *scriptUpstream) runsOf(key string) int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.runs[key]
}

func (u *scriptUpstream) errors() string {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.stderr.String()
}

type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (w *lockedWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.w.Write(p)
}

// framing is how a test client frames a keyed request's body.
type framing int

const (
	noBody        framing = iota // no body at all
	contentLength                // a 3 KiB body with its Content-Length
	chunked                      // the same body, Transfer-Encoding: chunked
)

func (f framing) String() string { return [...]string{"no body", "Content-Length", "chunked"}[f] }

// upstreamAnswer is what the script upstreams answer: the body they read.
type upstreamAnswer struct {
	Key        string
	Executions int
	Len        int
	SHA256     string
}

// A keyed request reaches the upstream framed as the client framed it, and
// its body whole: with no body, without one (not an empty chunked body,
// whose last chunk Python's http.server reads as the next request, a
// response desync), and with a body the proxy has read, with its
// Content-Length (a chunked body reached http.server empty, and the wrong
// result was stored). Against Python's http.server and Node's http, with
// keep-alive, sequential and concurrent, with a chunked request without a
// key before each keyed one (the proxy forwards it as it came, then closes
// that upstream connection, so that what the upstream makes of its chunks
// reaches no other request): every answer 201 with the body the client
// sent, one execution per key, byte-identical replays, no parse error
// upstream, and no line of the proxy's log outside the JSON log.
func TestProxyUpstreamFraming(t *testing.T) {
	t.Parallel()
	body := bytes.Repeat([]byte(`{"item":"widget","qty":1},`), 3<<10/26)
	for _, up := range []struct{ name, prog, script string }{
		{"python", "python3", "testdata/upstream.py"},
		{"node", "node", "testdata/upstream.js"},
	} {
		t.Run(up.name, func(t *testing.T) {
			t.Parallel()
			u := startScriptUpstream(t, up.prog, up.script)
			p := startProxy(t, nil, "--upstream", u.url)
			client := &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 16}}
			unkeyedClient := &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
			send := func(key string, f framing) (*http.Response, []byte, error) {
				var rd io.Reader
				switch f {
				case contentLength:
					rd = bytes.NewReader(body)
				case chunked:
					rd = io.MultiReader(bytes.NewReader(body)) // unknown length: net/http sends it chunked
				}
				req, _ := http.NewRequest("POST", p.url("/orders"), rd)
				req.Header.Set(idemhttp.HeaderKey, key)
				req.Header.Set("Content-Type", "application/json")
				resp, err := client.Do(req)
				if err != nil {
					return nil, nil, err
				}
				defer resp.Body.Close()
				b, err := io.ReadAll(resp.Body)
				return resp, b, err
			}
			// A request without a key is forwarded as the client framed
			// it, chunked here: its connection to the upstream must not
			// serve another request after it.
			unkeyed := func() error {
				req, _ := http.NewRequest("POST", p.url("/orders"), io.MultiReader(bytes.NewReader(body)))
				resp, err := unkeyedClient.Do(req)
				if err != nil && up.name == "python" {
					return nil // see below
				} else if err != nil {
					return fmt.Errorf("unkeyed chunked POST: %v", err)
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				// Its own answer is whatever the upstream makes of a
				// chunked body: Python's http.server answers before
				// reading it (a 502 for a broken pipe, or a cut
				// connection), Node reads it (201).
				if up.name == "node" && resp.StatusCode != http.StatusCreated {
					return fmt.Errorf("unkeyed chunked POST: got %d, want 201", resp.StatusCode)
				}
				return nil
			}
			check := func(key string, f framing) error {
				if err := unkeyed(); err != nil {
					return err
				}
				resp, first, err := send(key, f)
				if err != nil {
					return fmt.Errorf("%s %s: %v", key, f, err)
				}
				if resp.StatusCode != http.StatusCreated {
					return fmt.Errorf("%s %s: got %d %s, want 201", key, f, resp.StatusCode, first)
				}
				var a upstreamAnswer
				if err := json.Unmarshal(first, &a); err != nil {
					return fmt.Errorf("%s %s: answer %q: %v", key, f, first, err)
				}
				want := body
				if f == noBody {
					want = nil
				}
				sum := sha256.Sum256(want)
				if a.Key != key || a.Len != len(want) || a.SHA256 != hex.EncodeToString(sum[:]) {
					return fmt.Errorf("%s %s: the upstream answered %+v: want key %s and the %d bytes sent", key, f, a, key, len(want))
				}
				resp, again, err := send(key, f)
				if err != nil {
					return fmt.Errorf("%s %s, retry: %v", key, f, err)
				}
				if resp.StatusCode != http.StatusCreated || resp.Header.Get(idemhttp.HeaderReplayed) != "true" || !bytes.Equal(again, first) {
					return fmt.Errorf("%s %s, retry: got %d replayed=%q %s, want the replay of %s", key, f, resp.StatusCode,
						resp.Header.Get(idemhttp.HeaderReplayed), again, first)
				}
				return nil
			}
			var keys []string
			const perFraming = 40
			for i := range perFraming { // sequential: one keep-alive connection
				for _, f := range []framing{noBody, contentLength, chunked} {
					key := fmt.Sprintf("%s-seq-%d-%d", up.name, f, i)
					keys = append(keys, key)
					if err := check(key, f); err != nil {
						t.Fatal(err)
					}
				}
			}
			var wg sync.WaitGroup
			errs := make(chan error, 8*perFraming)
			for w := range 8 { // concurrent
				wg.Add(1)
				go func() {
					defer wg.Done()
					for i := range perFraming / 2 {
						f := framing((w + i) % 3)
						key := fmt.Sprintf("%s-par-%d-%d", up.name, w, i)
						if err := check(key, f); err != nil {
							errs <- err
							return
						}
					}
				}()
				for i := range perFraming / 2 {
					keys = append(keys, fmt.Sprintf("%s-par-%d-%d", up.name, w, i))
				}
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Error(err)
			}
			// The upstream prints an execution before it answers.
			for _, key := range keys {
				if n := u.runsOf(key); n != 1 {
					t.Errorf("%s: %d executions upstream, want 1", key, n)
				}
			}
			if e := u.errors(); e != "" {
				t.Errorf("the upstream could not parse what the proxy sent:\n%s", e)
			}
			for line := range strings.Lines(p.logText()) {
				if !json.Valid([]byte(line)) {
					t.Errorf("a line outside the JSON log: %q", line)
				}
				if strings.Contains(line, "Unsolicited") || strings.Contains(line, "malformed HTTP") {
					t.Errorf("the proxy saw an upstream answer that belonged to no request: %s", line)
				}
			}
		})
	}
}
