package seal

import (
	"bytes"
	"encoding/base64"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// testKey returns a 32-byte key filled with c, and its standard base64.
func testKey(c byte) ([]byte, string) {
	k := bytes.Repeat([]byte{c}, KeySize)
	return k, base64.StdEncoding.EncodeToString(k)
}

// mustSeal is r.Seal, whose error is always nil.
func mustSeal(t testing.TB, r *Ring, dst, plaintext, ad []byte) []byte {
	t.Helper()
	b, err := r.Seal(dst, plaintext, ad)
	if err != nil {
		t.Fatalf("Seal: %v", err)
	}
	return b
}

func mustRing(t testing.TB, text string) *Ring {
	t.Helper()
	r, err := ParseRing(text)
	if err != nil {
		t.Fatalf("ParseRing: %v", err)
	}
	return r
}

func TestParseRing(t *testing.T) {
	_, a := testKey(1)
	kb, _ := testKey(2)
	_, c := testKey(3)
	text := "# rotated 2026-12-01\r\n\n  k2 " + base64.RawURLEncoding.EncodeToString(kb) + "  \r\n" +
		"k1\t" + a + "\n# old\nold_key-0.x " + c
	r := mustRing(t, text)
	if got := r.Primary(); got != "k2" {
		t.Errorf("Primary() = %q; want k2, the first key", got)
	}
	if got := r.Len(); got != 3 {
		t.Errorf("Len() = %d; want 3", got)
	}
	for _, id := range []string{"k1", "k2", "old_key-0.x"} {
		if !r.Has(id) {
			t.Errorf("Has(%q) = false; want true", id)
		}
	}
	if r.Has("k3") {
		t.Error("Has(k3) = true; want false")
	}
}

func TestParseRingBase64Forms(t *testing.T) {
	k := make([]byte, KeySize)
	for i := range k {
		k[i] = byte(0xF8 + i%8) // bytes that give + / (- _ in URL-safe) in base64
	}
	want := mustSeal(t, mustRing(t, "k "+base64.StdEncoding.EncodeToString(k)), nil, []byte("x"), nil)
	for _, e := range []*base64.Encoding{base64.StdEncoding, base64.RawStdEncoding, base64.URLEncoding, base64.RawURLEncoding} {
		r := mustRing(t, "k "+e.EncodeToString(k))
		if _, err := r.Open(nil, want, nil); err != nil {
			t.Errorf("key as %q: Open of a value sealed under the same key: %v", e.EncodeToString(k), err)
		}
	}
}

// TestParseRingErrors checks every bad ring of issue 34 (and the other
// refusals): the message names the source and the line, is one line, and
// quotes no key.
func TestParseRingErrors(t *testing.T) {
	_, a := testKey(1)
	_, b := testKey(2)
	short := base64.StdEncoding.EncodeToString(make([]byte, 16))
	long := base64.StdEncoding.EncodeToString(bytes.Repeat([]byte{7}, 48))
	for _, tc := range []struct {
		name, text, want string
	}{
		{"empty", "", "seal keys: text holds no key, so no primary"},
		{"only comments", "# k1 " + a + "\n\n   \n#x\n", "seal keys: text holds no key, so no primary"},
		{"wrong size short", "k1 " + a + "\nk2 " + short, "seal keys: text line 2: key k2 has 16 bytes; want 32 (AES-256)"},
		{"wrong size long", "k1 " + long, "seal keys: text line 1: key k1 has 48 bytes; want 32 (AES-256)"},
		{"duplicate id", "k1 " + a + "\n# c\nk1 " + b, "seal keys: text line 3: key id k1 is already on line 1; want each id once"},
		{"not base64", "k1 " + a[:20] + "!!" + a[22:], "seal keys: text line 1: key k1 is not base64"},
		{"key alone", a, "seal keys: text line 1: 1 field(s); want ID BASE64"},
		{"three fields", "k1 " + a + " " + b, "seal keys: text line 1: 3 field(s); want ID BASE64"},
		{"id with a slash", "a/b " + a, "seal keys: text line 1: the key id is not 1 to 32 of A-Z a-z 0-9 . _ -"},
		{"key where the id goes", b + " " + a, "seal keys: text line 1: the key id is not 1 to 32"},
		{"id too long", strings.Repeat("x", 33) + " " + a, "seal keys: text line 1: the key id is not 1 to 32"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, err := ParseRing(tc.text)
			if err == nil {
				t.Fatalf("ParseRing(%q) = %v, nil; want an error starting %q", tc.name, r, tc.want)
			}
			checkRingError(t, err, tc.want, a, b, short, long, a[:20])
		})
	}
}

// checkRingError checks that err's message starts with want, is one line,
// and holds none of the secrets.
func checkRingError(t *testing.T, err error, want string, secrets ...string) {
	t.Helper()
	msg := err.Error()
	if !strings.HasPrefix(msg, want) {
		t.Errorf("error %q; want it to start with %q", msg, want)
	}
	if strings.ContainsAny(msg, "\r\n") {
		t.Errorf("error %q spans lines; want one", msg)
	}
	for _, s := range secrets {
		if strings.Contains(msg, s) {
			t.Errorf("error %q quotes key material %q", msg, s)
		}
	}
}

func TestRingFromFile(t *testing.T) {
	_, a := testKey(1)
	_, b := testKey(2)
	dir := t.TempDir()
	good := filepath.Join(dir, "keys")
	if err := os.WriteFile(good, []byte("k2 "+b+"\nk1 "+a+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	r, err := RingFromFile(good)
	if err != nil {
		t.Fatalf("RingFromFile: %v", err)
	}
	if r.Primary() != "k2" || r.Len() != 2 {
		t.Errorf("RingFromFile = %v; want 2 keys, primary k2", r)
	}

	missing := filepath.Join(dir, "nope")
	_, err = RingFromFile(missing)
	if !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("RingFromFile(missing) error %v; want one wrapping fs.ErrNotExist", err)
	}
	if err != nil {
		checkRingError(t, err, "seal keys: open "+missing+": no such file or directory")
	}

	bad := filepath.Join(dir, "bad")
	if err := os.WriteFile(bad, []byte("k1 "+a+"\n\nk2 "+a[:40]+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err = RingFromFile(bad)
	if err == nil {
		t.Fatal("RingFromFile(a file whose line 3 is a 30-byte key) = nil error; want one")
	}
	checkRingError(t, err, "seal keys: file "+bad+" line 3: key k2 has 30 bytes; want 32", a, a[:40])

	empty := filepath.Join(dir, "empty")
	if err := os.WriteFile(empty, []byte("# nothing yet\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err = RingFromFile(empty)
	if err == nil {
		t.Fatal("RingFromFile(a file of comments) = nil error; want one")
	}
	checkRingError(t, err, "seal keys: file "+empty+" holds no key, so no primary")
}

func TestRingFromEnv(t *testing.T) {
	_, a := testKey(1)
	t.Setenv("SEAL_TEST_KEYS", "# ring\nk1 "+a+"\n")
	r, err := RingFromEnv("SEAL_TEST_KEYS")
	if err != nil {
		t.Fatalf("RingFromEnv: %v", err)
	}
	if got, want := r.String(), "1 seal key(s) from environment variable SEAL_TEST_KEYS, primary k1"; got != want {
		t.Errorf("String() = %q; want %q", got, want)
	}

	_, err = RingFromEnv("SEAL_TEST_UNSET_VARIABLE")
	if err == nil {
		t.Fatal("RingFromEnv(unset) = nil error; want one")
	}
	checkRingError(t, err, "seal keys: environment variable SEAL_TEST_UNSET_VARIABLE is not set")

	t.Setenv("SEAL_TEST_KEYS", "k1 "+a+"\nk1 "+a)
	_, err = RingFromEnv("SEAL_TEST_KEYS")
	if err == nil {
		t.Fatal("RingFromEnv(duplicate id) = nil error; want one")
	}
	checkRingError(t, err, "seal keys: environment variable SEAL_TEST_KEYS line 2: key id k1 is already on line 1", a)

	_, err = RingFromEnv("k1 " + a)
	if err == nil {
		t.Fatal("RingFromEnv(a ring line given as the name) = nil error; want one")
	}
	checkRingError(t, err, "seal keys: the environment variable's name is not a name", a)
}

// TestRingNeverPrintsKeys formats a ring every way a log line or an error
// could, by pointer and by value: none shows a key, in base64 or raw.
func TestRingNeverPrintsKeys(t *testing.T) {
	ka, a := testKey(0x41) // "AAAA..." raw bytes are printable: a raw leak shows
	kb, b := testKey(0x42)
	r := mustRing(t, "k2 "+b+"\nk1 "+a)
	var log bytes.Buffer
	slog.New(slog.NewJSONHandler(&log, nil)).Info("ring", "keys", r, "value", *r)
	want := "2 seal key(s) from text, primary k2"
	for _, out := range []string{fmt.Sprint(r), fmt.Sprintf("%+v", r), fmt.Sprintf("%#v", r), fmt.Sprintf("%v", *r),
		fmt.Sprintf("%+v", *r), fmt.Sprintf("%#v", *r), fmt.Sprintf("%s", r), fmt.Sprintf("%x", *r), log.String()} {
		for _, s := range []string{a, b, string(ka), string(kb), string(ka[:8]), string(kb[:8])} {
			if strings.Contains(out, s) {
				t.Errorf("formatted ring %q holds key material", out)
			}
		}
		if !strings.Contains(out, want) && !strings.Contains(out, fmt.Sprintf("%x", want)) {
			t.Errorf("formatted ring %q; want it to say %q", out, want)
		}
	}
	if got := (Ring{}).String(); got != "no seal keys" {
		t.Errorf("zero Ring String() = %q; want %q", got, "no seal keys")
	}
}
