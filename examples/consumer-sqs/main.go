// Command consumer-sqs consumes an Amazon SQS queue with exactly-once
// handling per message key: messages carrying the same Idempotency-Key
// attribute are handled once, whatever SQS redelivers and, with a shared
// store (-redis), however many copies of this program run.
//
// The AWS SDK finds the endpoint, region and credentials in the
// environment (or ~/.aws). Against AWS, set the region and your usual
// credentials. Against a local SQS (fauxqs, LocalStack, ElasticMQ),
// name its endpoint, a region and static credentials (any values), and
// turn off the EC2 instance metadata lookup, which the SDK otherwise
// tries (and waits for) when it finds no credentials:
//
//	npx fauxqs &        # SQS on 127.0.0.1:4566
//	export AWS_ENDPOINT_URL=http://127.0.0.1:4566 AWS_REGION=us-east-1 \
//	  AWS_ACCESS_KEY_ID=test AWS_SECRET_ACCESS_KEY=test AWS_EC2_METADATA_DISABLED=true
//	go run ./examples/consumer-sqs -publish 20     # 20 messages, 10 distinct orders
//
//	redis-server &
//	go run ./examples/consumer-sqs -redis 127.0.0.1:6379 -publish 20
//	go run ./examples/consumer-sqs -redis 127.0.0.1:6379   # a second consumer, same queue
//
// It creates the queue and its dead-letter queue (<queue>-dead) when
// missing. -publish sends each order twice, as separate messages with the
// same Idempotency-Key (what a producer that resends after a lost reply
// does): SQS sees two messages, idem one key. Each handled order prints
// one "effect" line with its fencing token; the other copy prints
// "replayed". Stop it with Ctrl-C.
//
// SQS is HTTP, one request per call: a restarted or unreachable endpoint
// prints "sqs error" lines and the consumer carries on once it answers.
// Messages whose deletion was lost come back after their visibility and
// are replayed, not handled again.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"os"
	"os/signal"
	"strconv"
	"syscall"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/config"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"
	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemmsg"
	"github.com/idemkit/idem/idemmsg/sqs"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/redisstore"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout); err != nil {
		log.Fatal(err)
	}
}

// localHint is what a local run needs, for the errors of a missing region
// or credentials.
const localHint = "for a local SQS set AWS_ENDPOINT_URL=http://127.0.0.1:4566 AWS_REGION=us-east-1 " +
	"AWS_ACCESS_KEY_ID=test AWS_SECRET_ACCESS_KEY=test AWS_EC2_METADATA_DISABLED=true"

// run consumes until ctx ends, printing a line per outcome to out.
func run(ctx context.Context, args []string, out io.Writer) error {
	fs := flag.NewFlagSet("consumer-sqs", flag.ContinueOnError)
	queue := fs.String("queue", "orders", "queue name (created if missing, with <queue>-dead)")
	redisAddr := fs.String("redis", "", "Redis address of a store shared by all copies (default: an in-process store)")
	publish := fs.Int("publish", 0, "first publish this many messages, each order twice")
	if err := fs.Parse(args); err != nil {
		return err
	}

	// Endpoint (AWS_ENDPOINT_URL, or AWS_ENDPOINT_URL_SQS), region and
	// credentials from the environment, as every AWS SDK reads them.
	cfg, err := config.LoadDefaultConfig(ctx)
	if err != nil {
		return err
	}
	if cfg.Region == "" {
		return errors.New("no AWS region: set AWS_REGION (" + localHint + ")")
	}
	if _, err := cfg.Credentials.Retrieve(ctx); err != nil {
		return fmt.Errorf("no AWS credentials (%s): %w", localHint, err)
	}
	client := awssqs.NewFromConfig(cfg)

	queueURL, err := createQueue(ctx, client, *queue)
	if err != nil {
		return err
	}
	deadURL, err := createQueue(ctx, client, *queue+"-dead")
	if err != nil {
		return err
	}

	// memstore keeps the keys in this process only; copies of the program
	// share them through Redis.
	var store idem.Store = memstore.New(memstore.Options{})
	if *redisAddr != "" {
		rc := redis.NewClient(&redis.Options{Addr: *redisAddr})
		defer rc.Close()
		if store, err = redisstore.New(rc, redisstore.Options{}); err != nil {
			return err
		}
	}
	dedup, err := idemmsg.New(store, idemmsg.Config{Namespace: *queue, MaxFailures: 3})
	if err != nil {
		return err
	}

	for round := range min(*publish, 2) { // every order twice
		for i := range (*publish + 1 - round) / 2 {
			if _, err := client.SendMessage(ctx, &awssqs.SendMessageInput{
				QueueUrl:    aws.String(queueURL),
				MessageBody: aws.String(strconv.Itoa(100 + i)),
				MessageAttributes: map[string]types.MessageAttributeValue{
					sqs.DefaultKeyAttribute: {DataType: aws.String("String"), StringValue: aws.String("order-" + strconv.Itoa(i))},
				},
			}); err != nil {
				return fmt.Errorf("publish: %w", err)
			}
		}
	}

	c := &sqs.Consumer{
		Client: client, QueueURL: queueURL, Dedup: dedup, DeadLetterQueueURL: deadURL,
		Handler: func(ctx context.Context, msg types.Message) error {
			lease, _ := idem.LeaseFromContext(ctx)
			// The side effect: pass lease.Token to the system of record so it
			// can refuse a stale holder.
			fmt.Fprintf(out, "effect     %s charge %s (message %s, token %d)\n",
				orderOf(msg), aws.ToString(msg.Body), aws.ToString(msg.MessageId), lease.Token)
			return nil
		},
		OnResult: func(msg types.Message, res idemmsg.Result, err error) {
			switch {
			case err != nil:
				fmt.Fprintf(out, "error      %s: %v\n", orderOf(msg), err)
			case res.Err != nil:
				fmt.Fprintf(out, "%-10s %s: %v\n", res.Outcome, orderOf(msg), res.Err)
			case res.Outcome != idemmsg.Executed:
				fmt.Fprintf(out, "%-10s %s\n", res.Outcome, orderOf(msg))
			}
		},
		OnError: func(err error) { fmt.Fprintf(out, "sqs error  %v\n", err) },
	}
	fmt.Fprintf(out, "consumer on %s; Ctrl-C to stop\n", queueURL)
	// Run returns nil when ctx ends; an error only for a bad configuration
	// (or a redrive policy that would move messages before idem
	// dead-letters them, sqs.ErrRedrivePolicy).
	return c.Run(ctx)
}

// createQueue returns the URL of the standard queue name, created if
// missing.
func createQueue(ctx context.Context, client *awssqs.Client, name string) (string, error) {
	q, err := client.CreateQueue(ctx, &awssqs.CreateQueueInput{QueueName: aws.String(name)})
	if err != nil {
		return "", fmt.Errorf("create queue %s: %w", name, err)
	}
	return aws.ToString(q.QueueUrl), nil
}

// orderOf is the message's key attribute, the order it is for.
func orderOf(msg types.Message) string {
	return aws.ToString(msg.MessageAttributes[sqs.DefaultKeyAttribute].StringValue)
}
