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
	"io"
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

// issued writes a certificate for localhost signed by ca (nil: a CA of
// its own, self-signed) to cert and key, and returns it with its key.
func issued(t *testing.T, ca *x509.Certificate, caKey *ecdsa.PrivateKey, serial int64, isCA, client bool, cert, key string) (*x509.Certificate, *ecdsa.PrivateKey) {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: "localhost"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IsCA: isCA, BasicConstraintsValid: true}
	if client {
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}
	} else if !isCA {
		tmpl.DNSNames, tmpl.ExtKeyUsage = []string{"localhost"}, []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
	} else {
		tmpl.KeyUsage = x509.KeyUsageCertSign
	}
	if ca == nil {
		ca, caKey = tmpl, k
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &k.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	kder, _ := x509.MarshalPKCS8PrivateKey(k)
	os.WriteFile(cert, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600)
	if key != "" {
		os.WriteFile(key, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: kder}), 0o600)
	}
	c, _ := x509.ParseCertificate(der)
	return c, k
}

// TestCertSourceResumedClientCA: a client that resumes a TLS session
// after its CA was taken out of the client CA file (and reloaded) is
// refused, as a new handshake is; before that, it resumes.
func TestCertSourceResumedClientCA(t *testing.T) {
	dir := t.TempDir()
	p := func(name string) string { return filepath.Join(dir, name) }
	ca1, ca1Key := issued(t, nil, nil, 1, true, false, p("ca1.pem"), "")
	issued(t, nil, nil, 2, true, false, p("ca2.pem"), "")
	issued(t, ca1, ca1Key, 10, false, false, p("server.crt"), p("server.key"))
	issued(t, ca1, ca1Key, 11, false, true, p("client.crt"), p("client.key"))
	b, _ := os.ReadFile(p("ca1.pem"))
	os.WriteFile(p("clients.pem"), b, 0o600)
	s, err := NewCertSource(TLSFiles{Cert: p("server.crt"), Key: p("server.key"), CA: p("clients.pem")},
		TLSFiles{Cert: "cert", Key: "key", CA: "ca"}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	ln, err := tls.Listen("tcp", "127.0.0.1:0", s.Config())
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				if c.(*tls.Conn).Handshake() == nil {
					c.Write([]byte("ok"))
				}
			}()
		}
	}()
	roots := x509.NewCertPool()
	roots.AddCert(ca1)
	client, err := tls.LoadX509KeyPair(p("client.crt"), p("client.key"))
	if err != nil {
		t.Fatal(err)
	}
	cfg := &tls.Config{RootCAs: roots, ServerName: "localhost", Certificates: []tls.Certificate{client},
		ClientSessionCache: tls.NewLRUClientSessionCache(8)}
	dial := func() (resumed bool, err error) {
		c, err := tls.Dial("tcp", ln.Addr().String(), cfg)
		if err != nil {
			return false, err
		}
		defer c.Close()
		// The read takes the session ticket, and sees a refusal sent
		// after the client's Finished (TLS 1.3).
		buf := make([]byte, 2)
		if _, err := io.ReadFull(c, buf); err != nil {
			return false, err
		}
		return c.ConnectionState().DidResume, nil
	}
	if _, err := dial(); err != nil {
		t.Fatal(err)
	}
	if resumed, err := dial(); err != nil || !resumed {
		t.Fatalf("second connection: resumed %v, %v; want a resumed session", resumed, err)
	}
	b, _ = os.ReadFile(p("ca2.pem"))
	os.WriteFile(p("clients.pem"), b, 0o600)
	if err := s.Reload(); err != nil {
		t.Fatal(err)
	}
	if resumed, err := dial(); err == nil {
		t.Errorf("after its CA was taken out: connected (resumed %v), want refused", resumed)
	}
}
