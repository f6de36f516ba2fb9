package redisserver

import (
	"fmt"
	"go/build"
	"os"
	"path/filepath"
	"slices"
	"strings"
)

// Kind names a Redis-protocol server build the tests can run. The system's
// redis-server (Redis 7.0 on Debian 12) is the default; the others are
// built from Debian's source packages by scripts/build-redis-servers.sh
// (which scripts/test.sh runs) into $(go env GOPATH)/idem-servers.
type Kind string

const (
	// Redis7 is the system's redis-server (Redis 7.0 on Debian 12): Lua,
	// no SET IFEQ.
	Redis7 Kind = "redis-7.0"
	// Valkey9 is Valkey 9.1 (Debian sid): SET IFEQ, DELIFEQ, Lua as a module.
	Valkey9 Kind = "valkey-9.1"
	// Redis8 is Redis 8.6 (Debian experimental): SET IFEQ, DELEX, Lua.
	Redis8 Kind = "redis-8.6"
	// Valkey9NoLua is Valkey 9.1 started with --enable-module-command local
	// and its Lua module unloaded (MODULE UNLOAD lua) after every start: a
	// server without scripting, as managed services may run.
	Valkey9NoLua Kind = "valkey-9.1-nolua"
)

// Kinds are every kind, the system's first.
var Kinds = []Kind{Redis7, Valkey9, Redis8, Valkey9NoLua}

// ServersDir is where scripts/build-redis-servers.sh puts the servers it
// builds: $(go env GOPATH)/idem-servers (the first GOPATH entry).
func ServersDir() string {
	gopath := build.Default.GOPATH
	if i := strings.IndexByte(gopath, os.PathListSeparator); i >= 0 {
		gopath = gopath[:i]
	}
	return filepath.Join(gopath, "idem-servers")
}

// Binary returns the path of k's server binary, or an error saying how to
// build it when it is missing.
func (k Kind) Binary() (string, error) {
	var path string
	switch k {
	case Redis7, "":
		return lookPath("redis-server", "redis-server")
	case Valkey9, Valkey9NoLua:
		path = filepath.Join(ServersDir(), "valkey", "valkey-server")
	case Redis8:
		path = filepath.Join(ServersDir(), "redis8", "redis-server")
	default:
		return "", fmt.Errorf("redisserver: unknown server kind %q", k)
	}
	if fi, err := os.Stat(path); err != nil || fi.IsDir() || fi.Mode()&0o111 == 0 {
		return "", fmt.Errorf("redisserver: %s server not built: %s is missing; run scripts/build-redis-servers.sh (scripts/test.sh runs it)", k, path)
	}
	return path, nil
}

// WithKind starts the server (every node of a cluster, every server of a
// Sentinel set, whose sentinels then run the same binary) from k's binary.
// For Valkey9NoLua the server starts with --enable-module-command local and
// gets MODULE UNLOAD lua once it answers, after every start and restart.
func WithKind(k Kind) Option {
	return func(c *config) {
		c.kind = k
		if k == Valkey9NoLua {
			c.args = append(c.args, "--enable-module-command", "local")
			c.post = append(c.post, []string{"MODULE", "UNLOAD", "lua"})
		}
	}
}

// binary resolves the configuration's server binary.
func (c *config) binary() (string, error) {
	return c.kind.Binary()
}

// EnvBenchServers names the environment variable that picks the server
// kinds a benchmark runs on, for the benchmarks that read it with
// BenchKinds: a comma-separated list of kinds ("valkey-9.1,redis-8.6"),
// or "all" for every kind in Kinds.
const EnvBenchServers = "IDEM_BENCH_SERVERS"

// BenchKinds returns the kinds $IDEM_BENCH_SERVERS lists, in its order
// and without repeats; nil when it is unset or empty, for the benchmark's
// default (the system's redis-server, with the benchmark names it always
// had). An unknown kind is an error naming the known ones.
func BenchKinds() ([]Kind, error) {
	return ParseKinds(os.Getenv(EnvBenchServers))
}

// ParseKinds parses a comma-separated list of kinds, or "all" (see
// BenchKinds). Spaces around the names are ignored.
func ParseKinds(list string) ([]Kind, error) {
	if strings.TrimSpace(list) == "all" {
		return append([]Kind(nil), Kinds...), nil
	}
	var kinds []Kind
	for name := range strings.SplitSeq(list, ",") {
		name = strings.TrimSpace(name)
		if name == "" {
			continue
		}
		k := Kind(name)
		if !slices.Contains(Kinds, k) {
			names := make([]string, len(Kinds))
			for i, k := range Kinds {
				names[i] = string(k)
			}
			return nil, fmt.Errorf("redisserver: unknown server kind %q in %q: want a comma-separated list of %s, or all", name, list, strings.Join(names, ", "))
		}
		if !slices.Contains(kinds, k) {
			kinds = append(kinds, k)
		}
	}
	return kinds, nil
}
