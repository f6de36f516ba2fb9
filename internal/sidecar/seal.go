package sidecar

import (
	"context"
	"fmt"
	"log/slog"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/seal"
	"github.com/idemkit/idem/seal/awskms"
)

// SealSettings is how a sidecar seals the responses it stores (idem
// proxy's --seal-keys, --seal-kms and --seal-open-only; Caddy's seal_keys,
// seal_kms and seal_open_only). They are the process's, not a route's: one
// Sealer (NewSealer) serves every route, and idem proxy's --config file
// does not set them.
type SealSettings struct {
	// Keys is the key ring file: one key a line, "ID BASE64" (32-byte
	// AES-256 keys), the first the primary (seal.RingFromFile). It is read
	// at start and again on each reload (Sealer.Reload), so that a key
	// added as the first line becomes the primary with no downtime.
	Keys string
	// KMS is the ARN of an AWS KMS key whose data keys seal (envelope
	// encryption). With Keys too, KMS seals the new records and the ring
	// still opens those it sealed (moving from a ring to KMS).
	KMS string
	// OpenOnly: new responses are stored in clear, and sealed ones still
	// open (idem.Config.SealOpenOnly): turning sealing off without losing
	// the records sealed so far. It needs Keys or KMS.
	OpenOnly bool
}

// Enabled reports whether s names a source of keys.
func (s SealSettings) Enabled() bool { return s.Keys != "" || s.KMS != "" }

// kmsKeyARN is what SealSettings.KMS takes: the ARN of a KMS key, or of
// an alias (arn:aws:kms:REGION:ACCOUNT:key/ID or …:alias/NAME).
var kmsKeyARN = regexp.MustCompile(`^arn:aws[a-z-]*:kms:[a-z0-9-]+:[0-9]{12}:(key/[A-Za-z0-9-]+|alias/[A-Za-z0-9/_-]+)$`)

// Validate reports the first bad seal setting in one line, named by name
// (Settings.Validate's name function). It does not read the ring file:
// NewSealer does.
func (s SealSettings) Validate(name func(string) string) error {
	if s.Keys != "" && strings.TrimSpace(s.Keys) == "" {
		return fmt.Errorf("%s %q: want the path of a key ring file (lines ID BASE64, the first the primary)", name("seal-keys"), s.Keys)
	}
	if s.KMS != "" && !kmsKeyARN.MatchString(s.KMS) {
		return fmt.Errorf("%s %q: want the ARN of a KMS key, arn:aws:kms:REGION:ACCOUNT:key/ID (or an alias's, …:alias/NAME)", name("seal-kms"), s.KMS)
	}
	if s.OpenOnly && !s.Enabled() {
		return fmt.Errorf("%s needs %s or %s: the keys that open the records sealed so far", name("seal-open-only"), name("seal-keys"), name("seal-kms"))
	}
	return nil
}

// Sealer is a sidecar's idem.Sealer: the key ring of SealSettings.Keys
// and the KMS key of SealSettings.KMS, made once per process and given to
// every route (Env.Seal). Reload reads the ring file again and puts the
// new ring in place at once: Seal uses the primary of the ring in place
// when it is called, Open every key of it, so that a rotation (a new key
// added as the first line, then a reload) needs no restart, and a record
// sealed under the old primary still opens. It is safe for concurrent use
// and never prints a key.
type Sealer struct {
	settings SealSettings
	name     func(string) string
	kms      idem.Sealer // nil without SealSettings.KMS; not reloaded

	mu  sync.Mutex // serialises Reload
	now atomic.Pointer[sealerNow]
}

// sealerNow is what a Sealer seals and opens with until the next reload.
type sealerNow struct {
	ring   *seal.Ring // nil without SealSettings.Keys
	sealer idem.Sealer
}

// NewSealer makes the Sealer of s (nil, and no error, when s names no
// keys): it reads the ring file and opens the KMS key. Its error is one
// line that names the setting (by name) and the file, never a key: a
// missing or unreadable file, a key that is not 32 bytes of base64, a
// duplicate id, a file without a key (no primary).
func NewSealer(ctx context.Context, s SealSettings, name func(string) string) (*Sealer, error) {
	if err := s.Validate(name); err != nil {
		return nil, err
	}
	if !s.Enabled() {
		return nil, nil
	}
	sl := &Sealer{settings: s, name: name}
	if s.KMS != "" {
		kms, err := openKMS(ctx, s.KMS)
		if err != nil {
			return nil, fmt.Errorf("%s %s: %v", name("seal-kms"), s.KMS, err)
		}
		sl.kms = kms
	}
	now, err := sl.load()
	if err != nil {
		return nil, err
	}
	sl.now.Store(now)
	return sl, nil
}

// openKMS opens the sealer of the KMS key keyARN (SealSettings.KMS) with
// the AWS SDK's usual configuration (AWS_REGION, AWS_ENDPOINT_URL or
// AWS_ENDPOINT_URL_KMS, credentials from the environment, the shared files
// or the instance's role); it asks KMS for a data key at once, so that a
// wrong key, region, endpoint or credentials fail at start.
func openKMS(ctx context.Context, keyARN string) (idem.Sealer, error) {
	return awskms.Open(ctx, keyARN, awskms.Options{})
}

// load reads the ring file (if any) and makes what seals and opens with
// it.
func (s *Sealer) load() (*sealerNow, error) {
	now := &sealerNow{sealer: s.kms}
	if s.settings.Keys == "" {
		return now, nil
	}
	ring, err := seal.RingFromFile(s.settings.Keys)
	if err != nil {
		// seal's errors start "seal keys: " and name the file and line.
		return nil, fmt.Errorf("%s: %s", s.name("seal-keys"), strings.TrimPrefix(err.Error(), "seal keys: "))
	}
	now.ring, now.sealer = ring, ring
	if s.kms != nil {
		// KMS seals; the ring still opens what it sealed (a move from a
		// ring to KMS).
		now.sealer = seal.Combine(s.kms, ring)
	}
	return now, nil
}

// Reload reads the ring file again and puts it in place; a file that does
// not load is an error (one line, as NewSealer's) and the running ring is
// kept. Without a ring file it does nothing. The KMS key is not reopened.
func (s *Sealer) Reload() error {
	if s.settings.Keys == "" {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	now, err := s.load()
	if err != nil {
		return err
	}
	s.now.Store(now)
	return nil
}

// Reloads reports whether Reload reads anything (a ring file is set).
func (s *Sealer) Reloads() bool { return s != nil && s.settings.Keys != "" }

// OpenOnly reports SealSettings.OpenOnly.
func (s *Sealer) OpenOnly() bool { return s != nil && s.settings.OpenOnly }

// Seal seals with the primary key of the ring in place (or the KMS key).
func (s *Sealer) Seal(dst, plaintext, ad []byte) ([]byte, error) {
	return s.now.Load().sealer.Seal(dst, plaintext, ad)
}

// Open opens with the keys of the ring in place (or the KMS key).
func (s *Sealer) Open(dst, sealed, ad []byte) ([]byte, error) {
	return s.now.Load().sealer.Open(dst, sealed, ad)
}

// KeyID is the key id that sealed says sealed it.
func (s *Sealer) KeyID(sealed []byte) (string, bool) { return s.now.Load().sealer.KeyID(sealed) }

// String names the keys in place, never a key: the ring's source, its
// number of keys and its primary's id (seal.Ring's String), and the KMS
// key's ARN; "off" for a nil Sealer.
func (s *Sealer) String() string {
	if s == nil {
		return "off"
	}
	var parts []string
	if s.settings.KMS != "" {
		parts = append(parts, "KMS key "+s.settings.KMS)
	}
	if now := s.now.Load(); now != nil && now.ring != nil {
		parts = append(parts, now.ring.String())
	}
	if s.settings.OpenOnly {
		parts = append(parts, "open only (new records stored in clear)")
	}
	return strings.Join(parts, "; ")
}

// LogValue is String, for slog.
func (s *Sealer) LogValue() slog.Value { return slog.StringValue(s.String()) }
