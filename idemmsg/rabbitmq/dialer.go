package rabbitmq

import (
	"context"
	"errors"
	"net"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// DefaultDialTimeout is Dialer.Timeout's default.
const DefaultDialTimeout = 30 * time.Second

// Dialer keeps one connection to a broker and opens channels on it,
// dialing again once the connection is closed: its Channel method is a
// Consumer.NewChannel. Several Consumers may share one Dialer (one
// connection, one channel each). The zero value is not usable: set URL.
type Dialer struct {
	// URL is the AMQP URI, as for amqp.DialConfig.
	URL string
	// Config is the connection's configuration (amqp.DialConfig). Its
	// Heartbeat bounds how long a silent connection goes unnoticed: the
	// client closes it after 1.5 heartbeats without a frame from the
	// broker (amqp091-go's default Heartbeat is 10s, so 15s). Its Dial,
	// when nil, is a dialer bounded by Timeout and the context given to
	// Channel.
	Config amqp.Config
	// Timeout bounds each dial: the TCP connection and the AMQP handshake.
	// Default DefaultDialTimeout.
	Timeout time.Duration

	mu   sync.Mutex
	conn *amqp.Connection
}

// Channel returns a new channel on the Dialer's connection, dialing it
// first when there is none or it is closed.
func (d *Dialer) Channel(ctx context.Context) (*amqp.Channel, error) {
	conn, err := d.connection(ctx)
	if err != nil {
		return nil, err
	}
	ch, err := conn.Channel()
	if errors.Is(err, amqp.ErrClosed) {
		// Closed since connection looked at it: dial once more.
		if conn, err = d.connection(ctx); err == nil {
			ch, err = conn.Channel()
		}
	}
	return ch, err
}

// Close closes the connection, if open. Channel dials again after it.
func (d *Dialer) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.conn == nil {
		return nil
	}
	err := d.conn.Close()
	d.conn = nil
	if errors.Is(err, amqp.ErrClosed) {
		return nil
	}
	return err
}

func (d *Dialer) connection(ctx context.Context) (*amqp.Connection, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.conn != nil && !d.conn.IsClosed() {
		return d.conn, nil
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	cfg := d.Config
	stop := func() bool { return false }
	if cfg.Dial == nil {
		timeout := d.Timeout
		if timeout <= 0 {
			timeout = DefaultDialTimeout
		}
		cfg.Dial = func(network, addr string) (net.Conn, error) {
			conn, err := (&net.Dialer{Timeout: timeout}).DialContext(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			// The handshake's deadline (amqp091-go clears it once the
			// connection is open); ctx ending cuts the handshake short.
			if err := conn.SetDeadline(time.Now().Add(timeout)); err != nil {
				conn.Close()
				return nil, err
			}
			stop = context.AfterFunc(ctx, func() { conn.SetDeadline(time.Unix(1, 0)) })
			return conn, nil
		}
	}
	conn, err := amqp.DialConfig(d.URL, cfg)
	if !stop() && err == nil && ctx.Err() != nil {
		// ctx ended as the handshake finished: its deadline may be set.
		conn.Close()
		return nil, ctx.Err()
	}
	if err != nil {
		return nil, err
	}
	d.conn = conn
	return conn, nil
}
