// Package redistest is the tests' Redis fixture: one private redis-server
// (internal/redisserver) shared by a test binary's tests, and stores on it
// under prefixes of their own, so that the tests sharing the server never
// meet each other's keys. It is test support only (it imports testing);
// the binaries start their servers with internal/redisserver.
//
// A package whose tests share one server:
//
//	var srv *redisserver.Server
//
//	func TestMain(m *testing.M) { os.Exit(redistest.Run(m, &srv)) }
//
//	func TestX(t *testing.T) {
//		store := redistest.Store(t, srv, redisstore.Options{})
//		...
//	}
package redistest

import (
	"crypto/rand"
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/idemkit/idem/internal/redisserver"
	"github.com/idemkit/idem/redisstore"
)

// Run is a TestMain's body for a package whose tests share one
// redis-server: it starts the server with opts (on failure it prints the
// error to stderr and exits with status 1), sets *srv to it, runs the
// tests, stops the server and returns m.Run's code, for os.Exit. A
// TestMain with more to tear down does it after Run returns.
func Run(m *testing.M, srv **redisserver.Server, opts ...redisserver.Option) int {
	*srv = redisserver.MustStartServer(opts...)
	defer (*srv).Stop()
	return m.Run()
}

// runID keeps one run's prefixes apart from another's on a server that
// outlives the run.
var runID = rand.Text()[:8]

// prefixSeq numbers the prefixes of this run.
var prefixSeq atomic.Int64

// Prefix returns a Redis key prefix that no other call returns, in this
// run or another: "idem:NAME:RUN:N:", RUN random for the test binary, N a
// count. name says whose keys they are when one looks at the server.
func Prefix(name string) string {
	return fmt.Sprintf("idem:%s:%s:%d:", name, runID, prefixSeq.Add(1))
}

// Store opens a store on srv (redisstore.Open, so on rueidis) with opts,
// and closes it when t ends; t fails if it does not open. An empty
// opts.Prefix becomes Prefix("t"), so that the store sees no other test's
// records (a test that needs to know its prefix passes its own Prefix).
func Store(t testing.TB, srv *redisserver.Server, opts redisstore.Options) *redisstore.Store {
	t.Helper()
	if opts.Prefix == "" {
		opts.Prefix = Prefix("t")
	}
	s, err := redisstore.Open("redis://"+srv.Addr(), opts)
	if err != nil {
		t.Fatalf("redistest: redisstore on %s: %v", srv.Addr(), err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}
