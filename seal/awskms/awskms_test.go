package awskms_test

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/service/kms"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/kmstest"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/seal"
	"github.com/idemkit/idem/seal/awskms"
)

// A Sealer is the Sealer the Guard takes.
var _ idem.Sealer = (*awskms.Sealer)(nil)

// counting is a Client that counts its calls, may slow them down, and
// keeps a copy of the data keys KMS gave in clear (to check they leak
// nowhere) and the outputs it passed on (to check the Sealer cleared
// them).
type counting struct {
	c                 awskms.Client
	generates, decrpt atomic.Int64
	delay             time.Duration

	mu      sync.Mutex
	plain   [][]byte
	outputs []*kms.GenerateDataKeyOutput
}

func (c *counting) GenerateDataKey(ctx context.Context, in *kms.GenerateDataKeyInput, optFns ...func(*kms.Options)) (*kms.GenerateDataKeyOutput, error) {
	c.generates.Add(1)
	time.Sleep(c.delay)
	out, err := c.c.GenerateDataKey(ctx, in, optFns...)
	if err == nil {
		c.mu.Lock()
		c.plain = append(c.plain, bytes.Clone(out.Plaintext))
		c.outputs = append(c.outputs, out)
		c.mu.Unlock()
	}
	return out, err
}

func (c *counting) Decrypt(ctx context.Context, in *kms.DecryptInput, optFns ...func(*kms.Options)) (*kms.DecryptOutput, error) {
	c.decrpt.Add(1)
	time.Sleep(c.delay)
	return c.c.Decrypt(ctx, in, optFns...)
}

func (c *counting) counts() (generates, decrypts int64) { return c.generates.Load(), c.decrpt.Load() }

func mustNew(t testing.TB, c awskms.Client, arn string, opt awskms.Options) *awskms.Sealer {
	t.Helper()
	s, err := awskms.New(context.Background(), c, arn, opt)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func mustSeal(t testing.TB, s idem.Sealer, dst, plain, ad []byte) []byte {
	t.Helper()
	out, err := s.Seal(dst, plain, ad)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

var kmsKeyID = regexp.MustCompile(`^kms:[0-9a-f]{16}$`)

func TestRoundTrip(t *testing.T) {
	srv := kmstest.Start(t)
	s := mustNew(t, srv.Client(), srv.KeyARN(), awskms.Options{})
	// Another Sealer of the same KMS key (another process) opens it too.
	other := mustNew(t, srv.Client(), srv.KeyARN(), awskms.Options{})
	for _, n := range []int{0, 1, 16, 1 << 10, 100_000} {
		plain := bytes.Repeat([]byte("card 4111 1111 1111 1111;"), n/25+1)[:n]
		for _, ad := range [][]byte{nil, []byte("idem/record\x00key")} {
			prefix := []byte("prefix")
			sealed := mustSeal(t, s, prefix, plain, ad)
			if !bytes.Equal(sealed[:len(prefix)], prefix) {
				t.Fatalf("Seal did not keep dst's bytes: %q", sealed[:len(prefix)])
			}
			sealed = sealed[len(prefix):]
			if !bytes.HasPrefix(sealed, []byte{0xFF, 'S', 'K', 1}) || !awskms.IsSealed(sealed) || sealed[0] != idem.SealedMark {
				t.Fatalf("sealed value starts %x; want FF 53 4B 01", sealed[:4])
			}
			if n >= 16 && bytes.Contains(sealed, plain[:16]) {
				t.Errorf("sealed value of %d bytes holds its plaintext in clear", n)
			}
			for name, o := range map[string]*awskms.Sealer{"the sealer": s, "another sealer": other} {
				got, err := o.Open([]byte("x"), sealed, ad)
				if err != nil {
					t.Fatalf("%s: Open(Seal(%d bytes)): %v", name, n, err)
				}
				if got[0] != 'x' || !bytes.Equal(got[1:], plain) {
					t.Errorf("%s: Open(Seal(%d bytes)) = %d bytes, not dst then the plaintext", name, n, len(got))
				}
			}
			id, ok := s.KeyID(sealed)
			if !ok || !kmsKeyID.MatchString(id) {
				t.Errorf("KeyID = %q, %t; want kms: and 16 hex digits", id, ok)
			}
		}
	}
	a, b := mustSeal(t, s, nil, []byte("same"), nil), mustSeal(t, s, nil, []byte("same"), nil)
	if bytes.Equal(a, b) {
		t.Error("two Seals of one plaintext are equal; want distinct (random nonces)")
	}
	ida, _ := s.KeyID(a)
	idb, _ := s.KeyID(b)
	if ida != idb {
		t.Errorf("two Seals in a row under data keys %s and %s; want one data key", ida, idb)
	}
	// Every Sealer has its own data key.
	if ido, _ := other.KeyID(mustSeal(t, other, nil, []byte("x"), nil)); ido == ida {
		t.Errorf("two Sealers share data key %s; want one each", ido)
	}
	for name, v := range map[string][]byte{
		"clear record":   {0x04, 'x'},
		"ring envelope":  {0xFF, 'S', 'L', 1, 1, 'k'},
		"version 2":      append([]byte{0xFF, 'S', 'K', 2}, a[4:]...),
		"truncated blob": a[:10],
		"empty blob":     {0xFF, 'S', 'K', 1, 0, 0},
		"nil":            nil,
	} {
		if id, ok := s.KeyID(v); ok {
			t.Errorf("KeyID(%s) = %q, true; want false", name, id)
		}
	}
}

// TestRefused: a value altered anywhere, truncated, opened with other
// associated data, or sealed under another KMS key never opens, with the
// error each case says.
func TestRefused(t *testing.T) {
	srv := kmstest.Start(t)
	s := mustNew(t, srv.Client(), srv.KeyARN(), awskms.Options{})
	ad := []byte("idem/record/v1\x00key-1")
	plain := []byte(`{"card":"4111 1111 1111 1111","cvv":"123"}`)
	sealed := mustSeal(t, s, nil, plain, ad)
	blobLen := int(sealed[4])<<8 | int(sealed[5])

	if _, err := s.Open(nil, sealed, []byte("idem/record/v1\x00key-2")); !errors.Is(err, seal.ErrTampered) {
		t.Errorf("Open with other associated data: %v; want ErrTampered", err)
	}
	if _, err := s.Open(nil, sealed, nil); !errors.Is(err, seal.ErrTampered) {
		t.Errorf("Open without the associated data: %v; want ErrTampered", err)
	}
	for _, at := range []int{3, 6 + blobLen, 6 + blobLen + 12, len(sealed) - 1} { // version, nonce, ciphertext, tag
		bad := bytes.Clone(sealed)
		bad[at] ^= 1
		if _, err := s.Open(nil, bad, ad); !errors.Is(err, seal.ErrTampered) {
			t.Errorf("Open with byte %d altered: %v; want ErrTampered", at, err)
		}
	}
	for _, n := range []int{0, 3, 5, 6, 6 + blobLen, 6 + blobLen + 12 + 15} {
		if _, err := s.Open(nil, sealed[:n], ad); !errors.Is(err, seal.ErrTampered) {
			t.Errorf("Open of the first %d bytes: %v; want ErrTampered", n, err)
		}
	}
	// The blob's length, altered: the blob then ends elsewhere.
	bad := bytes.Clone(sealed)
	bad[5] ^= 1
	if _, err := s.Open(nil, bad, ad); err == nil {
		t.Error("Open with the blob's length altered succeeded")
	}
	// The encrypted data key altered at its end (local-kms's ciphertext):
	// KMS refuses it.
	bad = bytes.Clone(sealed)
	bad[6+blobLen-1] ^= 1
	_, err := s.Open(nil, bad, ad)
	if !errors.Is(err, seal.ErrUnknownKey) || !strings.Contains(err.Error(), srv.KeyARN()) {
		t.Errorf("Open with the encrypted data key altered: %v; want ErrUnknownKey naming %s", err, srv.KeyARN())
	}
	// Altered at its start (the key's ARN in local-kms's blob, which it
	// does not authenticate): KMS gives the data key all the same, and the
	// envelope's header, blob included, fails GCM's check.
	bad = bytes.Clone(sealed)
	bad[6+10] ^= 1
	if _, err := s.Open(nil, bad, ad); !errors.Is(err, seal.ErrTampered) {
		t.Errorf("Open with the start of the encrypted data key altered: %v; want ErrTampered", err)
	}

	// Sealed under the other KMS key of the same account.
	other := mustNew(t, srv.Client(), srv.OtherKeyARN(), awskms.Options{})
	byOther := mustSeal(t, other, nil, plain, ad)
	_, err = s.Open(nil, byOther, ad)
	id, _ := other.KeyID(byOther)
	if !errors.Is(err, seal.ErrUnknownKey) || !strings.Contains(err.Error(), srv.KeyARN()) || !strings.Contains(err.Error(), id) {
		t.Errorf("Open of a value of another KMS key: %v; want ErrUnknownKey naming %s and data key %s", err, srv.KeyARN(), id)
	}
	if strings.Contains(err.Error(), "\n") {
		t.Errorf("error %q is not one line", err)
	}
}

// TestDataKeyReuse: one data key seals until Lifetime or MaxSeals, then
// the next Seal asks KMS for a new one; what a Sealer sealed it opens
// without KMS, whatever data key sealed it.
func TestDataKeyReuse(t *testing.T) {
	srv := kmstest.Start(t)
	ad := []byte("ad")

	t.Run("MaxSeals", func(t *testing.T) {
		c := &counting{c: srv.Client()}
		s := mustNew(t, c, srv.KeyARN(), awskms.Options{MaxSeals: 10})
		var values [][]byte
		ids := map[string]int{}
		for i := range 25 {
			v := mustSeal(t, s, nil, fmt.Appendf(nil, "value %d", i), ad)
			values = append(values, v)
			id, _ := s.KeyID(v)
			ids[id]++
		}
		if g, d := c.counts(); g != 3 || d != 0 {
			t.Errorf("25 Seals at MaxSeals 10: %d GenerateDataKey, %d Decrypt; want 3 (at New, after 10, after 20), 0", g, d)
		}
		if len(ids) != 3 {
			t.Errorf("25 Seals at MaxSeals 10 used %d data keys (%v); want 3", len(ids), ids)
		}
		for _, n := range ids {
			if n > 10 {
				t.Errorf("a data key sealed %d values; want at most 10 (%v)", n, ids)
			}
		}
		for i, v := range values {
			if got, err := s.Open(nil, v, ad); err != nil || string(got) != fmt.Sprintf("value %d", i) {
				t.Fatalf("Open(value %d) = %q, %v", i, got, err)
			}
		}
		if _, d := c.counts(); d != 0 {
			t.Errorf("Open of the Sealer's own values called Decrypt %d times; want 0 (its data keys are cached)", d)
		}
	})

	t.Run("Lifetime", func(t *testing.T) {
		c := &counting{c: srv.Client()}
		s := mustNew(t, c, srv.KeyARN(), awskms.Options{Lifetime: 300 * time.Millisecond})
		start := time.Now()
		first := mustSeal(t, s, nil, []byte("first"), ad)
		second := mustSeal(t, s, nil, []byte("second"), ad)
		if time.Since(start) < 250*time.Millisecond {
			if g, _ := c.counts(); g != 1 {
				t.Errorf("two Seals within Lifetime: %d GenerateDataKey; want 1", g)
			}
		}
		time.Sleep(time.Until(start.Add(350 * time.Millisecond)))
		third := mustSeal(t, s, nil, []byte("third"), ad)
		if g, _ := c.counts(); g != 2 {
			t.Errorf("a Seal after Lifetime: %d GenerateDataKey in all; want 2", g)
		}
		id1, _ := s.KeyID(first)
		id2, _ := s.KeyID(second)
		id3, _ := s.KeyID(third)
		if id1 != id2 || id3 == id1 {
			t.Errorf("data keys %s, %s, then after Lifetime %s; want the same two, then a new one", id1, id2, id3)
		}
		if got, err := s.Open(nil, first, ad); err != nil || string(got) != "first" {
			t.Errorf("Open of a value of the expired data key: %q, %v; want it (opening has no lifetime)", got, err)
		}
		if _, d := c.counts(); d != 0 {
			t.Errorf("Decrypt called %d times; want 0", d)
		}
	})
}

// TestOpenCache: a Sealer decrypts each data key it has not seen once,
// keeps CacheSize of them, least recently used out first, and concurrent
// Opens under one data key share one Decrypt.
func TestOpenCache(t *testing.T) {
	srv := kmstest.Start(t)
	ad := []byte("ad")
	w := mustNew(t, srv.Client(), srv.KeyARN(), awskms.Options{MaxSeals: 1}) // a data key per value
	var v [4][]byte
	for i := range v {
		v[i] = mustSeal(t, w, nil, fmt.Appendf(nil, "value %d", i), ad)
	}
	c := &counting{c: srv.Client()}
	r := mustNew(t, c, srv.KeyARN(), awskms.Options{CacheSize: 3}) // its own data key takes one place
	open := func(i int, wantDecrypts int64) {
		t.Helper()
		got, err := r.Open(nil, v[i], ad)
		if err != nil || string(got) != fmt.Sprintf("value %d", i) {
			t.Fatalf("Open(value %d) = %q, %v", i, got, err)
		}
		if _, d := c.counts(); d != wantDecrypts {
			t.Fatalf("after Open(value %d): %d Decrypt in all; want %d", i, d, wantDecrypts)
		}
	}
	open(0, 1)
	open(0, 1) // cached
	open(1, 2)
	open(0, 2) // cached: the reader's own data key is now the least recently used
	open(2, 3) // the own key out
	open(1, 3)
	open(0, 3)
	open(3, 4) // value 2's data key out
	open(2, 5)

	// 8 Opens at once of a value whose data key is not cached: one Decrypt.
	slow := &counting{c: srv.Client(), delay: 200 * time.Millisecond}
	r2 := mustNew(t, slow, srv.KeyARN(), awskms.Options{})
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			if got, err := r2.Open(nil, v[1], ad); err != nil || string(got) != "value 1" {
				t.Errorf("concurrent Open = %q, %v", got, err)
			}
		})
	}
	wg.Wait()
	if _, d := slow.counts(); d != 1 {
		t.Errorf("8 concurrent Opens of one uncached data key: %d Decrypt; want 1", d)
	}
}

// TestKMSDown: with KMS stopped, Seal goes on with its data key until it
// expires and then fails (an error, no panic), Open goes on for cached
// data keys and fails for the others; KMS back, both work again.
func TestKMSDown(t *testing.T) {
	srv := kmstest.Start(t)
	ad := []byte("ad")
	const life = 500 * time.Millisecond
	opt := awskms.Options{Lifetime: life, Timeout: 2 * time.Second}
	s := mustNew(t, srv.Client(), srv.KeyARN(), opt)
	reader := mustNew(t, srv.Client(), srv.KeyARN(), opt)
	born := time.Now()
	before := mustSeal(t, s, nil, []byte("before"), ad)
	srv.Stop()

	during, err := s.Seal(nil, []byte("during"), ad)
	if time.Since(born) < life && err != nil {
		t.Fatalf("Seal within the data key's lifetime, KMS stopped: %v; want it sealed", err)
	}
	if got, err := s.Open(nil, before, ad); err != nil || string(got) != "before" {
		t.Errorf("Open by the Sealer that sealed it, KMS stopped: %q, %v; want it (cached)", got, err)
	}
	_, err = reader.Open(nil, before, ad)
	id, _ := s.KeyID(before)
	if err == nil || errors.Is(err, seal.ErrTampered) || errors.Is(err, seal.ErrUnknownKey) || !strings.Contains(err.Error(), id) || strings.Contains(err.Error(), "\n") {
		t.Errorf("Open of an uncached data key, KMS stopped: %v; want a one-line KMS error naming data key %s (neither tampered nor unknown)", err, id)
	}

	time.Sleep(time.Until(born.Add(life + 50*time.Millisecond)))
	_, err = s.Seal(nil, []byte("after"), ad)
	if err == nil || !strings.Contains(err.Error(), srv.KeyARN()) || strings.Contains(err.Error(), "\n") {
		t.Errorf("Seal after the data key expired, KMS stopped: %v; want a one-line error naming %s", err, srv.KeyARN())
	}
	// The Guard turns that into an error of Complete and stores nothing
	// clear: see TestGuard. KMS back:
	if err := srv.Restart(); err != nil {
		t.Fatal(err)
	}
	after := mustSeal(t, s, nil, []byte("after"), ad)
	for name, v := range map[string][]byte{"before": before, "during": during, "after": after} {
		if v == nil {
			continue
		}
		if got, err := reader.Open(nil, v, ad); err != nil || string(got) != name {
			t.Errorf("KMS back: Open(%s) = %q, %v", name, got, err)
		}
	}
}

// TestStart: a wrong key, endpoint or option fails New (and Open) at once
// with one line naming what is wrong; Open reads the SDK's usual
// environment.
func TestStart(t *testing.T) {
	srv := kmstest.Start(t)
	ctx := context.Background()
	missing := kmstest.ARN("00000000-0000-4000-8000-000000000000")
	for name, tc := range map[string]struct {
		c    awskms.Client
		arn  string
		opt  awskms.Options
		want []string
	}{
		"no such key":    {srv.Client(), missing, awskms.Options{}, []string{missing, "NotFoundException"}},
		"alias missing":  {srv.Client(), "alias/nope", awskms.Options{}, []string{"alias/nope"}},
		"empty":          {srv.Client(), "", awskms.Options{}, []string{"no KMS key"}},
		"space":          {srv.Client(), "arn:aws:kms:x key", awskms.Options{}, []string{`"arn:aws:kms:x key"`, "white space"}},
		"nil client":     {nil, srv.KeyARN(), awskms.Options{}, []string{"no KMS client"}},
		"lifetime":       {srv.Client(), srv.KeyARN(), awskms.Options{Lifetime: -time.Second}, []string{"Options.Lifetime is -1s"}},
		"max seals":      {srv.Client(), srv.KeyARN(), awskms.Options{MaxSeals: -1}, []string{"Options.MaxSeals is -1"}},
		"cache size":     {srv.Client(), srv.KeyARN(), awskms.Options{CacheSize: -2}, []string{"Options.CacheSize is -2"}},
		"timeout":        {srv.Client(), srv.KeyARN(), awskms.Options{Timeout: -1}, []string{"Options.Timeout is -1ns"}},
		"nothing listen": {kmstest.NewClient("127.0.0.1:1"), srv.KeyARN(), awskms.Options{}, []string{srv.KeyARN(), "connection refused"}},
	} {
		s, err := awskms.New(ctx, tc.c, tc.arn, tc.opt)
		if err == nil {
			t.Errorf("%s: New = %v; want an error", name, s)
			continue
		}
		msg := err.Error()
		if strings.Contains(msg, "\n") || !strings.HasPrefix(msg, "seal kms: ") {
			t.Errorf("%s: error %q is not one line starting \"seal kms: \"", name, msg)
		}
		for _, w := range tc.want {
			if !strings.Contains(msg, w) {
				t.Errorf("%s: error %q does not say %q", name, msg, w)
			}
		}
	}
	// A KMS that does not answer: New gives up after Timeout.
	hang := &counting{c: kmstest.NewClient(srv.Addr()), delay: time.Second}
	start := time.Now()
	if _, err := awskms.New(ctx, hang, srv.KeyARN(), awskms.Options{Timeout: 300 * time.Millisecond}); err == nil || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("New with a KMS slower than Timeout: %v; want context.DeadlineExceeded", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("New with a KMS slower than Timeout took %v", d)
	}

	// Open: the SDK's environment, AWS_ENDPOINT_URL (for every service).
	env := srv.Env()
	delete(env, "AWS_ENDPOINT_URL_KMS")
	env["AWS_ENDPOINT_URL"] = srv.Endpoint()
	env["AWS_MAX_ATTEMPTS"] = "1"
	for k, v := range env {
		t.Setenv(k, v)
	}
	s, err := awskms.Open(ctx, srv.KeyARN(), awskms.Options{})
	if err != nil {
		t.Fatalf("Open with AWS_ENDPOINT_URL %s: %v", srv.Endpoint(), err)
	}
	byAlias, err := awskms.Open(ctx, kmstest.KeyAlias, awskms.Options{})
	if err != nil {
		t.Fatalf("Open(%s): %v", kmstest.KeyAlias, err)
	}
	v := mustSeal(t, byAlias, nil, []byte("x"), nil)
	if got, err := s.Open(nil, v, nil); err != nil || string(got) != "x" {
		t.Errorf("what the Sealer of the alias sealed, the Sealer of the key's ARN opens: %q, %v", got, err)
	}
	// No region: the ARN's.
	t.Setenv("AWS_REGION", "")
	if _, err := awskms.Open(ctx, srv.KeyARN(), awskms.Options{}); err != nil {
		t.Errorf("Open without AWS_REGION, the key's ARN naming its region: %v", err)
	}
	if _, err := awskms.Open(ctx, kmstest.KeyAlias, awskms.Options{}); err == nil || !strings.Contains(err.Error(), "AWS_REGION") {
		t.Errorf("Open(%s) without AWS_REGION: %v; want an error saying to set AWS_REGION", kmstest.KeyAlias, err)
	}
	// AWS_ENDPOINT_URL_KMS wins over AWS_ENDPOINT_URL.
	t.Setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
	t.Setenv("AWS_ENDPOINT_URL_KMS", srv.Endpoint())
	if _, err := awskms.Open(ctx, srv.KeyARN(), awskms.Options{}); err != nil {
		t.Errorf("Open with AWS_ENDPOINT_URL_KMS: %v", err)
	}
	t.Setenv("AWS_ENDPOINT_URL_KMS", "http://127.0.0.1:1")
	if _, err := awskms.Open(ctx, srv.KeyARN(), awskms.Options{}); err == nil || !strings.Contains(err.Error(), srv.KeyARN()) {
		t.Errorf("Open with AWS_ENDPOINT_URL_KMS where nothing listens: %v; want an error naming the key", err)
	}
}

// TestConcurrent: Seals and Opens from many goroutines while data keys
// turn over (run under -race), and a data key refresh that many Seals
// wait for is one GenerateDataKey.
func TestConcurrent(t *testing.T) {
	srv := kmstest.Start(t)
	c := &counting{c: srv.Client()}
	s := mustNew(t, c, srv.KeyARN(), awskms.Options{MaxSeals: 50, CacheSize: 4})
	reader := mustNew(t, srv.Client(), srv.KeyARN(), awskms.Options{CacheSize: 2})
	const workers, each = 8, 100
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			ad := fmt.Appendf(nil, "worker %d", w)
			for i := range each {
				plain := fmt.Appendf(nil, "value %d of %d", i, w)
				v, err := s.Seal(nil, plain, ad)
				if err != nil {
					t.Error(err)
					return
				}
				for _, o := range []*awskms.Sealer{s, reader} {
					if got, err := o.Open(nil, v, ad); err != nil || !bytes.Equal(got, plain) {
						t.Errorf("Open = %q, %v; want %q", got, err, plain)
						return
					}
				}
			}
		})
	}
	wg.Wait()
	if g, _ := c.counts(); g < workers*each/50 || g > workers*each/50+1 {
		t.Errorf("%d Seals at MaxSeals 50: %d GenerateDataKey; want %d or %d", workers*each, g, workers*each/50, workers*each/50+1)
	}

	// 16 Seals at once when the data key is used up, KMS slow: one call
	// (whose data key seals all 16), and no Seal waits for more than it.
	slow := &counting{c: srv.Client()}
	s2 := mustNew(t, slow, srv.KeyARN(), awskms.Options{MaxSeals: 16})
	for range 16 {
		mustSeal(t, s2, nil, []byte("x"), nil)
	}
	slow.delay = 300 * time.Millisecond
	var longest atomic.Int64
	for range 16 {
		wg.Go(func() {
			start := time.Now()
			if _, err := s2.Seal(nil, []byte("x"), nil); err != nil {
				t.Error(err)
			}
			d := int64(time.Since(start))
			for {
				old := longest.Load()
				if d <= old || longest.CompareAndSwap(old, d) {
					break
				}
			}
		})
	}
	wg.Wait()
	if g, _ := slow.counts(); g != 2 {
		t.Errorf("16 concurrent Seals after the data key was used up: %d GenerateDataKey in all; want 2 (New's and one refresh)", g)
	}
	if d := time.Duration(longest.Load()); d > 2*slow.delay+time.Second {
		t.Errorf("a Seal waited %v for a refresh of %v; want at most one KMS call", d, slow.delay)
	}
}

// TestNoKeyMaterial: a Sealer printed any way, or logged, shows no data
// key (in clear or encrypted) and clears the data key KMS gave it.
func TestNoKeyMaterial(t *testing.T) {
	srv := kmstest.Start(t)
	c := &counting{c: srv.Client()}
	s := mustNew(t, c, srv.KeyARN(), awskms.Options{})
	v := mustSeal(t, s, nil, []byte("x"), nil)
	blob := v[6 : 6+int(v[4])<<8|int(v[5])]
	var logged bytes.Buffer
	slog.New(slog.NewTextHandler(&logged, nil)).Info("sealer", "s", s, "v", *s)
	outs := []string{fmt.Sprint(s), fmt.Sprintf("%v %+v %#v %s", *s, *s, *s, s), fmt.Sprintf("%#v %+v", s, s), logged.String()}
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.plain) != 1 {
		t.Fatalf("%d data keys from KMS; want 1", len(c.plain))
	}
	key := c.plain[0]
	for _, out := range outs {
		if !strings.Contains(out, srv.KeyARN()) {
			t.Errorf("%q does not name the KMS key", out)
		}
		for _, enc := range []string{string(key), hex.EncodeToString(key), base64.StdEncoding.EncodeToString(key), fmt.Sprint(key), string(blob), hex.EncodeToString(blob), fmt.Sprint(blob[:8])[1:20]} {
			if strings.Contains(out, enc) {
				t.Errorf("%q shows the data key", out)
			}
		}
	}
	if !bytes.Equal(c.outputs[0].Plaintext, make([]byte, len(key))) {
		t.Error("the data key KMS gave in clear is still in its output: want it cleared")
	}
}

// TestCombine: a ring's records still open after moving to KMS
// (seal.Combine(kms, ring)), new ones are sealed with KMS, and back.
func TestCombine(t *testing.T) {
	srv := kmstest.Start(t)
	k := mustNew(t, srv.Client(), srv.KeyARN(), awskms.Options{})
	ring, err := seal.ParseRing("k1 " + base64.StdEncoding.EncodeToString(bytes.Repeat([]byte{7}, seal.KeySize)))
	if err != nil {
		t.Fatal(err)
	}
	ad := []byte("ad")
	byRing := mustSeal(t, ring, nil, []byte("ring"), ad)
	both := seal.Combine(k, ring)
	byKMS := mustSeal(t, both, nil, []byte("kms"), ad)
	if !awskms.IsSealed(byKMS) {
		t.Fatalf("Combine(kms, ring) sealed %x; want a KMS envelope", byKMS[:4])
	}
	back := seal.Combine(ring, k)
	for name, s := range map[string]idem.Sealer{"Combine(kms, ring)": both, "Combine(ring, kms)": back} {
		for want, v := range map[string][]byte{"ring": byRing, "kms": byKMS} {
			if got, err := s.Open(nil, v, ad); err != nil || string(got) != want {
				t.Errorf("%s: Open(%s value) = %q, %v", name, want, got, err)
			}
		}
		if id, ok := s.KeyID(byRing); !ok || id != "k1" {
			t.Errorf("%s: KeyID(ring value) = %q, %t; want k1", name, id, ok)
		}
		if id, ok := s.KeyID(byKMS); !ok || !kmsKeyID.MatchString(id) {
			t.Errorf("%s: KeyID(kms value) = %q, %t; want kms:…", name, id, ok)
		}
		if _, err := s.Open(nil, byKMS, []byte("other")); !errors.Is(err, seal.ErrTampered) {
			t.Errorf("%s: Open(kms value, other ad): %v; want ErrTampered", name, err)
		}
		if str := fmt.Sprint(s); !strings.Contains(str, srv.KeyARN()) || !strings.Contains(str, "primary k1") {
			t.Errorf("%s prints as %q; want both Sealers named", name, str)
		}
	}
	if _, err := k.Open(nil, byRing, ad); !errors.Is(err, seal.ErrTampered) {
		t.Errorf("the KMS Sealer alone: Open(ring value): %v; want ErrTampered (not its envelope)", err)
	}
}

// TestGuard: a Guard sealing with KMS data keys stores no canary and
// replays; with KMS down once the data key expired, the completion fails
// and nothing clear is stored.
func TestGuard(t *testing.T) {
	srv := kmstest.Start(t)
	ctx := context.Background()
	const canary = "4111 1111 1111 1111"
	s := mustNew(t, srv.Client(), srv.KeyARN(), awskms.Options{Lifetime: 400 * time.Millisecond, Timeout: time.Second})
	born := time.Now()
	store := memstore.New(memstore.Options{})
	g, err := idem.New(store, idem.Config{Seal: s})
	if err != nil {
		t.Fatal(err)
	}
	want := &idem.Response{Status: 201,
		Header: http.Header{"Content-Type": {"application/json"}, "X-Session-Token": {"tok-" + canary}},
		Body:   []byte(`{"card":"` + canary + `","cvv":"123"}`)}
	runs := 0
	fn := func(context.Context) (*idem.Response, error) { runs++; return want, nil }
	key, fp := idem.Key{1}, idem.Fingerprint{1}
	if _, err := g.Do(ctx, key, fp, fn); err != nil {
		t.Fatal(err)
	}
	rec, ok, err := store.Get(ctx, key)
	if err != nil || !ok || rec.Response == nil || !rec.Response.Sealed() {
		t.Fatalf("Get: %+v, %t, %v; want a sealed response", rec, ok, err)
	}
	b, err := rec.Response.AppendBinary(nil)
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Contains(b, []byte("4111")) || bytes.Contains(b, []byte("tok-")) || !awskms.IsSealed(b) {
		t.Errorf("the store holds the canary, or not a KMS envelope: %x", b[:min(len(b), 8)])
	}
	// Replayed, by this Guard and by another process's (another Sealer).
	other := mustNew(t, srv.Client(), srv.KeyARN(), awskms.Options{})
	g2, err := idem.New(store, idem.Config{Seal: other})
	if err != nil {
		t.Fatal(err)
	}
	for name, gg := range map[string]*idem.Guard{"the Guard": g, "another Guard": g2} {
		res, err := gg.Do(ctx, key, fp, fn)
		if err != nil || !res.Replayed || runs != 1 {
			t.Fatalf("%s: replay %+v, %v, runs %d", name, res, err, runs)
		}
		if r := res.Response; r.Status != 201 || r.Header.Get("X-Session-Token") != "tok-"+canary || !bytes.Equal(r.Body, want.Body) {
			t.Errorf("%s replayed %+v; want the response stored", name, r)
		}
	}
	// A Guard with another KMS key: the record does not open, named by its
	// data key id, and the work does not run again.
	g3, err := idem.New(store, idem.Config{Seal: mustNew(t, srv.Client(), srv.OtherKeyARN(), awskms.Options{})})
	if err != nil {
		t.Fatal(err)
	}
	_, err = g3.Do(ctx, key, fp, fn)
	var se *idem.SealError
	if !errors.As(err, &se) || !kmsKeyID.MatchString(se.KeyID) || !errors.Is(err, seal.ErrUnknownKey) || runs != 1 {
		t.Errorf("Guard of another KMS key: %v (runs %d); want a SealError naming the data key", err, runs)
	}

	// KMS down after the data key expired: Complete fails, nothing clear
	// is stored.
	srv.Stop()
	time.Sleep(time.Until(born.Add(450 * time.Millisecond)))
	key2 := idem.Key{2}
	_, err = g.Do(ctx, key2, fp, fn)
	if err == nil || !strings.Contains(err.Error(), srv.KeyARN()) {
		t.Errorf("Do with KMS down and the data key expired: %v; want an error naming %s", err, srv.KeyARN())
	}
	if rec, ok, _ := store.Get(ctx, key2); ok && rec.Response != nil {
		b, _ := rec.Response.AppendBinary(nil)
		if bytes.Contains(b, []byte("4111")) {
			t.Error("with KMS down, the response was stored in clear")
		}
	}
}
