package dynamostore_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"net/http"
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awshttp "github.com/aws/aws-sdk-go-v2/aws/transport/http"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb/types"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/dynamostore"
	"github.com/idemkit/idem/storetest"
)

// BenchmarkAcquireComplete measures full acquire+complete pairs on unique
// keys from 64 goroutines against the package's private dynalite, as the
// Redis and PostgreSQL stores' benchmarks of the same name do. dynalite
// is a stand-in for DynamoDB: compare the pairs with the "raw" run, two
// plain conditional PutItem calls per pair on the same server (the least
// a store of two conditional writes can cost), not with other servers.
//
//	go test -run '^$' -bench AcquireComplete -benchtime 5s ./dynamostore/
func BenchmarkAcquireComplete(b *testing.B) {
	b.Run("store", func(b *testing.B) {
		storetest.BenchmarkPairs(b, mustNew(b, client, dynamostore.Options{Table: table, Namespace: newNamespace("bench")}), 64)
	})
	b.Run("raw", func(b *testing.B) {
		ctx := context.Background()
		put := func(pk string, cond string) error {
			_, err := client.PutItem(ctx, &dynamodb.PutItemInput{
				TableName: aws.String(table),
				Item: map[string]types.AttributeValue{
					dynamostore.KeyAttribute: &types.AttributeValueMemberS{Value: pk},
					"state":                  &types.AttributeValueMemberN{Value: "1"},
					"expires":                &types.AttributeValueMemberN{Value: strconv.FormatInt(time.Now().UnixMilli()+30000, 10)},
				},
				ConditionExpression:       aws.String(cond),
				ExpressionAttributeNames:  map[string]string{"#e": "expires"},
				ExpressionAttributeValues: map[string]types.AttributeValue{":now": &types.AttributeValueMemberN{Value: strconv.FormatInt(time.Now().UnixMilli(), 10)}},
			})
			return err
		}
		b.SetParallelism(max(1, 64/runtime.GOMAXPROCS(0)))
		b.ResetTimer()
		start := time.Now()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				var k [16]byte
				rand.Read(k[:])
				pk := "raw:" + hex.EncodeToString(k[:])
				if err := put(pk, "attribute_not_exists(#e) OR #e <= :now"); err != nil {
					b.Error(err)
					return
				}
				if err := put(pk, "#e > :now"); err != nil {
					b.Error(err)
					return
				}
			}
		})
		b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "pairs/s")
	})
}

// sequential is a store's batches as idem.AcquireMany and the others make
// them for a store that is not a BatchStore: the single-key calls, one
// after the other.
type sequential struct{ idem.Store }

func (q sequential) AcquireMany(ctx context.Context, reqs []idem.AcquireRequest) []idem.AcquireResult {
	out := make([]idem.AcquireResult, len(reqs))
	for i, r := range reqs {
		out[i].Acquisition, out[i].Err = q.Store.Acquire(ctx, r)
	}
	return out
}
func (q sequential) CompleteMany(ctx context.Context, cs []idem.Completion) []error {
	out := make([]error, len(cs))
	for i, c := range cs {
		out[i] = q.Store.Complete(ctx, c.Lease, c.Response, c.Retention)
	}
	return out
}
func (q sequential) ReleaseMany(ctx context.Context, ls []idem.Lease) []error {
	out := make([]error, len(ls))
	for i, l := range ls {
		out[i] = q.Store.Release(ctx, l)
	}
	return out
}

// BenchmarkBatchPairs measures batches of 64 acquire+complete pairs: the
// store's AcquireMany/CompleteMany (keys side by side) against the
// single-key calls one after the other, which is what a store without the
// batch extension gets. dynalite is one Node.js process that serves one
// request at a time (about 2ms each here), so on it alone side by side
// gains nothing; the rtt runs add a 5ms wait before each request leaves
// the client (a round trip to DynamoDB in its region is of that order),
// which is what a batch saves.
//
//	go test -run '^$' -bench BatchPairs -benchtime 3s ./dynamostore/
func BenchmarkBatchPairs(b *testing.B) {
	slow := dynamodb.New(client.Options(), func(o *dynamodb.Options) {
		o.HTTPClient = delayed{d: 5 * time.Millisecond, c: awshttp.NewBuildableClient()}
	})
	for _, c := range []struct {
		name string
		api  dynamostore.API
	}{{"dynalite", client}, {"dynalite+rtt5ms", slow}} {
		b.Run(c.name+"/batch", func(b *testing.B) {
			storetest.BenchmarkBatchPairs(b, mustNew(b, c.api, dynamostore.Options{Table: table, Namespace: newNamespace("bench")}), 1, 64)
		})
		b.Run(c.name+"/sequential", func(b *testing.B) {
			storetest.BenchmarkBatchPairs(b, sequential{mustNew(b, c.api, dynamostore.Options{Table: table, Namespace: newNamespace("bench")})}, 1, 64)
		})
	}
}

// delayed waits d before each request, a stand-in for the network.
type delayed struct {
	d time.Duration
	c interface {
		Do(*http.Request) (*http.Response, error)
	}
}

func (t delayed) Do(r *http.Request) (*http.Response, error) {
	time.Sleep(t.d)
	return t.c.Do(r)
}
