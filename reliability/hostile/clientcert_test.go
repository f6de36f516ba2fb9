package hostile

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/proctest"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/idemkit/idem/internal/reltest"
)

// certHost is the name of the TLS site (Caddy's strict SNI check for
// client authentication needs a name; clients dial 127.0.0.1 for it).
const certHost = "idem-hostile.test"

// testPKI is a CA of the test's, a server certificate for 127.0.0.1 and
// client certificates, written as PEM files in dir.
type testPKI struct {
	dir    string
	caKey  *ecdsa.PrivateKey
	ca     *x509.Certificate
	serial int64
}

func newTestPKI(t *testing.T) *testPKI {
	t.Helper()
	p := &testPKI{dir: t.TempDir()}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "idem hostile test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	p.caKey, p.serial = key, 1
	if p.ca, err = x509.ParseCertificate(der); err != nil {
		t.Fatal(err)
	}
	p.write(t, "ca.pem", "CERTIFICATE", der)
	return p
}

func (p *testPKI) write(t *testing.T, name, typ string, der []byte) string {
	t.Helper()
	path := filepath.Join(p.dir, name)
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// issue makes a certificate signed by the CA (a server's for certHost
// when server, else a client's named cn) and writes NAME.pem and
// NAME-key.pem.
func (p *testPKI) issue(t *testing.T, cn string, server bool) tls.Certificate {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	p.serial++
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(p.serial), Subject: pkix.Name{CommonName: cn},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour), KeyUsage: x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}
	if server {
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
		tmpl.DNSNames = []string{certHost}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, p.ca, &key.PublicKey, p.caKey)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	p.write(t, cn+".pem", "CERTIFICATE", der)
	p.write(t, cn+"-key.pem", "PRIVATE KEY", kder)
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
}

// TestClientCertificateCaddy identifies callers by their TLS client
// certificate: Caddy terminates TLS (client_auth verify_if_given, the
// test's CA) in front of idem's handler on Redis. `idem proxy` serves
// plain HTTP only (TLS ends in front of it, and a certificate does not
// cross that hop), so this style runs through Caddy alone. Alice's
// certificate twice, then Bob's and no certificate, with one key and
// body: Alice replays, Bob and the caller without one run their own.
func TestClientCertificateCaddy(t *testing.T) {
	t.Parallel()
	up := startCallerUpstream(t)
	pki := newTestPKI(t)
	pki.issue(t, "server", true)
	alice, bob := pki.issue(t, "alice", false), pki.issue(t, "bob", false)
	prefix := redistest.Prefix("callers")
	c := proctest.StartCaddy(t, func(addr string) string {
		host, port, _ := net.SplitHostPort(addr)
		return fmt.Sprintf(`{
	admin off
	persist_config off
	log {
		output stderr
		format json
		level WARN
	}
}
https://%s:%s {
	bind %s
	tls %s %s {
		client_auth {
			mode verify_if_given
			trust_pool file %s
		}
	}
	reverse_proxy %s
	idempotency {
		store redis://%s
		prefix %s
	}
}
`, certHost, port, host, filepath.Join(pki.dir, "server.pem"), filepath.Join(pki.dir, "server-key.pem"), filepath.Join(pki.dir, "ca.pem"),
			strings.TrimPrefix(up.url, "http://"), rdb.Addr(), prefix)
	})
	roots := x509.NewCertPool()
	roots.AddCert(pki.ca)
	clientWith := func(cert *tls.Certificate) *http.Client {
		cfg := &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}
		if cert != nil {
			cfg.Certificates = []tls.Certificate{*cert}
		}
		dial := func(ctx context.Context, network, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, network, c.Addr)
		}
		return &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: cfg, DialContext: dial}}
	}
	_, port, _ := net.SplitHostPort(c.Addr)
	url := "https://" + certHost + ":" + port + "/charges"
	key, body := "cert-"+randomToken(), `{"amount":8}`
	var tl tally
	before := up.count()
	first := tl.add(send(t, clientWith(&alice), url, key, body, nil))
	retry := tl.add(send(t, clientWith(&alice), url, key, body, nil))
	other := tl.add(send(t, clientWith(&bob), url, key, body, nil))
	none := tl.add(send(t, clientWith(nil), url, key, body, nil))
	if first.status != http.StatusCreated || first.replayed() {
		t.Fatalf("Caddy, client certificate: got Alice's first answer %d %q (replayed %v), want an execution", first.status, first.body, first.replayed())
	}
	if !retry.replayed() || retry.body != first.body {
		t.Errorf("Caddy, client certificate: got Alice's retry %d %q (replayed %v), want the replay of %q", retry.status, retry.body, retry.replayed(), first.body)
	}
	for _, who := range []struct {
		name string
		a    answer
	}{{"Bob's certificate", other}, {"no certificate", none}} {
		if who.a.replayed() || who.a.body == first.body || who.a.header.Get("X-Session-Token") == first.header.Get("X-Session-Token") {
			tl.leaked++
			t.Errorf("Caddy, %s: got %d %q (replayed %v), want its own execution, nothing of Alice's", who.name, who.a.status, who.a.body, who.a.replayed())
		}
	}
	tl.executions = up.count() - before
	if tl.executions != 3 {
		t.Errorf("Caddy, client certificate: the upstream ran %d times for Alice (twice), Bob and no certificate, want 3", tl.executions)
	}
	reltest.Report(t, reltest.Row{
		Scenario: "hostile: another caller, TLS client certificate (Caddy)", Store: "redis (single)",
		Fault:    "Caddy terminates TLS (client_auth verify_if_given); one key and body with Alice's certificate twice, Bob's, none (idem proxy serves plain HTTP: not run there)",
		Requests: tl.requests, Keys: 1, Duplicates: tl.executions - 3, ClientErrors: tl.errs,
		Notes: fmt.Sprintf("%d executions (Alice, Bob, no certificate), %d replay (Alice's); leaked to another caller: %d", tl.executions, tl.replays, tl.leaked),
	})
}
