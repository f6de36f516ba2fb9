package sidecar

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"log/slog"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// selfSigned writes a self-signed certificate of serial and its key to
// cert and key.
func selfSigned(t *testing.T, serial int64, cert, key string) {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: "localhost"},
		DNSNames: []string{"localhost"}, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &k.PublicKey, k)
	if err != nil {
		t.Fatal(err)
	}
	kder, _ := x509.MarshalPKCS8PrivateKey(k)
	os.WriteFile(cert, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600)
	os.WriteFile(key, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: kder}), 0o600)
}

type logBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuf) Write(p []byte) (int, error) { l.mu.Lock(); defer l.mu.Unlock(); return l.b.Write(p) }
func (l *logBuf) count(s string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Count(l.b.String(), s)
}

func serialOf(t *testing.T, s *CertSource) int64 {
	t.Helper()
	cfg, err := s.Config().GetConfigForClient(&tls.ClientHelloInfo{})
	if err != nil {
		t.Fatal(err)
	}
	return cfg.Certificates[0].Leaf.SerialNumber.Int64()
}

// TestCertSourceChanges: the watcher loads a change once it held still
// for one look; a change that does not load is logged once, however many
// looks see it, and the certificate in place is kept; Reload refuses a
// bad pair with an error and takes a good one.
func TestCertSourceChanges(t *testing.T) {
	dir := t.TempDir()
	cert, key := filepath.Join(dir, "c.pem"), filepath.Join(dir, "k.pem")
	selfSigned(t, 1, cert, key)
	var log logBuf
	names := TLSFiles{Cert: "--tls-cert", Key: "--tls-key", CA: "--tls-client-ca"}
	s, err := NewCertSource(TLSFiles{Cert: cert, Key: key}, names, slog.New(slog.NewTextHandler(&log, nil)))
	if err != nil {
		t.Fatal(err)
	}
	s.poll()
	if n := serialOf(t, s); n != 1 {
		t.Fatalf("serial %d, want 1", n)
	}

	selfSigned(t, 2, cert, key)
	s.poll() // the change is seen, not yet judged
	if n := serialOf(t, s); n != 1 {
		t.Errorf("after one look at a change: serial %d, want 1 (let it settle)", n)
	}
	s.poll()
	if n := serialOf(t, s); n != 2 {
		t.Errorf("after two looks: serial %d, want 2", n)
	}

	// A key of another pair: refused once, whatever the number of looks.
	other := filepath.Join(dir, "other")
	selfSigned(t, 3, other+".c", other+".k")
	b, _ := os.ReadFile(other + ".k")
	os.WriteFile(key, b, 0o600)
	for range 5 {
		s.poll()
	}
	if n := log.count("reload refused"); n != 1 {
		t.Errorf("%d refusals logged for one bad change, want 1:\n%s", n, log.b.String())
	}
	if !strings.Contains(log.b.String(), "the key does not match the certificate") {
		t.Errorf("the refusal does not say why:\n%s", log.b.String())
	}
	if n := serialOf(t, s); n != 2 {
		t.Errorf("after a bad pair: serial %d, want 2 kept", n)
	}
	if err := s.Reload(); err == nil || !strings.HasPrefix(err.Error(), "--tls-key "+key+": the key does not match") {
		t.Errorf("Reload of a bad pair: %v, want the key named", err)
	}

	selfSigned(t, 4, cert, key)
	if err := s.Reload(); err != nil {
		t.Fatal(err)
	}
	if n := serialOf(t, s); n != 4 {
		t.Errorf("after Reload: serial %d, want 4", n)
	}
	s.poll()
	s.poll()
	if n := log.count("reload refused"); n != 1 {
		t.Errorf("%d refusals logged, want 1", n)
	}
}
