package clients

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/childproc"
)

// call is one logical request: the same key and body on every attempt.
type call struct {
	url, key, body string
	timeout        time.Duration // per attempt
	attempts       int           // at most, the first included
}

// result is where a client ended, and what each of its attempts saw.
type result struct {
	Client     string   `json:"-"`
	Status     int      `json:"status"` // 0: the client ended in an error
	Body       string   `json:"body"`
	Replayed   string   `json:"replayed"`    // Idempotent-Replayed
	RetryAfter string   `json:"retry_after"` // Retry-After
	Seen       []string `json:"seen"`        // per attempt: a status, "timeout", "body timeout", "reset", ...
	Error      string   `json:"error"`
	key        string   // the key it sent
}

// client is a real client with its own retry logic.
type client struct {
	name    string
	tool    string        // the program it needs ("" for Go), checked before the run
	timeout time.Duration // its timeout per attempt, when not the scenario's
	run     func(ctx context.Context, c call) result
}

// clientDeadline bounds one client's whole run.
const clientDeadline = 40 * time.Second

var (
	pythonClient = client{name: "python requests+urllib3 Retry", tool: "python", run: runPython}
	nodeClient   = client{name: "node fetch", tool: "node", run: runNode}
	curlClient   = client{name: "curl --retry", tool: "curl", run: runCurl}
	goClient     = client{name: "Go http.Client", run: runGo}
	// goDropClient reads the first bytes of the body, closes the
	// connection, and retries as goClient does.
	goDropClient = client{name: "Go, drops mid-body", run: runGoDrop}
)

// tools are the programs the script clients run, found once.
var tools = struct {
	sync.Mutex
	path map[string]string
	err  map[string]error
}{path: map[string]string{}, err: map[string]error{}}

// toolPath finds a client's program, or fails the test naming the Debian
// package that provides it.
func toolPath(t *testing.T, tool string) string {
	t.Helper()
	tools.Lock()
	defer tools.Unlock()
	if p, ok := tools.path[tool]; ok {
		return p
	}
	if err, ok := tools.err[tool]; ok {
		t.Fatal(err)
	}
	var path string
	var err error
	switch tool {
	case "python": // Debian's python3 and python3-requests, not another python3 on PATH
		path = "/usr/bin/python3"
		if out, perr := exec.Command(path, "-c", "import requests, urllib3").CombinedOutput(); perr != nil {
			err = fmt.Errorf("got /usr/bin/python3 failing to import requests (%v: %s), want Debian's python3-requests installed (apt-get install python3-requests)", perr, bytes.TrimSpace(out))
		}
	case "python-grpc": // Debian's python3-grpcio (with python3-protobuf's well-known types)
		path = "/usr/bin/python3"
		if out, perr := exec.Command(path, "-c", "import grpc; from google.protobuf import wrappers_pb2").CombinedOutput(); perr != nil {
			err = fmt.Errorf("got /usr/bin/python3 failing to import grpc (%v: %s), want Debian's python3-grpcio installed (apt-get install python3-grpcio)", perr, bytes.TrimSpace(out))
		}
	case "node":
		if path, err = exec.LookPath("node"); err != nil {
			err = fmt.Errorf("got no node on PATH, want Debian's nodejs installed (apt-get install nodejs)")
		}
	case "curl":
		if path, err = exec.LookPath("curl"); err != nil {
			err = fmt.Errorf("got no curl on PATH, want Debian's curl installed (apt-get install curl)")
		}
	case "nginx":
		if path, err = exec.LookPath("nginx"); err != nil {
			path = "/usr/sbin/nginx" // not on a non-root PATH
			if _, err = os.Stat(path); err != nil {
				err = fmt.Errorf("got no nginx on PATH nor in /usr/sbin, want Debian's nginx-light installed (apt-get install nginx-light)")
			}
		}
	case "haproxy":
		if path, err = exec.LookPath("haproxy"); err != nil {
			path = "/usr/sbin/haproxy" // not on a non-root PATH
			if _, err = os.Stat(path); err != nil {
				err = fmt.Errorf("got no haproxy on PATH nor in /usr/sbin, want Debian's haproxy installed (apt-get install haproxy)")
			}
		}
	default:
		err = fmt.Errorf("unknown tool %q", tool)
	}
	if err != nil {
		tools.err[tool] = err
		t.Fatal(err)
	}
	tools.path[tool] = path
	return path
}

// tool is the path toolPath found.
func tool(name string) string {
	tools.Lock()
	defer tools.Unlock()
	return tools.path[name]
}

// seconds formats d for a command line.
func seconds(d time.Duration) string { return strconv.FormatFloat(d.Seconds(), 'f', -1, 64) }

// runScript runs a client program and decodes the JSON line it prints.
func runScript(ctx context.Context, bin string, args ...string) result {
	ctx, cancel := context.WithTimeout(ctx, clientDeadline)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.SysProcAttr = childproc.SysProcAttr()
	cmd.WaitDelay = time.Second
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	var res result
	if jerr := json.Unmarshal(lastLine(out), &res); jerr != nil {
		return result{Error: fmt.Sprintf("%s: %v, output %q, stderr %q", filepath.Base(bin), err, out, lastN(stderr.String(), 500))}
	}
	return res
}

func lastLine(b []byte) []byte {
	b = bytes.TrimSpace(b)
	if i := bytes.LastIndexByte(b, '\n'); i >= 0 {
		return b[i+1:]
	}
	return b
}

func lastN(s string, n int) string { return s[max(0, len(s)-n):] }

func runPython(ctx context.Context, c call) result {
	return runScript(ctx, tool("python"), "testdata/client.py", c.url, c.key, c.body, seconds(c.timeout), strconv.Itoa(c.attempts))
}

func runNode(ctx context.Context, c call) result {
	return runScript(ctx, tool("node"), "testdata/client.mjs", c.url, c.key, c.body,
		strconv.FormatInt(c.timeout.Milliseconds(), 10), strconv.Itoa(c.attempts))
}

// curlError is one "curl: (N) ..." line on curl's stderr.
var curlError = regexp.MustCompile(`(?m)^curl: \((\d+)\) (.*)$`)

// runCurl runs curl the way a shell script retries a POST:
//
//	curl -m TIMEOUT --retry N --retry-all-errors --fail-with-body --retry-delay 1
//
// -m bounds each attempt, body included. --retry alone resends after a
// timeout, a dropped connection and 408, 429, 500, 502, 503, 504 (honouring
// Retry-After on those), but not after 409, which is what idem answers
// while the key is in flight: --retry-all-errors retries any failure, and
// --fail-with-body makes an HTTP status of 400 or more a failure while
// keeping the body of the final answer (--fail would drop it). On a
// --retry-all-errors retry curl ignores Retry-After and waits --retry-delay
// (1 s, what idem's Retry-After says anyway; without it curl doubles its
// wait from 1 s). The price: a final answer such as 422 is retried too,
// and the client ends with it after N retries. curl truncates the -o file
// before each retry ("Throwing away N bytes"), so the body is the last
// attempt's; stdout would get every attempt's bytes appended.
func runCurl(ctx context.Context, c call) result {
	ctx, cancel := context.WithTimeout(ctx, clientDeadline)
	defer cancel()
	dir, err := os.MkdirTemp("", "idem-curl-")
	if err != nil {
		return result{Error: err.Error()}
	}
	defer os.RemoveAll(dir)
	bodyFile := filepath.Join(dir, "body")
	cmd := exec.CommandContext(ctx, tool("curl"), "--no-progress-meter", "-X", "POST", c.url,
		"-H", "Content-Type: application/json", "-H", idemhttp.HeaderKey+": "+c.key, "--data-binary", c.body,
		"-m", seconds(c.timeout), "--retry", strconv.Itoa(c.attempts-1), "--retry-all-errors", "--fail-with-body",
		"--retry-delay", "1", "-o", bodyFile, "-w", "%{http_code}\n%{header_json}")
	cmd.SysProcAttr = childproc.SysProcAttr()
	cmd.WaitDelay = time.Second
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, runErr := cmd.Output()
	var res result
	for _, m := range curlError.FindAllStringSubmatch(stderr.String(), -1) {
		res.Seen = append(res.Seen, curlSaw(m[1], m[2]))
	}
	code, headers, _ := strings.Cut(string(out), "\n")
	res.Status, _ = strconv.Atoi(strings.TrimSpace(code))
	if runErr == nil {
		res.Seen = append(res.Seen, strconv.Itoa(res.Status))
	} else if res.Status == 0 {
		res.Error = fmt.Sprintf("curl: %v: %s", runErr, lastN(stderr.String(), 300))
	}
	var h map[string][]string
	json.Unmarshal([]byte(headers), &h)
	if v := h["idempotent-replayed"]; len(v) > 0 {
		res.Replayed = v[0]
	}
	if v := h["retry-after"]; len(v) > 0 {
		res.RetryAfter = v[0]
	}
	if res.Status != 0 {
		b, _ := os.ReadFile(bodyFile)
		res.Body = string(b)
	}
	return res
}

// curlBytes finds "with N bytes received" in a timeout message.
var curlBytes = regexp.MustCompile(`with (\d+) (out of \d+ )?bytes received`)

// curlSaw names what a failed curl attempt saw.
func curlSaw(code, msg string) string {
	switch code {
	case "22": // --fail-with-body: "The requested URL returned error: 409"
		if i := strings.LastIndexByte(msg, ' '); i >= 0 {
			return msg[i+1:]
		}
	case "28":
		if m := curlBytes.FindStringSubmatch(msg); m != nil && m[1] != "0" {
			return "body timeout"
		}
		return "timeout"
	case "18":
		return "body reset"
	case "52", "55", "56":
		return "reset"
	}
	return "curl " + code
}

// retryable are the answers the hand-written Go loops retry.
func retryable(status int) bool {
	switch status {
	case http.StatusConflict, http.StatusTooManyRequests, http.StatusBadGateway,
		http.StatusServiceUnavailable, http.StatusGatewayTimeout:
		return true
	}
	return false
}

// retryLoop is a hand-written Go retry loop: it calls once up to attempts
// times, again after an error or a retryable status, waiting Retry-After
// when the answer has one, else 50 ms doubling.
func retryLoop(ctx context.Context, attempts int, once func() result) result {
	var res result
	var seen []string
	for i := 1; i <= attempts; i++ {
		res = once()
		if res.Status != 0 {
			seen = append(seen, strconv.Itoa(res.Status))
		} else {
			seen = append(seen, res.Error)
		}
		if (res.Status != 0 && !retryable(res.Status)) || i == attempts {
			break
		}
		wait := 50 * time.Millisecond << (i - 1)
		if s, err := strconv.Atoi(res.RetryAfter); err == nil {
			wait = time.Duration(s) * time.Second
		}
		select {
		case <-ctx.Done():
			res.Error = ctx.Err().Error()
			res.Seen = seen
			return res
		case <-time.After(wait):
		}
	}
	res.Seen = seen
	return res
}

// postOnce sends one attempt with hc and reads the whole answer; an error
// is named in Error ("timeout", "body timeout", "reset", ...).
func postOnce(ctx context.Context, hc *http.Client, c call) result {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.url, strings.NewReader(c.body))
	if err != nil {
		return result{Error: err.Error()}
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(idemhttp.HeaderKey, c.key)
	resp, err := hc.Do(req)
	if err != nil {
		return result{Error: failure(err)}
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return result{Error: "body " + failure(err)}
	}
	return result{Status: resp.StatusCode, Body: string(b), Replayed: resp.Header.Get(idemhttp.HeaderReplayed),
		RetryAfter: resp.Header.Get("Retry-After")}
}

// failure names a Go client error.
func failure(err error) string {
	var ne net.Error
	switch {
	case errors.Is(err, context.DeadlineExceeded), errors.As(err, &ne) && ne.Timeout():
		return "timeout"
	case errors.Is(err, context.Canceled):
		return "canceled"
	case errors.Is(err, syscall.ECONNRESET), errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return "reset"
	case errors.Is(err, syscall.ECONNREFUSED):
		return "refused"
	}
	return err.Error()
}

// runGo is Go's http.Client with Timeout (per attempt, body included) in
// a hand-written retry loop.
func runGo(ctx context.Context, c call) result {
	ctx, cancel := context.WithTimeout(ctx, clientDeadline)
	defer cancel()
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	hc := &http.Client{Timeout: c.timeout, Transport: tr}
	return retryLoop(ctx, c.attempts, func() result { return postOnce(ctx, hc, c) })
}

// runGoDrop reads the first 64 bytes of the first answer's body and
// closes the connection (a client that gives up mid-body), then retries
// as runGo does.
func runGoDrop(ctx context.Context, c call) result {
	ctx, cancel := context.WithTimeout(ctx, clientDeadline)
	defer cancel()
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	first := "dropped mid-body"
	func() {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.url, strings.NewReader(c.body))
		if err != nil {
			first = err.Error()
			return
		}
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set(idemhttp.HeaderKey, c.key)
		resp, err := (&http.Client{Timeout: 10 * time.Second, Transport: tr}).Do(req)
		if err != nil {
			first = failure(err)
			return
		}
		if _, err := io.ReadFull(resp.Body, make([]byte, 64)); err != nil {
			first = fmt.Sprintf("%d, body %s", resp.StatusCode, failure(err))
		}
		resp.Body.Close() // unread body: net/http closes the connection
	}()
	time.Sleep(100 * time.Millisecond)
	hc := &http.Client{Timeout: c.timeout, Transport: tr}
	res := retryLoop(ctx, c.attempts-1, func() result { return postOnce(ctx, hc, c) })
	res.Seen = append([]string{first}, res.Seen...)
	return res
}
