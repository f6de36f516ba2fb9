// Command benchpeers runs idem's benchmarks with the Go ecosystem's
// idempotency libraries beside idem, as implementations of the same
// scenarios on the same Redis (BENCHMARKS.md). It is a module of its own,
// so that the library's users never download the peers' dependencies:
//
//	go run -C internal/benchpeers . bench [idem bench's flags]
//	go run -C internal/benchpeers . consume [flags]
//
// bench is idem bench (internal/bench) with the peers added to --impls:
// gofiber/fiber v3's idempotency middleware on its Redis storage, and
// fiber without a layer as the baseline of its HTTP stack. consume puts
// watermill's Deduplicator middleware beside idem's Redis Streams consumer
// on one redis-server (consume.go).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/idemkit/idem/internal/bench"
)

// Catalog is idem bench's implementations followed by the peers.
func Catalog() []bench.Impl {
	return append(bench.Builtin(), fiberImpls...)
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Stdout, os.Stderr))
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprintln(stderr, "usage: benchpeers bench|consume [flags]")
		return 2
	}
	var err error
	switch args[0] {
	case "bench":
		err = runBench(ctx, args[1:], stdout, stderr)
	case "consume":
		err = runConsume(ctx, args[1:], stdout, stderr)
	default:
		fmt.Fprintf(stderr, "benchpeers: unknown command %q (have bench, consume)\n", args[0])
		return 2
	}
	switch {
	case err == nil, errors.Is(err, flag.ErrHelp):
		return 0
	case errors.As(err, new(bench.UsageError)):
		fmt.Fprintf(stderr, "benchpeers %s: %v\n", args[0], err)
		return 2
	}
	fmt.Fprintf(stderr, "benchpeers %s: %v\n", args[0], err)
	return 1
}

func runBench(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	flags := bench.NewFlags(fs, Catalog())
	if err := parse(fs, args); err != nil {
		return err
	}
	o, err := flags.Options()
	if err != nil {
		return err
	}
	return bench.Execute(ctx, o, stdout, stderr)
}

// parse parses args into fs, then fills unset flags from the environment
// as the idem command does (IDEM_<FLAG>, dashes as underscores: so
// IDEM_QUICK=true ./scripts/bench.sh works for both); mistakes are
// UsageErrors.
func parse(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return bench.UsageError{Msg: err.Error()}
	}
	if fs.NArg() > 0 {
		return bench.UsageError{Msg: fmt.Sprintf("unexpected argument %q", fs.Arg(0))}
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	var err error
	fs.VisitAll(func(f *flag.Flag) {
		env := "IDEM_" + strings.ToUpper(strings.ReplaceAll(f.Name, "-", "_"))
		v, ok := os.LookupEnv(env)
		if !ok || set[f.Name] || err != nil {
			return
		}
		if e := f.Value.Set(v); e != nil {
			err = bench.UsageError{Msg: fmt.Sprintf("%s=%q: %v", env, v, e)}
		}
	})
	return err
}
