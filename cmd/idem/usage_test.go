package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
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
