package dynamostore_test

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/dynamostore"
	"github.com/idemkit/idem/internal/dynamotest"
)

// cut is what the cutting proxy does to one request.
type cut int

const (
	whole       cut = iota // forwarded, and its answer
	midRequest             // half its bytes reach the server, then both connections close: never applied
	noAnswer               // applied; the connection closes before a byte of the answer
	midHeader              // applied; the connection closes inside the answer's header
	midBody                // applied; the connection closes inside the answer's body
	afterAnswer            // answered whole, then the connection closes (a server closing an idle connection)
	serverError            // not forwarded: the proxy answers 500 itself (a real answer, not a lost one)
	numCuts
)

var cutNames = [numCuts]string{"whole", "mid-request", "no answer", "mid-header", "mid-body", "after the answer", "server error"}

func (c cut) String() string { return cutNames[c] }

// cutter is a TCP proxy in front of dynalite that reads the HTTP/1.1
// requests and answers of each connection and cuts them as its plan says:
// what a reused connection that the server (or a load balancer) closed,
// or a network that drops, does to a client.
type cutter struct {
	ln       net.Listener
	upstream string

	mu   sync.Mutex
	plan func(op string, body []byte) cut
	// done counts the requests of each operation by what was done to them.
	done map[string]*[numCuts]int
	// answered holds the UpdateItem bodies the client got a whole answer
	// to; resentAfterAnswer counts those sent again.
	answered          map[[32]byte]bool
	resentAfterAnswer int
	conns             sync.WaitGroup
	open              map[net.Conn]bool
}

func newCutter(t *testing.T, upstream string) *cutter {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	c := &cutter{ln: ln, upstream: upstream, plan: passAll,
		done: map[string]*[numCuts]int{}, answered: map[[32]byte]bool{}, open: map[net.Conn]bool{}}
	go func() {
		for {
			cc, err := ln.Accept()
			if err != nil {
				return
			}
			c.mu.Lock()
			c.open[cc] = true
			c.conns.Add(1)
			c.mu.Unlock()
			go c.serve(cc)
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		c.mu.Lock()
		for cc := range c.open {
			cc.Close()
		}
		c.mu.Unlock()
		c.conns.Wait()
	})
	return c
}

func (c *cutter) addr() string { return c.ln.Addr().String() }

// setPlan sets what is done to the next requests.
func (c *cutter) setPlan(plan func(op string, body []byte) cut) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.plan = plan
}

// counts returns how many requests of op got each cut, and resets them.
func (c *cutter) counts(op string) [numCuts]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := c.done[op]
	if n == nil {
		return [numCuts]int{}
	}
	delete(c.done, op)
	return *n
}

// decide runs the plan for one request and counts it.
func (c *cutter) decide(op string, body []byte) cut {
	c.mu.Lock()
	defer c.mu.Unlock()
	k := c.plan(op, body)
	if c.done[op] == nil {
		c.done[op] = new([numCuts]int)
	}
	c.done[op][k]++
	if op == "UpdateItem" {
		h := digest(op, body)
		if c.answered[h] {
			c.resentAfterAnswer++
		}
		if k == whole || k == afterAnswer || k == serverError {
			c.answered[h] = true
		}
	}
	return k
}

const serverErrorBody = `{"__type":"com.amazonaws.dynamodb.v20120810#InternalServerError","message":"the cutting proxy's own answer"}`

func (c *cutter) serve(cc net.Conn) {
	var up net.Conn
	defer func() {
		cc.Close()
		if up != nil {
			up.Close()
		}
		c.mu.Lock()
		delete(c.open, cc)
		c.mu.Unlock()
		c.conns.Done()
	}()
	var upr *bufio.Reader
	br := bufio.NewReader(cc)
	for {
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		body, err := io.ReadAll(req.Body)
		if err != nil {
			return
		}
		op := strings.TrimPrefix(req.Header.Get("X-Amz-Target"), "DynamoDB_20120810.")
		k := c.decide(op, body)
		if k == serverError {
			fmt.Fprintf(cc, "HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/x-amz-json-1.0\r\nX-Amzn-Errortype: InternalServerError\r\nContent-Length: %d\r\n\r\n%s",
				len(serverErrorBody), serverErrorBody)
			continue
		}
		req.Body = io.NopCloser(bytes.NewReader(body))
		var raw bytes.Buffer
		if err := req.Write(&raw); err != nil {
			return
		}
		if up == nil {
			if up, err = net.Dial("tcp", c.upstream); err != nil {
				return
			}
			upr = bufio.NewReader(up)
		}
		if k == midRequest {
			up.Write(raw.Bytes()[:raw.Len()/2])
			return
		}
		if _, err := up.Write(raw.Bytes()); err != nil {
			return
		}
		resp, err := http.ReadResponse(upr, req)
		if err != nil {
			return
		}
		rb, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil {
			return
		}
		resp.Body, resp.ContentLength, resp.TransferEncoding = io.NopCloser(bytes.NewReader(rb)), int64(len(rb)), nil
		var out bytes.Buffer
		if err := resp.Write(&out); err != nil {
			return
		}
		b := out.Bytes()
		hdr := bytes.Index(b, []byte("\r\n\r\n")) + 4
		switch k {
		case noAnswer:
			return
		case midHeader:
			cc.Write(b[:hdr/2])
			return
		case midBody:
			cc.Write(b[:hdr+len(rb)/2])
			return
		}
		if _, err := cc.Write(b); err != nil || k == afterAnswer {
			return
		}
	}
}

// digest identifies a request by its operation and its body's JSON in a
// canonical form: the SDK writes the members of a map (expression
// attribute names and values) in Go's random map order, so the same
// request sent again is the same JSON, not the same bytes.
func digest(op string, body []byte) [32]byte {
	var v any
	if err := json.Unmarshal(body, &v); err == nil {
		body, _ = json.Marshal(v) // object members sorted
	}
	return sha256.Sum256(append([]byte(op+"\n"), body...))
}

// firstOnly cuts the first time each request body is seen, cycling
// through cuts (a whole answer between two cuts), and passes every
// repeat: a request the store sends again goes through, so every call
// succeeds within two attempts.
func firstOnly(cuts ...cut) func(op string, body []byte) cut {
	seen := map[[32]byte]bool{}
	n := map[string]int{}
	return func(op string, body []byte) cut {
		h := digest(op, body)
		if seen[h] {
			return whole
		}
		seen[h] = true
		n[op]++
		if n[op]%2 == 1 {
			return whole
		}
		return cuts[(n[op]/2)%len(cuts)]
	}
}

// passAll passes every request.
func passAll(string, []byte) cut { return whole }

// always does k to every request of op, and passes the others.
func always(op string, k cut) func(string, []byte) cut {
	return func(o string, _ []byte) cut {
		if o == op {
			return k
		}
		return whole
	}
}

// TestCutConnections runs keys through a Guard on a store whose
// connections to dynalite a proxy cuts, mid-request (never applied) and
// mid-answer (applied, the answer lost or half read), and closes after
// answers: every call succeeds, every key's work runs once (twice for the
// keys whose first run fails and is released), replays carry the
// response, and the store sends a request again only after a lost answer,
// SendAttempts times at most, never after a real one (a failed
// condition, a server error).
func TestCutConnections(t *testing.T) {
	ctx := t.Context()
	px := newCutter(t, dynaliteAddr)
	ns := newNamespace("cut")
	st := mustNew(t, dynamotest.Client(px.addr()), dynamostore.Options{Table: table, Namespace: ns})
	g, err := idem.New(st, idem.Config{})
	if err != nil {
		t.Fatal(err)
	}
	lost := []cut{midRequest, noAnswer, midHeader, midBody, afterAnswer}
	px.setPlan(firstOnly(lost...))

	const keys, workers = 150, 16
	var mu sync.Mutex
	runs := map[idem.Key]int{}
	errs := make(chan error, keys)
	var wg sync.WaitGroup
	next := make(chan int)
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				errs <- keyLife(ctx, g, i, &mu, runs)
			}
		}()
	}
	for i := range keys {
		next <- i
	}
	close(next)
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
	for i := range keys {
		key, want := cutKey(i), 1
		if failsFirst(i) {
			want = 2
		}
		if runs[key] != want {
			t.Errorf("key %d: the work ran %d times, want %d", i, runs[key], want)
		}
		// Read past the proxy: the stored record.
		rec, ok, err := mustNew(t, client, dynamostore.Options{Table: table, Namespace: ns}).Get(ctx, key)
		if err != nil || !ok || rec.State != idem.StateCompleted || string(rec.Response.Body) != cutBody(i) {
			t.Errorf("key %d: stored record %v, %t, %v; want completed with %q", i, rec.State, ok, err, cutBody(i))
		}
	}
	for _, op := range []string{"UpdateItem", "GetItem"} {
		n := px.counts(op)
		t.Logf("%s requests: %v", op, n)
		for _, k := range lost {
			if n[k] == 0 {
				t.Errorf("%s: no request cut %v: the test did not do what it says", op, k)
			}
		}
	}
	if px.resentAfterAnswer != 0 {
		t.Errorf("UpdateItem requests sent again after a whole answer: %d, want 0", px.resentAfterAnswer)
	}

	// A request whose every attempt is cut: SendAttempts attempts, then
	// the store's error.
	for _, k := range lost[:4] {
		px.setPlan(always("GetItem", k))
		_, _, err := st.Get(ctx, cutKey(0))
		var se *idem.StoreError
		if !errors.As(err, &se) {
			t.Errorf("Get, every attempt cut %v: got %v, want a *idem.StoreError", k, err)
		}
		if n := px.counts("GetItem"); n[k] != dynamostore.SendAttempts {
			t.Errorf("Get, every attempt cut %v: %d attempts, want %d", k, n[k], dynamostore.SendAttempts)
		}
	}

	// A Complete that never reaches the server is not taken for done: the
	// store's error after SendAttempts attempts, and the lease still held,
	// so the same Complete succeeds once the connections hold.
	px.setPlan(passAll)
	key := idem.Key{0xcc}
	acq, err := st.Acquire(ctx, idem.AcquireRequest{Key: key, Fingerprint: idem.Fingerprint{1}, LeaseID: idem.NewLeaseID(), TTL: time.Minute})
	if err != nil || acq.Outcome != idem.Acquired {
		t.Fatalf("Acquire: %v, %v", acq.Outcome, err)
	}
	px.counts("UpdateItem")
	px.setPlan(always("UpdateItem", midRequest))
	resp := &idem.Response{Status: 201, Body: []byte("cut")}
	if err := st.Complete(ctx, acq.Lease, resp, time.Hour); err == nil || errors.Is(err, idem.ErrLeaseLost) {
		t.Errorf("Complete, every attempt cut mid-request: got %v, want the store's error", err)
	}
	if n := px.counts("UpdateItem"); n[midRequest] != dynamostore.SendAttempts {
		t.Errorf("Complete, every attempt cut mid-request: %d attempts, want %d", n[midRequest], dynamostore.SendAttempts)
	}
	if rec, ok, err := st.Get(ctx, key); err != nil || !ok || rec.State != idem.StateInFlight || rec.LeaseID != acq.Lease.ID {
		t.Errorf("after the Complete that never arrived: %v, %t, %v; want in flight under the lease", rec.State, ok, err)
	}
	px.setPlan(passAll)
	if err := st.Complete(ctx, acq.Lease, resp, time.Hour); err != nil {
		t.Errorf("Complete again, connections whole: %v", err)
	}

	// A server error is an answer: sent once.
	px.setPlan(always("UpdateItem", serverError))
	_, err = st.Acquire(ctx, idem.AcquireRequest{Key: idem.Key{0xee}, Fingerprint: idem.Fingerprint{1}, LeaseID: idem.NewLeaseID(), TTL: time.Minute})
	if err == nil || !strings.Contains(err.Error(), "InternalServerError") {
		t.Errorf("Acquire answered 500: got %v, want the server's error", err)
	}
	if n := px.counts("UpdateItem"); n[serverError] != 1 {
		t.Errorf("Acquire answered 500: %d attempts, want 1", n[serverError])
	}
}

func cutKey(i int) idem.Key { return idem.Key{0xc0, byte(i >> 8), byte(i)} }

func cutBody(i int) string { return "order " + strconv.Itoa(i) }

// failsFirst reports whether key i's first run fails (and is released).
func failsFirst(i int) bool { return i%5 == 0 }

var errFirstRun = errors.New("the first run fails")

// keyLife runs key i's work through g until it completes (twice when
// failsFirst), then checks that two more calls replay it.
func keyLife(ctx context.Context, g *idem.Guard, i int, mu *sync.Mutex, runs map[idem.Key]int) error {
	key, fp := cutKey(i), idem.Fingerprint{byte(i)}
	work := func(context.Context) (*idem.Response, error) {
		mu.Lock()
		runs[key]++
		n := runs[key]
		mu.Unlock()
		if n == 1 && failsFirst(i) {
			return nil, errFirstRun
		}
		return &idem.Response{Status: 201, Body: []byte(cutBody(i))}, nil
	}
	if failsFirst(i) {
		if _, err := g.Do(ctx, key, fp, work); !errors.Is(err, errFirstRun) {
			return fmt.Errorf("key %d: first Do: got %v, want the work's error", i, err)
		}
	}
	res, err := g.Do(ctx, key, fp, work)
	if err != nil || res.Replayed || string(res.Response.Body) != cutBody(i) {
		return fmt.Errorf("key %d: Do: %+v, %v; want the work's response", i, res, err)
	}
	for range 2 {
		res, err := g.Do(ctx, key, fp, work)
		if err != nil || !res.Replayed || string(res.Response.Body) != cutBody(i) {
			return fmt.Errorf("key %d: repeated Do: %+v, %v; want a replay of %q", i, res, err, cutBody(i))
		}
	}
	return nil
}
