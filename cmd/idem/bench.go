package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/url"
	"strings"

	"github.com/idemkit/idem/internal/bench"
)

// idem bench: the harness is internal/bench; this is the command's wiring.
// The peers (other libraries' idempotency layers) run with the same flags
// from their own module: go run -C internal/benchpeers . bench.

func init() {
	commands["bench"] = command{
		summary: "compare naive, WATCH, Lua and idem idempotency layers on Redis",
		run:     runBench,
	}
}

func runBench(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	flags := bench.NewFlags(fs, bench.Builtin())
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), "usage: idem bench [--redis URL] [--impls LIST] [--scenarios LIST] [--quick] [--rate R] [--instances N] [--rounds N] [--json FILE] [--svg FILE] [--cpuprofile FILE]")
		fs.PrintDefaults()
	}
	if err := parseFlags(fs, args, stderr); err != nil {
		return err
	}
	o, err := flags.Options()
	if u, e := url.Parse(o.RedisURL); err == nil && o.RedisURL != "" && (e != nil || !strings.HasPrefix(u.Scheme, "redis")) {
		return usageError{"--redis: want redis://host:port or rediss://host:port (the value is not shown: it may hold a password)"}
	}
	if ue := (bench.UsageError{}); errors.As(err, &ue) {
		return usageError{ue.Msg}
	} else if err != nil {
		return err
	}
	return bench.Execute(ctx, o, stdout, stderr)
}
