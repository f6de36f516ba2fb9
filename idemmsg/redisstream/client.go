package redisstream

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/rueidis"
)

// streamClient is the six Redis operations a Consumer uses, on one client
// library. Entries come back as redis.XMessage, whose Values hold strings
// with either library.
type streamClient interface {
	// createGroup runs XGROUP CREATE stream group start MKSTREAM.
	createGroup(ctx context.Context, stream, group, start string) error
	// readGroup runs XREADGROUP GROUP group consumer COUNT count BLOCK
	// block STREAMS stream ">"; no entries within block is nil, nil. A
	// negative block sends no BLOCK: the read answers at once.
	readGroup(ctx context.Context, stream, group, consumer string, count int64, block time.Duration) ([]redis.XMessage, error)
	// autoClaim runs XAUTOCLAIM stream group consumer minIdle start COUNT
	// count and returns the claimed entries and the next start.
	autoClaim(ctx context.Context, stream, group, consumer string, minIdle time.Duration, start string, count int64) ([]redis.XMessage, string, error)
	// deliveryCounts returns the delivery count of each of ids still
	// pending, from one pipeline of XPENDING stream group id id 1.
	deliveryCounts(ctx context.Context, stream, group string, ids []string) (map[string]int64, error)
	// add runs XADD stream * with fieldValues (field, value, ...).
	add(ctx context.Context, stream string, fieldValues []string) error
	// ack runs XACK stream group id [id ...].
	ack(ctx context.Context, stream, group string, ids ...string) error
}

// ms is d in whole milliseconds, at least 1 when d is positive (as
// go-redis formats durations).
func ms(d time.Duration) int64 {
	if d > 0 && d < time.Millisecond {
		return 1
	}
	return int64(d / time.Millisecond)
}

// isRedisError reports whether err holds a Redis error reply, from either
// client library, of the given kind (its first word).
func isRedisError(err error, kind string) bool {
	var gerr redis.Error
	if errors.As(err, &gerr) {
		return strings.HasPrefix(gerr.Error(), kind+" ")
	}
	var rerr *rueidis.RedisError
	if errors.As(err, &rerr) && !rerr.IsNil() {
		return strings.HasPrefix(rerr.Error(), kind+" ")
	}
	return false
}

type goredisClient struct{ c redis.UniversalClient }

func (g goredisClient) createGroup(ctx context.Context, stream, group, start string) error {
	return g.c.XGroupCreateMkStream(ctx, stream, group, start).Err()
}

func (g goredisClient) readGroup(ctx context.Context, stream, group, consumer string, count int64, block time.Duration) ([]redis.XMessage, error) {
	res, err := g.c.XReadGroup(ctx, &redis.XReadGroupArgs{
		Group: group, Consumer: consumer, Streams: []string{stream, ">"},
		Count: count, Block: max(block, -1), // go-redis sends no BLOCK for a negative Block
	}).Result()
	if errors.Is(err, redis.Nil) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	if len(res) == 1 && len(res[0].Messages) > 0 {
		return res[0].Messages, nil // one stream read: its messages, not a copy
	}
	var msgs []redis.XMessage
	for _, s := range res {
		msgs = append(msgs, s.Messages...)
	}
	return msgs, nil
}

func (g goredisClient) autoClaim(ctx context.Context, stream, group, consumer string, minIdle time.Duration, start string, count int64) ([]redis.XMessage, string, error) {
	return g.c.XAutoClaim(ctx, &redis.XAutoClaimArgs{
		Stream: stream, Group: group, Consumer: consumer,
		MinIdle: minIdle, Start: start, Count: count,
	}).Result()
}

func (g goredisClient) deliveryCounts(ctx context.Context, stream, group string, ids []string) (map[string]int64, error) {
	cmds := make([]*redis.XPendingExtCmd, len(ids))
	_, err := g.c.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, id := range ids {
			cmds[i] = p.XPendingExt(ctx, &redis.XPendingExtArgs{
				Stream: stream, Group: group, Start: id, End: id, Count: 1,
			})
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	counts := make(map[string]int64, len(ids))
	for _, cmd := range cmds {
		for _, p := range cmd.Val() {
			counts[p.ID] = p.RetryCount
		}
	}
	return counts, nil
}

func (g goredisClient) add(ctx context.Context, stream string, fieldValues []string) error {
	return g.c.XAdd(ctx, &redis.XAddArgs{Stream: stream, Values: fieldValues}).Err()
}

func (g goredisClient) ack(ctx context.Context, stream, group string, ids ...string) error {
	return g.c.XAck(ctx, stream, group, ids...).Err()
}

// readMargin is how long past its BLOCK a blocking XREADGROUP waits for
// its reply before it fails, on a connection that went silent (a network
// that drops packets, a proxy whose server is gone): the read then ends
// at most Block+readMargin after it was sent. It is go-redis's own margin
// for blocking commands, which rueidis lacks (it sets no deadline on a
// blocking command and pings no connection that one occupies), so the
// Consumer applies it to rueidis itself.
const readMargin = 10 * time.Second

// errNoReply is the cause of a blocking read cancelled after
// Block+readMargin.
var errNoReply = errors.New("no reply")

// rueidisClient runs the operations on rueidis. XREADGROUP carries BLOCK,
// so rueidis sends it on a connection of its pool for blocking commands,
// never on the auto-pipelined connection that the other commands (and a
// redisstore on the same client) share.
type rueidisClient struct{ c rueidis.Client }

func (r rueidisClient) createGroup(ctx context.Context, stream, group, start string) error {
	return r.c.Do(ctx, r.c.B().XgroupCreate().Key(stream).Group(group).Id(start).Mkstream().Build()).Error()
}

func (r rueidisClient) readGroup(ctx context.Context, stream, group, consumer string, count int64, block time.Duration) ([]redis.XMessage, error) {
	var cmd rueidis.Completed
	if block < 0 {
		cmd = r.c.B().Xreadgroup().Group(group, consumer).Count(count).Streams().Key(stream).Id(">").Build()
	} else {
		cmd = r.c.B().Xreadgroup().Group(group, consumer).Count(count).Block(ms(block)).
			Streams().Key(stream).Id(">").Build()
	}
	res, err := r.doBlocking(ctx, cmd, block)
	if rueidis.IsRedisNil(err) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	n := 0
	for _, entries := range res {
		n += len(entries)
	}
	var msgs []redis.XMessage
	if n > 0 {
		msgs = make([]redis.XMessage, 0, n) // made once, not grown
	}
	for _, entries := range res {
		msgs = appendEntries(msgs, entries)
	}
	return msgs, nil
}

// doBlocking runs cmd, an XREADGROUP with BLOCK block (none if block is
// negative), and gives up on its reply after block+readMargin, or when ctx
// ends. The context it gives rueidis has no deadline, only a cancellation
// (by ctx or by the timer): with a deadline rueidis would set it on the
// connection and no longer watch for cancellation, so that the end of
// Run would wait for the read. Either way rueidis closes the connection
// of an abandoned blocking command and dials another for the next.
func (r rueidisClient) doBlocking(ctx context.Context, cmd rueidis.Completed, block time.Duration) (map[string][]rueidis.XRangeEntry, error) {
	if block < 0 {
		return r.c.Do(ctx, cmd).AsXRead()
	}
	rctx, cancel := context.WithCancelCause(context.WithoutCancel(ctx))
	defer cancel(nil)
	defer context.AfterFunc(ctx, func() { cancel(context.Cause(ctx)) })()
	defer time.AfterFunc(block+readMargin, func() { cancel(errNoReply) }).Stop()
	res, err := r.c.Do(rctx, cmd).AsXRead()
	if err != nil && ctx.Err() == nil && errors.Is(context.Cause(rctx), errNoReply) {
		err = fmt.Errorf("no reply within BLOCK %v + %v: %w", block, readMargin, os.ErrDeadlineExceeded)
	}
	return res, err
}

func (r rueidisClient) autoClaim(ctx context.Context, stream, group, consumer string, minIdle time.Duration, start string, count int64) ([]redis.XMessage, string, error) {
	cmd := r.c.B().Xautoclaim().Key(stream).Group(group).Consumer(consumer).
		MinIdleTime(strconv.FormatInt(ms(minIdle), 10)).Start(start).Count(count).Build()
	res, err := r.c.Do(ctx, cmd).ToArray()
	if err != nil {
		return nil, "", err
	}
	if len(res) < 2 {
		return nil, "", errors.New("unexpected XAUTOCLAIM reply")
	}
	next, err := res[0].ToString()
	if err != nil {
		return nil, "", err
	}
	entries, err := res[1].AsXRange()
	if err != nil {
		return nil, "", err
	}
	var msgs []redis.XMessage
	if len(entries) > 0 {
		msgs = make([]redis.XMessage, 0, len(entries)) // made once, not grown
	}
	return appendEntries(msgs, entries), next, nil
}

// deliveryCounts pins its commands (never returned to rueidis's command
// pool): XPENDING is read-only, so rueidis may retry it, and rueidis
// v1.0.79 can recycle a retried command's memory while a dead connection's
// writer still reads it (see redisstore's rueidisRunner.run).
func (r rueidisClient) deliveryCounts(ctx context.Context, stream, group string, ids []string) (map[string]int64, error) {
	cmds := make(rueidis.Commands, len(ids))
	for i, id := range ids {
		cmds[i] = r.c.B().Xpending().Key(stream).Group(group).Start(id).End(id).Count(1).Build().Pin()
	}
	counts := make(map[string]int64, len(ids))
	for _, res := range r.c.DoMulti(ctx, cmds...) {
		pending, err := res.ToArray()
		if err != nil {
			return nil, err
		}
		for _, p := range pending {
			fields, err := p.ToArray() // id, consumer, idle, deliveries
			if err != nil {
				return nil, err
			}
			if len(fields) != 4 {
				return nil, errors.New("unexpected XPENDING reply")
			}
			id, err := fields[0].ToString()
			if err != nil {
				return nil, err
			}
			if counts[id], err = fields[3].AsInt64(); err != nil {
				return nil, err
			}
		}
	}
	return counts, nil
}

func (r rueidisClient) add(ctx context.Context, stream string, fieldValues []string) error {
	b := r.c.B().Xadd().Key(stream).Id("*").FieldValue()
	for i := 0; i+1 < len(fieldValues); i += 2 {
		b = b.FieldValue(fieldValues[i], fieldValues[i+1])
	}
	return r.c.Do(ctx, b.Build()).Error()
}

func (r rueidisClient) ack(ctx context.Context, stream, group string, ids ...string) error {
	return r.c.Do(ctx, r.c.B().Xack().Key(stream).Group(group).Id(ids...).Build()).Error()
}

// appendEntries appends entries as go-redis messages, values as strings.
func appendEntries(msgs []redis.XMessage, entries []rueidis.XRangeEntry) []redis.XMessage {
	for _, e := range entries {
		var values map[string]any
		if e.FieldValues != nil {
			values = make(map[string]any, len(e.FieldValues))
			for f, v := range e.FieldValues {
				values[f] = v
			}
		}
		msgs = append(msgs, redis.XMessage{ID: e.ID, Values: values})
	}
	return msgs
}
