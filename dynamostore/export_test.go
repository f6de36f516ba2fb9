package dynamostore

import (
	"context"
	"strconv"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb/types"

	"github.com/idemkit/idem"
)

// Corrupt overwrites the stored response of key's record with bytes that
// do not decode (storetest's Fixture.Corrupt).
func Corrupt(ctx context.Context, c *dynamodb.Client, table, ns string, key idem.Key) error {
	s := &Store{table: aws.String(table), pre: ns}
	_, err := c.UpdateItem(ctx, &dynamodb.UpdateItemInput{
		TableName:                 aws.String(table),
		Key:                       s.key(key),
		UpdateExpression:          aws.String("SET #r = :r"),
		ExpressionAttributeNames:  map[string]string{"#r": attrResp},
		ExpressionAttributeValues: map[string]types.AttributeValue{":r": bin([]byte("\xc0 not a response"))},
	})
	return err
}

// Raw returns the attributes of key's item as numbers and whether it is
// there: expires (epoch ms), ttl (epoch s) and token.
func Raw(ctx context.Context, c *dynamodb.Client, table, ns string, key idem.Key) (expires, ttl int64, token uint64, ok bool, err error) {
	s := &Store{table: aws.String(table), pre: ns}
	out, err := c.GetItem(ctx, &dynamodb.GetItemInput{TableName: aws.String(table), Key: s.key(key), ConsistentRead: aws.Bool(true)})
	if err != nil || out.Item == nil {
		return 0, 0, 0, false, err
	}
	it, err := decodeItem(out.Item)
	if err != nil {
		return 0, 0, 0, false, err
	}
	x, ok := out.Item[TTLAttribute].(*types.AttributeValueMemberN)
	if !ok {
		return it.expires, 0, it.token, true, nil
	}
	ttl, err = strconv.ParseInt(x.Value, 10, 64)
	return it.expires, ttl, it.token, true, err
}

// SendAttempts is how many times the store sends a request that gets no
// answer.
const SendAttempts = sendAttempts
