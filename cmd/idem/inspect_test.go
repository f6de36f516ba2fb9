package main

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/redisserver"
	"github.com/idemkit/idem/redisstore"
	"github.com/idemkit/idem/seal"
)

// inspectExec runs the idem command line in-process.
func inspectExec(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errOut bytes.Buffer
	code = run(t.Context(), args, &out, &errOut)
	return code, out.String(), errOut.String()
}

// inspectRedis starts a private redis-server and returns its --store URL,
// a key prefix and a store on that prefix.
func inspectRedis(t *testing.T) (storeURL, prefix string, store *redisstore.Store) {
	t.Helper()
	srv, err := redisserver.StartServer()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	storeURL, prefix = "redis://"+srv.Addr(), "inspect-test:"
	store, err = redisstore.Open(storeURL, redisstore.Options{Prefix: prefix})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { store.Close() })
	return storeURL, prefix, store
}

// inspectFields parses inspect's "name: value" lines.
func inspectFields(t *testing.T, out string) map[string][]string {
	t.Helper()
	fields := map[string][]string{}
	for line := range strings.Lines(out) {
		name, value, ok := strings.Cut(strings.TrimSuffix(line, "\n"), ":")
		if !ok {
			t.Fatalf("line %q is not name: value\n%s", line, out)
		}
		fields[name] = append(fields[name], strings.TrimSpace(value))
	}
	return fields
}

func inspectField(t *testing.T, fields map[string][]string, name string) string {
	t.Helper()
	vs := fields[name]
	if len(vs) != 1 {
		t.Fatalf("field %q: got %q, want one value", name, vs)
	}
	return vs[0]
}

func inspectGet(t *testing.T, store idem.Store, key idem.Key) (idem.Record, bool) {
	t.Helper()
	rec, ok, err := store.Get(t.Context(), key)
	if err != nil {
		t.Fatal(err)
	}
	return rec, ok
}

func TestInspectCompleted(t *testing.T) {
	storeURL, prefix, store := inspectRedis(t)

	// A completed record, written by the middleware.
	mux := http.NewServeMux()
	mux.HandleFunc("POST /charges", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("X-Charge-Id", "ch_1")
		w.WriteHeader(http.StatusCreated)
		w.Write([]byte("{\"id\":\"ch_1\"}\n\x1b[31m"))
	})
	api := httptest.NewServer(idemhttp.Middleware(store, idemhttp.Config{})(mux))
	defer api.Close()
	req, _ := http.NewRequest(http.MethodPost, api.URL+"/charges", strings.NewReader(`{"amount":1000}`))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(idemhttp.HeaderKey, "order-42")
	resp, err := api.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusCreated {
		t.Fatalf("status: got %d, want 201", resp.StatusCode)
	}

	key, err := idem.Scope{Method: "POST", Route: "POST /charges"}.Key("order-42")
	if err != nil {
		t.Fatal(err)
	}
	rec, ok := inspectGet(t, store, key)
	if !ok || rec.State != idem.StateCompleted {
		t.Fatalf("record: got %+v, %v; want a completed record", rec, ok)
	}

	code, out, errOut := inspectExec(t, "inspect", "--store", storeURL, "--prefix", prefix,
		"--route", "POST /charges", "--key", "order-42")
	if code != 0 {
		t.Fatalf("inspect: exit %d, want 0; stderr: %s", code, errOut)
	}
	f := inspectFields(t, out)
	for name, want := range map[string]string{
		"stored key":  key.String(),
		"state":       "completed",
		"token":       strconv.FormatUint(rec.Token, 10),
		"fingerprint": hex.EncodeToString(rec.Fingerprint[:]),
		"size":        strconv.Itoa(rec.Size) + " bytes stored",
		"status":      "201 Created",
		"body":        `{"id":"ch_1"}\n\x1b[31m (19 bytes)`,
	} {
		if got := inspectField(t, f, name); got != want {
			t.Errorf("%s: got %q, want %q", name, got, want)
		}
	}
	if left := inspectField(t, f, "retention left"); !strings.HasPrefix(left, "23h59m") && !strings.HasPrefix(left, "24h0m") {
		t.Errorf("retention left: got %q, want about 24h", left)
	}
	if got := strings.Join(f["header"], "|"); !strings.Contains(got, "Content-Type: application/json") || !strings.Contains(got, "X-Charge-Id: ch_1") {
		t.Errorf("headers: got %q, want Content-Type and X-Charge-Id", got)
	}

	// The same record by its stored key.
	code, out2, errOut := inspectExec(t, "inspect", "--store", storeURL, "--prefix", prefix, "--stored-key", key.String())
	if code != 0 {
		t.Fatalf("inspect --stored-key: exit %d, want 0; stderr: %s", code, errOut)
	}
	f2 := inspectFields(t, out2)
	if inspectField(t, f2, "state") != "completed" || inspectField(t, f2, "token") != f["token"][0] {
		t.Errorf("inspect --stored-key: got\n%s\nwant the record of\n%s", out2, out)
	}

	// --json.
	code, out, errOut = inspectExec(t, "inspect", "--store", storeURL, "--prefix", prefix, "--stored-key", key.String(), "--json")
	if code != 0 {
		t.Fatalf("inspect --json: exit %d, want 0; stderr: %s", code, errOut)
	}
	var got inspectRecord
	if err := json.Unmarshal([]byte(out), &got); err != nil {
		t.Fatalf("inspect --json: %v\n%s", err, out)
	}
	if got.StoredKey != key.String() || !got.Found || got.State != "completed" || got.Token != rec.Token ||
		got.Response == nil || got.Response.Status != 201 || got.Response.Header.Get("X-Charge-Id") != "ch_1" ||
		string(got.Response.Body) != "{\"id\":\"ch_1\"}\n\x1b[31m" || got.TTLMS < int64(23*time.Hour/time.Millisecond) {
		t.Errorf("inspect --json: got %s", out)
	}

	// Another method is another key.
	code, out, _ = inspectExec(t, "inspect", "--store", storeURL, "--prefix", prefix,
		"--method", "PATCH", "--route", "POST /charges", "--key", "order-42")
	if code != 1 || out != "no record\n" {
		t.Errorf("inspect --method PATCH: got exit %d, %q; want 1, \"no record\"", code, out)
	}
}

func TestInspectInFlightAndReleased(t *testing.T) {
	storeURL, prefix, store := inspectRedis(t)
	ctx := t.Context()

	inFlight, _ := idem.Scope{Tenant: "acct_7", Method: "POST", Route: "/orders"}.Key("k-in-flight")
	acq, err := store.Acquire(ctx, idem.AcquireRequest{Key: inFlight, LeaseID: idem.NewLeaseID(), TTL: time.Minute,
		Fingerprint: idem.Fingerprint{0xab, 0xcd}})
	if err != nil || acq.Outcome != idem.Acquired {
		t.Fatalf("acquire: got %v, %v; want acquired", acq.Outcome, err)
	}
	code, out, errOut := inspectExec(t, "inspect", "--store", storeURL, "--prefix", prefix,
		"--tenant", "acct_7", "--route", "/orders", "--key", "k-in-flight")
	if code != 0 {
		t.Fatalf("inspect: exit %d, want 0; stderr: %s", code, errOut)
	}
	f := inspectFields(t, out)
	for name, want := range map[string]string{
		"state":       "in_flight",
		"token":       strconv.FormatUint(acq.Lease.Token, 10),
		"lease id":    acq.Lease.ID.String(),
		"fingerprint": "abcd0000000000000000000000000000",
	} {
		if got := inspectField(t, f, name); got != want {
			t.Errorf("%s: got %q, want %q", name, got, want)
		}
	}
	if left, err := time.ParseDuration(inspectField(t, f, "lease left")); err != nil || left <= 50*time.Second || left > time.Minute {
		t.Errorf("lease left: got %q, want about 1m", f["lease left"])
	}
	if _, ok := f["status"]; ok {
		t.Errorf("an in-flight record has no status; got\n%s", out)
	}

	released, _ := idem.Scope{Tenant: "acct_7", Method: "POST", Route: "/orders"}.Key("k-released")
	acq, err = store.Acquire(ctx, idem.AcquireRequest{Key: released, LeaseID: idem.NewLeaseID(), TTL: time.Minute})
	if err != nil || acq.Outcome != idem.Acquired {
		t.Fatalf("acquire: got %v, %v; want acquired", acq.Outcome, err)
	}
	if err := store.Release(ctx, acq.Lease); err != nil {
		t.Fatal(err)
	}
	code, out, errOut = inspectExec(t, "inspect", "--store", storeURL, "--prefix", prefix, "--stored-key", released.String())
	if code != 0 {
		t.Fatalf("inspect released: exit %d, want 0; stderr: %s", code, errOut)
	}
	f = inspectFields(t, out)
	if got := inspectField(t, f, "state"); got != "released" {
		t.Errorf("state: got %q, want released", got)
	}
	if got := inspectField(t, f, "token"); got != strconv.FormatUint(acq.Lease.Token, 10) {
		t.Errorf("token: got %q, want %d", got, acq.Lease.Token)
	}
	if _, ok := f["fingerprint"]; ok {
		t.Errorf("a released record keeps no fingerprint; got\n%s", out)
	}

	// The default prefix is another store: no record there.
	code, out, errOut = inspectExec(t, "inspect", "--store", storeURL, "--stored-key", released.String())
	if code != 1 || out != "no record\n" || !strings.Contains(errOut, "no record for stored key "+released.String()) {
		t.Errorf("inspect, default prefix: got exit %d, %q, %q; want 1, \"no record\"", code, out, errOut)
	}
}

func TestPurge(t *testing.T) {
	storeURL, prefix, store := inspectRedis(t)
	ctx := t.Context()
	key, _ := idem.Scope{Method: "POST", Route: "/refunds"}.Key("r-1")
	acq, err := store.Acquire(ctx, idem.AcquireRequest{Key: key, LeaseID: idem.NewLeaseID(), TTL: time.Minute})
	if err != nil || acq.Outcome != idem.Acquired {
		t.Fatalf("acquire: got %v, %v; want acquired", acq.Outcome, err)
	}
	if err := store.Complete(ctx, acq.Lease, &idem.Response{Status: 200, Body: []byte("ok")}, time.Hour); err != nil {
		t.Fatal(err)
	}
	sel := []string{"--store", storeURL, "--prefix", prefix, "--route", "/refunds", "--key", "r-1"}

	code, _, errOut := inspectExec(t, append([]string{"purge"}, sel...)...)
	if code != 2 || !strings.Contains(errOut, "without --yes") {
		t.Errorf("purge without --yes: got exit %d, %q; want 2 and a word on --yes", code, errOut)
	}
	if _, ok := inspectGet(t, store, key); !ok {
		t.Fatal("purge without --yes deleted the record")
	}

	code, out, errOut := inspectExec(t, append([]string{"purge", "--yes"}, sel...)...)
	want := "purged " + key.String() + " (was completed, token " + strconv.FormatUint(acq.Lease.Token, 10) + ")\n"
	if code != 0 || out != want {
		t.Fatalf("purge --yes: got exit %d, %q (stderr %q); want 0, %q", code, out, errOut, want)
	}
	if _, ok := inspectGet(t, store, key); ok {
		t.Fatal("purge --yes left the record")
	}

	code, out, _ = inspectExec(t, append([]string{"inspect"}, sel...)...)
	if code != 1 || out != "no record\n" {
		t.Errorf("inspect after purge: got exit %d, %q; want 1, \"no record\"", code, out)
	}
	code, out, _ = inspectExec(t, "purge", "--yes", "--json", "--store", storeURL, "--prefix", prefix, "--stored-key", key.String())
	if code != 1 || !strings.Contains(out, `"deleted": false`) {
		t.Errorf("purge of a missing record: got exit %d, %q; want 1, deleted false", code, out)
	}
}

func TestInspectFlags(t *testing.T) {
	valid := idem.Key{1}.String()
	for _, tc := range []struct {
		args []string
		want string // in stderr
	}{
		{[]string{"inspect"}, "which record?"},
		{[]string{"inspect", "--key", "k", "--route", "/a", "--stored-key", valid}, "--key and --stored-key"},
		{[]string{"purge", "--yes", "--key", "k", "--stored-key", valid}, "--key and --stored-key"},
		{[]string{"inspect", "--key", "k"}, "--key needs --route"},
		{[]string{"inspect", "--key", "k\x01", "--route", "/a"}, "--key: invalid idempotency key"},
		{[]string{"inspect", "--stored-key", "short"}, "--stored-key: stored key \"short\""},
		{[]string{"inspect", "--stored-key", valid, "--tenant", "t"}, "go with --key"},
		{[]string{"inspect", "--stored-key", valid, "--method", "POST"}, "go with --key"},
		{[]string{"inspect", "--stored-key", valid, "--yes"}, "unknown flag --yes; \"idem inspect -h\" lists the flags"},
		{[]string{"inspect", "--stored-key", valid, "extra"}, `unexpected argument "extra"`},
		{[]string{"inspect", "--stored-key", valid, "--store", "ftp://x"}, `--store: unknown scheme "ftp"`},
		{[]string{"purge", "--route", "/a", "--key", "k"}, "without --yes"},
		{[]string{"purge"}, "which record?"},
	} {
		code, _, errOut := inspectExec(t, tc.args...)
		if code != 2 || !strings.Contains(errOut, tc.want) {
			t.Errorf("idem %q: got exit %d, stderr %q; want 2 and %q", tc.args, code, errOut, tc.want)
		}
	}
}

func TestInspectFlagsFromEnvironment(t *testing.T) {
	storeURL, _, _ := inspectRedis(t)
	t.Setenv("IDEM_STORE", storeURL)
	t.Setenv("IDEM_ROUTE", "/orders") // counts as set: --key needs no --route
	code, out, errOut := inspectExec(t, "inspect", "--key", "k")
	if code != 1 || out != "no record\n" || !strings.Contains(errOut, `route "/orders"`) {
		t.Errorf("inspect with IDEM_ROUTE: got exit %d, %q, %q; want 1, no record, and the route from the environment", code, out, errOut)
	}
	t.Setenv("IDEM_STORED_KEY", idem.Key{}.String()) // now --key conflicts
	if code, _, errOut := inspectExec(t, "inspect", "--key", "k"); code != 2 || !strings.Contains(errOut, "--key and --stored-key") {
		t.Errorf("inspect with IDEM_STORED_KEY and --key: got exit %d, %q; want 2", code, errOut)
	}
}

func TestInspectEscape(t *testing.T) {
	for _, tc := range []struct {
		in   string
		max  int
		want string
	}{
		{`plain {"json"}`, 100, `plain {"json"}`},
		{"a\nb\tc\\d\re", 100, `a\nb\tc\\d\re`},
		{"\x1b[31m\x00", 100, `\x1b[31m\x00`},
		{"h\xffé\u2028", 100, `h\xffé\u2028`},
		{strings.Repeat("x", 10), 4, "xxxx…"},
		{"xxxx", 4, "xxxx"},
	} {
		if got := inspectEscape(tc.in, tc.max); got != tc.want {
			t.Errorf("inspectEscape(%q, %d): got %q, want %q", tc.in, tc.max, got, tc.want)
		}
	}
}

// Store URLs may carry passwords: no error repeats them.
func TestStoreErrorsHideCredentials(t *testing.T) {
	for _, spec := range []string{
		"redis://user:s3cretpw@127.0.0.1:notaport",
		"host=db password=s3cretpw",
		"ftp://user:s3cretpw@host",
	} {
		for _, cmd := range [][]string{{"inspect", "--stored-key", "AQAAAAAAAAAAAAAAAAAAAA"}, {"demo", "--payments", "1"}} {
			code, out, errOut := inspectExec(t, append(cmd, "--store", spec)...)
			if code == 0 || strings.Contains(errOut+out, "s3cretpw") {
				t.Errorf("idem %s --store %q: exit %d, output %q: want a failure that does not show the password", cmd[0], spec, code, errOut+out)
			}
		}
	}
	code, _, errOut := inspectExec(t, "proxy", "--upstream", "http://user:s3cretpw@127.0.0.1:1")
	if code != 2 || strings.Contains(errOut, "s3cretpw") || !strings.Contains(errOut, "credentials") {
		t.Errorf("proxy with credentials in --upstream: exit %d, stderr %q; want 2, refused, password not shown", code, errOut)
	}
}

// A confirmation must be typed: IDEM_YES does not confirm a purge.
func TestPurgeIgnoresYesFromEnvironment(t *testing.T) {
	t.Setenv("IDEM_YES", "true")
	code, _, errOut := inspectExec(t, "purge", "--route", "/a", "--key", "k")
	if code != 2 || !strings.Contains(errOut, "without --yes") {
		t.Fatalf("purge with IDEM_YES=true: exit %d, stderr %q; want 2 and the --yes refusal", code, errOut)
	}
}

// TestInspectSealed: a sealed record (written by the middleware with a
// key ring) shows its metadata and its key id, not its response (no byte
// of the body or of a header is printed); with --seal-keys (or
// IDEM_SEAL_KEYS) it is opened and shown as a clear one; with a ring that
// lacks its key it says so, naming the key id, and exits 1. --json says
// "sealed" and "key_id".
func TestInspectSealed(t *testing.T) {
	storeURL, prefix, store := inspectRedis(t)
	dir := t.TempDir()
	ringFile := filepath.Join(dir, "ring")
	writeFile(t, ringFile, sealRingLine("k2", 2)+"\n"+sealRingLine("k1", 1)+"\n")
	otherRing := filepath.Join(dir, "other")
	writeFile(t, otherRing, sealRingLine("k3", 3)+"\n")
	ring, err := seal.RingFromFile(ringFile)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /charges", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Session-Token", "tok-canary")
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, `{"card":"4111 1111 1111 1111"}`)
	})
	api := httptest.NewServer(idemhttp.Middleware(store, idemhttp.Config{Seal: ring})(mux))
	defer api.Close()
	req, _ := http.NewRequest(http.MethodPost, api.URL+"/charges", strings.NewReader(`{}`))
	req.Header.Set(idemhttp.HeaderKey, "sealed-42")
	resp, err := api.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	key, _ := idem.Scope{Method: "POST", Route: "POST /charges"}.Key("sealed-42")
	rec, ok := inspectGet(t, store, key)
	if !ok || rec.State != idem.StateCompleted || !rec.Response.Sealed() {
		t.Fatalf("record: got %+v, %v; want a completed, sealed one", rec, ok)
	}
	base := []string{"inspect", "--store", storeURL, "--prefix", prefix, "--stored-key", key.String()}
	canary := func(what, out string) {
		t.Helper()
		if strings.Contains(out, "4111") || strings.Contains(out, "tok-canary") || strings.Contains(out, "X-Session-Token") {
			t.Errorf("%s shows the sealed content:\n%s", what, out)
		}
	}

	// Without the ring: the metadata and the key id.
	code, out, errOut := inspectExec(t, base...)
	if code != 0 {
		t.Fatalf("inspect: exit %d, want 0; stderr: %s", code, errOut)
	}
	f := inspectFields(t, out)
	for name, want := range map[string]string{
		"state": "completed",
		"token": strconv.FormatUint(rec.Token, 10),
		"size":  strconv.Itoa(rec.Size) + " bytes stored",
	} {
		if got := inspectField(t, f, name); got != want {
			t.Errorf("%s: got %q, want %q", name, got, want)
		}
	}
	if got := inspectField(t, f, "sealed"); !strings.HasPrefix(got, "yes, key id k2 (") || !strings.Contains(got, "--seal-keys") {
		t.Errorf("sealed: got %q, want yes, key id k2, and a word on --seal-keys", got)
	}
	if _, shown := f["status"]; shown {
		t.Errorf("a sealed record without the ring shows a status:\n%s", out)
	}
	canary("inspect without the ring", out)
	code, out, _ = inspectExec(t, append(base, "--json")...)
	var got inspectRecord
	if err := json.Unmarshal([]byte(out), &got); code != 0 || err != nil {
		t.Fatalf("inspect --json: exit %d, %v\n%s", code, err, out)
	}
	if !got.Sealed || got.KeyID != "k2" || got.Opened || got.Response != nil || got.State != "completed" || got.Token != rec.Token {
		t.Errorf("inspect --json without the ring: got %s; want sealed, key_id k2, no response", out)
	}
	if !strings.Contains(out, `"sealed": true`) || !strings.Contains(out, `"key_id": "k2"`) {
		t.Errorf("inspect --json: %s; want \"sealed\": true and \"key_id\": \"k2\"", out)
	}
	canary("inspect --json without the ring", out)

	// With the ring, from the flag or the environment: opened.
	for _, env := range []bool{false, true} {
		args := append(slices.Clone(base), "--seal-keys", ringFile)
		if env {
			t.Setenv("IDEM_SEAL_KEYS", ringFile)
			args = base
		}
		code, out, errOut = inspectExec(t, args...)
		if code != 0 {
			t.Fatalf("inspect with the ring (env %v): exit %d; stderr: %s", env, code, errOut)
		}
		f = inspectFields(t, out)
		if got := inspectField(t, f, "status"); got != "201 Created" {
			t.Errorf("with the ring: status %q, want 201 Created", got)
		}
		if got := inspectField(t, f, "body"); got != `{"card":"4111 1111 1111 1111"} (30 bytes)` {
			t.Errorf("with the ring: body %q", got)
		}
		if got := strings.Join(f["header"], "|"); !strings.Contains(got, "X-Session-Token: tok-canary") {
			t.Errorf("with the ring: headers %q, want X-Session-Token", got)
		}
		if got := inspectField(t, f, "sealed"); got != "yes, key id k2 (opened with --seal-keys)" {
			t.Errorf("with the ring: sealed %q", got)
		}
		code, out, _ = inspectExec(t, append(args, "--json")...)
		got = inspectRecord{}
		if err := json.Unmarshal([]byte(out), &got); code != 0 || err != nil || !got.Sealed || got.KeyID != "k2" || !got.Opened ||
			got.Response == nil || got.Response.Status != 201 || string(got.Response.Body) != `{"card":"4111 1111 1111 1111"}` {
			t.Errorf("inspect --json with the ring: exit %d, %v, %s", code, err, out)
		}
	}
	t.Setenv("IDEM_SEAL_KEYS", "")
	os.Unsetenv("IDEM_SEAL_KEYS")

	// A ring without its key: says so, names the key id, exit 1.
	code, out, errOut = inspectExec(t, append(slices.Clone(base), "--seal-keys", otherRing)...)
	if code != 1 || !strings.Contains(errOut, "key id k2") || !strings.Contains(errOut, "does not open with --seal-keys "+otherRing) ||
		strings.Count(strings.TrimSuffix(errOut, "\n"), "\n") != 0 {
		t.Errorf("inspect with another ring: exit %d, stderr %q; want 1 and one line naming key id k2 and the ring", code, errOut)
	}
	if got := inspectField(t, inspectFields(t, out), "sealed"); !strings.Contains(got, "key id k2: does NOT open") {
		t.Errorf("inspect with another ring: sealed %q", got)
	}
	canary("inspect with another ring", out+errOut)
	code, out, _ = inspectExec(t, append(slices.Clone(base), "--seal-keys", otherRing, "--json")...)
	got = inspectRecord{}
	if err := json.Unmarshal([]byte(out), &got); code != 1 || err != nil || !got.Sealed || got.KeyID != "k2" || got.Opened ||
		!strings.Contains(got.OpenError, "key id k2") || got.Response != nil {
		t.Errorf("inspect --json with another ring: exit %d, %v, %s", code, err, out)
	}

	// A bad ring: exit 2, one line naming the flag and the file.
	code, _, errOut = inspectExec(t, append(slices.Clone(base), "--seal-keys", filepath.Join(dir, "missing"))...)
	if code != 2 || !strings.HasPrefix(errOut, "idem inspect: --seal-keys: open "+filepath.Join(dir, "missing")) {
		t.Errorf("inspect with a missing ring: exit %d, stderr %q; want 2 naming --seal-keys and the file", code, errOut)
	}

	// purge deletes it, and says a blob of it stays for idem gc.
	code, out, errOut = inspectExec(t, "purge", "--yes", "--store", storeURL, "--prefix", prefix, "--stored-key", key.String())
	if code != 0 || !strings.HasPrefix(out, "purged "+key.String()+" (was completed") || !strings.Contains(out, "its response was sealed") {
		t.Errorf("purge of a sealed record: exit %d, %q (stderr %q)", code, out, errOut)
	}
	if _, ok := inspectGet(t, store, key); ok {
		t.Error("purge --yes left the sealed record")
	}
}
