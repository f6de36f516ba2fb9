// Package idemlambda makes AWS Lambda handlers (github.com/aws/aws-lambda-go)
// idempotent with an idem.Store: Wrap for a typed handler
// func(context.Context, E) (O, error), WrapSQS for SQS batch events with
// partial batch responses. DynamoDB (dynamostore) is the natural store on
// Lambda; any idem.Store works (redisstore on ElastiCache, pgstore).
//
//	handler, err := idemlambda.Wrap(store, idemlambda.Config[events.APIGatewayProxyRequest]{
//		Key: idemlambda.APIGatewayKey,
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
// (Config.Key returns "" or an error wrapping idem.ErrMissingKey) fails
// with a *KeyError, whose message says where the key was expected ("no
// Idempotency-Key header in the API Gateway REST API request's headers"),
// unless Config.AllowMissingKey lets it run unprotected.
//
// # Callers (API Gateway)
//
// A key is scoped by the function (Config.Namespace), by who calls
// (Config.Tenant) and, for an API Gateway event
// (events.APIGatewayProxyRequest or events.APIGatewayV2HTTPRequest, or a
// pointer to one), by the method and the route API Gateway matched: two
// callers that send one key never share a record. By default the caller
// is the identity API Gateway established (APIGatewayTenant,
// APIGatewayV2Tenant): the authorizer's principal (a Lambda authorizer's
// principalId or context, a Cognito or JWT authorizer's "sub" claim, IAM's
// user ARN), else the credentials of the request as idemhttp reads them
// (Authorization in its normal form, so "bearer  tok" and "Bearer tok" are
// one caller, and the API-key headers X-Api-Key, Api-Key, X-Auth-Token;
// header names in any case, from Headers or MultiValueHeaders), else the
// client certificate of mutual TLS; each as a prefix and a digest, never
// the raw credential. An authorizer's principal keeps a caller whose
// token was refreshed between two retries one caller.
//
// A keyed request that none of these identifies is anonymous: all the
// anonymous callers of a route share its keys, a WARN is logged the first
// time on each route, and Config.RefuseAnonymous refuses them (a 401
// application/problem+json of type ProblemAnonymous, the handler not
// run). Events of other kinds (SQS, direct invocations, custom events)
// have no caller unless Config.Tenant names one: the Lambda API's IAM
// authorisation is their gate.
//
// The request is fingerprinted by default for API Gateway events: its
// method, path (escapes in normal form), query, Content-Type and body,
// as idemhttp does. A different body under the same key is a
// *MismatchError, never a replay. Config.Payload replaces this default.
//
// # Results and errors
//
// The handler's result is stored as its JSON encoding, and a repeat within
// the retention (Config.Retention, default 24h) decodes those very
// bytes: what Lambda returns to the repeat is what it returned to the
// first invocation, except for an HTTP response
// (events.APIGatewayProxyResponse, events.APIGatewayV2HTTPResponse,
// events.ALBTargetGroupResponse, events.LambdaFunctionURLResponse, or a
// result of another type that an API Gateway handler returns and that
// encodes as an object with a statusCode): its Set-Cookie headers, in
// Headers or MultiValueHeaders and in any case, v2's Cookies, and the
// hop-by-hop headers idemhttp drops (Connection, Keep-Alive,
// Transfer-Encoding, Upgrade, Te, Trailer, Proxy-Connection,
// Proxy-Authenticate, Proxy-Authorization) go to the first caller only,
// and are never stored nor replayed. Errors are not stored: when the
// handler returns an error (or panics), the key is released and the error
// is returned, so Lambda's retry, or the client's, runs the handler again.
// A handler that wants a failure kept returns it as part of its result (an
// API Gateway response with status 400, say).
//
// With Config.Seal the stored results are sealed at rest (see idem's
// doc, Sealed records). A repeat of an invocation whose sealed result
// cannot be opened (altered in the store, under a key id no longer in the
// ring, read without a Sealer) does not run the handler again and is not
// replayed: when the result is an HTTP response it answers 500
// application/problem+json of type ProblemResponseUnreadable (with
// Idempotent-Replayed: true), as idemhttp does; otherwise it fails with
// the *idem.SealError (errors.Is(err, idem.ErrUnsealable); Lambda reports
// errorType "SealError"). WrapSQS counts such a record a success (it ran
// once; a failure would only be delivered again). Each is logged at ERROR
// with the key and the key id, never content.
//
// # Leases and the invocation's deadline
//
// While the handler runs, its key is held under a lease. An invocation
// whose deadline (the context's, which aws-lambda-go sets from Lambda's)
// is closer than the configured lease (Config.Lease, default 30s)
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
// Powertools' IdempotencyAlreadyInProgressError, once it has waited
// Config.Wait (DefaultWait, 500ms, as idemhttp and idemgrpc; never past
// its deadline) for the other invocation to finish: if that one completes
// meanwhile, its result is replayed; if it fails and releases the key,
// this one runs. A negative Config.Wait fails at once.
//
// # Store failures
//
// When the store fails before the handler runs, the invocation fails
// with an *idem.StoreError and the handler does not run (fail closed).
// When it fails after the handler ran, the completion is tried again
// within the lease left (Config.CompleteRetry, default the lease, as
// idemmsg; negative: no retry); if it still fails, the invocation returns
// the handler's result, the failure is logged, and a retry may run the
// handler again (fenced).
//
// # Outcomes and telemetry
//
// Every invocation (every SQS record) ends in one Outcome, the words
// idemhttp, idemgrpc and idemmsg report: executed, replayed, in_flight,
// mismatch, rejected, store_error, released, unsealable, passed_through.
// Config.OnOutcome (SQSConfig.OnOutcome) is called with it, and with
// Config.MeterProvider it is counted in idem.outcomes with idem.layer
// "lambda" (and set as idem.outcome on the caller's span with
// Config.TracerProvider), beside the Guard's store spans and histograms.
//
// # Running locally
//
// Under the runtime interface emulator (aws-lambda-rie) with a local
// DynamoDB, the AWS SDK finds nothing Lambda would set: give it
// AWS_ENDPOINT_URL (the local endpoint), AWS_REGION, a static
// AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, and
// AWS_EC2_METADATA_DISABLED=true (else, without credentials, it asks the
// EC2 instance metadata address and fails later with "no EC2 IMDS role
// found"). docs/lambda.md gives the commands that build examples/lambda
// and run it under the emulator.
//
// See docs/lambda.md for the side-by-side comparison with Powertools for
// AWS Lambda.
package idemlambda
