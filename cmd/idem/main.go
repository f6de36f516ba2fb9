// Command idem gives any HTTP service idempotent POST and PATCH requests,
// and shows and manages what it stores.
//
//	idem proxy   --listen ADDR --upstream URL [--store STORE] [--blob URL] [flags]   sidecar reverse proxy
//	idem demo    [--store STORE] [--blob URL]                                      duplicate charges, with and without idem
//	idem inspect --store STORE (--key K [--tenant T --method M --route R] | --stored-key S) [--blob URL]
//	idem purge   --store STORE (... the same ...) [--blob URL] --yes
//	idem gc      --store STORE --blob URL [--min-age D] [--dry-run]              delete orphaned and expired blobs
//
// STORE is memory (the default), redis://…, rediss://…, the Redis Cluster
// and Sentinel URL forms of redisstore.Open, or postgres://…. The blob store
// of large response bodies (--blob) is s3://…, file:///DIR or mem:// (see
// package blobstore). Every flag can
// also be set in the environment as IDEM_<FLAG> (dashes as underscores:
// --admin-listen is IDEM_ADMIN_LISTEN), except purge's --yes; a flag on the
// command line wins.
// Run "idem COMMAND -h" for a command's flags.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"sort"
	"strings"
	"syscall"
)

// command is one subcommand: run parses args (without the command name)
// and does the work, writing results to stdout.
type command struct {
	summary string
	run     func(ctx context.Context, args []string, stdout, stderr io.Writer) error
}

// commands holds the subcommands; each file adds its own in an init.
var commands = map[string]command{}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	go func() { <-ctx.Done(); stop() }() // a second signal ends the process at once
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Stdout, os.Stderr))
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		usage(stderr)
		return 2
	}
	if args[0] == "-h" || args[0] == "--help" || args[0] == "help" { // asked for: not an error
		usage(stdout)
		return 0
	}
	cmd, ok := commands[args[0]]
	if !ok {
		fmt.Fprintf(stderr, "idem: unknown command %q\n\n", args[0])
		usage(stderr)
		return 2
	}
	err := cmd.run(ctx, args[1:], stdout, stderr)
	switch {
	case err == nil:
		return 0
	case errors.Is(err, flag.ErrHelp):
		return 0
	case errors.As(err, new(usageError)):
		fmt.Fprintf(stderr, "idem %s: %v\n", args[0], err)
		return 2
	}
	fmt.Fprintf(stderr, "idem %s: %v\n", args[0], err)
	return 1
}

func usage(w io.Writer) {
	fmt.Fprintln(w, "usage: idem COMMAND [flags]\n\ncommands:")
	names := make([]string, 0, len(commands))
	for name := range commands {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		fmt.Fprintf(w, "  %-8s %s\n", name, commands[name].summary)
	}
	fmt.Fprintln(w, "\nEvery flag can also come from the environment as IDEM_<FLAG>.")
}

// usageError is a mistake in the command line: exit status 2.
type usageError struct{ msg string }

func (e usageError) Error() string { return e.msg }

// parseFlags parses args into fs after filling unset flags from the
// environment (IDEM_<FLAG>). Errors are usageErrors; -h is flag.ErrHelp.
func parseFlags(fs *flag.FlagSet, args []string, stderr io.Writer) error {
	fs.SetOutput(stderr)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return usageError{err.Error()}
	}
	if fs.NArg() > 0 {
		return usageError{fmt.Sprintf("unexpected argument %q", fs.Arg(0))}
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	var err error
	fs.VisitAll(func(f *flag.Flag) {
		if f.Name == "yes" { // a confirmation must be typed, not left in the environment
			return
		}
		env := "IDEM_" + strings.ToUpper(strings.ReplaceAll(f.Name, "-", "_"))
		v, ok := os.LookupEnv(env)
		if !ok || set[f.Name] || err != nil {
			return
		}
		if e := f.Value.Set(v); e != nil {
			err = usageError{fmt.Sprintf("%s=%q: %v", env, v, e)}
		}
	})
	return err
}
