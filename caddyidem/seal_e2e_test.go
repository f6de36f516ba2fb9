package caddyidem

import (
	"bytes"
	"context"
	"encoding/base64"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"

	"github.com/idemkit/idem/idemhttp"
)

// sealRingLine is a key ring line "id BASE64" of a 32-byte key filled
// with c.
func sealRingLine(id string, c byte) string {
	return id + " " + base64.StdEncoding.EncodeToString(bytes.Repeat([]byte{c}, 32))
}

// redisValues are the values of every Redis key under prefix, joined.
func redisValues(t *testing.T, prefix string) ([]byte, int) {
	t.Helper()
	ctx := context.Background()
	c := redis.NewClient(&redis.Options{Addr: rdb.Addr()})
	defer c.Close()
	keys, err := c.Keys(ctx, prefix+"*").Result()
	if err != nil {
		t.Fatal(err)
	}
	var all []byte
	for _, k := range keys {
		v, err := c.Get(ctx, k).Bytes()
		if err != nil {
			t.Fatalf("GET %s: %v", k, err)
		}
		all = append(append(all, v...), '\n')
	}
	return all, len(keys)
}

// canaryUpstream answers 201 with a card number in the body and a session
// token in a header, counting its runs per key.
func canaryUpstream(t *testing.T, token string) *counter {
	c := startCounter(t, 0)
	c.srv.Config.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get(idemhttp.HeaderKey)
		c.mu.Lock()
		c.runs[key]++
		c.mu.Unlock()
		w.Header().Set("X-Session-Token", token)
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"card":"4111 1111 1111 1111","run":%d}`, c.seq.Add(1))
	})
	return c
}

// TestSealedRecords: through a real Caddy on Redis, with seal_keys the
// stored records hold neither the card number of the body nor the token
// of a header; without it (the control) they hold both. A rotation (key 2
// added as the first line, then a config reload) still replays what key 1
// sealed; the records after it are sealed under key 2 (with key 1 dropped
// they replay, and key 1's is neither replayed nor run again).
func TestSealedRecords(t *testing.T) {
	token := "tok-canary-" + runID
	up := canaryUpstream(t, token)
	ring := filepath.Join(t.TempDir(), "ring")
	writeRingFile(t, ring, sealRingLine("k1", 1))
	site := func(prefix, extra string) string {
		return fmt.Sprintf("\tidempotency {\n\t\tstore redis://%s\n\t\tprefix %s\n%s\t}\n\treverse_proxy %s",
			rdb.Addr(), prefix, extra, strings.TrimPrefix(up.srv.URL, "http://"))
	}
	hasCanary := func(b []byte) bool {
		return bytes.Contains(b, []byte("4111 1111")) || bytes.Contains(b, []byte(token))
	}

	// The control: in clear, the record holds the canary.
	clearPrefix := "caddyseal-clear:" + runID + ":"
	base := startCaddy(t, site(clearPrefix, ""))
	if a := post(t, base+"/pay", "clear-"+runID, "{}"); a.status != 201 {
		t.Fatalf("in clear: got %d %q", a.status, a.body)
	}
	if vals, n := redisValues(t, clearPrefix); n == 0 || !hasCanary(vals) {
		t.Fatalf("in clear: %d records, canary in them %v; want the control to show it", n, hasCanary(vals))
	}

	// Sealed: not a byte of it.
	prefix := "caddyseal:" + runID + ":"
	sealed := "\t\tseal_keys " + ring + "\n"
	base = startCaddy(t, site(prefix, sealed))
	keyA, keyB := "sealed-a-"+runID, "sealed-b-"+runID
	first := post(t, base+"/pay", keyA, "{}")
	if first.status != 201 || !strings.Contains(first.body, "4111") {
		t.Fatalf("sealed, first: got %d %q", first.status, first.body)
	}
	if vals, n := redisValues(t, prefix); n == 0 || hasCanary(vals) {
		t.Errorf("with seal_keys: %d records, canary in them %v; want records without it", n, hasCanary(vals))
	}
	if a := post(t, base+"/pay", keyA, "{}"); a.replayed != "true" || a.body != first.body {
		t.Errorf("sealed, repeat: got %d (replayed %q) %q, want the replay of %q", a.status, a.replayed, a.body, first.body)
	}

	// Rotation: key 2 first, then a reload.
	writeRingFile(t, ring, sealRingLine("k2", 2), sealRingLine("k1", 1))
	base = startCaddy(t, site(prefix, sealed+"\t\tmethods POST\n")) // another config: a reload
	if a := post(t, base+"/pay", keyA, "{}"); a.replayed != "true" || a.body != first.body {
		t.Errorf("key 1's record after the rotation: got %d (replayed %q) %q, want the replay of %q", a.status, a.replayed, a.body, first.body)
	}
	second := post(t, base+"/pay", keyB, "{}")
	if second.status != 201 || second.replayed != "" {
		t.Fatalf("after the rotation, a new key: got %d (replayed %q)", second.status, second.replayed)
	}
	writeRingFile(t, ring, sealRingLine("k2", 2))
	base = startCaddy(t, site(prefix, sealed))
	if a := post(t, base+"/pay", keyB, "{}"); a.replayed != "true" || a.body != second.body {
		t.Errorf("key 2's record with key 1 dropped: got %d (replayed %q) %q, want the replay of %q", a.status, a.replayed, a.body, second.body)
	}
	// The answer of work that ran and whose result cannot be read (it says
	// Idempotent-Replayed: true, and replays nothing of the record).
	if a := post(t, base+"/pay", keyA, "{}"); a.status != http.StatusInternalServerError || !strings.Contains(a.body, idemhttp.ProblemResponseUnreadable) || strings.Contains(a.body, first.body) {
		t.Errorf("key 1's record with key 1 dropped: got %d (replayed %q) %q, want 500 %s, not the replay", a.status, a.replayed, a.body, idemhttp.ProblemResponseUnreadable)
	}
	for _, k := range []string{keyA, keyB} {
		if n := up.count(k); n != 1 {
			t.Errorf("upstream ran %s %d times, want 1", k, n)
		}
	}
	if vals, _ := redisValues(t, prefix); hasCanary(vals) {
		t.Error("with seal_keys, after the rotation: a record holds the canary")
	}
}

func writeRingFile(t *testing.T, path string, lines ...string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(strings.Join(lines, "\n")+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
}

// TestSealKeysBadRing: a ring that does not load fails the config load
// (at start or on a reload, when the running config is kept) with an
// error naming seal_keys and the file, never a key.
func TestSealKeysBadRing(t *testing.T) {
	dir := t.TempDir()
	short := "k1 " + base64.StdEncoding.EncodeToString(make([]byte, 16))
	for _, tc := range []struct {
		name, text, want string
	}{
		{"missing", "", "no such file or directory"},
		{"short", short, "line 1: key k1 has 16 bytes; want 32 (AES-256)"},
		{"dup", sealRingLine("k1", 1) + "\n" + sealRingLine("k1", 2), "line 2: key id k1 is already on line 1"},
		{"empty", "# none\n", "holds no key, so no primary"},
	} {
		path := filepath.Join(dir, tc.name)
		if tc.name != "missing" {
			writeRingFile(t, path, tc.text)
		}
		cf := fmt.Sprintf("{\n\tadmin off\n\tstorage file_system %s\n\tpersist_config off\n\tauto_https off\n}\nhttp://127.0.0.1:0 {\n\tidempotency {\n\t\tseal_keys %s\n\t}\n\trespond ok\n}\n", storageDir, path)
		cfg, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(cf), nil)
		if err != nil {
			t.Fatalf("%s: adapting: %v", tc.name, err) // the file is read when provisioned, not adapted
		}
		err = caddy.Load(cfg, true)
		if err == nil {
			caddy.Stop()
			t.Errorf("%s: the config loaded; want the ring refused", tc.name)
			continue
		}
		if msg := err.Error(); !strings.Contains(msg, "seal_keys: ") || !strings.Contains(msg, path) || !strings.Contains(msg, tc.want) ||
			strings.Contains(msg, short[3:]) {
			t.Errorf("%s: got %q; want seal_keys, %s and %q, and no key", tc.name, msg, path, tc.want)
		}
	}
}

// TestReplayHeaderListsE2E: through a real Caddy on Redis,
// replay_headers_deny keeps the upstream's X-Session-Token out of the
// stored record, and so does a replay_headers_allow that does not name
// it, while the body is stored and replayed (TestSealedRecords's clear
// control shows the token stored without either).
func TestReplayHeaderListsE2E(t *testing.T) {
	token := "tok-list-canary-" + runID
	up := canaryUpstream(t, token)
	for _, c := range []struct{ name, line string }{
		{"deny", "\t\treplay_headers_deny X-Session-Token\n"},
		{"allow", "\t\treplay_headers_allow X-Request-Id\n"},
	} {
		t.Run(c.name, func(t *testing.T) {
			prefix := "caddylist-" + c.name + ":" + runID + ":"
			base := startCaddy(t, fmt.Sprintf("\tidempotency {\n\t\tstore redis://%s\n\t\tprefix %s\n%s\t}\n\treverse_proxy %s",
				rdb.Addr(), prefix, c.line, strings.TrimPrefix(up.srv.URL, "http://")))
			key := c.name + "-" + runID
			first := post(t, base+"/pay", key, "{}")
			again := post(t, base+"/pay", key, "{}")
			if first.status != 201 || again.replayed != "true" || again.body != first.body {
				t.Fatalf("got %d, then %d (replayed %q) %q; want 201 and its replay", first.status, again.status, again.replayed, again.body)
			}
			vals, n := redisValues(t, prefix)
			if n == 0 || !bytes.Contains(vals, []byte("4111 1111")) || bytes.Contains(vals, []byte(token)) {
				t.Errorf("%d records, body stored %v, token stored %v; want the body without the token",
					n, bytes.Contains(vals, []byte("4111 1111")), bytes.Contains(vals, []byte(token)))
			}
			if n := up.count(key); n != 1 {
				t.Errorf("upstream ran %d times, want 1", n)
			}
		})
	}
}
