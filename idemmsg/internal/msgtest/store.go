package msgtest

import (
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/redisserver"
	"github.com/idemkit/idem/redisstore"
)

// RedisStore returns a redisstore on a private redis-server reached through
// a Proxy, both gone when the test ends: Proxy.Reset takes the store away
// from the consumers (every call fails fast until Proxy.Restore) while the
// server keeps its records.
func RedisStore(t testing.TB) (idem.Store, *Proxy) {
	t.Helper()
	srv, err := redisserver.StartServer()
	if err != nil {
		t.Fatalf("msgtest: %v", err)
	}
	t.Cleanup(srv.Stop)
	p := NewProxy(t, srv.Addr())
	store, err := redisstore.Open("redis://"+p.Addr, redisstore.Options{Timeout: time.Second})
	if err != nil {
		t.Fatalf("msgtest: redisstore on %s: %v", p.Addr, err)
	}
	t.Cleanup(func() { store.Close() })
	return store, p
}
