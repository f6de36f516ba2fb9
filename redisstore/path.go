package redisstore

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/redis/go-redis/v9"
	"github.com/redis/rueidis"
)

// Path chooses how a Store carries out its transitions: Lua scripts, or
// native commands (a compare-and-set, SET … IFEQ, with MULTI/EXEC). Both
// keep the same records and the same guarantees (see the package
// documentation for the few differences); a store can switch paths with
// its records in place.
type Path int

const (
	// PathAuto (the default) asks the server, on the store's first call,
	// whether SET has the IFEQ argument (COMMAND DOCS SET: Valkey ≥ 8.1,
	// Redis ≥ 8.4), and takes the native path when it does, the Lua path
	// otherwise. It never reads version strings.
	PathAuto Path = iota
	// PathLua runs every transition as a Lua script (EVALSHA), as
	// redisstore always has. It fails on a server without scripting.
	PathLua
	// PathNative runs every transition with native commands. The store's
	// first call fails when the server's SET has no IFEQ argument.
	PathNative
)

func (p Path) String() string {
	switch p {
	case PathAuto:
		return "auto"
	case PathLua:
		return "lua"
	case PathNative:
		return "native"
	}
	return fmt.Sprintf("Path(%d)", int(p))
}

// ErrNoCAS is wrapped by the error of a store call with PathNative on a
// server whose SET has no IFEQ argument.
var ErrNoCAS = errors.New("the server's SET has no IFEQ argument (COMMAND DOCS SET), which the native path needs (Valkey ≥ 8.1, Redis ≥ 8.4)")

// pathRunner is the Store's runner: the Lua runner or the native one, as
// Options.Path says, chosen on the first call for PathAuto.
type pathRunner struct {
	path   Path
	lua    runner
	native *nativeRunner
	probe  func(ctx context.Context) (bool, error) // SET has IFEQ

	mu     sync.Mutex             // held while probing
	chosen atomic.Pointer[runner] // nil until chosen
}

func newPathRunner(p Path, lua runner, native *nativeRunner, probe func(ctx context.Context) (bool, error)) (*pathRunner, error) {
	r := &pathRunner{path: p, lua: lua, native: native, probe: probe}
	switch p {
	case PathAuto, PathNative:
	case PathLua:
		r.chosen.Store(&lua)
	default:
		return nil, fmt.Errorf("redisstore: unknown Options.Path %d", int(p))
	}
	return r, nil
}

// pick returns the runner of the chosen path, probing the server once.
// A failed probe is tried again on the next call.
func (r *pathRunner) pick(ctx context.Context) (runner, error) {
	if c := r.chosen.Load(); c != nil {
		return *c, nil
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if c := r.chosen.Load(); c != nil {
		return *c, nil
	}
	cas, err := r.probe(ctx)
	if err != nil {
		if !isReplyError(err) || r.path == PathNative {
			return nil, fmt.Errorf("asking the server for SET's arguments (COMMAND DOCS SET): %w", err)
		}
		cas = false // a server without COMMAND DOCS has no IFEQ either
	}
	var chosen runner
	switch {
	case cas:
		chosen = r.native
		// Start the clock estimate before the first claim (a claim
		// without one takes a second step).
		if v, err := r.native.c.one(ctx, "TIME"); err == nil {
			if us, err := timeMicros(v); err == nil {
				r.native.observe(us)
			}
		}
	case r.path == PathNative:
		return nil, ErrNoCAS
	default:
		chosen = r.lua
	}
	r.chosen.Store(&chosen)
	return chosen, nil
}

// current is Store.Path.
func (r *pathRunner) current() Path {
	c := r.chosen.Load()
	switch {
	case c == nil:
		return PathAuto
	case *c == r.lua:
		return PathLua
	}
	return PathNative
}

func (r *pathRunner) run(ctx context.Context, script int, key string, args ...string) (reply, error) {
	c, err := r.pick(ctx)
	if err != nil {
		return reply{}, err
	}
	rep, err := c.run(ctx, script, key, args...)
	if err != nil && c == r.lua {
		err = explainScripting(err)
	}
	return rep, err
}

func (r *pathRunner) runWait(ctx context.Context, w waitSpec, script int, key string, args ...string) (reply, int64, error) {
	c, err := r.pick(ctx)
	if err != nil {
		return reply{}, 0, err
	}
	rep, n, err := c.runWait(ctx, w, script, key, args...)
	if err != nil && c == r.lua {
		err = explainScripting(err)
	}
	return rep, n, err
}

func (r *pathRunner) del(ctx context.Context, key string) (int64, error) { return r.lua.del(ctx, key) }

func (r *pathRunner) close() { r.lua.close() }

// explainScripting adds to the error of a script on a server without
// scripting (Valkey with its Lua module unloaded, a managed service that
// disables it) what is missing and what to do.
func explainScripting(err error) error {
	if !isReplyError(err) {
		return err
	}
	msg := strings.ToLower(err.Error())
	if strings.Contains(msg, "unknown command") || strings.Contains(msg, "engine") || strings.Contains(msg, "scripting") || strings.Contains(msg, "lua") {
		return fmt.Errorf("%w (the Lua path needs server-side scripting, EVALSHA/EVAL, which this server lacks: use Options.Path PathAuto or PathNative on a server with SET IFEQ)", err)
	}
	return err
}

// isReplyError reports whether err is an error reply from the server.
func isReplyError(err error) bool {
	var rueidisErr *rueidis.RedisError
	var goredisErr redis.Error
	return errors.As(err, &rueidisErr) || errors.As(err, &goredisErr)
}

// hasIFEQ reports whether a COMMAND DOCS SET reply names the IFEQ token.
func hasIFEQ(v nval) bool {
	if strings.EqualFold(string(v.b), "ifeq") {
		return true
	}
	for _, e := range v.arr {
		if hasIFEQ(e) {
			return true
		}
	}
	return false
}

func probeWith(c nconn) func(ctx context.Context) (bool, error) {
	return func(ctx context.Context) (bool, error) {
		v, err := c.one(ctx, "COMMAND", "DOCS", "SET")
		if err == nil {
			err = v.err
		}
		if err != nil {
			return false, err
		}
		return hasIFEQ(v), nil
	}
}

// Path reports the path the store's calls take: PathLua or PathNative, or
// PathAuto while Options.Path is PathAuto and no call has asked the server
// yet.
func (s *Store) Path() Path {
	if p, ok := s.r.(*pathRunner); ok {
		return p.current()
	}
	return PathLua
}
