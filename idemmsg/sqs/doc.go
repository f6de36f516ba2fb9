// Package sqs consumes an Amazon SQS queue (standard or FIFO) with an
// idemmsg.Deduplicator: each message key's handler runs at most once per
// completed key, whatever SQS redelivers. It uses aws-sdk-go-v2's SQS
// client (any API implementation: an *sqs.Client).
//
// A Consumer receives messages with long polling (ReceiveMessage, up to
// MaxMessages, 10, at once, WaitTime 20s), holds them (their visibility
// extended while they are handled or wait their turn), and for each one
// calls Deduplicator.Handle and then:
//
//	Executed, Replayed     deleted (DeleteMessageBatch)
//	DeadLettered           sent to DeadLetterQueueURL (when set), then deleted
//	InFlight               visibility set to Result.RetryAfter (the holder's
//	                       lease left): received again after it
//	Released               visibility set to Backoff(attempt), default
//	                       min(attempt·1s, 30s): received again after it
//	invalid key, mismatch, as DeadLettered (permanent)
//	unsealable
//	store failure before   held (visibility extended) and decided again
//	the handler ran        after Backoff(try), until the store answers
//	store failure after    by its Outcome (Executed: deleted)
//	the handler ran
//
// SQS counts visibility in whole seconds: the adapter never sets less than
// 1s (a message handed back comes back after a second, and an InFlight
// one does not spin).
//
// Several Run loops, in one process or many, may share a queue: SQS hands
// each message to one of them at a time (until its visibility ends), and
// the Deduplicator settles duplicates sent as separate messages.
//
// examples/consumer-sqs is a whole consumer, run by its test against a
// local SQS.
//
// # A local SQS
//
// The client is the caller's: config.LoadDefaultConfig reads its
// endpoint, region and credentials from the environment. When it finds no
// credentials it asks the EC2 instance metadata address, so off EC2 a
// local run's calls fail ("no EC2 IMDS role found") after that lookup.
// Against an emulator (fauxqs, LocalStack, ElasticMQ), set the endpoint, a
// region and static credentials (an emulator takes any), and turn the
// lookup off:
//
//	AWS_ENDPOINT_URL=http://127.0.0.1:4566   (or AWS_ENDPOINT_URL_SQS)
//	AWS_REGION=us-east-1
//	AWS_ACCESS_KEY_ID=test AWS_SECRET_ACCESS_KEY=test
//	AWS_EC2_METADATA_DISABLED=true
//
// or in code, the SDK's sqs.Options{BaseEndpoint: aws.String("http://127.0.0.1:4566"),
// Region: "us-east-1", Credentials:
// credentials.NewStaticCredentialsProvider("test", "test", "")}. On AWS,
// leave the endpoint unset and set the region; the SDK finds the
// credentials (a role, a profile).
//
// # Keys
//
// The default key is the string value of the message attribute
// KeyAttribute (default "Idempotency-Key") when the message has it, else
// the MessageId. The MessageId is SQS's for one send: it guards against
// SQS's own redeliveries (a standard queue delivers at least once; any
// queue redelivers a message whose visibility ended), but a producer that
// sends again after a lost reply makes a new MessageId. Set the attribute
// (or Key) to a producer-chosen id so that those are recognised too.
//
// On a FIFO queue, SQS drops a message whose MessageDeduplicationId (or
// content hash, with ContentBasedDeduplication) repeats one sent within 5
// minutes; the Deduplicator keeps the key for Config.Retention (24h by
// default) and also covers redeliveries of the same message, which SQS's
// deduplication does not. Using the MessageDeduplicationId as the key
// (Key reading the attribute of that name, which the adapter does not
// request) or the same producer id in both places makes the two agree:
// SQS drops the copies within 5 minutes, idem the later ones.
//
// # Visibility and the lease
//
// A received message gets VisibilityTimeout (default: the Deduplicator's
// lease, rounded up to whole seconds), and every ExtendEvery (default a
// third of it, as idem renews its lease at a third) the visibility of
// every held message is set to VisibilityTimeout again, in one
// ChangeMessageVisibilityBatch per 10 messages. So a message stays with
// its consumer for as long as its handler runs (and its lease is renewed),
// and comes back within VisibilityTimeout of a crash, when the lease is
// about to end too. A message whose visibility ended anyway (an extension
// lost in a network partition) may be received by another consumer,
// which gets InFlight while the lease holds and sets its visibility to the
// lease left; the first consumer's delete then fails silently (its receipt
// handle is stale), and the message, received again later, is Replayed
// and deleted. With ExtendEvery negative nothing is extended.
//
// # Delivery counts and dead letters
//
// The Attempt given to Handle is SQS's ApproximateReceiveCount, 1 for the
// first receive. Every receive counts, including those answered InFlight;
// a store outage does not (the message is held, not handed back). When a
// failing handler's Attempt reaches the Deduplicator's MaxFailures, the
// failure is recorded as the key's result (idemmsg's dead-lettering): the
// message is sent to DeadLetterQueueURL, with its body, its message
// attributes (as many as fit SQS's 10, by name) and AttrKey, AttrError
// (the kept error text) and AttrSource ("<queue URL>#<message id>"), and
// then deleted; a later message with the same key is dead-lettered
// without running. On a FIFO queue the dead letter keeps the message group
// and uses the MessageId as MessageDeduplicationId, so a consumer that
// crashes between the send and the delete does not send it twice within 5
// minutes; on a standard queue the dead-letter queue is at-least-once. If
// the send fails the message is given Backoff(attempt) and sent again on
// its next receive (its key stays dead-lettered, so the handler does not
// run again).
//
// SQS's own redrive policy (a dead-letter queue with maxReceiveCount)
// moves a message that was received maxReceiveCount times without being
// deleted, whatever the reason, and records nothing: no error text, and
// the key is not marked, so a copy sent later runs again. Keep it as a
// backstop for what idemmsg cannot dead-letter (a handler that crashes the
// process every time), with maxReceiveCount above MaxFailures, with room
// for InFlight receives (say 2×MaxFailures): Run refuses a queue whose
// maxReceiveCount is below MaxFailures (ErrRedrivePolicy), where failing
// messages would leave before idemmsg dead-letters them. The two may share
// a dead-letter queue.
//
// # FIFO queues
//
// A QueueURL that ends in ".fifo" is a FIFO queue. SQS delivers a message
// group in order and hands out no message of a group while one of it is
// in flight. The adapter keeps that order: the messages of one group in a
// receive are handled one after another, and once one of them is not
// deleted (InFlight, Released, a failed dead-letter send) the later ones
// of its group are handed back (visibility 1s) behind it, which still
// holds the group. Groups run Concurrency at a time. With Batch, a
// receive's groups each get a HandleBatch call of their own
// (idemmsg.BatchOptions.InOrder), Concurrency groups at a time, or the
// whole receive in order with Concurrency 1.
//
// # Lost connections
//
// The SQS client speaks HTTP, one request per call: there is no
// connection to lose between calls. A call that fails (SQS unreachable,
// a reset, throttling) is reported to OnError; receives are tried again
// after 100ms, doubling to 5s; a failed delete leaves the message to come
// back after its visibility (then Replayed and deleted); a failed
// visibility change leaves the visibility it had. A silent network is
// noticed by the adapter's own bounds: a receive gives up WaitTime+10s
// after it was sent, every other call after 5s (the SDK's retryer tries
// again within that bound). Messages whose receive reply was lost stay
// invisible for VisibilityTimeout and come back. A handler running
// meanwhile goes on (its lease is in the idempotency store), its result is
// recorded there, and its delete is what may be lost.
//
// # Limits
//
// A handler that panics releases its key, and the panic ends Run (the
// messages it held, that one included, are handed back on the way out), so
// a message whose handler always panics is dead-lettered only by the
// redrive policy: recover in the handler and return an error instead. Messages received but not yet
// decided when Run stops are handed back (visible after a second); those
// of a crashed consumer come back after VisibilityTimeout.
package sqs
