package sidecar

import (
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"
)

func TestMySQLConfig(t *testing.T) {
	for _, c := range []struct {
		url, addr, user, pass, db string
		timeout                   time.Duration
	}{
		{"mysql://u:pw@db.example:3307/idem", "db.example:3307", "u", "pw", "idem", 5 * time.Second},
		{"mariadb://db.example/idem", "db.example:3306", "", "", "idem", 5 * time.Second},
		{"mysql://u@127.0.0.1/idem?timeout=2s&tls=false", "127.0.0.1:3306", "u", "", "idem", 2 * time.Second},
	} {
		u, _ := url.Parse(c.url)
		cfg, err := MySQLConfig(u, 5*time.Second)
		if err != nil {
			t.Fatalf("%s: %v", c.url, err)
		}
		if cfg.Net != "tcp" || cfg.Addr != c.addr || cfg.User != c.user || cfg.Passwd != c.pass || cfg.DBName != c.db || cfg.Timeout != c.timeout {
			t.Errorf("%s: got net %q addr %q user %q pass %q db %q timeout %v", c.url, cfg.Net, cfg.Addr, cfg.User, cfg.Passwd, cfg.DBName, cfg.Timeout)
		}
	}
	for raw, want := range map[string]string{
		"mysql:u:s3cret@127.0.0.1/db":               "has no host",
		"mysql://u:s3cret@127.0.0.1:1/":             "names no database",
		"mysql://u:s3cret@127.0.0.1:1/a/b":          "names no database",
		"mysql://u:s3cret@127.0.0.1:1/db?timeout=x": "parameters",
	} {
		u, _ := url.Parse(raw)
		_, err := MySQLConfig(u, time.Second)
		if err == nil || !strings.Contains(err.Error(), want) || strings.Contains(err.Error(), "s3cret") {
			t.Errorf("%s: got %v, want an error saying %q without the password", raw, err, want)
		}
	}
}

func TestTenantAndHints(t *testing.T) {
	r, _ := http.NewRequest("POST", "http://x/", nil)
	r.Header.Add("X-Tenant", "a")
	if got := TenantFunc("X-Tenant", "")(r); got != "hdr:a" {
		t.Errorf("one header value: tenant %q, want hdr:a", got)
	}
	r.Header.Add("X-Tenant", "b")
	if got := TenantFunc("X-Tenant", "")(r); got != "hdr:a\nb" {
		t.Errorf("two header values: tenant %q, want both", got)
	}
	h := http.Header{"Idempotency-Key": {"k"}, "Content-Type": {"a/b"}}
	out := HideReplayHints(h)
	if out["idempotency-key"][0] != "k" || out.Get("Content-Type") != "a/b" || h["Idempotency-Key"][0] != "k" {
		t.Errorf("HideReplayHints: got %v (and the original %v), want the key under its lower-case name in a copy", out, h)
	}
	if _, ok := out["Idempotency-Key"]; ok {
		t.Errorf("HideReplayHints kept the canonical name: %v", out)
	}
}
