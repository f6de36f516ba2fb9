// Command consumer-rabbitmq consumes a RabbitMQ queue with exactly-once
// handling per message key: messages carrying the same message-id are
// handled once, whatever RabbitMQ redelivers and, with a shared store
// (-redis), however many copies of this program run.
//
//	rabbitmq-server &
//	go run ./examples/consumer-rabbitmq -publish 20   # 20 messages, 10 distinct orders
//
//	redis-server &
//	go run ./examples/consumer-rabbitmq -redis 127.0.0.1:6379 -publish 20
//	go run ./examples/consumer-rabbitmq -redis 127.0.0.1:6379   # a second consumer
//
// It declares the queue, durable (with a dead-letter exchange <queue>.dlx
// routing to the queue <queue>.dlq), when missing, and publishes persistent
// messages. Each handled order prints one "effect" line with its fencing
// token; the second copy of each order prints "replayed". Stop it with
// Ctrl-C.
//
// The consumer survives its broker: restart RabbitMQ (or cut the network)
// while it runs, and it prints the lost channel, dials again with backoff
// until the broker is back, and resumes; messages whose acknowledgement
// was lost come back and print "replayed". A silent connection is noticed
// after 1.5 heartbeats (-heartbeat).
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

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemmsg"
	"github.com/idemkit/idem/idemmsg/rabbitmq"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/redisstore"
)

func main() {
	url := flag.String("amqp", "amqp://guest:guest@127.0.0.1:5672/", "AMQP URL")
	queue := flag.String("queue", "orders", "queue name")
	redisAddr := flag.String("redis", "", "Redis address of a store shared by all copies (default: an in-process store)")
	publish := flag.Int("publish", 0, "first publish this many messages, each order twice")
	heartbeat := flag.Duration("heartbeat", 5*time.Second, "AMQP heartbeat: a silent connection is dropped after 1.5 of them")
	flag.Parse()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	conn, err := amqp.Dial(*url)
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		log.Fatal(err)
	}
	defer ch.Close()

	// Dead-lettered messages go through the queue's dead-letter exchange.
	dlx, dlq := *queue+".dlx", *queue+".dlq"
	if err := ch.ExchangeDeclare(dlx, "direct", true, false, false, false, nil); err != nil {
		log.Fatal(err)
	}
	if _, err := ch.QueueDeclare(dlq, true, false, false, false, nil); err != nil {
		log.Fatal(err)
	}
	if err := ch.QueueBind(dlq, dlq, dlx, false, nil); err != nil {
		log.Fatal(err)
	}
	if _, err := ch.QueueDeclare(*queue, true, false, false, false, amqp.Table{
		"x-dead-letter-exchange": dlx, "x-dead-letter-routing-key": dlq,
	}); err != nil {
		log.Fatal(err)
	}

	// memstore keeps the keys in this process only; copies of the program
	// share them through Redis.
	var store idem.Store = memstore.New(memstore.Options{})
	if *redisAddr != "" {
		client := redis.NewClient(&redis.Options{Addr: *redisAddr})
		defer client.Close()
		if store, err = redisstore.New(client, redisstore.Options{}); err != nil {
			log.Fatal(err)
		}
	}
	dedup, err := idemmsg.New(store, idemmsg.Config{Namespace: *queue + "/billing", MaxFailures: 3})
	if err != nil {
		log.Fatal(err)
	}

	for round := range min(*publish, 2) { // every order twice
		for i := range (*publish + 1 - round) / 2 {
			if err := ch.PublishWithContext(ctx, "", *queue, false, false, amqp.Publishing{
				MessageId: "order-" + strconv.Itoa(i), Body: []byte(strconv.Itoa(100 + i)), DeliveryMode: amqp.Persistent,
			}); err != nil {
				log.Fatal(err)
			}
		}
	}
	conn.Close() // the setup's connection; the consumer dials its own

	// The consumer's channels come from a Dialer: one connection, dialed
	// again whenever it is closed. Run opens a new channel, with backoff,
	// whenever the broker restarts, the connection drops or goes silent, or
	// RabbitMQ's consumer timeout closes the channel.
	dialer := &rabbitmq.Dialer{URL: *url, Config: amqp.Config{Heartbeat: *heartbeat}, Timeout: 10 * time.Second}
	defer dialer.Close()

	c := &rabbitmq.Consumer{
		NewChannel: dialer.Channel, Queue: *queue, Dedup: dedup,
		Handler: func(ctx context.Context, d amqp.Delivery) error {
			lease, _ := idem.LeaseFromContext(ctx)
			// The side effect: pass lease.Token to the system of record so it
			// can refuse a stale holder.
			fmt.Printf("effect     %s charge %s (token %d)\n", d.MessageId, d.Body, lease.Token)
			return nil
		},
		OnResult: func(d amqp.Delivery, res idemmsg.Result, err error) {
			switch {
			case err != nil:
				fmt.Printf("error      %s: %v\n", d.MessageId, err)
			case res.Err != nil:
				fmt.Printf("%-10s %s: %v\n", res.Outcome, d.MessageId, res.Err)
			case res.Outcome != idemmsg.Executed:
				fmt.Printf("%-10s %s\n", res.Outcome, d.MessageId)
			}
		},
		// Each lost channel and failed attempt to open one (and any
		// failed settle step) lands here.
		OnError: func(err error) { fmt.Printf("error      %v\n", err) },
	}
	fmt.Printf("consuming %s; Ctrl-C to stop\n", *queue)
	if err := c.Run(ctx); err != nil {
		log.Fatal(err)
	}
}
