package idemgrpc

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/google/uuid"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// Defaults for ClientConfig's zero fields.
const (
	clientDefaultMaxAttempts = 5
	clientDefaultMaxElapsed  = 30 * time.Second
	clientDefaultMinBackoff  = 100 * time.Millisecond
	clientDefaultMaxBackoff  = 5 * time.Second
)

// ClientConfig tunes the client interceptor. The zero value means the
// defaults; each field says its own.
type ClientConfig struct {
	// Methods are the full method names ("/package.Service/Method") that
	// get a key and are retried; other calls go out untouched. MethodFunc,
	// when set, decides instead. Default: every unary method. Name your
	// mutating methods here: against a server that covers every method,
	// each keyed call, reads included, leaves a record in the store for
	// its retention.
	Methods    []string
	MethodFunc func(fullMethod string) bool

	// NewKey returns the key of a call that has none in its outgoing
	// metadata; it must return 1 to 255 printable ASCII characters
	// (idem.ValidateKey).
	// Default: a random UUIDv4.
	NewKey func() string

	// MaxAttempts bounds the attempts, the first one included; 1 disables
	// the interceptor's retries (the key is still added). Default 5.
	MaxAttempts int

	// MaxElapsed bounds the whole call, waits included: no wait is started
	// that would end after it, or after the context's deadline. It does
	// not interrupt an attempt in progress. Default 30s.
	MaxElapsed time.Duration

	// MinBackoff and MaxBackoff bound the wait before a retry: exponential
	// with full jitter, drawn from [0, min(MaxBackoff, MinBackoff·2^n))
	// before the (n+1)-th retry, and at least the google.rpc.RetryInfo
	// delay the server sent. Defaults 100ms and 5s.
	MinBackoff, MaxBackoff time.Duration

	// AttemptTimeout, when positive, bounds each attempt: a slower attempt
	// is abandoned (its deadline reaches the server as grpc-timeout) and
	// retried with the same key. Against an idemgrpc server the abandoned
	// attempt's work runs on to its end; the retry gets Aborted (or waits,
	// with Config.Wait) while it runs and then its stored outcome.
	// Default 0: no bound but the call's context.
	AttemptTimeout time.Duration

	// Retryable decides whether a failed attempt is retried. It is not
	// asked about an attempt cut off by AttemptTimeout, which is always
	// retried. Default DefaultRetryable.
	Retryable func(err error) bool
}

// DefaultRetryable retries Unavailable (the call may not have reached the
// server, or its store was down: nothing ran) and Aborted (an idemgrpc
// server answers it while the same key is in flight). Nothing else is
// retried.
func DefaultRetryable(err error) bool {
	switch status.Code(err) {
	case codes.Unavailable, codes.Aborted:
		return true
	}
	return false
}

// WithKey returns a context whose outgoing calls carry key as their
// idempotency key; the client interceptor keeps it instead of making one.
func WithKey(ctx context.Context, key string) context.Context {
	return metadata.AppendToOutgoingContext(ctx, MetadataKey, key)
}

// errAttemptTimeout is the cause of an attempt's cancellation after
// AttemptTimeout.
var errAttemptTimeout = errors.New("idemgrpc: attempt timed out")

// UnaryClientInterceptor returns a grpc.UnaryClientInterceptor that gives
// every covered unary call an idempotency key (a UUIDv4 unless the call's
// outgoing metadata already has one, which is kept) and retries it with the
// same key and the same request on Unavailable and Aborted, with
// exponential backoff and full jitter, honouring RetryInfo. The key is in
// the call's metadata, so grpc-go's own retries (a service config
// retryPolicy, transparent retries) send it too.
//
// The call's outcome is that of the last attempt; when the interceptor
// stops retrying (MaxAttempts, MaxElapsed), it returns the last attempt's
// error. Cancelling the call's context ends it at once.
func UnaryClientInterceptor(cfg ClientConfig) grpc.UnaryClientInterceptor {
	c := &client{cfg: cfg}
	if len(cfg.Methods) > 0 {
		c.methods = map[string]bool{}
		for _, m := range cfg.Methods {
			c.methods[m] = true
		}
	}
	c.maxAttempts = positiveOr(cfg.MaxAttempts, clientDefaultMaxAttempts)
	c.maxElapsed = positiveOr(cfg.MaxElapsed, clientDefaultMaxElapsed)
	c.minBackoff = positiveOr(cfg.MinBackoff, clientDefaultMinBackoff)
	c.maxBackoff = positiveOr(cfg.MaxBackoff, clientDefaultMaxBackoff)
	if c.cfg.Retryable == nil {
		c.cfg.Retryable = DefaultRetryable
	}
	return c.intercept
}

type client struct {
	cfg                    ClientConfig
	methods                map[string]bool
	maxAttempts            int
	maxElapsed             time.Duration
	minBackoff, maxBackoff time.Duration
}

func (c *client) covers(method string) bool {
	switch {
	case c.cfg.MethodFunc != nil:
		return c.cfg.MethodFunc(method)
	case c.methods != nil:
		return c.methods[method]
	}
	return true
}

func (c *client) intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	if !c.covers(method) {
		return invoker(ctx, method, req, reply, cc, opts...)
	}
	if md, _ := metadata.FromOutgoingContext(ctx); len(md.Get(MetadataKey)) == 0 {
		key, err := c.newKey()
		if err != nil {
			return err
		}
		ctx = metadata.AppendToOutgoingContext(ctx, MetadataKey, key)
	}
	budgetEnd := time.Now().Add(c.maxElapsed)
	if d, ok := ctx.Deadline(); ok && d.Before(budgetEnd) {
		budgetEnd = d
	}
	for attempt := 1; ; attempt++ {
		timedOut, err := c.send(ctx, method, req, reply, cc, invoker, opts)
		switch {
		case err == nil:
			return nil
		case ctx.Err() != nil: // the caller gave up
			return err
		case !timedOut && !c.cfg.Retryable(err):
			return err
		case attempt >= c.maxAttempts:
			return err
		}
		wait := jitter(c.minBackoff, c.maxBackoff, attempt-1)
		if d, ok := RetryDelay(err); ok && d > wait {
			wait = d
		}
		if wait > time.Until(budgetEnd) {
			return err
		}
		timer := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			timer.Stop()
			return status.FromContextError(ctx.Err()).Err()
		case <-timer.C:
		}
	}
}

// send makes one attempt, bounded by AttemptTimeout; timedOut reports that
// the bound cut it off.
func (c *client) send(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts []grpc.CallOption) (timedOut bool, err error) {
	if c.cfg.AttemptTimeout <= 0 {
		return false, invoker(ctx, method, req, reply, cc, opts...)
	}
	deadline := time.Now().Add(c.cfg.AttemptTimeout)
	actx, cancel := context.WithDeadlineCause(ctx, deadline, errAttemptTimeout)
	defer cancel()
	err = invoker(actx, method, req, reply, cc, opts...)
	if err == nil || ctx.Err() != nil {
		return false, err
	}
	if d, ok := ctx.Deadline(); ok && !d.After(deadline) {
		return false, err // the call's own deadline came first
	}
	// The server enforces the attempt's deadline too (grpc-timeout), and
	// its RST_STREAM can arrive before this process's timer has run: a
	// DeadlineExceeded once the deadline has passed is the attempt's.
	return errors.Is(context.Cause(actx), errAttemptTimeout) ||
		status.Code(err) == codes.DeadlineExceeded && !time.Now().Before(deadline), err
}

func (c *client) newKey() (string, error) {
	if c.cfg.NewKey != nil {
		k := c.cfg.NewKey()
		if err := validate(k); err != nil {
			return "", status.Errorf(codes.Internal, "idemgrpc: ClientConfig.NewKey: %v", err)
		}
		return k, nil
	}
	id, err := uuid.NewRandom()
	if err != nil {
		return "", status.Error(codes.Internal, fmt.Sprintf("idemgrpc: generating a key: %v", err))
	}
	return id.String(), nil
}

// jitter draws uniformly from [0, min(maxWait, minWait·2^attempt)).
func jitter(minWait, maxWait time.Duration, attempt int) time.Duration {
	ceiling := maxWait
	if attempt < 62 {
		if exp := minWait << attempt; exp>>attempt == minWait && exp > 0 && exp < ceiling {
			ceiling = exp
		}
	}
	if ceiling <= 0 {
		return 0
	}
	return rand.N(ceiling)
}

// positiveOr returns v, or def when v is not positive.
func positiveOr[T int | time.Duration](v, def T) T {
	if v <= 0 {
		return def
	}
	return v
}
