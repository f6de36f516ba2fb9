// Command consumer-kafka consumes a Kafka topic through a consumer group
// with exactly-once handling per message key: records carrying the same
// Idempotency-Key header are handled once, whatever Kafka redelivers and
// however many copies of this program run.
//
//	redis-server &      # and a Kafka broker on 127.0.0.1:9092
//	go run ./examples/consumer-kafka -publish 20    # 20 records, 10 distinct orders
//	go run ./examples/consumer-kafka                # a second member, same group
//
// The deduplication records are kept in Redis, shared by every member of
// the group; with -redis "" they are kept in memory (memstore), which
// deduplicates within one process only. Each handled order prints one
// "effect" line with its fencing token; duplicates print "replayed". Stop
// it with Ctrl-C.
//
// Stop or restart the broker while it runs: the client reconnects on its
// own and Run goes on, printing what fails meanwhile ("retrying: ...");
// records handled while the broker was away are committed once it is
// back, or delivered again and replayed. A connection that goes silent
// is given up after the request's own wait plus RequestTimeoutOverhead
// (set below), then dialled again.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemmsg"
	"github.com/idemkit/idem/idemmsg/kafka"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/redisstore"
)

func main() {
	brokers := flag.String("brokers", "127.0.0.1:9092", "comma-separated seed brokers")
	topic := flag.String("topic", "orders", "topic to consume")
	group := flag.String("group", "billing", "consumer group")
	redisAddr := flag.String("redis", "127.0.0.1:6379", `Redis address for the deduplication records ("" for memory)`)
	publish := flag.Int("publish", 0, "first produce this many records, each order twice")
	flag.Parse()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	client, err := kgo.NewClient(
		kgo.SeedBrokers(strings.Split(*brokers, ",")...),
		kgo.ConsumerGroup(*group),
		kgo.ConsumeTopics(*topic),
		kgo.DisableAutoCommit(), // the Consumer commits records once they are done
		kgo.AllowAutoTopicCreation(),
		// Lost connections: a request that gets no answer is given up
		// after its own wait (a fetch's FetchMaxWait) plus this, and the
		// connection dialled again (franz-go's default is 10s).
		kgo.RequestTimeoutOverhead(5*time.Second),
		// The coordinator hands this member's partitions to the others
		// when it has not heard from it for this long (the default).
		kgo.SessionTimeout(45*time.Second),
	)
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()

	var store idem.Store = memstore.New(memstore.Options{})
	if *redisAddr != "" {
		rc := redis.NewClient(&redis.Options{Addr: *redisAddr})
		defer rc.Close()
		if store, err = redisstore.New(rc, redisstore.Options{}); err != nil {
			log.Fatal(err)
		}
	}
	dedup, err := idemmsg.New(store, idemmsg.Config{Namespace: *topic + "/" + *group, MaxFailures: 3})
	if err != nil {
		log.Fatal(err)
	}

	for i := range *publish {
		order := "order-" + strconv.Itoa(i/2) // every order twice
		rec := &kgo.Record{
			Topic: *topic, Key: []byte(order), Value: []byte(strconv.Itoa(100 + i/2)),
			Headers: []kgo.RecordHeader{{Key: kafka.DefaultKeyHeader, Value: []byte(order)}},
		}
		if err := client.ProduceSync(ctx, rec).FirstErr(); err != nil {
			log.Fatal(err)
		}
	}

	c := &kafka.Consumer{
		Client: client, Dedup: dedup, DeadLetterTopic: *topic + ".dead",
		Handler: func(ctx context.Context, rec *kgo.Record) error {
			lease, _ := idem.LeaseFromContext(ctx)
			// The side effect: pass lease.Token to the system of record so it
			// can refuse a stale holder.
			fmt.Printf("effect     %s charge %s (%d@%d, token %d)\n", rec.Key, rec.Value, rec.Partition, rec.Offset, lease.Token)
			return nil
		},
		// Run retries what fails while the broker or the store is away
		// (polls, commits, dead letters, store calls) and reports it here.
		OnError: func(err error) { fmt.Printf("retrying   %v\n", err) },
		OnResult: func(rec *kgo.Record, res idemmsg.Result, err error) {
			switch {
			case err != nil:
				fmt.Printf("error      %d@%d: %v\n", rec.Partition, rec.Offset, err)
			case res.Err != nil:
				fmt.Printf("%-10s %s (%d@%d): %v\n", res.Outcome, rec.Key, rec.Partition, rec.Offset, res.Err)
			case res.Outcome != idemmsg.Executed:
				fmt.Printf("%-10s %s (%d@%d)\n", res.Outcome, rec.Key, rec.Partition, rec.Offset)
			}
		},
	}
	fmt.Printf("consuming %s in group %s from %s; Ctrl-C to stop\n", *topic, *group, *brokers)
	// Run returns only when ctx ends (nil) or the client is closed: a lost
	// connection is not an error to restart it for.
	if err := c.Run(ctx); err != nil {
		log.Fatal(err)
	}
}
