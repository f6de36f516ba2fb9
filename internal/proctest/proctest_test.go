package proctest

import (
	"os"
	"path/filepath"
	"testing"
)

func TestModuleRoot(t *testing.T) {
	root, err := moduleRoot()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(root, "cmd", "idem")); err != nil {
		t.Fatalf("module root %s: %v", root, err)
	}
}
