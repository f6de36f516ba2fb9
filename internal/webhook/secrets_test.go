package webhook

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func TestSecretsFromFile(t *testing.T) {
	dir := t.TempDir()
	for _, c := range []struct {
		name, text string
		want       []string // nil: an error naming the file
	}{
		{"one", "s3cret\n", []string{"s3cret"}},
		{"no final newline", "s3cret", []string{"s3cret"}},
		{"two for a rotation", "old-one\nnew-one\n", []string{"old-one", "new-one"}},
		{"comments, blanks, CRLF and spaces", "# rotated 2026-12-01\r\n\r\n  old-one  \r\n\t# next\nnew-one\r\n\n", []string{"old-one", "new-one"}},
		{"a # inside a secret", "abc#def\n", []string{"abc#def"}},
		{"empty", "", nil},
		{"blank lines only", "\n \n\t\n", nil},
		{"comments only", "# put the secret here\n#\n", nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			path := filepath.Join(dir, strings.ReplaceAll(c.name, " ", "_"))
			if err := os.WriteFile(path, []byte(c.text), 0o600); err != nil {
				t.Fatal(err)
			}
			s, err := SecretsFromFile(path)
			if c.want == nil {
				if err == nil || !strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), "no secret") {
					t.Errorf("got %v, %v; want an error naming %s", s, err, path)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, l := range s.lines {
				got = append(got, l.value)
			}
			if !slices.Equal(got, c.want) || s.Len() != len(c.want) {
				t.Errorf("got %q (Len %d), want %q", got, s.Len(), c.want)
			}
		})
	}
	t.Run("missing file", func(t *testing.T) {
		path := filepath.Join(dir, "absent")
		_, err := SecretsFromFile(path)
		if !errors.Is(err, fs.ErrNotExist) || !strings.Contains(err.Error(), path) {
			t.Errorf("got %v; want fs.ErrNotExist naming %s", err, path)
		}
	})
}

func TestSecretsFromEnv(t *testing.T) {
	const name = "IDEM_WEBHOOK_TEST_SECRET"
	t.Run("unset", func(t *testing.T) {
		os.Unsetenv(name)
		if _, err := SecretsFromEnv(name); err == nil || !strings.Contains(err.Error(), name+" is not set") {
			t.Errorf("got %v; want an error naming %s", err, name)
		}
	})
	t.Run("empty", func(t *testing.T) {
		t.Setenv(name, "# none yet\n")
		if _, err := SecretsFromEnv(name); err == nil || !strings.Contains(err.Error(), "environment variable "+name+" holds no secret") {
			t.Errorf("got %v; want an error naming %s", err, name)
		}
	})
	t.Run("two", func(t *testing.T) {
		t.Setenv(name, "old-one\nnew-one")
		s, err := SecretsFromEnv(name)
		if err != nil || s.Len() != 2 || s.lines[0].value != "old-one" || s.lines[1].value != "new-one" || s.lines[1].n != 2 {
			t.Errorf("got %+v, %v; want old-one on line 1, new-one on line 2", s.lines, err)
		}
	})
}

// A Secrets printed or logged by mistake shows no value.
func TestSecretsDoNotPrint(t *testing.T) {
	s, err := parseSecrets("file /run/secrets/hook", "hunter2-old\nhunter2-new\n")
	if err != nil {
		t.Fatal(err)
	}
	var log bytes.Buffer
	slog.New(slog.NewTextHandler(&log, nil)).Info("loaded", "secrets", s)
	slog.New(slog.NewJSONHandler(&log, nil)).Info("loaded", "secrets", s)
	for _, out := range []string{fmt.Sprint(s), fmt.Sprintf("%+v", s), fmt.Sprintf("%#v", s), fmt.Sprintf("%v", &s), log.String()} {
		if strings.Contains(out, "hunter2") {
			t.Errorf("printed %q: holds a secret", out)
		}
		if !strings.Contains(out, "2 webhook secret(s) from file /run/secrets/hook") {
			t.Errorf("printed %q: want the count and the source", out)
		}
	}
}

// TestSecretsSettingHoldsASecret: a secret written where its file's path
// or its variable's name goes is refused without being quoted.
func TestSecretsSettingHoldsASecret(t *testing.T) {
	const secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
	if _, err := SecretsFromFile(secret); err == nil || strings.Contains(err.Error(), "MfKQ") {
		t.Errorf("SecretsFromFile(a secret): %v, want an error that does not quote it", err)
	}
	for _, name := range []string{secret[6:] + "/+=", "my secret", "9LIVES"} {
		if _, err := SecretsFromEnv(name); err == nil || strings.Contains(err.Error(), name) {
			t.Errorf("SecretsFromEnv(%q): %v, want an error that does not quote it", name, err)
		}
	}
}
