package hostile

import (
	"fmt"
	"net/http"
	"testing"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/proctest"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/idemkit/idem/internal/reltest"
)

// v1Commit is the commit released as v1.0.0 (CHANGELOG, api/v1.0.0.export).
const v1Commit = "fd7d5db"

// TestUpgradeFromV1 stores records with the idem proxy of v1.0.0 (built
// from the git history), then serves the same requests with today's proxy
// on the same Redis and prefix: every request whose key v1.0 derived
// otherwise (a host in the key now, credentials in normal form, API-key
// headers, the path as the upstream sees it, an anonymous caller's
// cookies checked at replay instead of in the fingerprint) is replayed,
// never run again; another request under one of those keys is still a
// mismatch, and another caller runs its own. With --v1-scopes off the
// same request runs again: the look-up is what keeps the promise.
func TestUpgradeFromV1(t *testing.T) {
	t.Parallel()
	bin, err := proctest.BuildIdemAt(v1Commit)
	if err != nil {
		t.Fatal(err)
	}
	up := &app{}
	upstream, _ := startServer(t, up.handler(), nil)
	prefix := redistest.Prefix("upgrade")
	args := []string{"--upstream", upstream.URL, "--store", "redis://" + rdb.Addr(), "--prefix", prefix}

	type request struct {
		name, path string
		lines      []string
	}
	requests := []request{
		{"a virtual host", "/charges", []string{"Host: shop.example", "Authorization: Bearer alice"}},
		{"an odd spelling of a bearer token", "/charges", []string{"Authorization:   bearer   alice "}},
		{"an API key", "/charges", []string{"X-Api-Key: key-alice"}},
		{"an anonymous caller with cookies", "/charges", []string{"Cookie: session=abc; _ga=GA1.2"}},
		{"an escaped path", "/%63harges", []string{"Authorization: Bearer carol"}},
		{"an anonymous caller", "/charges", nil},
	}
	key := func(i int) string { return fmt.Sprintf("Idempotency-Key: upgrade-%d", i) }
	body := func(i int) string { return fmt.Sprintf(`{"amount":%d}`, 100+i) }

	v1 := proctest.StartProxyBin(t, bin, args...)
	stored := make([]answer, len(requests))
	for i, r := range requests {
		stored[i] = rawPost(t, v1.Addr, r.path, append([]string{key(i)}, r.lines...), body(i))
		if stored[i].status != http.StatusCreated {
			t.Fatalf("%s through v1.0: got %d %q, want 201", r.name, stored[i].status, stored[i].body)
		}
	}
	v1.Cmd.Process.Kill()
	ran := up.runs.Load()

	now := proctest.StartProxy(t, args...)
	replays := 0
	for i, r := range requests {
		a := rawPost(t, now.Addr, r.path, append([]string{key(i)}, r.lines...), body(i))
		if a.status != http.StatusCreated || a.header.Get(idemhttp.HeaderReplayed) != "true" || a.body != stored[i].body {
			t.Errorf("%s after the upgrade: got %d %q (replayed %q), want the replay of v1.0's %q",
				r.name, a.status, a.body, a.header.Get(idemhttp.HeaderReplayed), stored[i].body)
			continue
		}
		replays++
	}
	if n := up.runs.Load() - ran; n != 0 {
		t.Errorf("after the upgrade the upstream ran %d more times, want 0", n)
	}
	// The v1.0 record's fingerprint still holds.
	if a := rawPost(t, now.Addr, "/charges", []string{key(0), "Host: shop.example", "Authorization: Bearer alice"}, `{"amount":999}`); a.status != http.StatusUnprocessableEntity {
		t.Errorf("another body under a v1.0 key: got %d %q, want 422", a.status, a.body)
	}
	// Another caller under Alice's v1.0 key runs its own request.
	if a := rawPost(t, now.Addr, "/charges", []string{key(1), "Authorization: Bearer bob"}, body(1)); a.status != http.StatusCreated || a.header.Get(idemhttp.HeaderReplayed) != "" {
		t.Errorf("Bob under Alice's v1.0 key: got %d %q (replayed %q), want his own 201", a.status, a.body, a.header.Get(idemhttp.HeaderReplayed))
	}
	ran = up.runs.Load()

	off := proctest.StartProxy(t, append(args, "--v1-scopes", "off")...)
	if a := rawPost(t, off.Addr, requests[2].path, append([]string{key(2)}, requests[2].lines...), body(2)); a.header.Get(idemhttp.HeaderReplayed) != "" {
		t.Errorf("--v1-scopes off: got the replay of %q, want the request run again (nothing looks up v1.0's key)", a.body)
	}
	if n := up.runs.Load() - ran; n != 1 {
		t.Errorf("--v1-scopes off: the upstream ran %d times, want 1", n)
	}
	reltest.Report(t, reltest.Row{
		Scenario: "hostile: upgrade from v1.0.0", Store: "redis (single)",
		Fault:    "records stored by the v1.0.0 proxy, then the same requests through today's (host, credential spellings, API key, cookies, escaped path)",
		Requests: 2*len(requests) + 3, Keys: len(requests),
		Notes: fmt.Sprintf("%d of %d v1.0 records replayed after the upgrade, 0 run again; another body 422; another caller its own; with --v1-scopes off the same request ran again (1)", replays, len(requests)),
	})
}
