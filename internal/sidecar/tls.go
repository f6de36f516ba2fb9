package sidecar

import (
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// TLSFiles names the PEM files of one end of a TLS connection: a
// certificate (its chain, leaf first) and its private key, both or
// neither, and CA certificates: for a listener, the CAs that sign the
// client certificates it requires (mTLS); for an upstream, the CAs it is
// trusted by instead of the system's.
type TLSFiles struct {
	Cert, Key, CA string
}

// CertWatchInterval is how often a sidecar looks at its TLS files by
// default (CertSource.Watch): a rotated certificate is served within two
// intervals.
const CertWatchInterval = 2 * time.Second

// CertSource is the certificate of a TLS listener and, with a CA file, the
// pool its clients' certificates must verify against (or the client
// certificate of UpstreamTLS), read from PEM files and replaced while the
// listener serves: by Reload (on SIGHUP) and by
// Watch when the files' contents change. Connections already open keep
// the certificate they were handshaken with; each new handshake gets the
// one in place (tls.Config.GetConfigForClient reads it behind an atomic
// pointer, so a reload never waits for a handshake or drops one). New
// files that do not load (a key that does not match its certificate, a CA
// file without a certificate) are refused and the running ones kept.
//
// A session resumed with a ticket issued before a reload is checked
// against the client CAs in place (crypto/tls verifies a resumed client
// chain against the config of the handshake), so a CA taken out of the
// file stops admitting its clients at the next handshake, resumed or not.
type CertSource struct {
	what         string // what the log calls it: "certificates", "upstream certificate"
	upstream     bool   // the client side's (UpstreamTLS): CA is the upstream's roots, Cert optional
	files, names TLSFiles
	logger       *slog.Logger
	base         *tls.Config // what ServeTLS is given; its session ticket keys are shared by every state

	cur atomic.Pointer[certState]

	mu      sync.Mutex // serialises loads (Reload, poll) and guards the fields below
	refused [32]byte   // digest of the last contents refused: each change is logged once
	pending [32]byte   // digest the watcher saw last that is neither loaded nor refused
}

// certState is one generation of the files, loaded whole.
type certState struct {
	sum    [32]byte    // the digest of the files' contents it was loaded from
	config *tls.Config // the handshake's config: the certificate, the client CAs
	leaf   *x509.Certificate
	roots  *x509.CertPool // an upstream's CAs (UpstreamTLS); nil: the system's
}

// NewCertSource loads files (Cert and Key required; CA optional) for a
// listener. names are what to call each file in errors, such as
// "--tls-cert" (the error then reads "--tls-cert /etc/idem/tls.crt: ...").
// The logger gets a line for each certificate put in place, and the
// watcher's reloads and refusals, under "what": "certificates".
func NewCertSource(files, names TLSFiles, logger *slog.Logger) (*CertSource, error) {
	return newCertSource("certificates", files, names, logger)
}

func newCertSource(what string, files, names TLSFiles, logger *slog.Logger) (*CertSource, error) {
	s := &CertSource{what: what, files: files, names: names, logger: logger}
	s.base = &tls.Config{
		MinVersion: tls.VersionTLS12,
		NextProtos: []string{"h2", "http/1.1"},
		GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) {
			return s.cur.Load().config, nil
		},
	}
	st, err := s.load()
	if err != nil {
		return nil, err
	}
	s.install(st)
	return s, nil
}

// Config is the listener's tls.Config (for http.Server.TLSConfig, or
// tls.NewListener): TLS 1.2 at least, ALPN h2 and http/1.1, and each
// handshake served from the files in place.
func (s *CertSource) Config() *tls.Config { return s.base }

// Reload reads the files again and puts them in place, or returns an
// error that says in one line what is wrong with them and keeps the
// running ones (the sidecar's SIGHUP, ReloadOnHangup, logs it).
func (s *CertSource) Reload() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	st, err := s.load()
	if err != nil {
		s.refused = st.sum
		return err
	}
	s.install(st)
	return nil
}

// Watch looks at the files every interval until ctx is done, and loads
// them when their contents changed (mtimes are not trusted: a copy can
// keep one, and Kubernetes swaps a secret's files by a symlink). A change
// is loaded once it has held still for one interval, so that a rotation
// that writes the certificate and then the key is not judged half done; a
// change that does not load is logged once at ERROR and the running
// files kept, until the files change again.
func (s *CertSource) Watch(ctx context.Context, interval time.Duration) {
	go func() {
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				s.poll()
			}
		}
	}()
}

// WatchCerts starts Watch on each source that is not nil, every interval
// (0: none), and returns their Reloads for ReloadOnHangup.
func WatchCerts(ctx context.Context, interval time.Duration, sources ...*CertSource) []Reload {
	var reloads []Reload
	for _, s := range sources {
		if s == nil {
			continue
		}
		if interval > 0 {
			s.Watch(ctx, interval)
		}
		reloads = append(reloads, Reload{What: s.what, Do: s.Reload})
	}
	return reloads
}

// poll is one look of Watch.
func (s *CertSource) poll() {
	sum := s.digest()
	s.mu.Lock()
	defer s.mu.Unlock()
	if sum == s.cur.Load().sum || sum == s.refused {
		s.pending = [32]byte{}
		return
	}
	if sum != s.pending {
		s.pending = sum // changed since the last look: let it settle
		return
	}
	s.pending = [32]byte{}
	st, err := s.load()
	if err != nil && st.sum != sum {
		s.pending = st.sum // changed again since the look: judge it at the next
		return
	}
	if err != nil {
		s.refused = st.sum
		s.logger.Error("reload refused; the running configuration is kept", "what", s.what, "cause", "files changed", "error", err)
		return
	}
	s.install(st)
	s.logger.Info("reloaded", "what", s.what, "cause", "files changed")
}

// install puts st in place and logs what is served now.
func (s *CertSource) install(st certState) {
	s.cur.Store(&st)
	if st.leaf == nil { // an upstream's CAs alone
		s.logger.Info("TLS CAs in place", "what", s.what, "ca", s.files.CA)
		return
	}
	attrs := []any{"what", s.what, "serial", st.leaf.SerialNumber.Text(16), "subject", st.leaf.Subject.String(),
		"dns_names", st.leaf.DNSNames, "not_after", st.leaf.NotAfter.UTC().Format(time.RFC3339)}
	if st.config.ClientCAs != nil {
		attrs = append(attrs, "client_ca", s.files.CA)
	}
	s.logger.Info("TLS certificate in place", attrs...)
	if now := time.Now(); now.After(st.leaf.NotAfter) || now.Before(st.leaf.NotBefore) {
		s.logger.Warn("the TLS certificate is not valid now: clients will refuse it", "serial", st.leaf.SerialNumber.Text(16),
			"not_before", st.leaf.NotBefore.UTC().Format(time.RFC3339), "not_after", st.leaf.NotAfter.UTC().Format(time.RFC3339))
	}
}

// read reads the files (Cert, Key, CA) as they are now, and their
// digest: contents, and the error of a file that cannot be read.
func (s *CertSource) read() (b [3][]byte, errs [3]error, sum [32]byte) {
	h := sha256.New()
	for i, p := range []string{s.files.Cert, s.files.Key, s.files.CA} {
		if p == "" {
			continue
		}
		if b[i], errs[i] = os.ReadFile(p); errs[i] != nil {
			fmt.Fprintf(h, "%d error %s\n", i, errs[i])
			continue
		}
		fmt.Fprintf(h, "%d %d\n", i, len(b[i]))
		h.Write(b[i])
	}
	return b, errs, [32]byte(h.Sum(nil))
}

// digest is the digest of the files' contents as they are now.
func (s *CertSource) digest() [32]byte {
	_, _, sum := s.read()
	return sum
}

// load reads and checks the files. The state's sum is set on error too
// (what was refused).
func (s *CertSource) load() (certState, error) {
	var st certState
	b, errs, sum := s.read()
	st.sum = sum
	paths, names := [3]string{s.files.Cert, s.files.Key, s.files.CA}, [3]string{s.names.Cert, s.names.Key, s.names.CA}
	for i, err := range errs {
		if err != nil {
			return st, fileError(names[i], paths[i], err)
		}
	}
	certPEM, keyPEM, caPEM := b[0], b[1], b[2]
	st.config = &tls.Config{MinVersion: tls.VersionTLS12, NextProtos: []string{"h2", "http/1.1"}}
	if s.files.Cert != "" || !s.upstream {
		cert, err := loadPair(certPEM, keyPEM, s.files, s.names)
		if err != nil {
			return st, err
		}
		st.leaf = cert.Leaf
		st.config.Certificates = []tls.Certificate{cert}
	}
	if s.files.CA != "" {
		pool, err := parsePool(caPEM, s.names.CA, s.files.CA)
		if err != nil {
			return st, err
		}
		if s.upstream {
			st.roots = pool
		} else {
			st.config.ClientCAs = pool
			st.config.ClientAuth = tls.RequireAndVerifyClientCert
		}
	}
	return st, nil
}

// UpstreamTLS is the client side's tls.Config for an https:// upstream:
// TLS 1.2 at least; the upstream verified against the CAs of files.CA
// (instead of the system's) when it is set; and, with files.Cert and
// files.Key, the certificate presented when the upstream asks for one.
// The files are held by certs (nil without any of them), a CertSource that
// Reload and Watch replace as a listener's ("what": "upstream
// certificate"), so that a short-lived client certificate, or the CA of
// an upstream's renewed certificate, is taken without a restart
// (connections open to the upstream keep what they were made with).
// serverName is the upstream's host (its URL's, without the port), the
// name its certificate must hold. names are what to call each file in
// errors.
func UpstreamTLS(serverName string, files, names TLSFiles, logger *slog.Logger) (cfg *tls.Config, certs *CertSource, err error) {
	cfg = &tls.Config{MinVersion: tls.VersionTLS12, ServerName: serverName}
	if files == (TLSFiles{}) {
		return cfg, nil, nil
	}
	certs = &CertSource{what: "upstream certificate", upstream: true, files: files, names: names, logger: logger}
	st, err := certs.load()
	if err != nil {
		return nil, nil, err
	}
	certs.install(st)
	if files.CA != "" {
		// The CAs in place at each handshake, not those of the start:
		// crypto/tls's own verification (with RootCAs) would need a new
		// Transport for each reload. InsecureSkipVerify only turns that
		// off; VerifyConnection verifies the chain and the name as it
		// would (x509.Certificate.Verify with cfg.ServerName, an IP
		// address included, and the server-auth usage).
		cfg.InsecureSkipVerify = true
		cfg.VerifyConnection = func(cs tls.ConnectionState) error {
			return verifyUpstream(cs, serverName, certs.cur.Load().roots)
		}
	}
	if files.Cert != "" {
		// Sent whatever CAs the upstream names (crypto/tls would send
		// nothing from Certificates when none matches): its refusal then
		// names the CA, which helps more than "no certificate".
		cfg.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			return &certs.cur.Load().config.Certificates[0], nil
		}
	}
	return cfg, certs, nil
}

// verifyUpstream verifies an upstream's chain against roots and its name
// (not cs.ServerName, the SNI, which is empty for an IP address), as
// crypto/tls does with RootCAs.
func verifyUpstream(cs tls.ConnectionState, name string, roots *x509.CertPool) error {
	if len(cs.PeerCertificates) == 0 {
		return errors.New("tls: the upstream sent no certificate")
	}
	if name == "" {
		return errors.New("tls: no name to verify the upstream's certificate against")
	}
	opts := x509.VerifyOptions{Roots: roots, DNSName: name, Intermediates: x509.NewCertPool()}
	for _, c := range cs.PeerCertificates[1:] {
		opts.Intermediates.AddCert(c)
	}
	if _, err := cs.PeerCertificates[0].Verify(opts); err != nil {
		return &tls.CertificateVerificationError{UnverifiedCertificates: cs.PeerCertificates, Err: err}
	}
	return nil
}

// fileError is an error about the file at path, which callers call name.
func fileError(name, path string, err error) error {
	var pe *os.PathError
	if errors.As(err, &pe) {
		err = pe.Err // the path is said already
	}
	return fmt.Errorf("%s %s: %w", name, path, err)
}

// loadPair parses a certificate chain and its private key (PKCS #8,
// PKCS #1 or SEC 1 "EC PRIVATE KEY") and checks that the key is the
// certificate's.
func loadPair(certPEM, keyPEM []byte, files, names TLSFiles) (tls.Certificate, error) {
	var cert tls.Certificate
	certs, err := parseCerts(certPEM)
	if err != nil {
		return cert, fileError(names.Cert, files.Cert, err)
	}
	for _, c := range certs {
		cert.Certificate = append(cert.Certificate, c.Raw)
	}
	cert.Leaf = certs[0]
	key, err := parseKey(keyPEM)
	if err != nil {
		return cert, fileError(names.Key, files.Key, err)
	}
	pub, ok := key.Public().(interface{ Equal(crypto.PublicKey) bool })
	if !ok || !pub.Equal(cert.Leaf.PublicKey) {
		return cert, fmt.Errorf("%s %s: the key does not match the certificate in %s %s (a pair from two renewals?)", names.Key, files.Key, names.Cert, files.Cert)
	}
	cert.PrivateKey = key
	return cert, nil
}

// parseCerts parses every CERTIFICATE block of a PEM file (other blocks
// are skipped, as crypto/tls does), at least one.
func parseCerts(b []byte) ([]*x509.Certificate, error) {
	var certs []*x509.Certificate
	for {
		var block *pem.Block
		block, b = pem.Decode(b)
		if block == nil {
			break
		}
		if block.Type != "CERTIFICATE" {
			continue
		}
		c, err := x509.ParseCertificate(block.Bytes)
		if err != nil {
			return nil, fmt.Errorf("certificate %d of the file: %w", len(certs)+1, err)
		}
		certs = append(certs, c)
	}
	if len(certs) == 0 {
		return nil, errors.New("no certificate in it (want PEM \"CERTIFICATE\" blocks)")
	}
	return certs, nil
}

// parsePool is the pool of every certificate of a PEM CA file.
func parsePool(b []byte, name, path string) (*x509.CertPool, error) {
	certs, err := parseCerts(b)
	if err != nil {
		return nil, fileError(name, path, err)
	}
	pool := x509.NewCertPool()
	for _, c := range certs {
		pool.AddCert(c)
	}
	return pool, nil
}

// parseKey parses the first private key block of a PEM file.
func parseKey(b []byte) (crypto.Signer, error) {
	for {
		var block *pem.Block
		block, b = pem.Decode(b)
		if block == nil {
			return nil, errors.New("no private key in it (want a PEM \"PRIVATE KEY\" block)")
		}
		if !strings.HasSuffix(block.Type, "PRIVATE KEY") {
			continue
		}
		var key any
		var err error
		switch block.Type {
		case "RSA PRIVATE KEY":
			key, err = x509.ParsePKCS1PrivateKey(block.Bytes)
		case "EC PRIVATE KEY":
			key, err = x509.ParseECPrivateKey(block.Bytes)
		default:
			key, err = x509.ParsePKCS8PrivateKey(block.Bytes)
		}
		if err != nil {
			return nil, fmt.Errorf("the %s block: %w (an encrypted key? the proxy takes it unencrypted)", block.Type, err)
		}
		switch k := key.(type) {
		case *rsa.PrivateKey, *ecdsa.PrivateKey, ed25519.PrivateKey:
			return k.(crypto.Signer), nil
		}
		return nil, fmt.Errorf("a %T key: want RSA, ECDSA or Ed25519", key)
	}
}
