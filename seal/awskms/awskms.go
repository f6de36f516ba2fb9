// Package awskms seals stored idempotency records with data keys from AWS
// KMS (envelope encryption): KMS makes an AES-256 data key under a KMS key
// the operator names (GenerateDataKey), the Sealer seals records with it
// (AES-256-GCM) for a while, and each sealed value carries the data key as
// KMS encrypted it, so that any Sealer of the same KMS key opens it (KMS
// decrypts the data key once; the cipher is then cached). The data key in
// clear lives only in memory, as a cipher, never in a store, a log or an
// error: whoever reads the store needs KMS's permission to decrypt under
// the key to read a record.
//
// A Sealer is an idem.Sealer: set it as idem.Config.Seal. To move from a
// key ring to KMS and still read what the ring sealed, combine them:
// seal.Combine(kmsSealer, ring).
//
// With the AWS SDK's usual configuration (the environment, the shared
// files, the instance's role):
//
//	// AWS_REGION=eu-west-1, AWS_ENDPOINT_URL=http://127.0.0.1:8080 for a
//	// local KMS (or AWS_ENDPOINT_URL_KMS), credentials as usual.
//	s, err := awskms.Open(ctx, "arn:aws:kms:eu-west-1:111122223333:key/1234abcd-12ab-34cd-56ef-1234567890ab", awskms.Options{})
//	if err != nil {
//		log.Fatal(err) // one line: the key, and what KMS said
//	}
//	guard, err := idem.NewGuard(store, idem.Config{Seal: s})
//
// Open (and New, with a client of one's own) asks KMS for a data key at
// once, so that a wrong key, region, endpoint or credentials fail at start.
//
// # Data keys
//
// A data key seals for at most Options.Lifetime (default 1h) and
// Options.MaxSeals values (default 2^20, far below the 2^32 random GCM
// nonces a key may take); the next Seal then asks KMS for a new one, and
// Seals that arrive meanwhile wait for that one call. A KMS that does not
// answer makes Seal fail once the data key has expired (the Guard then
// stores nothing and reports the error), never earlier. Open decrypts each
// data key it has not seen with one KMS call (concurrent Opens of values
// under one data key share it) and keeps the last Options.CacheSize
// (default 1024) ciphers; a KMS that does not answer fails the Opens of
// values whose data key is not cached, with an error (the Guard's
// idem.SealError), and nothing else.
//
// Every KMS call passes the encryption context {"idem": "seal/awskms/v1"}
// (a key policy can require it) and runs for at most Options.Timeout
// (default 10s).
//
// # The envelope
//
// Version 1:
//
//	magic   3 bytes  0xFF 'S' 'K'
//	version 1 byte   1
//	blob len 2 bytes big-endian, 1..65535
//	blob    the data key as KMS encrypted it (CiphertextBlob)
//	nonce   12 bytes random (crypto/rand)
//	sealed  AES-256-GCM ciphertext of the plaintext, then its 16-byte tag
//
// GCM authenticates the header (magic through blob) followed by the
// caller's associated data. The key id of a value (KeyID, for logs) is
// "kms:" and 16 hex digits of the SHA-256 of its blob: it names the data
// key without saying anything of it.
package awskms

import (
	"container/list"
	"context"
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/aws/arn"
	"github.com/aws/aws-sdk-go-v2/config"
	"github.com/aws/aws-sdk-go-v2/service/kms"
	"github.com/aws/aws-sdk-go-v2/service/kms/types"

	"github.com/idemkit/idem/seal"
)

// Client is the part of *kms.Client that a Sealer uses.
type Client interface {
	GenerateDataKey(ctx context.Context, in *kms.GenerateDataKeyInput, optFns ...func(*kms.Options)) (*kms.GenerateDataKeyOutput, error)
	Decrypt(ctx context.Context, in *kms.DecryptInput, optFns ...func(*kms.Options)) (*kms.DecryptOutput, error)
}

var _ Client = (*kms.Client)(nil)

// Options tune a Sealer. The zero value of a field is its default.
type Options struct {
	// Lifetime is the longest a data key seals for (default 1h); the
	// first Seal after it asks KMS for a new one.
	Lifetime time.Duration
	// MaxSeals is the most values a data key seals (default 2^20).
	MaxSeals int
	// CacheSize is how many decrypted data keys (ciphers) Open keeps
	// (default 1024), the least recently used dropped first.
	CacheSize int
	// Timeout bounds each KMS call (default 10s).
	Timeout time.Duration
}

// The defaults of Options.
const (
	DefaultLifetime  = time.Hour
	DefaultMaxSeals  = 1 << 20
	DefaultCacheSize = 1024
	DefaultTimeout   = 10 * time.Second
)

// EncryptionContext is the encryption context of every KMS call.
var EncryptionContext = map[string]string{"idem": "seal/awskms/v1"}

var magic = [3]byte{0xFF, 'S', 'K'}

const (
	version     = 1
	nonceSize   = 12
	tagSize     = 16
	dataKeySize = 32 // AES-256
	maxBlob     = 1<<16 - 1
	// headerMin is magic, version and the blob's length.
	headerMin = len(magic) + 1 + 2
)

// IsSealed reports whether b starts as this package's envelope does (the
// magic), whatever its version and whether or not it is whole.
func IsSealed(b []byte) bool {
	return len(b) >= len(magic) && b[0] == magic[0] && b[1] == magic[1] && b[2] == magic[2]
}

// Sealer seals with data keys from one KMS key. It is safe for concurrent
// use. It never prints a data key, in clear or encrypted: String,
// GoString and LogValue name the KMS key and the data key lifetime.
type Sealer struct {
	st *state
}

type state struct {
	c   Client
	arn string
	opt Options

	cur atomic.Pointer[current]

	mu      sync.Mutex
	refresh *call            // the GenerateDataKey under way
	opening map[string]*call // the Decrypts under way, by blob
	lru     *list.List       // of *key, the most recently used first
	cache   map[string]*list.Element
}

// key is a data key: its blob (as KMS encrypted it), its id and its
// cipher. The key in clear is kept nowhere but in the cipher.
type key struct {
	blob []byte
	id   string
	aead cipher.AEAD
}

// current is the data key that seals, until expires or MaxSeals.
type current struct {
	k       *key
	expires time.Time
	seals   atomic.Int64
}

// call is one KMS call that others wait for.
type call struct {
	done chan struct{}
	k    *key
	err  error
}

// New returns a Sealer of data keys made by c under the KMS key keyARN (a
// key ARN, or anything KMS takes as a KeyId: a key id, an alias name or
// ARN). It asks KMS for the first data key at once, with ctx: a wrong key,
// endpoint or credentials are an error, one line naming the key and what
// KMS said.
func New(ctx context.Context, c Client, keyARN string, opt Options) (*Sealer, error) {
	if c == nil {
		return nil, errors.New("seal kms: no KMS client (nil)")
	}
	if err := checkKeyARN(keyARN); err != nil {
		return nil, err
	}
	if err := opt.fill(); err != nil {
		return nil, err
	}
	st := &state{
		c: c, arn: keyARN, opt: opt,
		opening: map[string]*call{},
		lru:     list.New(),
		cache:   map[string]*list.Element{},
	}
	k, err := st.generate(ctx)
	if err != nil {
		return nil, err
	}
	st.install(k)
	return &Sealer{st: st}, nil
}

// Open returns a Sealer of data keys under the KMS key keyARN, with a KMS
// client of the AWS SDK's usual configuration (config.LoadDefaultConfig
// with optFns: AWS_REGION, AWS_ENDPOINT_URL_KMS or AWS_ENDPOINT_URL,
// credentials from the environment, the shared files or the instance's
// role). Without a region it takes the key ARN's. Like New, it asks KMS for
// a data key at once.
func Open(ctx context.Context, keyARN string, opt Options, optFns ...func(*config.LoadOptions) error) (*Sealer, error) {
	if err := checkKeyARN(keyARN); err != nil {
		return nil, err
	}
	cfg, err := config.LoadDefaultConfig(ctx, optFns...)
	if err != nil {
		return nil, fmt.Errorf("seal kms: loading the AWS configuration: %w", err)
	}
	if cfg.Region == "" {
		a, err := arn.Parse(keyARN)
		if err != nil || a.Region == "" {
			return nil, fmt.Errorf("seal kms: no AWS region for key %s: set AWS_REGION, or name the key by its ARN (arn:aws:kms:REGION:ACCOUNT:key/ID)", keyARN)
		}
		cfg.Region = a.Region
	}
	return New(ctx, kms.NewFromConfig(cfg), keyARN, opt)
}

func checkKeyARN(keyARN string) error {
	if keyARN == "" {
		return errors.New("seal kms: no KMS key; want its ARN (arn:aws:kms:REGION:ACCOUNT:key/ID), key id or alias")
	}
	if i := strings.IndexFunc(keyARN, func(r rune) bool { return unicode.IsSpace(r) || !unicode.IsPrint(r) }); i >= 0 {
		return fmt.Errorf("seal kms: the KMS key %q holds white space or a control character; want its ARN (arn:aws:kms:REGION:ACCOUNT:key/ID), key id or alias", keyARN)
	}
	return nil
}

func (o *Options) fill() error {
	for _, f := range []struct {
		name string
		d    *time.Duration
		def  time.Duration
	}{{"Lifetime", &o.Lifetime, DefaultLifetime}, {"Timeout", &o.Timeout, DefaultTimeout}} {
		if *f.d < 0 {
			return fmt.Errorf("seal kms: Options.%s is %v; want a positive duration (0: the default, %v)", f.name, *f.d, f.def)
		}
		if *f.d == 0 {
			*f.d = f.def
		}
	}
	for _, f := range []struct {
		name string
		n    *int
		def  int
	}{{"MaxSeals", &o.MaxSeals, DefaultMaxSeals}, {"CacheSize", &o.CacheSize, DefaultCacheSize}} {
		if *f.n < 0 {
			return fmt.Errorf("seal kms: Options.%s is %d; want a positive number (0: the default, %d)", f.name, *f.n, f.def)
		}
		if *f.n == 0 {
			*f.n = f.def
		}
	}
	return nil
}

// keyID is the id of the data key whose blob is blob.
func keyID(blob []byte) string {
	sum := sha256.Sum256(blob)
	return "kms:" + hex.EncodeToString(sum[:8])
}

// newKey makes the cipher of plain, a data key, whose encrypted form is
// blob (which it keeps). It does not keep plain.
func newKey(blob, plain []byte) (*key, error) {
	block, err := aes.NewCipher(plain)
	if err != nil {
		return nil, err
	}
	aead, err := cipher.NewGCM(block)
	if err != nil {
		return nil, err
	}
	return &key{blob: blob, id: keyID(blob), aead: aead}, nil
}

// generate asks KMS for a data key.
func (st *state) generate(ctx context.Context) (*key, error) {
	ctx, cancel := context.WithTimeout(ctx, st.opt.Timeout)
	defer cancel()
	out, err := st.c.GenerateDataKey(ctx, &kms.GenerateDataKeyInput{
		KeyId:             aws.String(st.arn),
		KeySpec:           types.DataKeySpecAes256,
		EncryptionContext: EncryptionContext,
	})
	if err != nil {
		return nil, fmt.Errorf("seal kms: a data key from KMS key %s: %w", st.arn, err)
	}
	defer clear(out.Plaintext)
	if len(out.Plaintext) != dataKeySize {
		return nil, fmt.Errorf("seal kms: KMS key %s gave a data key of %d bytes; want %d (AES-256)", st.arn, len(out.Plaintext), dataKeySize)
	}
	if n := len(out.CiphertextBlob); n == 0 || n > maxBlob {
		return nil, fmt.Errorf("seal kms: KMS key %s gave an encrypted data key of %d bytes; want 1 to %d", st.arn, n, maxBlob)
	}
	return newKey(append([]byte(nil), out.CiphertextBlob...), out.Plaintext)
}

// decrypt asks KMS for the data key of blob.
func (st *state) decrypt(blob []byte) (*key, error) {
	ctx, cancel := context.WithTimeout(context.Background(), st.opt.Timeout)
	defer cancel()
	out, err := st.c.Decrypt(ctx, &kms.DecryptInput{
		CiphertextBlob:    blob,
		KeyId:             aws.String(st.arn),
		EncryptionContext: EncryptionContext,
	})
	if err != nil {
		var bad *types.InvalidCiphertextException
		var other *types.IncorrectKeyException
		if errors.As(err, &bad) || errors.As(err, &other) {
			return nil, &refusedError{fmt.Sprintf("seal kms: data key %s: KMS key %s does not decrypt it (a data key of another KMS key, or altered): %v", keyID(blob), st.arn, err), err}
		}
		return nil, fmt.Errorf("seal kms: decrypting data key %s with KMS key %s: %w", keyID(blob), st.arn, err)
	}
	defer clear(out.Plaintext)
	if len(out.Plaintext) != dataKeySize {
		return nil, fmt.Errorf("seal kms: KMS key %s decrypted data key %s to %d bytes; want %d (AES-256)", st.arn, keyID(blob), len(out.Plaintext), dataKeySize)
	}
	return newKey(append([]byte(nil), blob...), out.Plaintext)
}

// refusedError is KMS's refusal to decrypt a data key: it matches
// seal.ErrUnknownKey (the value is under a key the Sealer does not hold)
// and KMS's error.
type refusedError struct {
	msg string
	err error
}

func (e *refusedError) Error() string   { return e.msg }
func (e *refusedError) Unwrap() []error { return []error{seal.ErrUnknownKey, e.err} }

// install makes k the data key that seals, and caches it for Open.
func (st *state) install(k *key) {
	c := &current{k: k, expires: time.Now().Add(st.opt.Lifetime)}
	st.mu.Lock()
	st.cur.Store(c)
	st.add(k)
	st.mu.Unlock()
}

// usable reports whether c may seal one more value (and counts it).
func (st *state) usable(c *current) bool {
	return c != nil && time.Now().Before(c.expires) && c.seals.Add(1) <= int64(st.opt.MaxSeals)
}

// sealKey returns the data key to seal with: the current one, or a new
// one from KMS, asked for by one caller while the others wait.
func (st *state) sealKey() (*key, error) {
	for {
		c := st.cur.Load()
		if st.usable(c) {
			return c.k, nil
		}
		st.mu.Lock()
		if st.cur.Load() != c { // replaced meanwhile
			st.mu.Unlock()
			continue
		}
		cl, leader := st.refresh, false
		if cl == nil {
			cl, leader = &call{done: make(chan struct{})}, true
			st.refresh = cl
		}
		st.mu.Unlock()
		if leader {
			cl.k, cl.err = st.generate(context.Background())
			if cl.err == nil {
				st.install(cl.k)
			}
			st.mu.Lock()
			st.refresh = nil
			st.mu.Unlock()
			close(cl.done)
		} else {
			<-cl.done
		}
		if cl.err != nil {
			return nil, cl.err
		}
	}
}

// openKey returns the data key of blob: cached, or from KMS, asked for
// by one caller while the others wait.
func (st *state) openKey(blob []byte) (*key, error) {
	st.mu.Lock()
	if e, ok := st.cache[string(blob)]; ok {
		st.lru.MoveToFront(e)
		st.mu.Unlock()
		return e.Value.(*key), nil
	}
	cl, leader := st.opening[string(blob)], false
	if cl == nil {
		cl, leader = &call{done: make(chan struct{})}, true
		st.opening[string(blob)] = cl
	}
	st.mu.Unlock()
	if leader {
		cl.k, cl.err = st.decrypt(blob)
		st.mu.Lock()
		delete(st.opening, string(blob))
		if cl.err == nil {
			st.add(cl.k)
		}
		st.mu.Unlock()
		close(cl.done)
	} else {
		<-cl.done
	}
	return cl.k, cl.err
}

// add caches k for Open, dropping the least recently used past
// CacheSize. st.mu is held.
func (st *state) add(k *key) {
	if e, ok := st.cache[string(k.blob)]; ok {
		st.lru.MoveToFront(e)
		return
	}
	st.cache[string(k.blob)] = st.lru.PushFront(k)
	for st.lru.Len() > st.opt.CacheSize {
		old := st.lru.Remove(st.lru.Back()).(*key)
		delete(st.cache, string(old.blob))
	}
}

// Seal appends to dst the envelope of plaintext sealed under the current
// data key with associated data ad, and returns the extended slice. It
// fails only when a new data key is due and KMS does not give one. dst
// and plaintext must not overlap.
func (s *Sealer) Seal(dst, plaintext, ad []byte) ([]byte, error) {
	k, err := s.st.sealKey()
	if err != nil {
		return dst, err
	}
	start := len(dst)
	dst = append(dst, magic[:]...)
	dst = append(dst, version)
	dst = binary.BigEndian.AppendUint16(dst, uint16(len(k.blob)))
	dst = append(dst, k.blob...)
	headerEnd := len(dst)
	dst = append(dst, make([]byte, nonceSize)...)
	nonce := dst[headerEnd:]
	rand.Read(nonce) // never fails (crypto/rand)
	return k.aead.Seal(dst, nonce, plaintext, associated(dst[start:headerEnd], ad)), nil
}

// parse splits sealed into its header, blob, nonce and ciphertext.
func parse(sealed []byte) (header, blob, nonce, ciphertext []byte, err error) {
	if !IsSealed(sealed) {
		return nil, nil, nil, nil, fmt.Errorf("%w: not a sealed value of AWS KMS data keys", seal.ErrTampered)
	}
	if len(sealed) < headerMin {
		return nil, nil, nil, nil, fmt.Errorf("%w: truncated header (%d bytes)", seal.ErrTampered, len(sealed))
	}
	if v := sealed[len(magic)]; v != version {
		return nil, nil, nil, nil, fmt.Errorf("%w: unknown envelope version %d", seal.ErrTampered, v)
	}
	n := int(binary.BigEndian.Uint16(sealed[len(magic)+1:]))
	if n == 0 || len(sealed) < headerMin+n+nonceSize+tagSize {
		return nil, nil, nil, nil, fmt.Errorf("%w: truncated or malformed (%d bytes, data key of %d bytes)", seal.ErrTampered, len(sealed), n)
	}
	end := headerMin + n
	return sealed[:end], sealed[headerMin:end], sealed[end : end+nonceSize], sealed[end+nonceSize:], nil
}

// Open checks and decrypts sealed, a value Seal made (this Sealer or
// another of the same KMS key) with the same ad, appends the plaintext to
// dst and returns the extended slice. A value that is not whole, altered,
// or sealed with another ad is an error wrapping seal.ErrTampered; one
// whose data key KMS will not decrypt under this KMS key (another key's,
// or an altered one), an error wrapping seal.ErrUnknownKey; a KMS that does
// not answer, an error naming the data key's id. dst and sealed must not
// overlap.
func (s *Sealer) Open(dst, sealed, ad []byte) ([]byte, error) {
	header, blob, nonce, ciphertext, err := parse(sealed)
	if err != nil {
		return dst, err
	}
	k, err := s.st.openKey(blob)
	if err != nil {
		return dst, err
	}
	out, err := k.aead.Open(dst, nonce, ciphertext, associated(header, ad))
	if err != nil {
		return dst, fmt.Errorf("%w: under data key %s (altered, or sealed with other associated data)", seal.ErrTampered, k.id)
	}
	return out, nil
}

// KeyID returns the id of the data key that sealed a value, "kms:" and 16
// hex digits, and false when sealed is not this package's envelope (its
// magic, version 1, a whole blob).
func (s *Sealer) KeyID(sealed []byte) (string, bool) { return KeyID(sealed) }

// KeyID is Sealer.KeyID without a Sealer: it reads only the envelope's
// header, "kms:" and the first 16 hex digits of the SHA-256 of the
// encrypted data key it carries (for tools without KMS access, such as
// idem inspect).
func KeyID(sealed []byte) (string, bool) {
	if !IsSealed(sealed) || len(sealed) < headerMin || sealed[len(magic)] != version {
		return "", false
	}
	n := int(binary.BigEndian.Uint16(sealed[len(magic)+1:]))
	if n == 0 || len(sealed) < headerMin+n {
		return "", false
	}
	return keyID(sealed[headerMin : headerMin+n]), true
}

// KeyARN returns the KMS key the Sealer's data keys are made under.
func (s *Sealer) KeyARN() string { return s.st.arn }

// associated returns the data GCM authenticates: the envelope's header,
// then the caller's associated data.
func associated(header, ad []byte) []byte {
	b := make([]byte, 0, len(header)+len(ad))
	return append(append(b, header...), ad...)
}

// String names the KMS key and the data keys' lifetime, never a data key.
func (s Sealer) String() string {
	if s.st == nil {
		return "no AWS KMS key"
	}
	return fmt.Sprintf("AWS KMS data keys under %s (each sealing for %v or %d values)", s.st.arn, s.st.opt.Lifetime, s.st.opt.MaxSeals)
}

// GoString is String, so that %#v does not print the data keys either.
func (s Sealer) GoString() string { return s.String() }

// LogValue is String, for slog.
func (s Sealer) LogValue() slog.Value { return slog.StringValue(s.String()) }
