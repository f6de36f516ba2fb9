package idemgrpc_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"math/big"
	"net"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/idemkit/idem/idemgrpc"
	"github.com/idemkit/idem/memstore"
)

// Without authorization metadata, the peer's TLS client certificate is
// the tenant (DefaultTenant): two certificates never share a
// record, over a real TLS connection; a call without one has its own
// scope.
func TestTenantByClientCertificate(t *testing.T) {
	serverCert, roots := selfSigned(t, "127.0.0.1")
	icpt, err := idemgrpc.NewUnaryServerInterceptor(memstore.New(memstore.Options{}), idemgrpc.Config{Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	s := &server{h: func(ctx context.Context, _ string, _ *structpb.Struct) (*wrapperspb.StringValue, error) {
		return wrapperspb.String(idemgrpc.DefaultTenant(ctx)), nil
	}}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer(grpc.ChainUnaryInterceptor(recoverPanics, icpt),
		grpc.Creds(credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{serverCert}, ClientAuth: tls.RequestClientCert})))
	gs.RegisterService(&paymentsDesc, s)
	go gs.Serve(lis)
	t.Cleanup(gs.Stop)

	dial := func(cert *tls.Certificate) *server {
		cfg := &tls.Config{RootCAs: roots, ServerName: "127.0.0.1"}
		if cert != nil {
			cfg.Certificates = []tls.Certificate{*cert}
		}
		conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(credentials.NewTLS(cfg)))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		return &server{conn: conn}
	}
	aliceCert, _ := selfSigned(t, "")
	bobCert, _ := selfSigned(t, "")
	alice, bob, anon := dial(&aliceCert), dial(&bobCert), dial(nil)

	first := alice.call(t.Context(), methodCharge, "k", nil)
	if first.err != nil || first.replayed() || len(first.reply) < len("cert:") || first.reply[:5] != "cert:" {
		t.Fatalf("alice: got %q %v, want an execution under a cert: tenant", first.reply, first.err)
	}
	if b := bob.call(t.Context(), methodCharge, "k", nil); b.err != nil || b.replayed() || b.reply == first.reply {
		t.Errorf("bob: got %q replayed=%t (%v), want his own execution", b.reply, b.replayed(), b.err)
	}
	if a := alice.call(t.Context(), methodCharge, "k", nil); !a.replayed() || a.reply != first.reply {
		t.Errorf("alice's retry: got %q replayed=%t, want the replay of %q", a.reply, a.replayed(), first.reply)
	}
	if n := anon.call(t.Context(), methodCharge, "k", nil); n.err != nil || n.replayed() || n.reply != "" {
		t.Errorf("no certificate: got %q replayed=%t (%v), want its own execution with tenant \"\"", n.reply, n.replayed(), n.err)
	}
	// Authorization metadata comes first, as before.
	if a := alice.call(t.Context(), methodCharge, "k2", nil, "authorization", "Bearer x"); a.err != nil || a.reply[:6] != "authz:" {
		t.Errorf("alice with a token: got %q (%v), want an authz: tenant", a.reply, a.err)
	}
	wantRuns(t, s, 4)
}

// selfSigned makes a self-signed certificate (for host, when not "") and
// a pool that trusts it.
func selfSigned(t *testing.T, host string) (tls.Certificate, *x509.CertPool) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "idemgrpc test"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage:    x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		IsCA:        true, BasicConstraintsValid: true,
	}
	if host != "" {
		tmpl.IPAddresses = []net.IP{net.ParseIP(host)}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(leaf)
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}, pool
}
