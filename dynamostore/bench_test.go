package dynamostore_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
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
		storetest.BenchmarkPairs(b, dynamostore.New(client, dynamostore.Options{Table: table, Prefix: newPrefix("bench")}), 64)
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

// BenchmarkBatchPairs measures batches of 64 acquire+complete pairs from 4
// goroutines: the store's AcquireMany/CompleteMany (keys side by side)
// against the single-key calls one after the other, which is what a store
// without the batch extension gets.
//
//	go test -run '^$' -bench BatchPairs -benchtime 5s ./dynamostore/
func BenchmarkBatchPairs(b *testing.B) {
	b.Run("batch", func(b *testing.B) {
		storetest.BenchmarkBatchPairs(b, dynamostore.New(client, dynamostore.Options{Table: table, Prefix: newPrefix("bench")}), 4, 64)
	})
	b.Run("sequential", func(b *testing.B) {
		storetest.BenchmarkBatchPairs(b, sequential{dynamostore.New(client, dynamostore.Options{Table: table, Prefix: newPrefix("bench")})}, 4, 64)
	})
}
