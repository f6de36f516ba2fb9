package sidecar

import (
	"strings"
	"testing"
)

// TestStoreForLog checks that the logged name of a store names its
// database, /0 for Redis's default, and never the password.
func TestStoreForLog(t *testing.T) {
	for spec, want := range map[string]string{
		"":                                  "memory",
		"memory":                            "memory",
		"redis://:s3cret@127.0.0.1:6379":    "redis://127.0.0.1:6379/0",
		"redis://:s3cret@127.0.0.1:6379/":   "redis://127.0.0.1:6379/0",
		"redis://u:s3cret@127.0.0.1:6379/0": "redis://127.0.0.1:6379/0",
		"redis://u:s3cret@127.0.0.1:6379/9": "redis://127.0.0.1:6379/9",
		"rediss://127.0.0.1:6379?db=9&dial_timeout=1s":          "rediss://127.0.0.1:6379/9",
		"valkey://h:1?addr=h:2":                                 "valkey://h:1/0",
		"postgres://u:s3cret@db.example:5432/shop?sslmode=none": "postgres://db.example:5432/shop",
		"postgresql://app:s3cret@db.example":                    "postgresql://db.example/app",
		"postgres:///shop?host=/run/pg":                         "postgres://%2Frun%2Fpg/shop",
		"mysql://u:s3cret@127.0.0.1:3306/shop?tls=true":         "mysql://127.0.0.1:3306/shop",
		"mariadb://u:s3cret@db.example/shop":                    "mariadb://db.example:3306/shop",
		"redis://:s3cret@r:6379/2 postgres://u:s3cret@p/shop":   "redis://r:6379/2 postgres://p/shop",
	} {
		got := StoreForLog(spec)
		if got != want || strings.Contains(got, "s3cret") {
			t.Errorf("StoreForLog(%q) = %q, want %q", spec, got, want)
		}
	}
}
