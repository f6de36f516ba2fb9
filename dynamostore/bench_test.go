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
