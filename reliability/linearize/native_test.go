package linearize

import (
	"testing"
	"time"

	"github.com/idemkit/idem/internal/redisserver"
	"github.com/idemkit/idem/internal/reltest"
	"github.com/idemkit/idem/redisstore"
)

// The native path of redisstore (SET IFEQ, MULTI/EXEC, no Lua) against the
// same model, on a private Valkey 9.1 (built by scripts/test.sh).

func startValkey(t *testing.T) *redisserver.Server {
	t.Helper()
	s, err := redisserver.StartServer(redisserver.WithKind(redisserver.Valkey9))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Stop)
	return s
}

func TestLinearizableRedisNative(t *testing.T) {
	v := startValkey(t)
	for _, name := range []string{"go-redis", "rueidis"} {
		t.Run(name, func(t *testing.T) {
			w := newWorkload(t, redisStoresPath(t, v.Addr(), 2*time.Second, true, redisstore.PathNative)[name], 12, reltest.Scale(100, 1000))
			w.callTTL = 5 * time.Second
			w.run(2)
			result(t, w, "redis native path (valkey 9.1 single, "+name+")", "none", newModel(stepper{provisional: true}))
		})
	}
}

func TestLinearizableRedisFaultsNative(t *testing.T) {
	v := startValkey(t)
	linearizableFaults(t, v.Addr(), redisstore.PathNative, "redis native path (valkey 9.1 single, ")
}
