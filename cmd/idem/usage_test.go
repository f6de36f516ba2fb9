package main

import (
	"bytes"
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/sidecar"
)

// Help that was asked for goes to stdout with status 0; a missing or
// unknown command is a usage error (2) on stderr.
func TestHelpAndUsage(t *testing.T) {
	for _, c := range []struct {
		args       []string
		code       int
		stdoutHelp bool
	}{
		{[]string{"--help"}, 0, true},
		{[]string{"-h"}, 0, true},
		{[]string{"help"}, 0, true},
		{nil, 2, false},
		{[]string{"frobnicate"}, 2, false},
	} {
		var out, errb bytes.Buffer
		code := run(context.Background(), c.args, &out, &errb)
		help := out.String()
		if !c.stdoutHelp {
			help = errb.String()
		}
		if code != c.code || !strings.Contains(help, "proxy") {
			t.Errorf("idem %q: exit %d, stdout %q, stderr %q; want exit %d and the commands on %s",
				c.args, code, out.String(), errb.String(), c.code, map[bool]string{true: "stdout", false: "stderr"}[c.stdoutHelp])
		}
	}
}

// Spellings of the in-process store that are not its name get a usage
// error that names it.
func TestStoreMemorySpellings(t *testing.T) {
	for _, spec := range []string{"mem", "memstore", "mem://", "memory://"} {
		code, stderr := runIdem(t, nil, "inspect", "--store", spec, "--key", "k", "--route", "/x")
		if code != 2 || !strings.Contains(stderr, "written memory") {
			t.Errorf("--store %s: exit %d, stderr %q; want 2 and the name memory", spec, code, stderr)
		}
	}
}

// Every store --store opens is named in each help text that lists the
// stores: the flags of every command that takes --store, the usage of
// inspect and purge, the proxy's warning on memory, the errors of the
// commands that read, and the package doc (`go doc`). The schemes are
// found, not listed here: every "scheme://" written anywhere in the module
// is offered to the sidecar's opener, and each one it does not refuse as
// an unknown scheme must be in the help. Each scheme the help names must
// open, too.
func TestHelpNamesEveryStore(t *testing.T) {
	accepted := acceptedStoreSchemes(t)
	for _, must := range []string{"redis", "valkey", "postgres", "mysql"} { // the probe found something
		if !slices.Contains(accepted, must) {
			t.Fatalf("accepted store schemes: got %q, want %s:// among them", accepted, must)
		}
	}
	help := func(cmd string) string {
		var out, errb bytes.Buffer
		if code := run(context.Background(), []string{cmd, "-h"}, &out, &errb); code != 0 {
			t.Fatalf("idem %s -h: exit %d, want 0\n%s", cmd, code, errb.String())
		}
		return out.String() + errb.String()
	}
	doc, err := os.ReadFile("main.go")
	if err != nil {
		t.Fatal(err)
	}
	texts := map[string]string{
		"idem proxy -h":         help("proxy"),
		"idem demo -h":          help("demo"),
		"idem inspect -h":       help("inspect"),
		"idem purge -h":         help("purge"),
		"idem gc -h":            help("gc"),
		"the memory warning":    memoryStoreWarning,
		"--store missing error": checkReadable("", "why").Error(),
		"--store memory error":  checkReadable("memory", "why").Error(),
		"main.go's package doc": string(doc[:bytes.Index(doc, []byte("\npackage main"))]),
	}
	for name, text := range texts {
		for _, scheme := range accepted {
			if !strings.Contains(text, scheme+"://") {
				t.Errorf("%s does not name %s://, a store --store opens", name, scheme)
			}
		}
		if !strings.Contains(text, "tiered") {
			t.Errorf("%s does not name the tiered store", name)
		}
	}
	for _, m := range regexp.MustCompile(`\b([a-z][a-z0-9+.-]*)://`).FindAllStringSubmatch(sharedStores, -1) {
		if !slices.Contains(accepted, m[1]) {
			t.Errorf("sharedStores names %s://, which --store does not open (it opens %q)", m[1], accepted)
		}
	}
}

// acceptedStoreSchemes returns the schemes of every "scheme://" in the
// module's Go and Markdown files that sidecar.OpenStore does not refuse as
// an unknown scheme, sorted.
func acceptedStoreSchemes(t *testing.T) []string {
	t.Helper()
	schemeRE := regexp.MustCompile(`\b([a-z][a-z0-9+.-]*)://`)
	seen := map[string]bool{}
	err := filepath.WalkDir("../..", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == ".git" || d.Name() == "node_modules") {
			return filepath.SkipDir
		}
		if ext := filepath.Ext(path); d.IsDir() || ext != ".go" && ext != ".md" {
			return nil
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, m := range schemeRE.FindAllSubmatch(b, -1) {
			seen[string(m[1])] = true
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	var accepted []string
	for scheme := range seen {
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
		// Port 1 on loopback: nothing listens, so an opener that gets past
		// the scheme fails at once, to connect.
		_, closeStore, err := sidecar.OpenStore(ctx, scheme+"://127.0.0.1:1/db", "", sidecar.StoreOptions{ReadOnly: true})
		cancel()
		if err == nil {
			closeStore()
		}
		if bad := (sidecar.BadStore{}); errors.As(err, &bad) && strings.Contains(bad.Msg, "unknown scheme") {
			continue
		}
		accepted = append(accepted, scheme)
	}
	slices.Sort(accepted)
	t.Logf("%d schemes in the module, --store opens %q", len(seen), accepted)
	return accepted
}
