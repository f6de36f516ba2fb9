// Command lambda is an API Gateway (REST API) function whose charges run
// once per Idempotency-Key, over a DynamoDB table: idemlambda.Wrap around
// the handler, and the wrapper's refusals answered as HTTP responses (409,
// 422, 400), not as Lambda errors, which API Gateway turns into a 502.
//
// Built with -tags lambda.norpc as "bootstrap", it runs on Lambda's
// provided.al2023 runtime, or locally under the runtime interface emulator
// (aws-lambda-rie) against a local DynamoDB: docs/lambda.md gives the
// commands, and main_test.go runs them.
//
// The AWS SDK reads its settings from the environment: AWS_REGION and the
// credentials (set by Lambda; locally, any static pair such as
// AWS_ACCESS_KEY_ID=local AWS_SECRET_ACCESS_KEY=local), AWS_ENDPOINT_URL
// for a local DynamoDB, and AWS_EC2_METADATA_DISABLED=true so that a local
// run without credentials fails at once instead of asking the EC2 instance
// metadata address. IDEM_TABLE names the table (default "idem");
// IDEM_CREATE_TABLE=1 creates it when it is missing (a local run; on AWS
// the table is made with the rest of the infrastructure).
package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log"
	"net/http"
	"os"
	"strconv"
	"time"

	"github.com/aws/aws-lambda-go/events"
	"github.com/aws/aws-lambda-go/lambda"
	"github.com/aws/aws-sdk-go-v2/config"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb/types"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/dynamostore"
	"github.com/idemkit/idem/idemlambda"
)

type (
	request  = events.APIGatewayProxyRequest
	response = events.APIGatewayProxyResponse
)

func main() {
	ctx := context.Background()
	// Region, credentials and AWS_ENDPOINT_URL come from the environment.
	awsCfg, err := config.LoadDefaultConfig(ctx)
	if err != nil {
		log.Fatal(err)
	}
	client := dynamodb.NewFromConfig(awsCfg)
	table := cmp.Or(os.Getenv("IDEM_TABLE"), "idem")
	if os.Getenv("IDEM_CREATE_TABLE") == "1" {
		if err := dynamostore.CreateTable(ctx, client, table); err != nil && !errors.As(err, new(*types.ResourceInUseException)) {
			log.Fatal(err)
		}
	}
	store, err := dynamostore.New(client, dynamostore.Options{Table: table})
	if err != nil {
		log.Fatal(err)
	}
	idempotent, err := idemlambda.Wrap(store, idemlambda.Config[events.APIGatewayProxyRequest]{
		Namespace: "payments",
		Key:       idemlambda.APIGatewayKey,
	}, charge)
	if err != nil {
		log.Fatal(err)
	}
	lambda.Start(answerRefusals(idempotent))
}

// answerRefusals answers the wrapper's refusals as API Gateway responses:
// returned as Lambda errors, API Gateway would turn them into a 502.
func answerRefusals(h func(context.Context, request) (response, error)) func(context.Context, request) (response, error) {
	return func(ctx context.Context, req request) (response, error) {
		resp, err := h(ctx, req)
		var inFlight *idem.InFlightError
		switch {
		case errors.As(err, &inFlight): // still running elsewhere after Config.Wait: retry later
			retry := strconv.Itoa(max(1, int(inFlight.RetryAfter.Round(time.Second).Seconds())))
			return problem(http.StatusConflict, "in flight", err, "Retry-After", retry), nil
		case errors.Is(err, idem.ErrMismatch): // the key was used with another request
			return problem(http.StatusUnprocessableEntity, "key reused with another request", err), nil
		case errors.Is(err, idem.ErrMissingKey), errors.Is(err, idem.ErrInvalidKey):
			return problem(http.StatusBadRequest, "bad Idempotency-Key", err), nil
		}
		return resp, err // a store failure or the handler's error: a Lambda error, retried
	}
}

// problem is an application/problem+json answer (RFC 9457).
func problem(status int, title string, err error, header ...string) response {
	h := map[string]string{"Content-Type": "application/problem+json"}
	for i := 0; i+1 < len(header); i += 2 {
		h[header[i]] = header[i+1]
	}
	return response{StatusCode: status, Headers: h,
		Body: fmt.Sprintf(`{"status":%d,"title":%q,"detail":%q}`, status, title, err.Error())}
}

// charge is the work done once per key: a real one writes the charge to
// its system of record with the fencing token.
func charge(ctx context.Context, req request) (response, error) {
	token, _ := idemlambda.FencingToken(ctx)
	return response{StatusCode: http.StatusCreated, Headers: map[string]string{"Content-Type": "application/json"},
		Body: fmt.Sprintf(`{"charge":"ch_%d","request":%q,"at":%q}`, token, req.Body, time.Now().UTC().Format(time.RFC3339Nano))}, nil
}
