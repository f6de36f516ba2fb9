// Command consumer-nats consumes a NATS JetStream durable pull consumer with
// exactly-once handling per message key: messages carrying the same
// Nats-Msg-Id are handled once, whatever JetStream redelivers and, with a
// shared store (-redis), however many copies of this program run.
//
//	nats-server -js &
//	go run ./examples/consumer-nats -publish 20     # 20 messages, 10 distinct orders
//
//	redis-server &
//	go run ./examples/consumer-nats -redis 127.0.0.1:6379 -publish 20
//	go run ./examples/consumer-nats -redis 127.0.0.1:6379   # a second consumer, same durable
//
// It creates the stream (subjects <stream>.orders and <stream>.dead) and
// the durable consumer when missing. JetStream drops a republished
// Nats-Msg-Id within the stream's duplicate window, so -publish waits the
// window out between the two copies of each order; the second copy reaches
// the consumer and prints "replayed". Each handled order prints one
// "effect" line with its fencing token. Stop it with Ctrl-C.
//
// It survives its broker: the connection reconnects for ever and pings
// every 10s, so that a restarted nats-server (kill it and start it again
// with the same -sd) or a dropped connection is noticed at once, and a
// silent one within about 30s; Run waits meanwhile and goes on after the
// reconnect, and messages left unacknowledged come back after AckWait and
// are replayed, not handled again. Run returns only if the connection is
// closed for good (natsjs.ErrConnectionClosed), which MaxReconnects(-1)
// leaves to Ctrl-C.
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

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemmsg"
	"github.com/idemkit/idem/idemmsg/natsjs"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/redisstore"
)

// dupWindow is the stream's duplicate window (the server's minimum).
const dupWindow = 100 * time.Millisecond

func main() {
	url := flag.String("nats", nats.DefaultURL, "NATS server URL")
	streamName := flag.String("stream", "ORDERS", "stream name")
	durable := flag.String("consumer", "billing", "durable consumer name")
	redisAddr := flag.String("redis", "", "Redis address of a store shared by all copies (default: an in-process store)")
	publish := flag.Int("publish", 0, "first publish this many messages, each order twice")
	flag.Parse()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	// The consumer's answer to a lost connection is the client's: see
	// natsjs's "Lost connections".
	nc, err := nats.Connect(*url,
		nats.MaxReconnects(-1),            // reconnect for ever (default: 60 tries)
		nats.PingInterval(10*time.Second), // notice a silent connection in ~30s (default: ~6 min)
		nats.MaxPingsOutstanding(2),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil { // nil: closed by the program
				log.Printf("disconnected: %v", err)
			}
		}),
		nats.ReconnectHandler(func(nc *nats.Conn) { log.Printf("reconnected to %s", nc.ConnectedUrl()) }),
	)
	if err != nil {
		log.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		log.Fatal(err)
	}
	subject, dead := *streamName+".orders", *streamName+".dead"
	if _, err := js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{
		Name: *streamName, Subjects: []string{subject, dead}, Duplicates: dupWindow,
	}); err != nil {
		log.Fatal(err)
	}
	cons, err := js.CreateOrUpdateConsumer(ctx, *streamName, jetstream.ConsumerConfig{
		Durable: *durable, AckPolicy: jetstream.AckExplicitPolicy, FilterSubject: subject,
		AckWait: 30 * time.Second, MaxDeliver: 10,
	})
	if err != nil {
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
	dedup, err := idemmsg.New(store, idemmsg.Config{Namespace: *streamName + "/" + *durable, MaxFailures: 3})
	if err != nil {
		log.Fatal(err)
	}

	for round := range min(*publish, 2) { // every order twice
		for i := range (*publish + 1 - round) / 2 {
			m := nats.NewMsg(subject)
			m.Header.Set(jetstream.MsgIDHeader, "order-"+strconv.Itoa(i))
			m.Data = []byte(strconv.Itoa(100 + i))
			if _, err := js.PublishMsg(ctx, m); err != nil {
				log.Fatal(err)
			}
		}
		time.Sleep(dupWindow + 100*time.Millisecond)
	}

	c := &natsjs.Consumer{
		Consumer: cons, JetStream: js, Dedup: dedup, DeadLetterSubject: dead,
		Handler: func(ctx context.Context, msg jetstream.Msg) error {
			lease, _ := idem.LeaseFromContext(ctx)
			// The side effect: pass lease.Token to the system of record so it
			// can refuse a stale holder.
			fmt.Printf("effect     %s charge %s (subject %s, token %d)\n",
				msg.Headers().Get(jetstream.MsgIDHeader), msg.Data(), msg.Subject(), lease.Token)
			return nil
		},
		OnResult: func(msg jetstream.Msg, res idemmsg.Result, err error) {
			id := msg.Headers().Get(jetstream.MsgIDHeader)
			switch {
			case err != nil:
				fmt.Printf("error      %s: %v\n", id, err)
			case res.Err != nil:
				fmt.Printf("%-10s %s: %v\n", res.Outcome, id, res.Err)
			case res.Outcome != idemmsg.Executed:
				fmt.Printf("%-10s %s\n", res.Outcome, id)
			}
		},
	}
	fmt.Printf("consumer %s on %s; Ctrl-C to stop\n", *durable, *streamName)
	// Run resumes by itself after a reconnect; it returns an error only
	// for a bad configuration or a connection closed for good.
	if err := c.Run(ctx); err != nil {
		log.Fatal(err)
	}
}
