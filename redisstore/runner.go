package redisstore

import (
	"context"
	"fmt"

	"github.com/redis/go-redis/v9"
	"github.com/redis/rueidis"
)

// The scripts, embedded. Each starts with a comment giving KEYS, ARGV and
// the reply.
const (
	scriptAcquire = iota
	scriptRenew
	scriptComplete
	scriptRelease
	scriptGet
	scriptHold
	scriptFill
	scriptRaise
	nScripts
)

var scriptFiles = [nScripts]string{"acquire.lua", "renew.lua", "complete.lua", "release.lua", "get.lua",
	"hold.lua", "fill.lua", "raise.lua"}

// reply is the one shape every script answers with: up to three integers
// and an optional bulk string.
type reply struct {
	n    [3]int64
	blob []byte
}

// runner runs the scripts on one Redis client library. Both run a script
// as EVALSHA and fall back to EVAL on NOSCRIPT, and both may resend a
// script after a lost reply, which the scripts are written to tolerate.
type runner interface {
	run(ctx context.Context, script int, key string, args ...string) (reply, error)
	// runWait runs a script and then WAIT replicas timeout on the same
	// connection, to the primary that ran the script (see wait.go). It
	// returns the script's reply and how many replicas acknowledged.
	runWait(ctx context.Context, w waitSpec, script int, key string, args ...string) (reply, int64, error)
	del(ctx context.Context, key string) (int64, error)
	close()
}

type goredisRunner struct {
	c       redis.UniversalClient
	scripts [nScripts]*redis.Script
}

func newGoredisRunner(c redis.UniversalClient) *goredisRunner {
	r := &goredisRunner{c: c}
	for i, src := range scriptSources {
		r.scripts[i] = redis.NewScript(src)
	}
	return r
}

func (r *goredisRunner) run(ctx context.Context, script int, key string, args ...string) (reply, error) {
	argv := make([]any, len(args))
	for i, a := range args {
		argv[i] = a
	}
	res, err := r.scripts[script].Run(ctx, r.c, []string{key}, argv...).Slice()
	if err != nil {
		return reply{}, err
	}
	return goredisReply(res)
}

// goredisReply converts a script's reply as go-redis decodes it.
func goredisReply(res []any) (reply, error) {
	var out reply
	for i, v := range res {
		switch v := v.(type) {
		case int64:
			if i < len(out.n) {
				out.n[i] = v
				continue
			}
		case string:
			if i == len(out.n) {
				out.blob = []byte(v)
				continue
			}
		}
		return reply{}, fmt.Errorf("unexpected script reply %v", res)
	}
	return out, nil
}

func (r *goredisRunner) del(ctx context.Context, key string) (int64, error) {
	return r.c.Del(ctx, key).Result()
}

func (r *goredisRunner) close() { r.c.Close() }

type rueidisRunner struct {
	c rueidis.Client
}

func newRueidisRunner(c rueidis.Client) *rueidisRunner { return &rueidisRunner{c: c} }

// run sends EVALSHA, and EVAL after NOSCRIPT (a restarted or flushed
// server). The commands are retryable, so rueidis may resend them after a
// lost reply, as go-redis does: the scripts are safe to repeat. They are
// pinned (never returned to rueidis's command pool): rueidis v1.0.79
// recycles a retried command's memory when the retry succeeds on a new
// connection while the dead connection's writer may still read it, a
// data race that the race detector reports (reliability/faults).
func (r *rueidisRunner) run(ctx context.Context, script int, key string, args ...string) (reply, error) {
	cmd := r.c.B().Evalsha().Sha1(scriptSHAs[script]).Numkeys(1).Key(key).Arg(args...).Build()
	res, err := r.c.Do(ctx, cmd.ToRetryable().Pin()).ToArray()
	if re, ok := rueidis.IsRedisErr(err); ok && re.IsNoScript() {
		cmd = r.c.B().Eval().Script(scriptSources[script]).Numkeys(1).Key(key).Arg(args...).Build()
		res, err = r.c.Do(ctx, cmd.ToRetryable().Pin()).ToArray()
	}
	if err != nil {
		return reply{}, err
	}
	return rueidisReply(res)
}

// rueidisReply converts a script's reply as rueidis decodes it.
func rueidisReply(res []rueidis.RedisMessage) (reply, error) {
	var (
		out reply
		err error
	)
	for i := range res {
		if i < len(out.n) {
			if out.n[i], err = res[i].AsInt64(); err != nil {
				return reply{}, fmt.Errorf("unexpected script reply: %w", err)
			}
			continue
		}
		if i > len(out.n) {
			return reply{}, fmt.Errorf("unexpected script reply of %d elements", len(res))
		}
		if out.blob, err = res[i].AsBytes(); err != nil {
			return reply{}, fmt.Errorf("unexpected script reply: %w", err)
		}
	}
	return out, nil
}

func (r *rueidisRunner) del(ctx context.Context, key string) (int64, error) {
	return r.c.Do(ctx, r.c.B().Del().Key(key).Build()).AsInt64()
}

func (r *rueidisRunner) close() { r.c.Close() }
