package hostile

import (
	"fmt"
	"math"
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/reltest"
	"github.com/idemkit/idem/redisstore"
)

const clusterSlots = 16384

// crc16 is CRC16-CCITT (XMODEM), the checksum of Redis Cluster's key slots.
func crc16(b []byte) uint16 {
	var crc uint16
	for _, c := range b {
		crc ^= uint16(c) << 8
		for range 8 {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
	}
	return crc
}

// keySlot is Redis Cluster's HASH_SLOT: the CRC16 of the hash tag (the
// bytes between the first '{' and the first '}' after it, when not empty)
// or of the whole key, modulo 16384.
func keySlot(key string) int {
	if i := strings.IndexByte(key, '{'); i >= 0 {
		if j := strings.IndexByte(key[i+1:], '}'); j > 0 {
			key = key[i+1 : i+1+j]
		}
	}
	return int(crc16([]byte(key))) % clusterSlots
}

func TestKeySlotVectors(t *testing.T) {
	// From the Redis Cluster specification and the CLUSTER KEYSLOT docs.
	if got := crc16([]byte("123456789")); got != 0x31C3 {
		t.Errorf("crc16(123456789) = %#x, want 0x31c3", got)
	}
	for key, want := range map[string]int{"somekey": 11058, "foo{hash_tag}": 2515, "bar{hash_tag}": 2515, "{}x": keySlot("{}x")} {
		if got := keySlot(key); got != want {
			t.Errorf("keySlot(%q) = %d, want %d", key, got, want)
		}
	}
	if keySlot("{}x") != int(crc16([]byte("{}x")))%clusterSlots {
		t.Error("an empty hash tag must hash the whole key")
	}
}

// hostileKey returns the i-th client key, tenant and path of a set built
// to steer a naive "prefix + client key" scheme onto few slots: braces
// everywhere, in the key, in the tenant, in the path.
func hostileKey(i int) (key, tenant, path string) {
	tenant, path = "{x}", "/charges"
	switch i % 10 {
	case 0:
		key, tenant = "{x}", fmt.Sprintf("{t}%d", i) // the same key for every tenant
	case 1:
		key = fmt.Sprintf("{%d}", i%7)
		tenant = fmt.Sprintf("{x}-%d", i)
	case 2:
		key = fmt.Sprintf("{}%d", i)
	case 3:
		key = fmt.Sprintf("}{%d", i)
	case 4:
		key = fmt.Sprintf("{{%d}}", i)
	case 5:
		key = fmt.Sprintf("%d{x}", i)
	case 6:
		key = strconv.Quote(fmt.Sprintf("{x} {y} %d", i)) // an sf-string, with spaces
	case 7:
		key = fmt.Sprintf("{user1000}.following-%d", i)
	case 8:
		key = fmt.Sprintf("x-%d", i)
		path = fmt.Sprintf("/r/%%7Bx%%7D/%d", i) // "{x}" in the route (no pattern: the path is the route)
	case 9:
		key = strings.Repeat("{", 120) + strconv.Itoa(i) + strings.Repeat("}", 120)
	}
	return key, tenant, path
}

// TestHostileKeysSpreadOverSlots sends keyed requests whose client keys,
// tenants and routes are brace games, observes the key names written on
// the private Redis (KEYS), and checks that every name is the prefix and a
// 22-character digest in one hash tag (no client bytes), and that the
// names spread evenly over the 16384 cluster slots (distinct slots near
// what uniform hashing gives, and a chi-square test over 64 slot ranges).
func TestHostileKeysSpreadOverSlots(t *testing.T) {
	t.Parallel()
	store, prefix := newRedisStore(t, rdb)
	cfg := idemhttp.Config{
		Tenant: func(r *http.Request) string { return r.Header.Get("X-Tenant") },
		Route: func(r *http.Request) string { // the escaped path, so "{x}" in it reaches the scope
			return r.URL.EscapedPath()
		},
		Logger: quietLogger(),
	}
	created := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusCreated) })
	ts, _ := startServer(t, idemhttp.Middleware(store, cfg)(created), nil)
	client := newClient(10 * time.Second)
	n := reltest.Scale(2000, 50_000)
	const workers = 8
	errs := map[string]int{}
	results := make(chan string, workers)
	for w := range workers {
		go func() {
			bad := ""
			for i := w; i < n; i += workers {
				key, tenant, path := hostileKey(i)
				ans, err := post(client, ts.URL+path, key, "{}", map[string]string{"X-Tenant": tenant})
				if err != nil || ans.status != http.StatusCreated {
					bad = fmt.Sprintf("key %q tenant %q path %q: %v %d %.100s", key, tenant, path, err, ans.status, ans.body)
				}
			}
			results <- bad
		}()
	}
	for range workers {
		if bad := <-results; bad != "" {
			errs["failed"]++
			t.Error(bad)
		}
	}

	names := slices.DeleteFunc(keysWith(t, rdb, prefix), func(name string) bool { return name == prefix+"store-id" })
	if len(names) != n {
		t.Errorf("%d records for %d distinct (tenant, route, key) triples", len(names), n)
	}
	shape := regexp.MustCompile(`^` + regexp.QuoteMeta(prefix) + `\{[A-Za-z0-9_-]{22}\}$`)
	slots := make([]int, clusterSlots)
	for _, name := range names {
		if !shape.MatchString(name) {
			t.Errorf("key name %q is not the prefix and a digest in one hash tag", name)
			continue
		}
		slots[keySlot(name)]++
	}
	distinct := 0
	for _, c := range slots {
		if c > 0 {
			distinct++
		}
	}
	expected := clusterSlots * (1 - math.Pow(1-1.0/clusterSlots, float64(len(names))))
	if float64(distinct) < 0.9*expected {
		t.Errorf("%d names on %d distinct slots, uniform hashing gives about %.0f", len(names), distinct, expected)
	}
	const groups = 64
	var chi2 float64
	per := float64(len(names)) / groups
	for g := range groups {
		c := 0
		for _, x := range slots[g*clusterSlots/groups : (g+1)*clusterSlots/groups] {
			c += x
		}
		chi2 += (float64(c) - per) * (float64(c) - per) / per
	}
	if chi2 > 130 { // 63 degrees of freedom: p < 1e-5 beyond about 120
		t.Errorf("chi-square %.1f over %d slot ranges: the names are not spread evenly", chi2, groups)
	}
	// What a naive scheme (prefix + client key) would have done.
	naive := map[int]bool{}
	for i := range n {
		key, _, _ := hostileKey(i)
		naive[keySlot("idem:"+key)] = true
	}
	// A prefix with a brace is refused: it would move the hash tag.
	for _, p := range []string{"a{b}:", "x{", "}"} {
		if _, err := redisstore.Open("redis://"+rdb.Addr(), redisstore.Options{Prefix: p}); err == nil {
			t.Errorf("Prefix %q accepted", p)
		}
	}
	reltest.Report(t, reltest.Row{
		Scenario: "hostile: brace games in keys, tenants, routes", Store: "redis (single)",
		Fault:    fmt.Sprintf("%d keys like {x}, {}N, }{N, {{N}}, N{x}, quoted \"{x} {y}\", {user1000}.…, 120 braces; tenants {x}…; routes /r/%%7Bx%%7D/…", n),
		Requests: n, Keys: len(names), ClientErrors: errs,
		Notes: fmt.Sprintf("all names prefix{22-char digest}; %d distinct slots (uniform: %.0f), chi-square %.1f over 64 ranges (63 dof); a naive prefix+key scheme: %d slots",
			distinct, expected, chi2, len(naive)),
	})
}
