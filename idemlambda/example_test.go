package idemlambda_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"net/http"

	"github.com/aws/aws-lambda-go/events"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemlambda"
	"github.com/idemkit/idem/memstore"
)

// An API Gateway function: the key from the Idempotency-Key header, the
// body as the payload that must match. In main, the store would be a
// dynamostore.Store and the last line lambda.Start(handler).
func ExampleWrap() {
	store := memstore.New(memstore.Options{}) // or dynamostore.New(client, dynamostore.Options{Table: "idem"}), and its error
	charges := 0
	charge := func(ctx context.Context, req events.APIGatewayProxyRequest) (events.APIGatewayProxyResponse, error) {
		token, _ := idemlambda.FencingToken(ctx) // pass it to the system of record with the write
		_ = token
		charges++
		// A refusal the client should not retry is a result, and is
		// stored; an error is not (the key is released).
		return events.APIGatewayProxyResponse{StatusCode: http.StatusCreated, Body: fmt.Sprintf(`{"charge":%d}`, charges)}, nil
	}
	idempotent, err := idemlambda.Wrap(store, idemlambda.Config[events.APIGatewayProxyRequest]{
		Name: "payments",
		Key:  idemlambda.APIGatewayKey,
	}, charge)
	if err != nil {
		log.Fatal(err)
	}
	// Concurrent and mismatched requests are errors from the wrapper; an
	// API answers them with 409 and 422 rather than a Lambda error.
	handler := func(ctx context.Context, req events.APIGatewayProxyRequest) (events.APIGatewayProxyResponse, error) {
		resp, err := idempotent(ctx, req)
		switch {
		case errors.Is(err, idem.ErrInFlight):
			return events.APIGatewayProxyResponse{StatusCode: http.StatusConflict, Headers: map[string]string{"Retry-After": "1"}}, nil
		case errors.Is(err, idem.ErrMismatch):
			return events.APIGatewayProxyResponse{StatusCode: http.StatusUnprocessableEntity}, nil
		case errors.Is(err, idem.ErrMissingKey), errors.Is(err, idem.ErrInvalidKey):
			return events.APIGatewayProxyResponse{StatusCode: http.StatusBadRequest}, nil
		}
		return resp, err
	}

	req := events.APIGatewayProxyRequest{
		Headers: map[string]string{"idempotency-key": "order-1", "authorization": "Bearer shop-1"},
		Body:    `{"amount":10}`,
	}
	for range 2 {
		resp, _ := handler(context.Background(), req)
		fmt.Println(resp.StatusCode, resp.Body)
	}
	req.Body = `{"amount":99}`
	resp, _ := handler(context.Background(), req)
	fmt.Println(resp.StatusCode)
	// Output:
	// 201 {"charge":1}
	// 201 {"charge":1}
	// 422
}

// An SQS function with partial batch responses (turn on
// ReportBatchItemFailures on the event source mapping).
func ExampleWrapSQS() {
	store := memstore.New(memstore.Options{})
	handler, err := idemlambda.WrapSQS(store, idemlambda.SQSConfig{Name: "orders"}, func(ctx context.Context, m events.SQSMessage) error {
		if m.Body == "bad" {
			return errors.New("cannot ship")
		}
		return nil // ship the order, fenced with idemlambda.FencingToken(ctx)
	})
	if err != nil {
		log.Fatal(err)
	}
	resp, _ := handler(context.Background(), events.SQSEvent{Records: []events.SQSMessage{
		{MessageId: "m1", Body: "ok"}, {MessageId: "m2", Body: "bad"},
	}})
	fmt.Println(resp.BatchItemFailures)
	// Output:
	// [{m2}]
}
