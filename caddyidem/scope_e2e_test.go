package caddyidem

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/idemkit/idem/idemhttp"
)

// postAs is post with an X-Account header (the tenant of tenant_header
// X-Account).
func postAs(t *testing.T, url, account, key, body string) answer {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set(idemhttp.HeaderKey, key)
	req.Header.Set("X-Account", account)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return answer{resp.StatusCode, string(b), resp.Header.Get(idemhttp.HeaderReplayed), resp.Header.Get("Retry-After")}
}

// TestScope: through a real Caddy on one Redis, a key's record is scoped
// by the tenant (tenant_header), the path the upstream sees, and the
// prefix. The same key and body from the same tenant on the same path
// replay; from another tenant, on another path, or under another prefix
// (two handle_path blocks whose upstream paths are the same) they run
// again, each as a new execution.
func TestScope(t *testing.T) {
	up := startCounter(t, 0)
	upstream := strings.TrimPrefix(up.srv.URL, "http://")
	block := func(path, prefix string) string {
		return fmt.Sprintf("\thandle_path /%s/* {\n\t\tidempotency {\n\t\t\tstore redis://%s\n\t\t\tprefix %s\n\t\t\ttenant_header X-Account\n\t\t}\n\t\treverse_proxy %s\n\t}\n",
			path, rdb.Addr(), prefix, upstream)
	}
	base := startCaddy(t, block("a", "scope-a:"+runID+":")+block("b", "scope-b:"+runID+":"))
	key, body := "scope-"+runID, `{"amount":1}`

	first := postAs(t, base+"/a/pay", "acct-1", key, body)
	if first.status != 201 || first.replayed != "" {
		t.Fatalf("first: got %d (replayed %q) %q, want the upstream's 201", first.status, first.replayed, first.body)
	}
	again := postAs(t, base+"/a/pay", "acct-1", key, body)
	if again.status != 201 || again.replayed != "true" || again.body != first.body {
		t.Errorf("same tenant, path and prefix: got %d (replayed %q) %q, want the replay of %q", again.status, again.replayed, again.body, first.body)
	}
	runs := 1
	for _, c := range []struct{ what, url, account string }{
		{"another tenant (X-Account)", base + "/a/pay", "acct-2"},
		{"another path", base + "/a/refund", "acct-1"},
		{"another prefix (the same upstream path /pay)", base + "/b/pay", "acct-1"},
	} {
		got := postAs(t, c.url, c.account, key, body)
		runs++
		if got.status != 201 || got.replayed != "" || got.body == first.body {
			t.Errorf("%s: got %d (replayed %q) %q, want a new execution's 201", c.what, got.status, got.replayed, got.body)
		}
		if n := up.count(key); n != runs {
			t.Errorf("%s: the upstream ran the key %d times, want %d", c.what, n, runs)
		}
	}
}
