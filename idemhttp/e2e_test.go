package idemhttp_test

import (
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/redisstore"
)

// TestTransportThroughFaults: the server runs the operation on the first
// attempt but the response is lost (the connection is reset), the second
// attempt gets 503, the third a replay. The Transport must end with the
// operation's own response, one execution and one key.
func TestTransportThroughFaults(t *testing.T) {
	eachStore(t, func(t *testing.T, store idem.Store) {
		var executions, attempts atomic.Int64
		var mu sync.Mutex
		keys := map[string]bool{}
		inner := idemhttp.Middleware(store, idemhttp.Config{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			executions.Add(1)
			charge(w, r)
		}))
		var lost *httptest.ResponseRecorder
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			mu.Lock()
			keys[r.Header.Get(idemhttp.HeaderKey)] = true
			mu.Unlock()
			switch attempts.Add(1) {
			case 1: // the work is done, then the answer is lost: a TCP reset
				lost = httptest.NewRecorder()
				inner.ServeHTTP(lost, r)
				conn, _, err := http.NewResponseController(w).Hijack()
				if err != nil {
					t.Error(err)
					return
				}
				conn.(*net.TCPConn).SetLinger(0)
				conn.Close()
			case 2:
				w.Header().Set("Retry-After", "0")
				http.Error(w, "overloaded", http.StatusServiceUnavailable)
			default:
				inner.ServeHTTP(w, r)
			}
		}))
		defer srv.Close()

		client := &http.Client{Transport: &idemhttp.Transport{MinBackoff: time.Millisecond, MaxBackoff: 10 * time.Millisecond}}
		resp, err := client.Post(srv.URL+"/charges", "application/json", strings.NewReader(`{"amount":1000}`))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusCreated || resp.Header.Get(idemhttp.HeaderReplayed) != "true" || string(body) != lost.Body.String() {
			t.Fatalf("got %d %q replayed=%q, want the lost answer %q replayed", resp.StatusCode, body, resp.Header.Get(idemhttp.HeaderReplayed), lost.Body)
		}
		if n := executions.Load(); n != 1 {
			t.Fatalf("executions: got %d, want 1", n)
		}
		if len(keys) != 1 || keys[""] {
			t.Fatalf("keys seen by the server: got %v, want one", keys)
		}
		if n := attempts.Load(); n < 3 {
			t.Fatalf("attempts: got %d, want at least 3", n)
		}
	})
}

var storeKeyName = regexp.MustCompile(`^idem:\{[A-Za-z0-9_-]{22}\}$`)

// FuzzParseKey: header values never panic the parser; accepted keys give
// store key names of a fixed shape with no client bytes in them; distinct
// client keys (or tenants) give distinct records, and the quoted and bare
// spellings of one key give the same record.
func FuzzParseKey(f *testing.F) {
	for _, s := range []string{"abc", `"abc"`, `"a\"b"`, "{slot}", `"{x} y"`, "caf\xc3\xa9", "\x00", `"`, strings.Repeat("k", 255)} {
		f.Add(s, "tenant", "other")
	}
	rs, err := redisstore.New(redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}), redisstore.Options{}) // never dialled
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, value, tenant, value2 string) {
		h := http.Header{idemhttp.HeaderKey: {value}}
		key, err := idemhttp.ParseKey(h)
		if err != nil {
			return
		}
		if err := idem.ValidateKey(key); err != nil {
			t.Fatalf("ParseKey(%q) accepted %q, which ValidateKey refuses: %v", value, key, err)
		}
		scope := idem.Scope{Tenant: tenant, Method: "POST", Route: "/r"}
		k, err := scope.Key(key)
		if err != nil {
			t.Fatal(err)
		}
		if name := rs.KeyName(k); !storeKeyName.MatchString(name) {
			t.Fatalf("store key %q for header %q: want idem:{22 base64url characters}", name, value)
		}
		other := idem.Scope{Tenant: tenant + "x", Method: "POST", Route: "/r"}
		if ko, _ := other.Key(key); ko == k {
			t.Fatalf("tenants %q and %q share a record", tenant, tenant+"x")
		}
		if key2, err := idemhttp.ParseKey(http.Header{idemhttp.HeaderKey: {value2}}); err == nil {
			k2, _ := scope.Key(key2)
			if (key2 == key) != (k2 == k) {
				t.Fatalf("keys %q and %q: same client key %t, same record %t", key, key2, key2 == key, k2 == k)
			}
		}
		quoted := `"` + strings.NewReplacer(`\`, `\\`, `"`, `\"`).Replace(key) + `"`
		if back, err := idemhttp.ParseKey(http.Header{idemhttp.HeaderKey: {quoted}}); err != nil || back != key {
			t.Fatalf("quoted form %q of %q: got %q, %v", quoted, key, back, err)
		}
	})
}
