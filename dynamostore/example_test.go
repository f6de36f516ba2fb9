package dynamostore_test

import (
	"context"
	"log"

	"github.com/aws/aws-sdk-go-v2/config"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/dynamostore"
)

// A store on the table "idem", with the SDK's default configuration
// (credentials and region from the environment, an instance profile or a
// Lambda's role). CreateTable and EnableTTL set the table up once.
func ExampleNew() {
	ctx := context.Background()
	cfg, err := config.LoadDefaultConfig(ctx)
	if err != nil {
		log.Fatal(err)
	}
	client := dynamodb.NewFromConfig(cfg)
	// Once, at deployment (or with your infrastructure tool: partition
	// key "pk", a string; TTL on the attribute "ttl"):
	//	dynamostore.CreateTable(ctx, client, "idem")
	//	dynamostore.EnableTTL(ctx, client, "idem")
	var store idem.Store = dynamostore.New(client, dynamostore.Options{Table: "idem", Prefix: "orders:"})
	_ = store // hand it to idemhttp.Config.Store, idem.Guard, ...
}
