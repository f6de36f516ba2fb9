package rabbitmq

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// TestNewChannelResumes: with NewChannel (a Dialer), Run survives its
// connection closing twice under it (as after a broker restart) and
// consumes what is published afterwards; every key has its one effect.
func TestNewChannelResumes(t *testing.T) {
	e := newEnv(t, envOpts{})
	d := &Dialer{URL: amqpURL, Config: amqp.Config{Vhost: vhost}, Timeout: 5 * time.Second}
	t.Cleanup(func() { d.Close() })
	var lostErrs atomic.Int32
	c := e.consumer("c1", nil, nil, nil)
	c.Channel.Close()
	c.Channel, c.NewChannel = nil, d.Channel
	c.Backoff = func(int) time.Duration { return 10 * time.Millisecond }
	c.OnError = func(err error) {
		if errors.Is(err, ErrChannelLost) {
			lostErrs.Add(1)
		}
		t.Logf("c1: %v", err)
	}
	stop := e.start(c)
	var keys []string
	for round, batch := range [][]string{{"a-1", "a-2", "a-1"}, {"b-1", "a-2", "b-2"}, {"c-1", "b-1"}} {
		e.publish(true, batch...)
		keys = append(keys, batch...)
		e.waitAcked(len(keys))
		if round < 2 {
			d.Close() // the connection goes: Run opens a new channel on a new one
		}
	}
	e.checkLedger(keys, stop)
	if n := lostErrs.Load(); n != 2 {
		t.Errorf("OnError got %d lost channels, want 2", n)
	}
}

// TestChannelLostReturns: with Channel, Run returns an error wrapping
// ErrChannelLost once the channel closes under it.
func TestChannelLostReturns(t *testing.T) {
	for _, batch := range []bool{false, true} {
		e := newEnv(t, envOpts{})
		c := e.consumer("c1", nil, nil, nil)
		c.Batch = batch
		done := make(chan error, 1)
		go func() { done <- c.Run(context.Background()) }()
		e.publish(true, "k-1")
		e.waitAcked(1)
		c.Channel.Close()
		select {
		case err := <-done:
			if !errors.Is(err, ErrChannelLost) {
				t.Errorf("batch %t: Run returned %v, want ErrChannelLost", batch, err)
			}
		case <-time.After(waitLimit):
			t.Fatalf("batch %t: Run did not return after its channel closed", batch)
		}
	}
}

// TestNewChannelRefusedConsume: Run with NewChannel returns, rather than
// retrying, when Consume is refused (a missing queue).
func TestNewChannelRefusedConsume(t *testing.T) {
	e := newEnv(t, envOpts{})
	d := &Dialer{URL: amqpURL, Config: amqp.Config{Vhost: vhost}}
	t.Cleanup(func() { d.Close() })
	c := e.consumer("c1", nil, nil, nil)
	c.Channel.Close()
	c.Channel, c.NewChannel, c.Queue = nil, d.Channel, "no-such-queue-"+e.queue
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	if err := c.Run(ctx); err == nil || errors.Is(err, ErrChannelLost) || ctx.Err() != nil {
		t.Errorf("Run on a missing queue: got %v, want the refused Consume at once", err)
	}
}
