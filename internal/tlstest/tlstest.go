// Package tlstest makes the certificates of the TLS tests: a certificate
// authority of a test, written to a file, that issues server certificates
// for 127.0.0.1 and localhost and client certificates, with
// crypto/x509, into the test's own directory. It is test support: only
// _test.go files import it (it imports testing), so it is never linked
// into the idem binary.
package tlstest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// CA is a certificate authority of a test: its certificate is in File
// (PEM) and in Pool, and it issues server and client certificates into
// Dir.
type CA struct {
	t    testing.TB
	Dir  string
	Cert *x509.Certificate
	Key  *ecdsa.PrivateKey
	File string
	Pool *x509.CertPool
}

// NewCA makes a CA whose common name is name and writes its certificate
// to name.pem in dir.
func NewCA(t testing.TB, dir, name string) *CA {
	t.Helper()
	key := NewKey(t)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	ca := &CA{t: t, Dir: dir, Cert: cert, Key: key, File: filepath.Join(dir, name+".pem"), Pool: x509.NewCertPool()}
	ca.Pool.AddCert(cert)
	WritePEM(t, ca.File, "CERTIFICATE", der)
	return ca
}

// NewKey is a fresh P-256 key.
func NewKey(t testing.TB) *ecdsa.PrivateKey {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// WritePEM writes one PEM block to path by a rename, as a rotation does:
// a reader never sees half a file.
func WritePEM(t testing.TB, path, typ string, der []byte) {
	t.Helper()
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// WriteKey writes key to path as a PKCS #8 PEM block, by a rename.
func WriteKey(t testing.TB, path string, key *ecdsa.PrivateKey) {
	t.Helper()
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	WritePEM(t, path, "PRIVATE KEY", der)
}

// Issue writes a certificate for cn with serial, signed by ca, to
// name.crt and its key to name.key in ca.Dir: a server certificate for
// 127.0.0.1 and localhost, or (client) a client certificate.
func (ca *CA) Issue(name, cn string, serial int64, client bool) (certFile, keyFile string) {
	ca.t.Helper()
	certFile, keyFile = filepath.Join(ca.Dir, name+".crt"), filepath.Join(ca.Dir, name+".key")
	ca.IssueTo(certFile, keyFile, cn, serial, client)
	return certFile, keyFile
}

// IssueTo writes the certificate, then its key (two renames: the pair is
// not replaced at once, as with cp, so a reader that watches the files
// may see the new certificate with the old key for a while).
func (ca *CA) IssueTo(certFile, keyFile, cn string, serial int64, client bool) {
	t := ca.t
	t.Helper()
	key := NewKey(t)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: cn},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	if client {
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}
	} else {
		tmpl.DNSNames, tmpl.IPAddresses = []string{"localhost"}, []net.IP{net.IPv4(127, 0, 0, 1)}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, &key.PublicKey, ca.Key)
	if err != nil {
		t.Fatal(err)
	}
	WritePEM(t, certFile, "CERTIFICATE", der)
	WriteKey(t, keyFile, key)
}

// Pair is the tls.Certificate of a certificate and key file; its
// Certificate[0] is the certificate's DER.
func Pair(t testing.TB, certFile, keyFile string) tls.Certificate {
	t.Helper()
	c, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		t.Fatal(err)
	}
	return c
}
