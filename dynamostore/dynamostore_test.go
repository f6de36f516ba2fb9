package dynamostore_test

import (
	"context"
	"errors"
	"fmt"
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

var client *dynamodb.Client

func TestMain(m *testing.M) {
	os.Setenv("AWS_EC2_METADATA_DISABLED", "true")
	srv, err := dynamotest.Start()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	client = srv.Client()
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
	return func(t *testing.T, prefix string) storetest.Fixture {
		s := dynamostore.New(api(), dynamostore.Options{Table: table, Prefix: prefix})
		return storetest.Fixture{
			Store: s,
			Sleep: time.Sleep,
			Corrupt: func(key idem.Key) error {
				return dynamostore.Corrupt(t.Context(), client, table, prefix, key)
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
	conditionFailures(t, dynamostore.New(c, dynamostore.Options{Table: table, Prefix: "reads-after:" + idem.NewLeaseID().String() + ":"}))
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
	conditionFailures(t, dynamostore.New(a, dynamostore.Options{Table: table, Prefix: "all-old:" + idem.NewLeaseID().String() + ":"}))
	if got := a.gets.Load(); got != 0 {
		t.Errorf("GetItem calls by the store: got %d, want 0", got)
	}
	if got := a.fill.Load(); got != 7 {
		t.Errorf("failed conditions answered with the item: got %d, want 7", got)
	}
}
