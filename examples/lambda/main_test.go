package main

import (
	"bytes"
	"context"
	"encoding/json"
	"go/build"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/dynamotest"
	"github.com/idemkit/idem/internal/nettest"
)

// rieInstall is the command that installs the emulator where the test
// looks for it (scripts/test.sh runs it).
const rieInstall = "go install github.com/aws/aws-lambda-runtime-interface-emulator/cmd/aws-lambda-rie@v0.0.0-20261030222936-bef5c4ba774d"

// docScript returns the sh block of docs/lambda.md's "Run it locally".
func docScript(t *testing.T) string {
	t.Helper()
	md, err := os.ReadFile(filepath.Join("..", "..", "docs", "lambda.md"))
	if err != nil {
		t.Fatal(err)
	}
	_, sect, ok := strings.Cut(string(md), "\n## Run it locally\n")
	if !ok {
		t.Fatal(`docs/lambda.md: no "## Run it locally" section`)
	}
	_, block, ok := strings.Cut(sect, "\n```sh\n")
	if !ok {
		t.Fatal("docs/lambda.md, Run it locally: no ```sh block")
	}
	block, _, ok = strings.Cut(block, "\n```")
	if !ok {
		t.Fatal("docs/lambda.md, Run it locally: the ```sh block does not end")
	}
	return block
}

// findRIE returns the directory of the emulator: on PATH or in
// $GOPATH/bin.
func findRIE(t *testing.T) string {
	t.Helper()
	if p, err := exec.LookPath("aws-lambda-rie"); err == nil {
		return filepath.Dir(p)
	}
	for _, p := range filepath.SplitList(build.Default.GOPATH) {
		if _, err := os.Stat(filepath.Join(p, "bin", "aws-lambda-rie")); err == nil {
			return filepath.Join(p, "bin")
		}
	}
	t.Fatalf("aws-lambda-rie not found on PATH nor in $GOPATH/bin; ./scripts/test.sh installs it, or run: %s", rieInstall)
	return ""
}

// TestLocalRun runs the commands of docs/lambda.md's "Run it locally" as
// they are written, but for the addresses (free loopback ports, and a
// private dynalite for the doc's local DynamoDB) and the place of the
// built function (a temporary directory, not the module's root): the
// function builds, runs under aws-lambda-rie against DynamoDB with only
// the settings the doc gives, charges once, replays byte for byte, and
// answers a reused key 422 and a missing key 400 (not a Lambda error).
func TestLocalRun(t *testing.T) {
	rieDir := findRIE(t)
	ddb, err := dynamotest.Start()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ddb.Stop)
	port := func() string {
		p, err := nettest.FreePort()
		if err != nil {
			t.Fatal(err)
		}
		return "127.0.0.1:" + strconv.Itoa(p)
	}
	dir := t.TempDir()
	script := docScript(t)
	for _, r := range [][2]string{
		{"127.0.0.1:8000", ddb.Addr()},
		{"127.0.0.1:9000", port()},
		{"127.0.0.1:9001", port()},
		{"-o bootstrap ", "-o " + filepath.Join(dir, "bootstrap") + " "},
		{" ./bootstrap &", " " + filepath.Join(dir, "bootstrap") + " &"},
	} {
		if !strings.Contains(script, r[0]) {
			t.Fatalf("docs/lambda.md's commands no longer hold %q, which this test replaces; update the test:\n%s", r[0], script)
		}
		script = strings.ReplaceAll(script, r[0], r[1])
	}

	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute) // the build, on a busy machine
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", "-e", "-c", script)
	cmd.Dir = filepath.Join("..", "..") // the module's root
	// The doc's settings only: none of the caller's AWS ones.
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "AWS_") && !strings.HasPrefix(kv, "PATH=") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, "PATH="+rieDir+string(filepath.ListSeparator)+os.Getenv("PATH"))
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err = cmd.Run()
	syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) // whatever the script left behind
	if err != nil {
		t.Fatalf("the doc's commands: %v\nstdout:\n%s\nstderr:\n%s", err, stdout.String(), stderr.String())
	}

	var answers []string
	for _, line := range strings.Split(stdout.String(), "\n") {
		if strings.HasPrefix(line, "{") {
			answers = append(answers, line)
		}
	}
	t.Logf("the four answers:\n%s", strings.Join(answers, "\n"))
	if len(answers) != 4 {
		t.Fatalf("got %d answers, want 4 (one per invoke)\nstdout:\n%s\nstderr:\n%s", len(answers), stdout.String(), stderr.String())
	}
	type answer struct {
		StatusCode int               `json:"statusCode"`
		Headers    map[string]string `json:"headers"`
		Body       string            `json:"body"`
		ErrorType  string            `json:"errorType"`
	}
	got := make([]answer, len(answers))
	for i, a := range answers {
		if err := json.Unmarshal([]byte(a), &got[i]); err != nil {
			t.Fatalf("answer %d %s: %v", i+1, a, err)
		}
		if got[i].ErrorType != "" {
			t.Errorf("answer %d is a Lambda error (API Gateway answers 502): %s", i+1, a)
		}
	}
	if got[0].StatusCode != 201 || !strings.Contains(got[0].Body, `"charge":"ch_`) {
		t.Errorf("first: got %s, want 201 and a charge", answers[0])
	}
	if answers[1] != answers[0] {
		t.Errorf("repeat: got\n%s\nwant the first answer byte for byte:\n%s", answers[1], answers[0])
	}
	if got[2].StatusCode != 422 || got[2].Headers["Content-Type"] != "application/problem+json" {
		t.Errorf("another body under the key: got %s, want 422 problem+json", answers[2])
	}
	if got[3].StatusCode != 400 || !strings.Contains(got[3].Body, "idemlambda: no Idempotency-Key header in the API Gateway REST API request") {
		t.Errorf("no key: got %s, want 400 naming the missing header", answers[3])
	}
}
