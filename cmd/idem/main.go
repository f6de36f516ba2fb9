// Command idem gives any HTTP service idempotent POST and PATCH requests,
// and shows and manages what it stores.
//
//	idem proxy   --listen ADDR --upstream URL [--store STORE] [--blob URL] [flags]   sidecar reverse proxy
//	idem demo    [--store STORE] [--blob URL]                                      duplicate charges, with and without idem
//	idem inspect --store STORE (--key K [--tenant T --method M --route R] | --stored-key S) [--blob URL]
//	idem purge   --store STORE (... the same ...) [--blob URL] --yes
//	idem gc      --store STORE --blob URL [--min-age D] [--dry-run]              delete orphaned and expired blobs
//
// STORE is memory (the default of proxy and demo; in one process only),
// Redis or Valkey (redis://, valkey://; rediss://, valkeys:// for TLS;
// the Cluster and Sentinel URL forms of redisstore.Open), PostgreSQL
// (postgres://, postgresql://), MySQL or MariaDB (mysql://, mariadb://),
// or a Redis URL and a PostgreSQL URL in one value, quoted (the tiered
// store). inspect, purge and gc need the store the proxies use (not
// memory, which they cannot read from another process) and create nothing
// in it. The blob store
// of large response bodies (--blob) is s3://…, file:///DIR or mem:// (see
// package blobstore). Every flag can
// also be set in the environment as IDEM_<FLAG> (dashes as underscores:
// --admin-listen is IDEM_ADMIN_LISTEN), except purge's --yes; a flag on the
// command line wins. A bad value, on the command line or in the
// environment, is one line on stderr naming the flag (or variable) and
// what it wants, with exit status 2; the usage is for -h.
// Run "idem COMMAND -h" for a command's flags.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/url"
	"os"
	"os/signal"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"
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
		fmt.Fprintf(stderr, "idem %s: %s%v\n", args[0], fromEnvironment(err.Error(), args[1:]), err)
		return 2
	}
	// A failure at run time that names a flag (--admin-listen ADDR: bind:
	// address already in use) names its variable too when that set it.
	fmt.Fprintf(stderr, "idem %s: %s%v\n", args[0], fromEnvironment(err.Error(), args[1:]), err)
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
// environment (IDEM_<FLAG>). Errors are usageErrors of one or two lines that
// say what was expected (no usage text: that is for -h); -h is flag.ErrHelp,
// after fs.Usage printed the flags.
func parseFlags(fs *flag.FlagSet, args []string, stderr io.Writer) error {
	// Every value is wrapped for the time of parsing, so that a bad one is
	// reported with what its type wants instead of flag's "parse error".
	var bad error
	restore := map[*flag.Flag]flag.Value{}
	fs.VisitAll(func(f *flag.Flag) {
		restore[f] = f.Value
		f.Value = &checkedValue{Value: f.Value, name: f.Name, bad: &bad}
	})
	printUsage := fs.Usage
	if printUsage == nil {
		printUsage = fs.PrintDefaults
	}
	fs.Usage = func() {} // flag calls it on every error; only -h shows it, below
	defer func() { fs.Usage = printUsage }()
	fs.SetOutput(io.Discard) // flag's own error line: replaced by the usageError
	err := fs.Parse(args)
	fs.SetOutput(stderr)
	for f, v := range restore { // the values as they were, for -h and the environment below
		f.Value = v
	}
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			printUsage()
			return err
		}
		if bad != nil {
			return usageError{bad.Error()}
		}
		return usageError{flagSyntaxError(fs, err)}
	}
	if fs.NArg() > 0 {
		return usageError{unexpectedArgument(fs, args)}
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	fs.VisitAll(func(f *flag.Flag) {
		if f.Name == "yes" { // a confirmation must be typed, not left in the environment
			return
		}
		env := envName(f.Name)
		v, ok := os.LookupEnv(env)
		if !ok || set[f.Name] || err != nil {
			return
		}
		if e := f.Value.Set(v); e != nil {
			err = usageError{fmt.Sprintf("%s=%q: %s", env, v, wantOf(f.Value, e))}
		}
	})
	return err
}

// fromEnvironment returns "IDEM_NAME: " when msg is about --name (it
// starts so) and that flag's value came from the environment: set there
// and not on the command line args. The message names the flag; the
// operator set the variable.
func fromEnvironment(msg string, args []string) string {
	m := flagInMessage.FindStringSubmatch(msg)
	if m == nil || strings.HasPrefix(msg, "IDEM_") {
		return ""
	}
	if _, ok := os.LookupEnv(envName(m[1])); !ok || m[1] == "yes" {
		return ""
	}
	for _, a := range args {
		if a == "--" {
			break
		}
		if name, _, _ := strings.Cut(strings.TrimLeft(a, "-"), "="); strings.HasPrefix(a, "-") && name == m[1] {
			return ""
		}
	}
	return envName(m[1]) + ": "
}

// flagInMessage matches the flag an error starts with.
var flagInMessage = regexp.MustCompile(`^--([a-z0-9][a-z0-9-]*)\b`)

// envName is the environment variable of the flag name: IDEM_<NAME>,
// dashes as underscores.
func envName(name string) string {
	return "IDEM_" + strings.ToUpper(strings.ReplaceAll(name, "-", "_"))
}

// checkedValue wraps a flag's Value while parseFlags parses: a value
// that Set refuses is recorded in bad with what the flag wants.
type checkedValue struct {
	flag.Value
	name string
	bad  *error
}

func (v *checkedValue) Set(s string) error {
	err := v.Value.Set(s)
	if err != nil && *v.bad == nil {
		form := "--" + v.name + " " + shellWord(s)
		if v.IsBoolFlag() {
			form = "--" + v.name + "=" + shellWord(s)
		}
		*v.bad = fmt.Errorf("%s: %s", form, wantOf(v.Value, err))
	}
	return err
}

// IsBoolFlag keeps -flag (without a value) working for bool flags.
func (v *checkedValue) IsBoolFlag() bool {
	b, ok := v.Value.(interface{ IsBoolFlag() bool })
	return ok && b.IsBoolFlag()
}

// shellWord is s as it was typed: quoted when it is empty or holds
// anything but plain characters.
func shellWord(s string) string {
	if s == "" || strings.ContainsFunc(s, func(r rune) bool {
		return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("-_.:/@%+,=", r))
	}) {
		return strconv.Quote(s)
	}
	return s
}

// wantOf says what a flag of v's type wants, as the --config file does;
// err is what Set said, for types without a sentence of their own.
func wantOf(v flag.Value, err error) string {
	if _, ok := v.(*byteSize); ok {
		return sizeWant
	}
	g, ok := v.(flag.Getter)
	if !ok {
		return err.Error()
	}
	switch g.Get().(type) {
	case bool:
		return "want true or false"
	case time.Duration:
		return "want a duration with a unit, such as 30s or 1m"
	case int, int64:
		return "want a whole number"
	case uint, uint64:
		return "want a whole number, 0 or more"
	case float64:
		return "want a number"
	}
	return err.Error()
}

// flagSyntaxError rewrites flag's errors other than bad values (an
// unknown flag, a missing value) in one line that points to -h.
func flagSyntaxError(fs *flag.FlagSet, err error) string {
	msg := err.Error()
	help := fmt.Sprintf("%q lists the flags", commandName(fs)+" -h")
	if name, ok := strings.CutPrefix(msg, "flag provided but not defined: "); ok {
		return fmt.Sprintf("unknown flag --%s; %s", strings.TrimLeft(name, "-"), help)
	}
	if name, ok := strings.CutPrefix(msg, "flag needs an argument: "); ok {
		name = strings.TrimLeft(name, "-")
		want := ""
		if f := fs.Lookup(name); f != nil {
			if w := wantOf(f.Value, errors.New("")); w != "" {
				want = ": " + strings.TrimPrefix(w, "want ")
			}
		}
		return fmt.Sprintf("--%s needs a value%s", name, want)
	}
	return msg + "; " + help
}

// unexpectedArgument explains the first argument left after the flags:
// the second URL of an unquoted tiered --store, or the value of a bool
// flag written without "=".
func unexpectedArgument(fs *flag.FlagSet, args []string) string {
	arg := fs.Arg(0)
	if u, err := url.Parse(arg); err == nil && u.Host != "" && fs.Lookup("store") != nil {
		switch u.Scheme {
		case "redis", "rediss", "valkey", "valkeys", "postgres", "postgresql":
			return fmt.Sprintf("unexpected argument %q: the tiered store's two URLs are one value, quote them: "+
				"--store 'redis://host:port postgres://host/db'", u.Redacted())
		}
	}
	if strings.Contains(arg, "://") || strings.Contains(arg, "@") {
		arg = "(not shown: it may hold a password)"
	} else {
		arg = strconv.Quote(arg)
	}
	msg := "unexpected argument " + arg
	if i := len(args) - fs.NArg(); i > 0 && !strings.Contains(args[i-1], "=") {
		if f := fs.Lookup(strings.TrimLeft(args[i-1], "-")); f != nil {
			if b, ok := f.Value.(interface{ IsBoolFlag() bool }); ok && b.IsBoolFlag() {
				return fmt.Sprintf("%s: a true/false flag takes its value after '=': --%s=true or --%s=false", msg, f.Name, f.Name)
			}
		}
	}
	return fmt.Sprintf("%s: every value goes with a flag (%q lists them)", msg, commandName(fs)+" -h")
}

// commandName is how the user runs fs's command: "idem proxy".
func commandName(fs *flag.FlagSet) string {
	if name := fs.Name(); !strings.HasPrefix(name, "idem ") {
		return "idem " + name
	}
	return fs.Name()
}
