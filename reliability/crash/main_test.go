//go:build unix

package crash

import (
	"os"
	"testing"

	"github.com/idemkit/idem/internal/redisserver"
	"github.com/idemkit/idem/internal/redistest"
)

// redisSrv is the private redis-server every test of the package shares
// (keys are unique per test).
var redisSrv *redisserver.Server

func TestMain(m *testing.M) {
	if kind := os.Getenv(envChild); kind != "" {
		os.Exit(childMain(kind)) // a child server, not the tests
	}
	code := redistest.Run(m, &redisSrv)
	stopMySQL()
	os.Exit(code)
}

func redisURL() string { return "redis://" + redisSrv.Addr() }
