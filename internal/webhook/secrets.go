package webhook

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"regexp"
	"strings"
)

// Secrets are the signing secrets of one webhook endpoint, several while a
// sender rotates them. They are read from a file or an environment
// variable, never from a flag's value (which ps and shell histories show),
// and they never print: String, GoString and LogValue name only where they
// came from and how many there are, so that a Secrets passed to a log line
// or an error by mistake leaks nothing.
type Secrets struct {
	source string // "file PATH" or "environment variable NAME", for errors
	lines  []secretLine
}

type secretLine struct {
	n     int // 1-based line number in the source, for errors that must not quote the value
	value string
}

// SecretsFromFile reads the secrets in the file at path: one a line,
// surrounding white space (a trailing "\r" too) trimmed, blank lines and
// lines starting with "#" ignored. A file without any secret is an error
// that names the file.
func SecretsFromFile(path string) (Secrets, error) {
	if strings.HasPrefix(path, "whsec_") {
		// A secret given where its file's path goes: never quote it.
		return Secrets{}, errors.New("webhook secret file: the setting holds a secret (whsec_...), not a path; want the path of a file that holds the secrets, one a line")
	}
	data, err := os.ReadFile(path)
	if err != nil {
		// os.PathError names the file and the cause, never its contents.
		return Secrets{}, fmt.Errorf("webhook secret file: %w", err)
	}
	return parseSecrets("file "+path, string(data))
}

// SecretsFromEnv reads the secrets in the environment variable name, in
// SecretsFromFile's format (newline-separated). An unset variable, or one
// without any secret, is an error that names the variable.
func SecretsFromEnv(name string) (Secrets, error) {
	if !envName.MatchString(name) {
		// Perhaps the secret itself, given where its variable's name goes:
		// never quote it.
		return Secrets{}, errors.New("webhook secret: the environment variable's name is not a name; want letters, digits and _ ([A-Za-z_][A-Za-z0-9_]*), the name of a variable that holds the secrets")
	}
	text, ok := os.LookupEnv(name)
	if !ok {
		return Secrets{}, fmt.Errorf("webhook secret: environment variable %s is not set", name)
	}
	return parseSecrets("environment variable "+name, text)
}

// envName is what SecretsFromEnv takes for a variable's name.
var envName = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

func parseSecrets(source, text string) (Secrets, error) {
	s := Secrets{source: source}
	n := 0
	for line := range strings.Lines(text) {
		n++
		v := strings.TrimSpace(line)
		if v == "" || strings.HasPrefix(v, "#") {
			continue
		}
		s.lines = append(s.lines, secretLine{n: n, value: v})
	}
	if len(s.lines) == 0 {
		return Secrets{}, fmt.Errorf("webhook secret: %s holds no secret; want one a line (blank lines and # comments are ignored)", source)
	}
	return s, nil
}

// Len reports how many secrets there are.
func (s Secrets) Len() int { return len(s.lines) }

// String names where the secrets came from and how many there are, never
// their values.
func (s Secrets) String() string {
	if s.source == "" {
		return "no webhook secrets"
	}
	return fmt.Sprintf("%d webhook secret(s) from %s", len(s.lines), s.source)
}

// GoString is String, so that %#v does not print the values either.
func (s Secrets) GoString() string { return s.String() }

// LogValue is String, for slog.
func (s Secrets) LogValue() slog.Value { return slog.StringValue(s.String()) }

var errNoSecrets = errors.New("webhook: no secrets (load them with SecretsFromFile or SecretsFromEnv)")
