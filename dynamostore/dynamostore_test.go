package dynamostore_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"net/http"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb/types"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/dynamostore"
	"github.com/idemkit/idem/internal/dynamotest"
	"github.com/idemkit/idem/storetest"
)

const table = "idem"

var (
	client       *dynamodb.Client
	dynaliteAddr string // host:port
)

func TestMain(m *testing.M) {
	os.Setenv("AWS_EC2_METADATA_DISABLED", "true")
	srv, err := dynamotest.Start()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	client, dynaliteAddr = srv.Client(), srv.Addr()
	// For ExampleNew_localEndpoint, which takes the endpoint from the
	// environment as a local run would (the other tests' clients name it).
	os.Setenv("AWS_ENDPOINT_URL", "http://"+srv.Addr())
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	err = dynamostore.CreateTable(ctx, client, table)
	cancel()
	code := 1
	if err != nil {
		fmt.Fprintln(os.Stderr, "CreateTable:", err)
	} else {
		code = m.Run()
	}
	srv.Stop()
	os.Exit(code)
}

// allOld is DynamoDB's answer to a failed condition where dynalite ignores
// ReturnValuesOnConditionCheckFailure: it reads the item after the failure
// and hands it back inside the error, as DynamoDB does in the same round
// trip. It counts the reads the store itself makes.
type allOld struct {
	*dynamodb.Client
	gets atomic.Int64 // GetItem calls by the store
	fill atomic.Int64 // failed conditions answered with the item
}

func (a *allOld) GetItem(ctx context.Context, in *dynamodb.GetItemInput, opts ...func(*dynamodb.Options)) (*dynamodb.GetItemOutput, error) {
	a.gets.Add(1)
	return a.Client.GetItem(ctx, in, opts...)
}

func (a *allOld) UpdateItem(ctx context.Context, in *dynamodb.UpdateItemInput, opts ...func(*dynamodb.Options)) (*dynamodb.UpdateItemOutput, error) {
	out, err := a.Client.UpdateItem(ctx, in, opts...)
	var ccf *types.ConditionalCheckFailedException
	if errors.As(err, &ccf) && in.ReturnValuesOnConditionCheckFailure == types.ReturnValuesOnConditionCheckFailureAllOld {
		if ccf.Item != nil {
			return nil, errors.New("allOld: the server returned the item itself; this wrapper is not needed")
		}
		got, gerr := a.Client.GetItem(ctx, &dynamodb.GetItemInput{TableName: in.TableName, Key: in.Key, ConsistentRead: aws.Bool(true)})
		if gerr != nil {
			return nil, gerr
		}
		a.fill.Add(1)
		ccf.Item = got.Item
		if ccf.Item == nil {
			ccf.Item = map[string]types.AttributeValue{}
		}
	}
	return out, err
}

func harness(api func() dynamostore.API) storetest.Harness {
	return func(t *testing.T, ns string) storetest.Fixture {
		s := mustNew(t, api(), dynamostore.Options{Table: table, Namespace: ns})
		return storetest.Fixture{
			Store: s,
			Sleep: time.Sleep,
			Corrupt: func(key idem.Key) error {
				return dynamostore.Corrupt(t.Context(), client, table, ns, key)
			},
		}
	}
}

// TestConformance runs storetest on dynalite as it is: every failed
// condition is followed by a GetItem.
func TestConformance(t *testing.T) {
	storetest.Run(t, harness(func() dynamostore.API { return client }))
}

// TestConformanceAllOld runs storetest with failed conditions answered
// with the item, as DynamoDB does.
func TestConformanceAllOld(t *testing.T) {
	storetest.Run(t, harness(func() dynamostore.API { return &allOld{Client: client} }))
}

// counting counts the calls the store makes.
type counting struct {
	*dynamodb.Client
	gets, updates atomic.Int64
}

func (c *counting) GetItem(ctx context.Context, in *dynamodb.GetItemInput, opts ...func(*dynamodb.Options)) (*dynamodb.GetItemOutput, error) {
	c.gets.Add(1)
	return c.Client.GetItem(ctx, in, opts...)
}

func (c *counting) UpdateItem(ctx context.Context, in *dynamodb.UpdateItemInput, opts ...func(*dynamodb.Options)) (*dynamodb.UpdateItemOutput, error) {
	c.updates.Add(1)
	return c.Client.UpdateItem(ctx, in, opts...)
}

// conditionFailures drives every kind of failed condition (in flight,
// mismatch, replay, repeated Complete and Release, lost lease) through st,
// and checks the answers.
func conditionFailures(t *testing.T, st *dynamostore.Store) {
	ctx := t.Context()
	fpA, fpB := idem.Fingerprint{0: 'a'}, idem.Fingerprint{0: 'b'}
	acquire := func(key idem.Key, fp idem.Fingerprint, id idem.LeaseID) idem.Acquisition {
		t.Helper()
		acq, err := st.Acquire(ctx, idem.AcquireRequest{Key: key, Fingerprint: fp, LeaseID: id, TTL: time.Minute})
		if err != nil {
			t.Fatalf("Acquire: %v", err)
		}
		return acq
	}
	key, id := idem.Key{1}, idem.NewLeaseID()
	l := acquire(key, fpA, id).Lease
	if acq := acquire(key, fpA, id); acq.Outcome != idem.Acquired || acq.Lease.Token != l.Token {
		t.Errorf("repeated Acquire: got %v token %d, want acquired token %d", acq.Outcome, acq.Lease.Token, l.Token)
	}
	if acq := acquire(key, fpA, idem.NewLeaseID()); acq.Outcome != idem.InFlight || acq.RetryAfter <= 0 {
		t.Errorf("Acquire of a held key: got %v, RetryAfter %v; want in_flight, > 0", acq.Outcome, acq.RetryAfter)
	}
	if acq := acquire(key, fpB, idem.NewLeaseID()); acq.Outcome != idem.Mismatch {
		t.Errorf("Acquire with another fingerprint: got %v, want mismatch", acq.Outcome)
	}
	resp := &idem.Response{Status: 201, Body: []byte("made")}
	for i := range 2 { // the second is a repeat after a lost reply
		if err := st.Complete(ctx, l, resp, time.Hour); err != nil {
			t.Fatalf("Complete %d: %v", i, err)
		}
	}
	if acq := acquire(key, fpA, idem.NewLeaseID()); acq.Outcome != idem.Replay || string(acq.Response.Body) != "made" {
		t.Errorf("Acquire of a completed key: got %v, want replay of %q", acq.Outcome, "made")
	}
	if err := st.Renew(ctx, l, time.Minute); !errors.Is(err, idem.ErrLeaseLost) {
		t.Errorf("Renew after Complete: got %v, want ErrLeaseLost", err)
	}
	key2 := idem.Key{2}
	l2 := acquire(key2, fpA, idem.NewLeaseID()).Lease
	for i := range 2 {
		if err := st.Release(ctx, l2); err != nil {
			t.Fatalf("Release %d: %v", i, err)
		}
	}
	if err := st.Complete(ctx, l2, resp, time.Hour); !errors.Is(err, idem.ErrLeaseLost) {
		t.Errorf("Complete after Release: got %v, want ErrLeaseLost", err)
	}
}

// TestConditionFailureReadsAfter: against dynalite, which ignores
// ReturnValuesOnConditionCheckFailure, every failed condition that needs
// the item costs one GetItem.
func TestConditionFailureReadsAfter(t *testing.T) {
	c := &counting{Client: client}
	conditionFailures(t, mustNew(t, c, dynamostore.Options{Table: table, Namespace: "reads-after:" + idem.NewLeaseID().String() + ":"}))
	// Failed conditions: repeated Acquire, InFlight, Mismatch, repeated
	// Complete, Replay, repeated Release, Complete after Release (Renew
	// needs no item).
	if got := c.gets.Load(); got != 7 {
		t.Errorf("GetItem calls: got %d, want 7 (one per failed condition)", got)
	}
}

// TestConditionFailureAllOld: where the failed condition carries the item
// (DynamoDB), the store reads nothing.
func TestConditionFailureAllOld(t *testing.T) {
	a := &allOld{Client: client}
	conditionFailures(t, mustNew(t, a, dynamostore.Options{Table: table, Namespace: "all-old:" + idem.NewLeaseID().String() + ":"}))
	if got := a.gets.Load(); got != 0 {
		t.Errorf("GetItem calls by the store: got %d, want 0", got)
	}
	if got := a.fill.Load(); got != 7 {
		t.Errorf("failed conditions answered with the item: got %d, want 7", got)
	}
}

// mustNew is dynamostore.New, failing tb on an error.
func mustNew(tb testing.TB, api dynamostore.API, opts dynamostore.Options) *dynamostore.Store {
	tb.Helper()
	s, err := dynamostore.New(api, opts)
	if err != nil {
		tb.Fatalf("dynamostore.New: %v", err)
	}
	return s
}

func newNamespace(name string) string { return name + ":" + idem.NewLeaseID().String() + ":" }

// TestTTLAttribute: the ttl attribute, for DynamoDB TTL, is ClockSkew past
// both the record's end and its token read as a time, and an Acquire whose
// token runs more than ClockSkew/2 ahead of the clock pushes it (a second
// write), so that TTL never deletes an item before every clock within
// ClockSkew has passed its token.
func TestTTLAttribute(t *testing.T) {
	ctx := t.Context()
	const skew = 20 * time.Millisecond
	ns := newNamespace("ttl")
	c := &counting{Client: client}
	// A clock that stands still: every acquisition adds 1 ms' worth of
	// token, so they run ahead of it.
	t0 := time.Now()
	st := mustNew(t, c, dynamostore.Options{Table: table, Namespace: ns, ClockSkew: skew,
		Clock: func() time.Time { return t0 }})
	key := idem.Key{3}
	check := func(what string) uint64 {
		t.Helper()
		exp, ttl, tok, ok, err := dynamostore.Raw(ctx, client, table, ns, key)
		if err != nil || !ok {
			t.Fatalf("%s: raw item: %v, %v", what, ok, err)
		}
		last := max(exp, int64(tok)+1) + skew.Milliseconds()
		if ttl*1000 < last {
			t.Errorf("%s: ttl %d s, want at least %d ms (expires %d ms, token %d, skew %v)", what, ttl, last, exp, tok, skew)
		}
		return tok
	}
	l, err := st.Acquire(ctx, idem.AcquireRequest{Key: key, Fingerprint: idem.Fingerprint{1}, LeaseID: idem.NewLeaseID(), TTL: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	check("in flight")
	if err := st.Renew(ctx, l.Lease, time.Hour); err != nil {
		t.Fatal(err)
	}
	check("renewed")
	if err := st.Release(ctx, l.Lease); err != nil {
		t.Fatal(err)
	}
	c.updates.Store(0)
	const n = 50
	var tok uint64
	pushes := int64(0)
	for range n {
		acq, err := st.Acquire(ctx, idem.AcquireRequest{Key: key, Fingerprint: idem.Fingerprint{1}, LeaseID: idem.NewLeaseID(), TTL: time.Second})
		if err != nil || acq.Outcome != idem.Acquired {
			t.Fatalf("Acquire: %v, %v", acq.Outcome, err)
		}
		tok = acq.Lease.Token
		if int64(tok) > t0.UnixMilli()+skew.Milliseconds()/2 {
			pushes++
		}
		check("after a quick acquisition")
		if err := st.Release(ctx, acq.Lease); err != nil {
			t.Fatal(err)
		}
		check("after its release")
	}
	if ahead := time.Duration(int64(tok)-t0.UnixMilli()) * time.Millisecond; ahead <= 2*skew {
		t.Fatalf("token %v ahead of the clock, want more than %v: the test did not drive it ahead", ahead, 2*skew)
	}
	// One Acquire and one Release each, and a push for every Acquire
	// whose token ran more than skew/2 ahead.
	if got, want := c.updates.Load(), 2*n+pushes; got != want || pushes == 0 {
		t.Errorf("UpdateItem calls: got %d, want %d (the TTL pushes)", got, want)
	}
}

// TestClockSkew: an instance whose clock runs ahead takes a live lease
// over early (leases hold only up to the skew between clocks), and its
// fencing token is larger all the same; the first holder then finds its
// lease gone.
func TestClockSkew(t *testing.T) {
	ctx := t.Context()
	ns := newNamespace("skew")
	a := mustNew(t, client, dynamostore.Options{Table: table, Namespace: ns})
	b := mustNew(t, client, dynamostore.Options{Table: table, Namespace: ns,
		Clock: func() time.Time { return time.Now().Add(time.Hour) }})
	key, fp := idem.Key{4}, idem.Fingerprint{1}
	la, err := a.Acquire(ctx, idem.AcquireRequest{Key: key, Fingerprint: fp, LeaseID: idem.NewLeaseID(), TTL: time.Minute})
	if err != nil || la.Outcome != idem.Acquired {
		t.Fatalf("Acquire by a: %v, %v", la.Outcome, err)
	}
	lb, err := b.Acquire(ctx, idem.AcquireRequest{Key: key, Fingerprint: fp, LeaseID: idem.NewLeaseID(), TTL: time.Minute})
	if err != nil || lb.Outcome != idem.Acquired {
		t.Fatalf("Acquire by b, an hour ahead: got %v, %v; want acquired (a's lease has ended on b's clock)", lb.Outcome, err)
	}
	if lb.Lease.Token <= la.Lease.Token {
		t.Errorf("b's token %d, want more than a's %d", lb.Lease.Token, la.Lease.Token)
	}
	if err := a.Complete(ctx, la.Lease, &idem.Response{Status: 200}, time.Hour); !errors.Is(err, idem.ErrLeaseLost) {
		t.Errorf("Complete by a after b's takeover: got %v, want ErrLeaseLost", err)
	}
}

// TestItemTooLarge: a response over DynamoDB's 400 KB item limit does not
// fail Complete after the work ran: it is stored without its body
// (BodyOmitted), and OnBodyOmitted hears of it. A body just under the
// limit is kept whole (the store's estimate of the item is not too
// generous for the server).
func TestItemTooLarge(t *testing.T) {
	ctx := t.Context()
	var omitted atomic.Int64
	st := mustNew(t, client, dynamostore.Options{Table: table, Namespace: newNamespace("large"),
		OnBodyOmitted: func(idem.Key, int) { omitted.Add(1) }})
	hdr := http.Header{"Content-Type": {"application/octet-stream"}}
	for i, tt := range []struct {
		name string
		size int
		kept bool
	}{
		{"under the limit", dynamostore.MaxItemSize - 400, true},
		{"over the limit", 500 << 10, false},
	} {
		key := idem.Key{5, byte(i)}
		acq, err := st.Acquire(ctx, idem.AcquireRequest{Key: key, Fingerprint: idem.Fingerprint{1}, LeaseID: idem.NewLeaseID(), TTL: time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		body := make([]byte, tt.size)
		rand.Read(body)
		before := omitted.Load()
		if err := st.Complete(ctx, acq.Lease, &idem.Response{Status: 200, Header: hdr, Body: body}, time.Hour); err != nil {
			t.Fatalf("%s: Complete of a %d-byte body: %v", tt.name, tt.size, err)
		}
		rec, ok, err := st.Get(ctx, key)
		if err != nil || !ok || rec.Response == nil {
			t.Fatalf("%s: Get: %v, %v", tt.name, ok, err)
		}
		got := rec.Response
		if got.Status != 200 || got.Header.Get("Content-Type") != "application/octet-stream" {
			t.Errorf("%s: stored status %d, header %v; want 200 and the header", tt.name, got.Status, got.Header)
		}
		if tt.kept {
			if !bytes.Equal(got.Body, body) || got.BodyOmitted || omitted.Load() != before {
				t.Errorf("%s: got %d bytes, omitted %t; want the body whole", tt.name, len(got.Body), got.BodyOmitted)
			}
		} else if len(got.Body) != 0 || !got.BodyOmitted || omitted.Load() != before+1 {
			t.Errorf("%s: got %d bytes, omitted %t, OnBodyOmitted calls %d; want none, true, 1", tt.name, len(got.Body), got.BodyOmitted, omitted.Load()-before)
		}
	}
}
