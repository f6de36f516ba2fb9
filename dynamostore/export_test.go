package dynamostore

import (
	"context"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb/types"

	"github.com/idemkit/idem"
)

// Corrupt overwrites the stored response of key's record with bytes that
// do not decode (storetest's Fixture.Corrupt).
func Corrupt(ctx context.Context, c *dynamodb.Client, table, prefix string, key idem.Key) error {
	s := New(c, Options{Table: table, Prefix: prefix})
	_, err := c.UpdateItem(ctx, &dynamodb.UpdateItemInput{
		TableName:                 aws.String(table),
		Key:                       s.key(key),
		UpdateExpression:          aws.String("SET #r = :r"),
		ExpressionAttributeNames:  map[string]string{"#r": attrResp},
		ExpressionAttributeValues: map[string]types.AttributeValue{":r": bin([]byte("\xff not a response"))},
	})
	return err
}
