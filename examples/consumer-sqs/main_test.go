package main

import (
	"context"
	"crypto/rand"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/idemkit/idem/internal/redisserver"
	"github.com/idemkit/idem/internal/sqstest"
)

var srv *sqstest.Server

func TestMain(m *testing.M) {
	var err error
	if srv, err = sqstest.Start(sqstest.Options{}); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	code := m.Run()
	srv.Stop()
	os.Exit(code)
}

// localEnv sets the environment of a local run as the package doc gives
// it, with the server's address, and points the SDK's files at nothing.
func localEnv(t *testing.T) {
	dir := t.TempDir()
	for k, v := range map[string]string{
		"AWS_ENDPOINT_URL":            "http://" + srv.Addr(),
		"AWS_REGION":                  sqstest.Region,
		"AWS_ACCESS_KEY_ID":           "test",
		"AWS_SECRET_ACCESS_KEY":       "test",
		"AWS_EC2_METADATA_DISABLED":   "true",
		"AWS_CONFIG_FILE":             filepath.Join(dir, "config"),
		"AWS_SHARED_CREDENTIALS_FILE": filepath.Join(dir, "credentials"),
		"AWS_PROFILE":                 "",
		"AWS_DEFAULT_REGION":          "",
		"AWS_ENDPOINT_URL_SQS":        "",
	} {
		t.Setenv(k, v)
	}
}

// lines collects what run prints.
type lines struct {
	mu  sync.Mutex
	buf strings.Builder
}

func (l *lines) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func (l *lines) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

// count returns how many lines start with each outcome word, and the
// effect lines per order.
func (l *lines) count() (outcomes map[string]int, effects map[string]int) {
	outcomes, effects = map[string]int{}, map[string]int{}
	for line := range strings.Lines(l.String()) {
		f := strings.Fields(line)
		if len(f) < 2 {
			continue
		}
		outcomes[f[0]]++
		if f[0] == "effect" {
			effects[f[1]]++
		}
	}
	return outcomes, effects
}

// consumer is one run of the program, stopped at the end of the test.
type consumer struct {
	out    lines
	cancel context.CancelFunc
	done   chan error
}

func start(t *testing.T, args ...string) *consumer {
	ctx, cancel := context.WithCancel(t.Context())
	c := &consumer{cancel: cancel, done: make(chan error, 1)}
	go func() { c.done <- run(ctx, args, &c.out) }()
	t.Cleanup(func() { c.stop(t) })
	return c
}

// stop ends the run (Ctrl-C) and fails the test unless it returned nil.
func (c *consumer) stop(t *testing.T) {
	t.Helper()
	if c.cancel == nil {
		return
	}
	c.cancel()
	c.cancel = nil
	select {
	case err := <-c.done:
		if err != nil {
			t.Errorf("run: %v\n%s", err, c.out.String())
		}
	case <-time.After(30 * time.Second):
		t.Errorf("run still running 30s after its context ended\n%s", c.out.String())
	}
}

// waitFor polls until every consumer's output together has want effect
// and replayed lines, or fails after limit.
func waitFor(t *testing.T, limit time.Duration, want int, cs ...*consumer) (outcomes, effects map[string]int) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for {
		outcomes, effects = map[string]int{}, map[string]int{}
		for _, c := range cs {
			o, e := c.out.count()
			for k, n := range o {
				outcomes[k] += n
			}
			for k, n := range e {
				effects[k] += n
			}
		}
		if outcomes["effect"] >= want && outcomes["replayed"] >= want || time.Now().After(deadline) {
			return outcomes, effects
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// checkOnce fails unless each of orders orders had one effect, every
// other copy was replayed, nothing failed, and the queue is empty: every
// message deleted.
func checkOnce(t *testing.T, queue string, orders int, outcomes, effects map[string]int, out string) {
	t.Helper()
	for i := range orders {
		if n := effects[fmt.Sprint("order-", i)]; n != 1 {
			t.Errorf("order-%d: got %d effect lines, want 1", i, n)
		}
	}
	if len(effects) != orders || outcomes["replayed"] != orders {
		t.Errorf("got effects for %d orders and %d replayed, want %d and %d", len(effects), outcomes["replayed"], orders, orders)
	}
	for _, bad := range []string{"error", "sqs", "dead_lettered", "released", "none"} {
		if outcomes[bad] != 0 {
			t.Errorf("got %d %q lines, want none", outcomes[bad], bad)
		}
	}
	if t.Failed() {
		t.Logf("output:\n%s", out)
	}
	client := srv.Client()
	q, err := client.GetQueueUrl(t.Context(), &awssqs.GetQueueUrlInput{QueueName: aws.String(queue)})
	if err != nil {
		t.Fatal(err)
	}
	attrs, err := client.GetQueueAttributes(t.Context(), &awssqs.GetQueueAttributesInput{QueueUrl: q.QueueUrl,
		AttributeNames: []types.QueueAttributeName{types.QueueAttributeNameApproximateNumberOfMessages, types.QueueAttributeNameApproximateNumberOfMessagesNotVisible}})
	if err != nil {
		t.Fatal(err)
	}
	for name, v := range attrs.Attributes {
		if v != "0" {
			t.Errorf("queue %s: %s %s, want 0 (every message deleted)", queue, name, v)
		}
	}
}

// TestRun runs the program as its doc says, -publish 20 on the
// in-process store: 10 orders, each sent twice; each order's handler runs
// once, its other copy is replayed, and every message is deleted.
func TestRun(t *testing.T) {
	localEnv(t)
	queue := "orders-" + rand.Text()[:8]
	c := start(t, "-queue", queue, "-publish", "20")
	outcomes, effects := waitFor(t, time.Minute, 10, c)
	c.stop(t)
	checkOnce(t, queue, 10, outcomes, effects, c.out.String())
	if !regexp.MustCompile(`(?m)^effect     order-3 charge 103 \(message \S+, token [1-9]\d*\)$`).MatchString(c.out.String()) {
		t.Errorf("no effect line for order-3 with its body 103 and a token in:\n%s", c.out.String())
	}
}

// TestShared runs two copies on one Redis store, as the doc's second
// example: 20 orders sent twice, handled once each across both copies.
// (A copy that finds its order in flight at the other one puts it back
// for the lease left, so this may take the lease, 30s.)
func TestShared(t *testing.T) {
	localEnv(t)
	redis, err := redisserver.StartServer()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(redis.Stop)
	queue := "orders-" + rand.Text()[:8]
	b := start(t, "-queue", queue, "-redis", redis.Addr())
	a := start(t, "-queue", queue, "-redis", redis.Addr(), "-publish", "40")
	outcomes, effects := waitFor(t, 90*time.Second, 20, a, b)
	a.stop(t)
	b.stop(t)
	delete(outcomes, "in_flight") // put back, then replayed: counted there
	checkOnce(t, queue, 20, outcomes, effects, a.out.String()+"---\n"+b.out.String())
}

// Without a region or credentials, the error says what a local run sets,
// at once (the instance metadata lookup is off).
func TestMissingSettings(t *testing.T) {
	for _, unset := range []string{"AWS_REGION", "AWS_ACCESS_KEY_ID"} {
		localEnv(t)
		t.Setenv(unset, "")
		if unset == "AWS_ACCESS_KEY_ID" {
			t.Setenv("AWS_SECRET_ACCESS_KEY", "")
		}
		ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
		var out lines
		err := run(ctx, []string{"-queue", "never-created"}, &out)
		cancel()
		if err == nil || !strings.Contains(err.Error(), "AWS_ENDPOINT_URL=") || !strings.Contains(err.Error(), unset) {
			t.Errorf("without %s: got %v, want an error naming %s and the settings of a local run", unset, err, unset)
		}
	}
}
