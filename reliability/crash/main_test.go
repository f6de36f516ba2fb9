//go:build unix

package crash

import (
	"fmt"
	"os"
	"testing"

	"github.com/idemkit/idem/internal/redisserver"
)

// redisSrv is the private redis-server every test of the package shares
// (keys are unique per test).
var redisSrv *redisserver.Server

func TestMain(m *testing.M) {
	if kind := os.Getenv(envChild); kind != "" {
		os.Exit(childMain(kind)) // a child server, not the tests
	}
	var err error
	redisSrv, err = redisserver.StartServer()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	code := m.Run()
	redisSrv.Stop()
	stopMySQL()
	os.Exit(code)
}

func redisURL() string { return "redis://" + redisSrv.Addr() }
