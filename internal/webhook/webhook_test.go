package webhook

import (
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"
)

// A fixture of testdata/, written by a sender's own library (regen.sh).
type fixture struct {
	Generator    string              `json:"generator"`
	Secret       string              `json:"secret"`
	OldSecret    string              `json:"old_secret"`
	ForgerSecret string              `json:"forger_secret"`
	SignedAt     int64               `json:"signed_at"`
	Key          string              `json:"key"`
	Deliveries   map[string]delivery `json:"deliveries"`
}

type delivery struct {
	Headers map[string]string `json:"headers"`
	Body    string            `json:"body"`
}

func (d delivery) header() http.Header {
	h := http.Header{}
	for k, v := range d.Headers {
		h.Set(k, v)
	}
	return h
}

func loadFixture(t *testing.T, preset string) fixture {
	t.Helper()
	data, err := os.ReadFile(filepath.Join("testdata", preset+".json"))
	if err != nil {
		t.Fatal(err)
	}
	var f fixture
	if err := json.Unmarshal(data, &f); err != nil {
		t.Fatalf("testdata/%s.json: %v", preset, err)
	}
	if f.Secret == "" || f.Key == "" || f.SignedAt == 0 || f.Deliveries["genuine"].Body == "" {
		t.Fatalf("testdata/%s.json: incomplete fixture", preset)
	}
	return f
}

// verifier returns a Verifier of preset over the secrets, one a line of a
// secrets file, as an operator would write it.
func verifier(t *testing.T, preset string, secrets ...string) *Verifier {
	t.Helper()
	p, err := Lookup(preset)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "secrets")
	text := "# " + preset + " signing secrets, newest last\n\n" + strings.Join(secrets, "\n") + "\n"
	if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	s, err := SecretsFromFile(path)
	if err != nil {
		t.Fatal(err)
	}
	v, err := NewVerifier(p, s)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

var allPresets = []string{"github", "shopify", "standard-webhooks", "stripe"}

// signsTime reports whether the preset's scheme signs a timestamp.
func signsTime(preset string) bool { return preset == "stripe" || preset == "standard-webhooks" }

// The signature and key headers each preset needs, in its fixture's spelling.
var sigHeaders = map[string][]string{
	"github":            {"X-Hub-Signature-256"},
	"shopify":           {"X-Shopify-Hmac-Sha256"},
	"stripe":            {"Stripe-Signature"},
	"standard-webhooks": {"webhook-id", "webhook-timestamp", "webhook-signature"},
}

// Malformed values of each preset's signature header.
var malformed = map[string]map[string][]string{
	"github": {"X-Hub-Signature-256": {
		"sha1=0123456789abcdef0123456789abcdef01234567",
		"sha256=" + strings.Repeat("zz", 32),
		"sha256=" + strings.Repeat("ab", 31),
		strings.Repeat("ab", 32),
	}},
	"shopify": {"X-Shopify-Hmac-Sha256": {
		"not base64!",
		base64.StdEncoding.EncodeToString(make([]byte, 20)),
	}},
	"stripe": {"Stripe-Signature": {
		"v1=" + strings.Repeat("ab", 32),
		"t=1796176800",
		"t=1796176800,v0=" + strings.Repeat("ab", 32),
		"t=1796176800,v1=xyz",
		"t=1796176800,v1",
		"t=1796176800,t=1796176800,v1=" + strings.Repeat("ab", 32),
		"t=-1796176800,v1=" + strings.Repeat("ab", 32),
		"t=soon,v1=" + strings.Repeat("ab", 32),
	}},
	"standard-webhooks": {
		"webhook-signature": {"v1", "v1a,abc", "v1," + base64.StdEncoding.EncodeToString(make([]byte, 20)), "v1,@@@"},
		"webhook-timestamp": {"soon", "+1796176800", "1796176800.5"},
	},
}

// secretFree fails unless msg names the preset and holds none of the
// fixture's secrets (nor their decoded form) and nothing that looks like a
// signature.
func secretFree(t *testing.T, preset string, f fixture, msg string) {
	t.Helper()
	if !strings.Contains(msg, preset) {
		t.Errorf("error %q does not name the preset %s", msg, preset)
	}
	for _, s := range []string{f.Secret, f.OldSecret, f.ForgerSecret} {
		forms := []string{s}
		if b, err := base64.StdEncoding.DecodeString(strings.TrimPrefix(s, "whsec_")); err == nil {
			forms = append(forms, string(b))
		}
		for _, form := range forms {
			if strings.Contains(msg, form) {
				t.Errorf("error %q holds a secret", msg)
			}
		}
	}
	if m := regexp.MustCompile(`[0-9a-fA-F]{32,}|[A-Za-z0-9+/]{40,}={0,2}`).FindString(msg); m != "" {
		t.Errorf("error %q holds %q, a signature's shape", msg, m)
	}
}

func TestGenuineDeliveriesVerify(t *testing.T) {
	for _, preset := range allPresets {
		t.Run(preset, func(t *testing.T) {
			f := loadFixture(t, preset)
			t.Logf("fixture signed by %s", f.Generator)
			v := verifier(t, preset, f.Secret)
			d := f.Deliveries["genuine"]
			signed := time.Unix(f.SignedAt, 0)
			nows := []time.Time{signed}
			if signsTime(preset) {
				// The tolerance's edges, both sides, are still inside.
				nows = append(nows, signed.Add(DefaultTolerance), signed.Add(-DefaultTolerance))
			} else {
				// No timestamp is signed: a year later is the same delivery.
				nows = append(nows, signed.AddDate(1, 0, 0))
			}
			for _, now := range nows {
				key, err := v.Verify(d.header(), []byte(d.Body), now)
				if err != nil || key != f.Key {
					t.Errorf("at signing time %+ds: got key %q, error %v; want key %q", now.Unix()-f.SignedAt, key, err, f.Key)
				}
			}
		})
	}
}

func TestForgeriesAreRefused(t *testing.T) {
	for _, preset := range allPresets {
		t.Run(preset, func(t *testing.T) {
			f := loadFixture(t, preset)
			signed := time.Unix(f.SignedAt, 0)
			genuine := f.Deliveries["genuine"]
			type attempt struct {
				name   string
				v      *Verifier
				h      http.Header
				body   string
				now    time.Time
				reason string // a word the error must hold
			}
			good := verifier(t, preset, f.Secret)
			attempts := []attempt{
				{"wrong secret", verifier(t, preset, f.ForgerSecret), genuine.header(), genuine.Body, signed, "no secret gives"},
				{"signed by a forger under the real id", good, f.Deliveries["forged"].header(), f.Deliveries["forged"].Body, signed, "no secret gives"},
			}
			for _, i := range []int{0, len(genuine.Body) / 2, len(genuine.Body) - 1} {
				b := []byte(genuine.Body)
				b[i] ^= 0x01
				attempts = append(attempts, attempt{fmt.Sprintf("body altered at byte %d", i), good, genuine.header(), string(b), signed, "no secret gives"})
			}
			attempts = append(attempts, attempt{"body with a byte more", good, genuine.header(), genuine.Body + "\n", signed, "no secret gives"})
			for _, name := range sigHeaders[preset] {
				h := genuine.header()
				h.Del(name)
				attempts = append(attempts, attempt{name + " missing", good, h, genuine.Body, signed, "missing"})
				h = genuine.header()
				h.Set(name, "")
				attempts = append(attempts, attempt{name + " empty", good, h, genuine.Body, signed, "missing"})
				h = genuine.header()
				h.Add(name, h.Get(name))
				attempts = append(attempts, attempt{name + " twice", good, h, genuine.Body, signed, "2 times"})
			}
			for name, values := range malformed[preset] {
				for _, val := range values {
					h := genuine.header()
					h.Set(name, val)
					attempts = append(attempts, attempt{name + " " + val, good, h, genuine.Body, signed, "malformed"})
				}
			}
			if signsTime(preset) {
				attempts = append(attempts,
					attempt{"too old", good, genuine.header(), genuine.Body, signed.Add(DefaultTolerance + time.Second), "before now"},
					attempt{"too far ahead", good, genuine.header(), genuine.Body, signed.Add(-DefaultTolerance - time.Second), "after now"},
					attempt{"a day old", good, genuine.header(), genuine.Body, signed.AddDate(0, 0, 1), "before now"},
				)
			}
			switch preset {
			case "standard-webhooks":
				d := f.Deliveries["other_id"]
				attempts = append(attempts, attempt{"signature of another message id", good, d.header(), d.Body, signed, "no secret gives"})
				h := genuine.header()
				h.Set("webhook-timestamp", "1796176801")
				attempts = append(attempts, attempt{"timestamp changed after signing", good, h, genuine.Body, signed, "no secret gives"})
			case "stripe":
				h := genuine.header()
				h.Set("Stripe-Signature", strings.Replace(h.Get("Stripe-Signature"), "t=1796176800", "t=1796176801", 1))
				attempts = append(attempts, attempt{"timestamp changed after signing", good, h, genuine.Body, signed, "no secret gives"})
			}
			for _, a := range attempts {
				key, err := a.v.Verify(a.h, []byte(a.body), a.now)
				if !errors.Is(err, ErrUnverified) || errors.Is(err, ErrNoKey) || key != "" {
					t.Errorf("%s: got key %q, error %v; want ErrUnverified", a.name, key, err)
					continue
				}
				if !strings.Contains(err.Error(), a.reason) {
					t.Errorf("%s: error %q does not say %q", a.name, err, a.reason)
				}
				secretFree(t, preset, f, err.Error())
			}
		})
	}
}

func TestRotation(t *testing.T) {
	for _, preset := range allPresets {
		t.Run(preset, func(t *testing.T) {
			f := loadFixture(t, preset)
			now := time.Unix(f.SignedAt, 0)
			run := func(v *Verifier, name string) (string, error) {
				d := f.Deliveries[name]
				return v.Verify(d.header(), []byte(d.Body), now)
			}
			// The receiver rotates: both secrets in the file, either signs.
			both := verifier(t, preset, f.OldSecret, f.Secret)
			for _, name := range []string{"genuine", "old_secret"} {
				if key, err := run(both, name); err != nil || key != f.Key {
					t.Errorf("%s under both secrets: got key %q, error %v; want key %q", name, key, err, f.Key)
				}
			}
			// ... and the old one is what accepted old_secret.
			if _, err := run(verifier(t, preset, f.Secret), "old_secret"); !errors.Is(err, ErrUnverified) {
				t.Errorf("old_secret under the current secret alone: got %v; want ErrUnverified", err)
			}
			if _, ok := f.Deliveries["rotation"]; !ok {
				if signsTime(preset) {
					t.Fatal("fixture has no rotation delivery")
				}
				return
			}
			// The sender rotates: two signatures in the header, either
			// secret alone accepts the delivery.
			for _, s := range []string{f.Secret, f.OldSecret} {
				if key, err := run(verifier(t, preset, s), "rotation"); err != nil || key != f.Key {
					t.Errorf("rotation under one secret: got key %q, error %v; want key %q", key, err, f.Key)
				}
			}
			if _, err := run(verifier(t, preset, f.ForgerSecret), "rotation"); !errors.Is(err, ErrUnverified) {
				t.Errorf("rotation under the forger's secret: got %v; want ErrUnverified", err)
			}
		})
	}
}

func TestVerifiedWithoutKey(t *testing.T) {
	t.Run("stripe", func(t *testing.T) {
		f := loadFixture(t, "stripe")
		v := verifier(t, "stripe", f.Secret)
		for name, want := range map[string]string{
			"no_id":     `no "id"`,
			"id_number": "not a string",
			"not_json":  "not a JSON object",
		} {
			d := f.Deliveries[name]
			key, err := v.Verify(d.header(), []byte(d.Body), time.Unix(f.SignedAt, 0))
			if !errors.Is(err, ErrNoKey) || errors.Is(err, ErrUnverified) || key != "" {
				t.Errorf("%s: got key %q, error %v; want ErrNoKey", name, key, err)
				continue
			}
			if !strings.Contains(err.Error(), want) {
				t.Errorf("%s: error %q does not say %q", name, err, want)
			}
			secretFree(t, "stripe", f, err.Error())
		}
	})
	for preset, keyHeader := range map[string]string{"github": "X-GitHub-Delivery", "shopify": "X-Shopify-Webhook-Id"} {
		t.Run(preset, func(t *testing.T) {
			f := loadFixture(t, preset)
			v := verifier(t, preset, f.Secret)
			d := f.Deliveries["genuine"]
			h := d.header()
			h.Del(keyHeader)
			key, err := v.Verify(h, []byte(d.Body), time.Unix(f.SignedAt, 0))
			if !errors.Is(err, ErrNoKey) || errors.Is(err, ErrUnverified) || key != "" || !strings.Contains(err.Error(), keyHeader) {
				t.Errorf("without %s: got key %q, error %v; want ErrNoKey naming the header", keyHeader, key, err)
			}
			// A forgery without the key header is unverified first.
			d = f.Deliveries["forged"]
			h = d.header()
			h.Del(keyHeader)
			if _, err := v.Verify(h, []byte(d.Body), time.Unix(f.SignedAt, 0)); !errors.Is(err, ErrUnverified) {
				t.Errorf("forged without %s: got %v; want ErrUnverified", keyHeader, err)
			}
		})
	}
}

// stripeID's reading of the body, for the bodies no fixture can carry.
func TestStripeID(t *testing.T) {
	v := &Verifier{preset: presets["stripe"]}
	for _, c := range []struct{ body, key, err string }{
		{`{"id":"evt_1","object":"event"}`, "evt_1", ""},
		{`{"object":"event","data":{"id":"pi_1"},"id":"evt_2"}`, "evt_2", ""},
		{` {"id":"evt_3"} ` + "\n", "evt_3", ""},
		{`{"ID":"evt_1"}`, "", `no "id"`},
		{`{"data":{"id":"pi_1"}}`, "", `no "id"`},
		{`{"id":""}`, "", `no "id" or an empty one`},
		{`{"id":null}`, "", "not a string"},
		{`{"id":["evt_1"]}`, "", "not a string"},
		{`{"id":"evt_1","id":"evt_2"}`, "", "twice"},
		{`{"id":"evt_1"}{"id":"evt_2"}`, "", "more after"},
		{`{"id":"evt_1"`, "", "not valid JSON"},
		{`["evt_1"]`, "", "not a JSON object"},
		{``, "", "not a JSON object"},
	} {
		key, err := v.stripeID([]byte(c.body))
		switch {
		case c.err == "" && (err != nil || key != c.key):
			t.Errorf("%s: got key %q, error %v; want key %q", c.body, key, err, c.key)
		case c.err != "" && (!errors.Is(err, ErrNoKey) || !strings.Contains(err.Error(), c.err) || key != ""):
			t.Errorf("%s: got key %q, error %v; want ErrNoKey saying %q", c.body, key, err, c.err)
		}
	}
}

func TestLookup(t *testing.T) {
	for _, name := range allPresets {
		p, err := Lookup(name)
		if err != nil || p.Name() != name {
			t.Errorf("Lookup(%q): got %q, %v", name, p.Name(), err)
		}
		if want := map[bool]time.Duration{true: DefaultTolerance}[signsTime(name)]; p.Tolerance != want {
			t.Errorf("Lookup(%q).Tolerance: got %v, want %v", name, p.Tolerance, want)
		}
	}
	_, err := Lookup("gitlab")
	if err == nil || !strings.Contains(err.Error(), `"gitlab"`) || !strings.Contains(err.Error(), strings.Join(allPresets, ", ")) {
		t.Errorf(`Lookup("gitlab"): got %v; want an error naming it and listing %v`, err, allPresets)
	}
}

func TestNewVerifierChecks(t *testing.T) {
	secrets := func(text string) Secrets {
		s, err := parseSecrets("file /etc/idem/hook", text)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	std, _ := Lookup("standard-webhooks")
	for _, bad := range []string{"whsec_not base64!", "whsec_", "plain-text-secret"} {
		_, err := NewVerifier(std, secrets("whsec_aWRlbQ==\n"+bad+"\n"))
		if err == nil || !strings.Contains(err.Error(), "line 2 of file /etc/idem/hook") || strings.Contains(err.Error(), strings.TrimPrefix(bad, "whsec_")) && bad != "whsec_" {
			t.Errorf("standard-webhooks secret %q: got %v; want an error naming line 2 and the file, not the secret", bad, err)
		}
	}
	if _, err := NewVerifier(std, secrets("aWRlbQ==")); err != nil {
		t.Errorf("standard-webhooks secret without whsec_: got %v; want it accepted, as the libraries do", err)
	}
	stripe, _ := Lookup("stripe")
	stripe.Tolerance = 0
	if _, err := NewVerifier(stripe, secrets("whsec_x")); err == nil || !strings.Contains(err.Error(), "want at least 1s") {
		t.Errorf("stripe with tolerance 0: got %v; want an error", err)
	}
	stripe.Tolerance = time.Minute
	if _, err := NewVerifier(stripe, secrets("whsec_x")); err != nil {
		t.Errorf("stripe with tolerance 1m: got %v", err)
	}
	gh, _ := Lookup("github")
	gh.Tolerance = time.Minute
	if _, err := NewVerifier(gh, secrets("s")); err == nil || !strings.Contains(err.Error(), "signs no timestamp") {
		t.Errorf("github with a tolerance: got %v; want an error", err)
	}
	if _, err := NewVerifier(Preset{}, secrets("s")); err == nil {
		t.Error("the zero Preset: got no error")
	}
	gh.Tolerance = 0
	if _, err := NewVerifier(gh, Secrets{}); err == nil {
		t.Error("no secrets: got no error")
	}
}

// A shorter tolerance is the one enforced.
func TestTolerance(t *testing.T) {
	f := loadFixture(t, "stripe")
	p, _ := Lookup("stripe")
	p.Tolerance = 10 * time.Second
	v, err := NewVerifier(p, secretsOf(t, f.Secret))
	if err != nil {
		t.Fatal(err)
	}
	d := f.Deliveries["genuine"]
	for off, ok := range map[time.Duration]bool{10 * time.Second: true, 11 * time.Second: false, -10 * time.Second: true, -11 * time.Second: false} {
		_, err := v.Verify(d.header(), []byte(d.Body), time.Unix(f.SignedAt, 0).Add(off))
		if (err == nil) != ok {
			t.Errorf("%v from the signing time under a 10s tolerance: got %v; want accepted %v", off, err, ok)
		}
	}
}

func secretsOf(t *testing.T, lines ...string) Secrets {
	t.Helper()
	s, err := parseSecrets("test", strings.Join(lines, "\n"))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// One Verifier serves many requests at once (run under -race).
func TestConcurrentVerify(t *testing.T) {
	f := loadFixture(t, "standard-webhooks")
	v := verifier(t, "standard-webhooks", f.OldSecret, f.Secret)
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for i := range 8 {
		name := []string{"genuine", "forged"}[i%2]
		wg.Go(func() {
			d := f.Deliveries[name]
			for range 50 {
				key, err := v.Verify(d.header(), []byte(d.Body), time.Unix(f.SignedAt, 0))
				if (name == "genuine") != (err == nil && key == f.Key) {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Errorf("concurrent Verify: got %v", err)
	}
}

// What verification costs a delivery, per preset (the benchmark
// compares a signed webhook through the proxy with an unsigned request).
func BenchmarkVerify(b *testing.B) {
	for _, preset := range allPresets {
		b.Run(preset, func(b *testing.B) {
			data, err := os.ReadFile(filepath.Join("testdata", preset+".json"))
			if err != nil {
				b.Fatal(err)
			}
			var f fixture
			if err := json.Unmarshal(data, &f); err != nil {
				b.Fatal(err)
			}
			p, _ := Lookup(preset)
			s, _ := parseSecrets("bench", f.OldSecret+"\n"+f.Secret)
			v, err := NewVerifier(p, s)
			if err != nil {
				b.Fatal(err)
			}
			d := f.Deliveries["genuine"]
			h, body, now := d.header(), []byte(d.Body), time.Unix(f.SignedAt, 0)
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					if _, err := v.Verify(h, body, now); err != nil {
						b.Error(err)
						return
					}
				}
			})
		})
	}
}
