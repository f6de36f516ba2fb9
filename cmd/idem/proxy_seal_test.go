package main

// Sealed records tested from the outside (issue 34): a canary (a card
// number in the body, a token in the X-Session-Token header of the
// upstream's answer) sent with curl and Python requests through the built
// proxy, then looked for in what an operator with read access to the
// store sees: every Redis key's value, pg_dump, mysqldump, the S3
// server's files on disk, the file:// blob directory. Absent with
// --seal-keys, present without (the control). A sealed value altered by
// one byte, or copied under another key, is never replayed nor run again.

import (
	"bytes"
	"context"
	"encoding/hex"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/kmstest"
	"github.com/idemkit/idem/internal/mysqltest"
	"github.com/idemkit/idem/internal/proctest"
	"github.com/idemkit/idem/internal/s3test"
)

const sealCard = "4111 1111 1111 1111"

// canaryUpstream answers each request with its body (the card) followed
// by ?pad= bytes of filler, and the request's X-Session-Token in its own
// X-Session-Token; it counts its runs per Idempotency-Key.
type canaryUpstream struct {
	*httptest.Server
	mu   sync.Mutex
	runs map[string]int
}

func newCanaryUpstream(t *testing.T) *canaryUpstream {
	u := &canaryUpstream{runs: map[string]int{}}
	u.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		u.mu.Lock()
		u.runs[r.Header.Get(idemhttp.HeaderKey)]++
		u.mu.Unlock()
		pad, _ := strconv.Atoi(r.URL.Query().Get("pad"))
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("X-Session-Token", r.Header.Get("X-Session-Token"))
		w.WriteHeader(http.StatusCreated)
		w.Write(body)
		w.Write(bytes.Repeat([]byte{' '}, pad))
	}))
	t.Cleanup(u.Close)
	return u
}

func (u *canaryUpstream) runsOf(key string) int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.runs[key]
}

// paymentsKey is the record key of a POST /payments with clientKey (no
// tenant), and paymentsRedisKey its name in Redis under the default prefix.
func paymentsKey(t *testing.T, clientKey string) idem.Key {
	t.Helper()
	k, err := idem.Scope{Method: "POST", Route: "/payments"}.Key(clientKey)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func paymentsRedisKey(t *testing.T, clientKey string) string {
	return "idem:{" + paymentsKey(t, clientKey).String() + "}"
}

// sealRingFile writes a ring of the given lines and returns its path.
func sealRingFile(t *testing.T, lines ...string) string {
	path := filepath.Join(t.TempDir(), "ring")
	if err := os.WriteFile(path, []byte(strings.Join(lines, "\n")+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// canaryAnswer is what a client got: status, the replay header, the token
// header and the body.
type canaryAnswer struct {
	status   int
	replayed bool
	token    string
	body     string
}

// curlCanary POSTs body with key and token through curl.
func curlCanary(t *testing.T, url, key, token, body string) canaryAnswer {
	t.Helper()
	r := runCurl(t, "-H", "Content-Type: application/json", "-H", "Idempotency-Key: "+key,
		"-H", "X-Session-Token: "+token, "--data-binary", body, url)
	if r.code != 0 {
		t.Fatalf("curl: exit %d", r.code)
	}
	return canaryAnswer{r.status, r.header.Get(idemhttp.HeaderReplayed) == "true", r.header.Get("X-Session-Token"), string(r.body)}
}

// pythonCanary POSTs body with key and token through Debian's python3
// and requests.
const pythonCanaryScript = `import sys, requests
r = requests.post(sys.argv[1], data=sys.argv[4].encode(), timeout=20,
    headers={"Content-Type": "application/json", "Idempotency-Key": sys.argv[2], "X-Session-Token": sys.argv[3]})
sys.stdout.write("%d\n%s\n%s\n" % (r.status_code, r.headers.get("Idempotent-Replayed", ""), r.headers.get("X-Session-Token", "")))
sys.stdout.write(r.text)
`

func pythonCanary(t *testing.T, url, key, token, body string) canaryAnswer {
	t.Helper()
	if err := exec.Command("/usr/bin/python3", "-c", "import requests").Run(); err != nil {
		t.Fatalf("got /usr/bin/python3 failing to import requests (%v), want Debian's python3-requests installed", err)
	}
	out, err := exec.Command("/usr/bin/python3", "-c", pythonCanaryScript, url, key, token, body).Output()
	if err != nil {
		t.Fatalf("python3 requests: %v", err)
	}
	f := strings.SplitN(string(out), "\n", 4)
	if len(f) != 4 {
		t.Fatalf("python3 requests: output %q", out)
	}
	status, _ := strconv.Atoi(f[0])
	return canaryAnswer{status, f[1] == "true", f[2], f[3]}
}

// redisValues returns every key's value in the Redis at addr.
func redisValues(t *testing.T, addr string) []byte {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: addr})
	defer c.Close()
	ctx := context.Background()
	var all bytes.Buffer
	iter := c.Scan(ctx, 0, "*", 100).Iterator()
	for iter.Next(ctx) {
		k := iter.Val()
		typ, err := c.Type(ctx, k).Result()
		if err != nil {
			t.Fatal(err)
		}
		switch typ {
		case "string":
			v, err := c.Get(ctx, k).Bytes()
			if err != nil && err != redis.Nil {
				t.Fatal(err)
			}
			all.Write(v)
		case "hash":
			m, err := c.HGetAll(ctx, k).Result()
			if err != nil {
				t.Fatal(err)
			}
			for f, v := range m {
				all.WriteString(f + v)
			}
		default:
			t.Fatalf("redis key %s of type %s: want strings and hashes only", k, typ)
		}
		all.WriteByte('\n')
	}
	if err := iter.Err(); err != nil {
		t.Fatal(err)
	}
	return all.Bytes()
}

// filesUnder returns the contents of every file under dir.
func filesUnder(t *testing.T, dir string) []byte {
	t.Helper()
	var all bytes.Buffer
	err := filepath.WalkDir(dir, func(path string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := os.ReadFile(path)
		all.Write(b)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return all.Bytes()
}

// holdsCanary reports whether dump holds s, as it is or in hex (pg_dump
// writes bytea in hex, mysqldump --hex-blob blobs).
func holdsCanary(dump []byte, s string) bool {
	return bytes.Contains(dump, []byte(s)) || bytes.Contains(bytes.ToLower(dump), []byte(hex.EncodeToString([]byte(s))))
}

func runDump(t *testing.T, name string, args ...string) []byte {
	t.Helper()
	out, err := exec.Command(proctest.RequireTool(t, name), args...).Output()
	if err != nil {
		var stderr []byte
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = ee.Stderr
		}
		t.Fatalf("%s: %v\n%s", name, err, stderr)
	}
	return out
}

// TestProxySealCanary: per store, with sealing on and off, the canary of
// a curl and a Python client replays to both, and is in what the store
// holds only with sealing off.
func TestProxySealCanary(t *testing.T) {
	ring := sealRingFile(t, sealRingLine("k1", 1))
	type store struct {
		args []string                // --store and --blob
		dump func(*testing.T) []byte // what an operator reads
		pad  int                     // filler after the canary
		blob func(*testing.T) []byte // the blob store's files alone
	}
	stores := map[string]func(t *testing.T) store{
		"redis": func(t *testing.T) store {
			r := proxyRedis(t)
			return store{[]string{"--store", "redis://" + r.Addr()}, func(t *testing.T) []byte { return redisValues(t, r.Addr()) }, 0, nil}
		},
		"postgres": func(t *testing.T) store {
			u := pgURL(t)
			return store{[]string{"--store", u}, func(t *testing.T) []byte { return runDump(t, "pg_dump", "--data-only", u) }, 0, nil}
		},
		"mysql": func(t *testing.T) store {
			ms, err := mysqltest.Start()
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(ms.Stop)
			db, err := ms.CreateDatabase()
			if err != nil {
				t.Fatal(err)
			}
			host, port, _ := strings.Cut(ms.Addr(), ":")
			return store{[]string{"--store", ms.URL(db)}, func(t *testing.T) []byte {
				return runDump(t, "mysqldump", "-h", host, "-P", port, "-u", "root", "--protocol=tcp", "--hex-blob", "--skip-comments", db)
			}, 0, nil}
		},
		"s3-blob": func(t *testing.T) store {
			r := proxyRedis(t)
			srv, err := s3test.Start()
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(srv.Stop)
			bucket, err := srv.Bucket()
			if err != nil {
				t.Fatal(err)
			}
			return store{[]string{"--store", "redis://" + r.Addr(), "--blob", srv.URL(bucket), "--max-response", "1KiB"},
				func(t *testing.T) []byte { return append(filesUnder(t, srv.Dir()), redisValues(t, r.Addr())...) }, 64 * kib,
				func(t *testing.T) []byte { return filesUnder(t, srv.Dir()) }}
		},
		"file-blob": func(t *testing.T) store {
			r := proxyRedis(t)
			dir := filepath.Join(t.TempDir(), "blobs")
			return store{[]string{"--store", "redis://" + r.Addr(), "--blob", "file://" + dir, "--max-response", "1KiB"},
				func(t *testing.T) []byte { return append(filesUnder(t, dir), redisValues(t, r.Addr())...) }, 64 * kib,
				func(t *testing.T) []byte { return filesUnder(t, dir) }}
		},
	}
	for _, name := range []string{"redis", "postgres", "mysql", "s3-blob", "file-blob"} {
		t.Run(name, func(t *testing.T) {
			for _, sealed := range []bool{true, false} {
				st := stores[name](t)
				up := newCanaryUpstream(t)
				args := append([]string{"--upstream", up.URL}, st.args...)
				if sealed {
					args = append(args, "--seal-keys", ring)
				}
				p := startProxy(t, nil, args...)
				url := p.url("/payments?pad=" + strconv.Itoa(st.pad))
				for _, c := range []struct {
					client string
					send   func(t *testing.T, url, key, token, body string) canaryAnswer
				}{{"curl", curlCanary}, {"python", pythonCanary}} {
					key := name + "-" + c.client + "-" + strconv.FormatBool(sealed)
					token := "tok-for-" + key
					body := `{"card":"` + sealCard + `","cvv":"123"}`
					for i := range 2 {
						a := c.send(t, url, key, token, body)
						if a.status != 201 || a.replayed != (i == 1) || a.token != token || !strings.Contains(a.body, sealCard) {
							t.Fatalf("sealed %t, %s request %d: got %d replayed %t token %q body %.80q; want 201, replayed %t, the token and the card",
								sealed, c.client, i, a.status, a.replayed, a.token, a.body, i == 1)
						}
					}
					if n := up.runsOf(key); n != 1 {
						t.Fatalf("sealed %t, %s: upstream ran %d times, want 1", sealed, c.client, n)
					}
					dump := st.dump(t)
					if len(dump) == 0 {
						t.Fatalf("sealed %t: the store's dump is empty", sealed)
					}
					if st.blob != nil && holdsCanary(st.blob(t), sealCard) == sealed {
						t.Errorf("sealed %t, %s: the blob files hold the card: %t, want %t (the body offloaded there)", sealed, c.client, !sealed, !sealed)
					}
					for _, canary := range []string{sealCard, token} {
						if got := holdsCanary(dump, canary); got == sealed {
							t.Errorf("sealed %t, %s: the store holds %q: %t, want %t", sealed, c.client, canary, got, !sealed)
						}
					}
				}
			}
		})
	}
}

// TestProxySealTamperedAndMoved: on Redis, a sealed value with one
// ciphertext byte flipped, and a sealed value copied under another key,
// are answered 500 response-unreadable (never a replay) and the upstream
// is not called again.
func TestProxySealTamperedAndMoved(t *testing.T) {
	r := proxyRedis(t)
	up := newCanaryUpstream(t)
	p := startProxy(t, nil, "--upstream", up.URL, "--store", "redis://"+r.Addr(), "--seal-keys", sealRingFile(t, sealRingLine("k1", 1)))
	c := redis.NewClient(&redis.Options{Addr: r.Addr()})
	defer c.Close()
	ctx := context.Background()
	body := `{"card":"` + sealCard + `"}`
	for _, k := range []string{"tampered", "source", "target"} {
		wantStatus(t, k, mustSend(t, "POST", p.url("/payments"), k, body, "X-Session-Token: tok"), 201, "")
	}
	// One byte of the GCM tag (the value's last) flipped.
	v, err := c.Get(ctx, paymentsRedisKey(t, "tampered")).Bytes()
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Contains(v, []byte("\xffSL\x01")) {
		t.Fatalf("the record in Redis holds no sealed envelope: %q", v)
	}
	v[len(v)-1] ^= 1
	if err := c.Set(ctx, paymentsRedisKey(t, "tampered"), v, redis.KeepTTL).Err(); err != nil {
		t.Fatal(err)
	}
	// source's value (same body, so same fingerprint) copied over target's.
	src, err := c.Get(ctx, paymentsRedisKey(t, "source")).Bytes()
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Set(ctx, paymentsRedisKey(t, "target"), src, redis.KeepTTL).Err(); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"tampered", "target"} {
		for range 2 {
			a := mustSend(t, "POST", p.url("/payments"), k, body, "X-Session-Token: tok")
			wantStatus(t, k, a, http.StatusInternalServerError, idemhttp.ProblemResponseUnreadable)
			if bytes.Contains(a.body, []byte(sealCard)) {
				t.Fatalf("%s: the answer holds the card: %s", k, a.body)
			}
		}
		if n := up.runsOf(k); n != 1 {
			t.Errorf("%s: upstream ran %d times, want 1 (never again)", k, n)
		}
	}
	if a := mustSend(t, "POST", p.url("/payments"), "source", body); !a.replayed() || !bytes.Contains(a.body, []byte(sealCard)) {
		t.Errorf("source after its copy: got %d replayed %t %s, want its replay", a.status, a.replayed(), a.body)
	}
	if got := p.metric(`idem_requests_total{outcome="unsealable"}`); got != 4 {
		t.Errorf(`idem_requests_total{outcome="unsealable"}: got %v, want 4`, got)
	}
}

// TestProxySealRotationUnderLoad: clients keep sending new keys while key
// 2 is added to the ring as its primary and the proxy reloaded (SIGHUP):
// no request fails, every record, under key 1 or key 2, replays byte for
// byte without running again, and idem inspect names key k1 for a record
// stored before the rotation and k2 for one stored after it.
func TestProxySealRotationUnderLoad(t *testing.T) {
	r := proxyRedis(t)
	storeURL := "redis://" + r.Addr()
	up := newCanaryUpstream(t)
	ring := sealRingFile(t, sealRingLine("k1", 1))
	p := startProxy(t, nil, "--upstream", up.URL, "--store", storeURL, "--seal-keys", ring)
	type stored struct{ key, body string }
	var (
		mu     sync.Mutex
		all    []stored
		failed []string
		stop   = make(chan struct{})
		wg     sync.WaitGroup
		n      atomic.Int64
	)
	for w := range 4 {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				key := "rot-" + strconv.Itoa(w) + "-" + strconv.Itoa(i)
				a, err := send("POST", p.url("/payments"), key, `{"card":"`+sealCard+`"}`, "X-Session-Token: tok-"+key)
				mu.Lock()
				if err != nil || a.status != 201 || a.replayed() {
					failed = append(failed, key+": "+strconv.Itoa(a.status)+" "+string(a.body)+" "+errString(err))
				} else {
					all = append(all, stored{key, string(a.body)})
				}
				mu.Unlock()
				n.Add(1)
			}
		})
	}
	waitCount := func(min int64) {
		for deadline := time.Now().Add(10 * time.Second); n.Load() < min; time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("only %d requests within 10s", n.Load())
			}
		}
	}
	waitCount(50)
	mu.Lock()
	before := all[0].key
	mu.Unlock()
	if err := os.WriteFile(ring, []byte(sealRingLine("k2", 2)+"\n"+sealRingLine("k1", 1)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	p.hangup(t, `"msg":"reloaded","what":"seal keys"`, 1)
	atReload := n.Load()
	waitCount(atReload + 50)
	close(stop)
	wg.Wait()
	if len(failed) > 0 {
		t.Fatalf("%d of %d requests failed across the rotation, e.g. %s", len(failed), n.Load(), failed[0])
	}
	after := all[len(all)-1].key
	for _, s := range all {
		a := mustSend(t, "POST", p.url("/payments"), s.key, `{"card":"`+sealCard+`"}`)
		if a.status != 201 || !a.replayed() || string(a.body) != s.body {
			t.Fatalf("%s after the rotation: got %d replayed %t %s, want the replay of %s", s.key, a.status, a.replayed(), a.body, s.body)
		}
		if runs := up.runsOf(s.key); runs != 1 {
			t.Fatalf("%s: upstream ran %d times, want 1", s.key, runs)
		}
	}
	for key, want := range map[string]string{before: "k1", after: "k2"} {
		k := paymentsKey(t, key)
		code, out := runIdemOut(t, "inspect", "--store", storeURL, "--stored-key", k.String(), "--json")
		if code != 0 || !strings.Contains(out, `"sealed": true`) || !strings.Contains(out, `"key_id": "`+want+`"`) || strings.Contains(out, sealCard) {
			t.Errorf("inspect %s: exit %d, %s; want sealed, key_id %s, no card", key, code, out, want)
		}
	}
	t.Logf("%d requests, %d after the reload, all replayed", len(all), n.Load()-atReload)
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// TestProxySealKMS: --seal-kms against a private local-kms. A record
// sealed by a ring still replays through a proxy that seals with KMS and
// keeps the ring (--seal-kms with --seal-keys: the move from a ring to
// KMS); what that proxy stores is a KMS envelope without the card; a proxy
// with KMS alone replays it, and answers response-unreadable for the
// ring's record; a key that is not in KMS stops the proxy at start with
// one line.
func TestProxySealKMS(t *testing.T) {
	k := kmstest.Start(t)
	var env []string
	for name, v := range k.Env() {
		env = append(env, name+"="+v)
	}
	r := proxyRedis(t)
	up := newCanaryUpstream(t)
	c := redis.NewClient(&redis.Options{Addr: r.Addr()})
	defer c.Close()
	ctx := context.Background()
	body := `{"card":"` + sealCard + `"}`
	ring := sealRingFile(t, sealRingLine("k1", 1))
	store := []string{"--upstream", up.URL, "--store", "redis://" + r.Addr()}

	byRing := startProxy(t, env, append(store, "--seal-keys", ring)...)
	wantStatus(t, "by ring", mustSend(t, "POST", byRing.url("/payments"), "by-ring", body), 201, "")

	both := startProxy(t, env, append(store, "--seal-kms", k.KeyARN(), "--seal-keys", ring)...)
	if a := mustSend(t, "POST", both.url("/payments"), "by-ring", body); !a.replayed() || !bytes.Contains(a.body, []byte(sealCard)) {
		t.Errorf("KMS and ring: the ring's record: got %d replayed %t %s, want its replay", a.status, a.replayed(), a.body)
	}
	wantStatus(t, "by kms", mustSend(t, "POST", both.url("/payments"), "by-kms", body), 201, "")
	v, err := c.Get(ctx, paymentsRedisKey(t, "by-kms")).Bytes()
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Contains(v, []byte("\xffSK\x01")) || bytes.Contains(v, []byte(sealCard)) || bytes.Contains(v, []byte("4111")) {
		t.Errorf("the record stored with --seal-kms is not a KMS envelope without the card: %q", v)
	}

	kmsOnly := startProxy(t, env, append(store, "--seal-kms", k.KeyARN())...)
	if a := mustSend(t, "POST", kmsOnly.url("/payments"), "by-kms", body); !a.replayed() || !bytes.Contains(a.body, []byte(sealCard)) {
		t.Errorf("KMS alone: the KMS record: got %d replayed %t %s, want its replay", a.status, a.replayed(), a.body)
	}
	wantStatus(t, "KMS alone, the ring's record", mustSend(t, "POST", kmsOnly.url("/payments"), "by-ring", body),
		http.StatusInternalServerError, idemhttp.ProblemResponseUnreadable)
	for _, key := range []string{"by-ring", "by-kms"} {
		if n := up.runsOf(key); n != 1 {
			t.Errorf("%s: upstream ran %d times, want 1", key, n)
		}
	}

	// inspect without KMS nor the ring names the KMS record's data key.
	kk := paymentsKey(t, "by-kms")
	code, out := runIdemOut(t, "inspect", "--store", "redis://"+r.Addr(), "--stored-key", kk.String(), "--json")
	if code != 0 || !strings.Contains(out, `"sealed": true`) || !strings.Contains(out, `"key_id": "kms:`) || strings.Contains(out, sealCard) {
		t.Errorf("inspect by-kms: exit %d, %s; want sealed, key_id kms:…, no card", code, out)
	}

	missing := kmstest.ARN("00000000-0000-0000-0000-000000000000")
	code, stderr := runIdem(t, env, append([]string{"proxy", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"}, append(store, "--seal-kms", missing)...)...)
	if code != 2 || !strings.Contains(stderr, "--seal-kms "+missing) || strings.Count(strings.TrimSpace(stderr), "\n") != 0 {
		t.Errorf("a KMS key that does not exist: exit %d, want 2 and one line naming --seal-kms and the key:\n%s", code, stderr)
	}
}

// TestProxyReplayHeaderLists: --replay-headers-deny keeps a header out of
// the store (not in any value in Redis, not in the replay) and
// --replay-headers-allow keeps only what it names (and Content-Type);
// without either (the control) the header is stored and replayed. Sent by
// curl and Python's requests, the first send and its retry.
func TestProxyReplayHeaderLists(t *testing.T) {
	const token = "tok-header-list-canary"
	body := `{"card":"` + sealCard + `"}`
	for _, c := range []struct {
		name   string
		args   []string
		stored bool
	}{
		{"none", nil, true},
		{"deny", []string{"--replay-headers-deny", "X-Session-Token"}, false},
		{"allow", []string{"--replay-headers-allow", "X-Request-Id"}, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			r := proxyRedis(t)
			up := newCanaryUpstream(t)
			p := startProxy(t, nil, append([]string{"--upstream", up.URL, "--store", "redis://" + r.Addr()}, c.args...)...)
			for client, send := range map[string]func(*testing.T, string, string, string, string) canaryAnswer{"curl": curlCanary, "python": pythonCanary} {
				key := c.name + "-" + client
				first, again := send(t, p.url("/payments"), key, token, body), send(t, p.url("/payments"), key, token, body)
				if first.status != 201 || first.token != token || again.status != 201 || !again.replayed || again.body != body {
					t.Fatalf("%s: first %+v, again %+v: want 201 with the token, then its replay", client, first, again)
				}
				if got := again.token == token; got != c.stored {
					t.Errorf("%s: the replay carries the token: %t, want %t", client, got, c.stored)
				}
				if n := up.runsOf(key); n != 1 {
					t.Errorf("%s: upstream ran %d times, want 1", client, n)
				}
			}
			if got := holdsCanary(redisValues(t, r.Addr()), token); got != c.stored {
				t.Errorf("the token in Redis's values: %t, want %t", got, c.stored)
			}
		})
	}
}
