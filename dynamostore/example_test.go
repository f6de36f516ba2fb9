package dynamostore_test

import (
	"context"
	"fmt"
	"log"

	"github.com/aws/aws-sdk-go-v2/config"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/dynamostore"
)

// A store on the table "idem" in AWS, with the SDK's default
// configuration (credentials and region from the environment, an
// instance profile or a Lambda's role). CreateTable and EnableTTL set the
// table up once. For a local server, see the next example.
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
	store, err := dynamostore.New(client, dynamostore.Options{Table: "idem", Namespace: "orders:"})
	if err != nil {
		log.Fatal(err) // an option with a bad value: New names it
	}
	var _ idem.Store = store // hand it to idemhttp.Config.Store, idem.Guard, ...
}

// A store on a local DynamoDB (DynamoDB Local, dynalite, LocalStack),
// for development and tests. A local run needs four settings, or every
// call fails (with "no EC2 IMDS role found" after the SDK has tried the
// instance metadata address for credentials):
//
//   - the endpoint: AWS_ENDPOINT_URL=http://localhost:8000 in the
//     environment (read by config.LoadDefaultConfig), or BaseEndpoint in
//     the client's options;
//   - a region (AWS_REGION, or config.WithRegion): any one, the local
//     server ignores it, but the SDK signs every request with it;
//   - credentials: static ones (AWS_ACCESS_KEY_ID and
//     AWS_SECRET_ACCESS_KEY, or config.WithCredentialsProvider), which a
//     local server accepts whatever they are;
//   - AWS_EC2_METADATA_DISABLED=true, so that a setting left out fails at
//     once instead of after a wait on the instance metadata address.
//
// This example runs in the package's tests with AWS_ENDPOINT_URL set to
// their private dynalite.
func ExampleNew_localEndpoint() {
	ctx := context.Background()
	cfg, err := config.LoadDefaultConfig(ctx, // the endpoint: AWS_ENDPOINT_URL
		config.WithRegion("us-east-1"),
		config.WithCredentialsProvider(credentials.NewStaticCredentialsProvider("local", "local", "")))
	if err != nil {
		log.Fatal(err)
	}
	client := dynamodb.NewFromConfig(cfg)
	// Without AWS_ENDPOINT_URL, name the endpoint in the client instead:
	//	client := dynamodb.NewFromConfig(cfg, func(o *dynamodb.Options) {
	//		o.BaseEndpoint = aws.String("http://localhost:8000")
	//	})
	if err := dynamostore.CreateTable(ctx, client, "idem-local"); err != nil {
		log.Fatal(err)
	}
	store, err := dynamostore.New(client, dynamostore.Options{Table: "idem-local"})
	if err != nil {
		log.Fatal(err)
	}
	g, err := idem.New(store, idem.Config{})
	if err != nil {
		log.Fatal(err)
	}
	runs := 0
	for range 2 {
		res, err := g.Do(ctx, idem.Key{1}, idem.Fingerprint{1}, func(context.Context) (*idem.Response, error) {
			runs++
			return &idem.Response{Status: 201, Body: []byte("order 1 placed")}, nil
		})
		if err != nil {
			log.Fatal(err)
		}
		fmt.Printf("%s (%d, replayed: %t)\n", res.Response.Body, res.Response.Status, res.Replayed)
	}
	fmt.Println("runs:", runs)
	// Output:
	// order 1 placed (201, replayed: false)
	// order 1 placed (201, replayed: true)
	// runs: 1
}
