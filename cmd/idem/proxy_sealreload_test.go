package main

// SIGHUP re-reads --seal-keys, from outside: the built binary, its ring
// file rewritten and the signal sent, and its answers and log lines read.

import (
	"bytes"
	"encoding/base64"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/idemkit/idem/idemhttp"
)

// sealRingLine is a key ring line "id BASE64" of a 32-byte key filled
// with c.
func sealRingLine(id string, c byte) string {
	return id + " " + base64.StdEncoding.EncodeToString(bytes.Repeat([]byte{c}, 32))
}

// TestProxyReloadSealKeys: the start-up line names the ring (its file,
// key count and primary), never a key; a rotation (key 2 added as the
// first line, SIGHUP) keeps replaying what key 1 sealed, and the records
// stored after it are sealed under key 2: once key 1 is dropped, they
// still replay, and key 1's record is neither replayed nor run again. A
// ring that does not load is refused with one ERROR line naming the file,
// and the running ring kept.
func TestProxyReloadSealKeys(t *testing.T) {
	t.Parallel()
	up := newTestUpstream(t)
	ring := filepath.Join(t.TempDir(), "seal-keys")
	writeFile(t, ring, sealRingLine("k1", 1)+"\n")
	p := startProxy(t, nil, "--upstream", up.URL, "--seal-keys", ring)
	if log := p.logText(); !strings.Contains(log, `"seal":"1 seal key(s) from file `+ring+`, primary k1"`) {
		t.Errorf("start-up log does not name the ring (1 key from %s, primary k1):\n%s", ring, log)
	}

	first := mustSend(t, "POST", p.url("/pay/1"), "sealed-1", `{"n":1}`)
	wantStatus(t, "under key 1", first, http.StatusCreated, "")

	writeFile(t, ring, sealRingLine("k2", 2)+"\n"+sealRingLine("k1", 1)+"\n")
	p.hangup(t, `"msg":"reloaded","what":"seal keys"`, 1)
	if log := p.logText(); !strings.Contains(log, `"msg":"seal keys loaded","seal":"2 seal key(s) from file `+ring+`, primary k2"`) {
		t.Errorf("after the rotation: no log line naming the new ring (2 keys, primary k2):\n%s", log)
	}
	if r := mustSend(t, "POST", p.url("/pay/1"), "sealed-1", `{"n":1}`); !r.replayed() || string(r.body) != string(first.body) {
		t.Errorf("key 1's record after the rotation: got %d replayed %v %s, want the replay of %s", r.status, r.replayed(), r.body, first.body)
	}
	second := mustSend(t, "POST", p.url("/pay/2"), "sealed-2", `{"n":2}`)
	wantStatus(t, "under key 2", second, http.StatusCreated, "")

	for i, bad := range []struct{ text, want string }{
		{sealRingLine("k3", 3) + "\n" + sealRingLine("k3", 4) + "\n", "key id k3 is already on line 1"},
		{"k3 " + base64.StdEncoding.EncodeToString(make([]byte, 16)) + "\n", "key k3 has 16 bytes; want 32"},
		{"", "holds no key, so no primary"},
		{"\x00remove", "no such file or directory"},
	} {
		if bad.text == "\x00remove" {
			if err := os.Remove(ring); err != nil {
				t.Fatal(err)
			}
		} else {
			writeFile(t, ring, bad.text)
		}
		p.hangup(t, "reload refused", i+1)
		lines := p.errorLines()
		if len(lines) != i+1 {
			t.Fatalf("after bad ring %d: %d ERROR lines, want %d:\n%s", i, len(lines), i+1, strings.Join(lines, ""))
		}
		if last := lines[i]; !strings.Contains(last, `"what":"seal keys"`) || !strings.Contains(last, "--seal-keys: ") ||
			!strings.Contains(last, ring) || !strings.Contains(last, bad.want) {
			t.Errorf("bad ring %d: ERROR line %s, want what=seal keys, --seal-keys, the file and %q", i, last, bad.want)
		}
		// The running ring (k2, k1) is kept: both records replay.
		for _, c := range []struct {
			key, path, body string
			want            result
		}{{"sealed-1", "/pay/1", `{"n":1}`, first}, {"sealed-2", "/pay/2", `{"n":2}`, second}} {
			if r := mustSend(t, "POST", p.url(c.path), c.key, c.body); !r.replayed() || string(r.body) != string(c.want.body) {
				t.Errorf("%s after refused reload %d: got %d replayed %v %s, want the replay of %s", c.key, i, r.status, r.replayed(), r.body, c.want.body)
			}
		}
	}

	// Key 1 dropped: key 2's record still replays (it was sealed under
	// key 2); key 1's is not replayed, and not run again.
	writeFile(t, ring, sealRingLine("k2", 2)+"\n")
	p.hangup(t, `"msg":"reloaded","what":"seal keys"`, 2)
	if r := mustSend(t, "POST", p.url("/pay/2"), "sealed-2", `{"n":2}`); !r.replayed() || string(r.body) != string(second.body) {
		t.Errorf("key 2's record with key 1 dropped: got %d replayed %v %s, want the replay of %s", r.status, r.replayed(), r.body, second.body)
	}
	// The answer of work that ran and whose result cannot be read (it says
	// Idempotent-Replayed: true, and replays nothing of the record).
	if r := mustSend(t, "POST", p.url("/pay/1"), "sealed-1", `{"n":1}`); bytes.Contains(r.body, first.body) {
		t.Errorf("key 1's record with key 1 dropped: got %d %s, want 500 response-unreadable, not the replay", r.status, r.body)
	} else {
		wantStatus(t, "key 1's record with key 1 dropped", r, http.StatusInternalServerError, idemhttp.ProblemResponseUnreadable)
	}
	for _, k := range []string{"sealed-1", "sealed-2"} {
		if n := up.runsOf(k); n != 1 {
			t.Errorf("upstream ran %s %d times, want 1", k, n)
		}
	}
	for _, c := range []byte{1, 2, 3, 4} {
		if k := base64.StdEncoding.EncodeToString(bytes.Repeat([]byte{c}, 32)); strings.Contains(p.logText(), k) {
			t.Errorf("key %d is in the log", c)
		}
	}
}
