package hostile

import (
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/reltest"
	"github.com/idemkit/idem/memstore"
)

// TestNoCrossTenantReplay sends the same key and body from several
// tenants, one after the other and then all at once, on Redis and in
// memory: each tenant runs its own handler exactly once and never sees
// another's body or cookie. Tenants and keys whose concatenations collide
// ("acct:1" + "0abc" and "acct:10" + "abc") stay apart. The first answer
// of each tenant sets a cookie; its replays carry none.
func TestNoCrossTenantReplay(t *testing.T) {
	t.Parallel()
	redis, _ := newRedisStore(t, rdb)
	for _, st := range []struct {
		name  string
		store idem.Store
	}{{"redis (single)", redis}, {"memory", memstore.New(memstore.Options{})}} {
		a := &app{}
		cfg := idemhttp.Config{
			Tenant: func(r *http.Request) string {
				if v := r.Header.Get("X-Tenant"); v != "" {
					return "acct:" + v
				}
				return idemhttp.DefaultTenant(r)
			},
			Wait:   10 * time.Second,
			Logger: quietLogger(),
		}
		ts, _ := startServer(t, idemhttp.Middleware(st.store, cfg)(a.handler()), nil)
		url := ts.URL + "/charges"
		client := newClient(15 * time.Second)
		tenants := []map[string]string{
			{"Authorization": "Bearer alice"},
			{"Authorization": "Bearer bob"},
			{"Authorization": "Bearer alice-rotated"}, // another token: another tenant
			{}, // no credentials
		}
		requests, replays := 0, 0
		check := func(who map[string]string, got answer, wantReplay bool, own string) {
			t.Helper()
			requests++
			replayed := got.header.Get(idemhttp.HeaderReplayed) == "true"
			cookies := got.header.Values("Set-Cookie")
			switch {
			case got.status != http.StatusCreated:
				t.Errorf("%s, %v: %d %s", st.name, who, got.status, got.body)
			case replayed != wantReplay:
				t.Errorf("%s, %v: replayed=%v, want %v (%s)", st.name, who, replayed, wantReplay, got.body)
			case !strings.Contains(got.body, fmt.Sprintf(`"auth":%q`, own)):
				t.Errorf("%s, %v: got another tenant's body %s", st.name, who, got.body)
			case replayed && len(cookies) != 0:
				t.Errorf("%s, %v: a replay carries Set-Cookie %q", st.name, who, cookies)
			case !replayed && len(cookies) != 1:
				t.Errorf("%s, %v: a first execution has Set-Cookie %q, want one cookie", st.name, who, cookies)
			}
			if replayed {
				replays++
			}
		}
		// One after the other, twice each.
		for round := range 2 {
			for _, who := range tenants {
				got := mustPost(t, client, url, "shared-key", `{"amount":100}`, who)
				check(who, got, round == 1, who["Authorization"])
			}
		}
		if got := a.runs.Load(); got != int64(len(tenants)) {
			t.Errorf("%s: handler ran %d times for %d tenants", st.name, got, len(tenants))
		}
		// All at once on a fresh key: one execution per tenant, every
		// answer that tenant's own.
		per := reltest.Scale(10, 100)
		a.runs.Store(0)
		var mu sync.Mutex
		var wg sync.WaitGroup
		for _, who := range tenants[:2] {
			for range per {
				wg.Go(func() {
					got, err := post(client, url, "concurrent-key", `{"amount":5}`, who)
					mu.Lock()
					defer mu.Unlock()
					requests++
					if err != nil {
						t.Errorf("%s: %v", st.name, err)
						return
					}
					if got.status != http.StatusCreated || !strings.Contains(got.body, fmt.Sprintf(`"auth":%q`, who["Authorization"])) {
						t.Errorf("%s, %v: concurrent: %d %s", st.name, who, got.status, got.body)
					}
					if got.header.Get(idemhttp.HeaderReplayed) == "true" {
						replays++
						if len(got.header.Values("Set-Cookie")) != 0 {
							t.Errorf("%s: a concurrent replay carries Set-Cookie", st.name)
						}
					}
				})
			}
		}
		wg.Wait()
		if got := a.runs.Load(); got != 2 {
			t.Errorf("%s: %d concurrent requests from 2 tenants ran the handler %d times, want 2", st.name, 2*per, got)
		}
		// Field boundaries: "acct:1" + "0abc" is not "acct:10" + "abc".
		a.runs.Store(0)
		x := mustPost(t, client, url, "0abc", "{}", map[string]string{"X-Tenant": "1"})
		y := mustPost(t, client, url, "abc", "{}", map[string]string{"X-Tenant": "10"})
		requests += 2
		if a.runs.Load() != 2 || y.header.Get(idemhttp.HeaderReplayed) != "" || x.body == y.body {
			t.Errorf("%s: tenant 1 key 0abc and tenant 10 key abc shared a record: %q / %q", st.name, x.body, y.body)
		}
		reltest.Report(t, reltest.Row{
			Scenario: "hostile: cross-tenant replay and Set-Cookie", Store: st.name,
			Fault:    fmt.Sprintf("same key and body from %d tenants in turn, from 2 tenants %d× at once (Wait 10s); tenant/key concatenation collisions", len(tenants), per),
			Requests: requests, Keys: len(tenants) + 2 + 2,
			Notes: fmt.Sprintf("one execution per tenant; %d replays, each the tenant's own and without Set-Cookie", replays),
		})
	}
}
