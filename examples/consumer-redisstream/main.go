// Command consumer-redisstream consumes a Redis stream through a consumer
// group, handling each message key once (at most once per completed key;
// effects at-least-once with fencing, see package idemmsg): entries carrying the
// same "order" field are handled once, whatever Redis redelivers and however
// many copies of this program run.
//
//	redis-server --appendonly yes &
//	go run ./examples/consumer-redisstream -publish 20     # 20 entries, 10 distinct orders
//	go run ./examples/consumer-redisstream -consumer c2    # a second consumer, same group
//
// Each handled order prints one "effect" line with its fencing token;
// duplicates print "replayed". Stop it with Ctrl-C.
//
// Restart redis-server meanwhile (redis-cli shutdown, then start it
// again), or cut the network: the consumer prints "redis error" lines and
// carries on once Redis answers again, without a restart. Entries whose
// acknowledgement was lost are claimed again after MinIdle and answered
// "replayed"; with --appendonly yes Redis keeps the stream and its group
// across the restart.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemmsg"
	"github.com/idemkit/idem/idemmsg/redisstream"
	"github.com/idemkit/idem/redisstore"
)

func main() {
	addr := flag.String("redis", "127.0.0.1:6379", "Redis address")
	stream := flag.String("stream", "orders", "stream key")
	group := flag.String("group", "billing", "consumer group")
	host, _ := os.Hostname()
	name := flag.String("consumer", host+"-"+strconv.Itoa(os.Getpid()), "consumer name within the group")
	publish := flag.Int("publish", 0, "first add this many entries, each order twice")
	flag.Parse()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	// Run rides out a Redis restart or a dropped connection: go-redis
	// reconnects on its own, and Run reports each failed step to OnError
	// and tries again with backoff. On a connection gone silent, a command
	// without a reply fails after ReadTimeout (a blocking XREADGROUP after
	// its Block + 10s) and is retried on a new connection up to MaxRetries
	// times (see "Lost connections" in package redisstream).
	client := redis.NewClient(&redis.Options{Addr: *addr, ReadTimeout: 5 * time.Second, MaxRetries: 3})
	defer client.Close()
	store, err := redisstore.New(client, redisstore.Options{})
	if err != nil {
		log.Fatal(err)
	}
	dedup, err := idemmsg.New(store, idemmsg.Config{Namespace: *stream + "/" + *group, MaxFailures: 3})
	if err != nil {
		log.Fatal(err)
	}

	for i := range *publish {
		order := "order-" + strconv.Itoa(i/2) // every order twice
		if err := client.XAdd(ctx, &redis.XAddArgs{Stream: *stream, Values: []any{"order", order, "amount", 100 + i/2}}).Err(); err != nil {
			log.Fatal(err)
		}
	}

	c := &redisstream.Consumer{
		Client: client, Stream: *stream, Group: *group, Consumer: *name,
		Dedup: dedup, KeyField: "order", DeadLetterStream: *stream + ":dead",
		Handler: func(ctx context.Context, msg redis.XMessage) error {
			lease, _ := idem.LeaseFromContext(ctx)
			// The side effect: pass lease.Token to the system of record so it
			// can refuse a stale holder.
			fmt.Printf("effect     %s charge %v (entry %s, token %d)\n", msg.Values["order"], msg.Values["amount"], msg.ID, lease.Token)
			return nil
		},
		OnError: func(err error) { fmt.Printf("redis error (retrying) %v\n", err) },
		OnResult: func(msg redis.XMessage, res idemmsg.Result, err error) {
			switch {
			case err != nil:
				fmt.Printf("error      entry %s: %v\n", msg.ID, err)
			case res.Err != nil:
				fmt.Printf("%-10s %s (entry %s): %v\n", res.Outcome, msg.Values["order"], msg.ID, res.Err)
			case res.Outcome != idemmsg.Executed:
				fmt.Printf("%-10s %s (entry %s)\n", res.Outcome, msg.Values["order"], msg.ID)
			}
		},
	}
	fmt.Printf("consumer %s on %s/%s; Ctrl-C to stop\n", *name, *stream, *group)
	if err := c.Run(ctx); err != nil {
		log.Fatal(err)
	}
}
