package redisstore

import (
	"context"
	"crypto/sha1"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/rueidis"

	"github.com/idemkit/idem"
)

// DefaultWaitTimeout is Options.WaitTimeout's default when
// Options.WaitReplicas is set.
const DefaultWaitTimeout = time.Second

// ErrNotReplicated reports a completion that fewer replicas acknowledged
// than Options.WaitReplicas asks for. It arrives as a *ReplicationError
// wrapped in an *idem.StoreError (Op "complete"); errors.Is matches it.
// The record is written on the primary all the same (WAIT rolls nothing
// back): repeats are replayed from it, and the lease is over. It is
// idem.ErrNotReplicated, so that code written against any store (Guard,
// idemhttp) can tell this failure from one that wrote nothing.
var ErrNotReplicated = idem.ErrNotReplicated

// ReplicationError is the error behind ErrNotReplicated.
type ReplicationError struct {
	Want    int           // Options.WaitReplicas
	Acked   int           // replicas that acknowledged the record in time
	Timeout time.Duration // Options.WaitTimeout
}

func (e *ReplicationError) Error() string {
	return fmt.Sprintf("redisstore: completion written on the primary, but only %d of %d replicas acknowledged it within %v (WAIT)",
		e.Acked, e.Want, e.Timeout)
}

// Is makes errors.Is(err, ErrNotReplicated) true.
func (e *ReplicationError) Is(target error) bool { return target == ErrNotReplicated }

// waitSpec is the WAIT that follows a script: WAIT replicas timeoutMs.
type waitSpec struct {
	replicas  int64
	timeoutMs int64
}

// maxRedirects bounds how many MOVED and ASK replies runWait follows.
const maxRedirects = 5

// waitOptions checks and completes the WAIT options.
func waitOptions(opts *Options) error {
	switch {
	case opts.WaitReplicas < 0:
		return fmt.Errorf("redisstore: negative Options.WaitReplicas %d", opts.WaitReplicas)
	case opts.WaitReplicas == 0:
		return nil
	case opts.WaitTimeout == 0:
		opts.WaitTimeout = DefaultWaitTimeout
	case opts.WaitTimeout < time.Millisecond:
		// WAIT n 0 would block for ever.
		return fmt.Errorf("redisstore: Options.WaitTimeout %v is shorter than 1ms", opts.WaitTimeout)
	}
	return nil
}

// checkGoredisWait refuses go-redis clients that runWait cannot pin to
// one node, and a WaitTimeout the client's read timeout would cut short.
func checkGoredisWait(c redis.UniversalClient, wait time.Duration) error {
	var read time.Duration
	switch c := c.(type) {
	case *redis.Client:
		read = c.Options().ReadTimeout
	case *redis.ClusterClient:
		read = c.Options().ReadTimeout
	default:
		return fmt.Errorf("redisstore: Options.WaitReplicas needs a *redis.Client (single node or Sentinel) or a *redis.ClusterClient, not %T", c)
	}
	if read > 0 && wait >= read {
		return fmt.Errorf("redisstore: Options.WaitTimeout %v is not shorter than the client's ReadTimeout %v", wait, read)
	}
	return nil
}

// completeWait runs the complete script and WAIT after it.
func (s *Store) completeWait(ctx context.Context, key idem.Key, args ...string) error {
	if err := ctx.Err(); err != nil {
		return &idem.StoreError{Op: "complete", Key: key, Err: err}
	}
	ctx, cancel := s.bound(ctx)
	defer cancel()
	w := waitSpec{replicas: int64(s.waitReplicas), timeoutMs: s.waitTimeout.Milliseconds()}
	r, acked, err := s.r.runWait(ctx, w, scriptComplete, s.KeyName(key), args...)
	switch {
	case err != nil:
		return &idem.StoreError{Op: "complete", Key: key, Err: s.explainACL(err)}
	case r.n[0] != 1:
		return idem.ErrLeaseLost // nothing written: the WAIT did not matter
	case acked < w.replicas:
		return &idem.StoreError{Op: "complete", Key: key,
			Err: &ReplicationError{Want: s.waitReplicas, Acked: int(acked), Timeout: s.waitTimeout}}
	}
	return nil
}

// redirectOf reads a MOVED or ASK error reply ("MOVED 3999 127.0.0.1:7001").
func redirectOf(err error) (addr string, ask, ok bool) {
	if addr, ok := redis.IsMovedError(err); ok {
		return addr, false, true
	}
	if addr, ok := redis.IsAskError(err); ok {
		return addr, true, true
	}
	return "", false, false
}

// runWait sends the script and WAIT in one pipeline on one connection of
// the node that owns key: the client itself for a *redis.Client (single
// node or Sentinel; its pipelines use one connection), the slot's primary
// for a *redis.ClusterClient. A ClusterClient's own pipeline would not do:
// it sends a keyless WAIT to any primary, and after MOVED or ASK resends
// the script alone, elsewhere. So redirections are followed here, with the
// WAIT (and ASKING for ASK) sent again next to the script.
func (r *goredisRunner) runWait(ctx context.Context, w waitSpec, script int, key string, args ...string) (reply, int64, error) {
	cc, cluster := r.c.(*redis.ClusterClient)
	var node *redis.Client
	switch c := r.c.(type) {
	case *redis.Client:
		node = c
	case *redis.ClusterClient:
		var err error
		if node, err = c.MasterForKey(ctx, key); err != nil {
			return reply{}, 0, err
		}
	default: // refused by New
		return reply{}, 0, fmt.Errorf("WAIT needs a *redis.Client or *redis.ClusterClient, not %T", r.c)
	}
	argv := make([]any, len(args))
	for i, a := range args {
		argv[i] = a
	}
	asking := false
	for redirects := 0; ; redirects++ {
		rep, acked, err := r.pipeWait(ctx, node, asking, w, script, key, argv)
		addr, ask, ok := redirectOf(err)
		if !ok || !cluster || redirects == maxRedirects {
			return rep, acked, err
		}
		if !ask {
			cc.ReloadState(ctx)
		}
		if node, err = primaryAt(ctx, cc, addr); err != nil {
			return reply{}, 0, err
		}
		asking = ask
	}
}

// pipeWait sends [ASKING,] EVALSHA, WAIT in one pipeline on node, and
// again with EVAL on NOSCRIPT.
func (r *goredisRunner) pipeWait(ctx context.Context, node *redis.Client, asking bool, w waitSpec, script int, key string, argv []any) (reply, int64, error) {
	for evalsha := true; ; evalsha = false {
		var run *redis.Cmd
		var wait *redis.Cmd
		_, _ = node.Pipelined(ctx, func(p redis.Pipeliner) error {
			if asking {
				p.Do(ctx, "asking")
			}
			if evalsha {
				run = p.EvalSha(ctx, r.scripts[script].Hash(), []string{key}, argv...)
			} else {
				run = p.Eval(ctx, scriptSources[script], []string{key}, argv...)
			}
			wait = p.Do(ctx, "wait", w.replicas, w.timeoutMs)
			return nil
		})
		res, err := run.Slice()
		if err != nil {
			if evalsha && redis.HasErrorPrefix(err, "NOSCRIPT") {
				continue
			}
			return reply{}, 0, err
		}
		rep, err := goredisReply(res)
		if err != nil {
			return reply{}, 0, err
		}
		acked, err := wait.Int64()
		if err != nil {
			return reply{}, 0, fmt.Errorf("WAIT after the script: %w", err)
		}
		return rep, acked, nil
	}
}

// primaryAt returns the client of the cluster's primary at addr.
func primaryAt(ctx context.Context, cc *redis.ClusterClient, addr string) (*redis.Client, error) {
	var (
		mu    sync.Mutex
		found *redis.Client
	)
	err := cc.ForEachMaster(ctx, func(_ context.Context, c *redis.Client) error {
		if c.Options().Addr == addr {
			mu.Lock()
			found = c
			mu.Unlock()
		}
		return nil
	})
	if found == nil {
		return nil, errors.Join(fmt.Errorf("redirected to %s, which is not a known primary", addr), err)
	}
	return found, nil
}

// runWait sends the script and WAIT together with DoMulti on a dedicated
// connection: Dedicated picks the slot's primary on a cluster and the
// primary otherwise. rueidis's cluster DoMulti would resend a redirected
// script alone, elsewhere, so redirections are followed here, to the
// node that Nodes knows at the redirection's address.
func (r *rueidisRunner) runWait(ctx context.Context, w waitSpec, script int, key string, args ...string) (reply, int64, error) {
	c, asking := r.c, false
	for redirects := 0; ; redirects++ {
		rep, acked, err := r.dedicatedWait(ctx, c, asking, w, script, key, args)
		addr, ask, ok := redirectOf(err)
		if !ok || redirects == maxRedirects {
			return rep, acked, err
		}
		node, ok := r.c.Nodes()[addr]
		if !ok {
			return reply{}, 0, fmt.Errorf("%w; %s is not a known node", err, addr)
		}
		c, asking = node, ask
	}
}

func (r *rueidisRunner) dedicatedWait(ctx context.Context, c rueidis.Client, asking bool, w waitSpec, script int, key string, args []string) (rep reply, acked int64, err error) {
	err = c.Dedicated(func(d rueidis.DedicatedClient) error {
		for evalsha := true; ; evalsha = false {
			cmds := make(rueidis.Commands, 0, 3)
			if asking {
				cmds = append(cmds, d.B().Asking().Build())
			}
			if evalsha {
				cmds = append(cmds, d.B().Evalsha().Sha1(scriptSHAs[script]).Numkeys(1).Key(key).Arg(args...).Build())
			} else {
				cmds = append(cmds, d.B().Eval().Script(scriptSources[script]).Numkeys(1).Key(key).Arg(args...).Build())
			}
			cmds = append(cmds, d.B().Wait().Numreplicas(w.replicas).Timeout(w.timeoutMs).Build())
			res := d.DoMulti(ctx, cmds...)
			arr, err := res[len(res)-2].ToArray()
			if err != nil {
				if re, ok := rueidis.IsRedisErr(err); ok && re.IsNoScript() && evalsha {
					continue
				}
				return err
			}
			if rep, err = rueidisReply(arr); err != nil {
				return err
			}
			if acked, err = res[len(res)-1].AsInt64(); err != nil {
				return fmt.Errorf("WAIT after the script: %w", err)
			}
			return nil
		}
	})
	return rep, acked, err
}

// scriptSHAs are the scripts' SHA-1 digests, for EVALSHA.
var scriptSHAs = func() (h [nScripts]string) {
	for i, src := range scriptSources {
		sum := sha1.Sum([]byte(src))
		h[i] = hex.EncodeToString(sum[:])
	}
	return h
}()
