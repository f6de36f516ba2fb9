// Package idemlambda makes AWS Lambda handlers (github.com/aws/aws-lambda-go)
// idempotent with an idem.Store: Wrap for a typed handler
// func(context.Context, E) (O, error), WrapSQS for SQS batch events with
// partial batch responses. DynamoDB (dynamostore) is the natural store on
// Lambda; any idem.Store works (redisstore on ElastiCache, pgstore).
//
//	handler, err := idemlambda.Wrap(store, idemlambda.Config[events.APIGatewayProxyRequest]{
//		Key:     idemlambda.APIGatewayKey,
//		Payload: func(e events.APIGatewayProxyRequest) any { return e.Body },
//	}, createOrder)
//	...
//	lambda.Start(handler)
//
// # Keys and payloads
//
// Config.Key takes the key from the event: APIGatewayKey and
// APIGatewayV2Key read the Idempotency-Key header (any case),
// SQSMessageID the message id, and PayloadKey hashes a part of the event
// that the caller selects with a Go function (the typed equivalent of
// Powertools' event_key_jmespath). Config.Payload selects the part whose
// JSON encoding is fingerprinted (Powertools' payload validation): a key
// reused with another payload fails with a *MismatchError. Both are
// computed once, before the handler runs, so a handler that changes its
// event does not change the record it completes. An event without a key
// fails with a *KeyError unless Config.AllowMissingKey lets it run
// unprotected.
//
// # Results and errors
//
// The handler's result is stored as its JSON encoding, and a repeat
// within the retention (Config.Guard.Retention, default 24h) decodes
// those very bytes: what Lambda returns to the repeat is what it returned
// to the first invocation. Errors are not stored: when the handler
// returns an error (or panics), the key is released and the error is
// returned, so Lambda's retry, or the client's, runs the handler again.
// A handler that wants a failure kept returns it as part of its result
// (an API Gateway response with status 400, say).
//
// # Leases and the invocation's deadline
//
// While the handler runs, its key is held under a lease. An invocation
// whose deadline (the context's, which aws-lambda-go sets from Lambda's)
// is closer than the configured lease (Config.Guard.Lease, default 30s)
// takes a lease that ends at the deadline plus Config.DeadlineMargin
// (default 2s), not renewed: Lambda stops the invocation at its deadline,
// so the lease never ends while the invocation may still run, even when
// the store stops answering meanwhile, and the key of an invocation that
// was killed (a timeout, an out-of-memory, a crash) becomes free when that
// lease ends. An invocation with more time than the lease (a 15-minute
// function) takes the configured lease and renews it in the background
// every third of it: a killed invocation's key is free within one lease,
// not at a deadline minutes away; a live one keeps it for as long as the
// store answers renewals (should the store be unreachable for a whole
// lease, the lease is given up and the handler's context is cancelled
// with idem.ErrLeaseLost).
//
// Every transition (acquire, renew, complete, release) is one atomic,
// conditional step on the store, checked against the lease: an
// invocation whose lease ended cannot complete or release the key that
// another invocation now holds. The handler's context carries the
// lease's fencing token (FencingToken): it grows with every new holder
// of the key, so a system of record that refuses tokens smaller than the
// largest it has seen refuses the late writes of an invocation that
// outlived its lease.
//
// # Concurrent invocations
//
// An invocation whose key is held by another running invocation fails at
// once with an *idem.InFlightError (errors.Is(err, idem.ErrInFlight);
// Lambda reports errorType "InFlightError"), the handler not run, like
// Powertools' IdempotencyAlreadyInProgressError. With Config.Wait it
// first waits, at most that long and never past its deadline, for the
// other invocation to finish, and then replays its result (or runs, if
// the other one failed and released the key).
//
// # Store failures
//
// When the store fails before the handler runs, the invocation fails
// with an *idem.StoreError and the handler does not run (fail closed).
// When it fails after the handler ran, the completion is tried again
// within the lease left (Config.Guard.CompleteRetry, default the lease);
// if it still fails, the invocation returns the handler's result, the
// failure is logged, and a retry may run the handler again (fenced).
//
// See docs/lambda.md for the side-by-side comparison with Powertools for
// AWS Lambda.
package idemlambda
