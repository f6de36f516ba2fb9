package bench

import (
	"bytes"
	"context"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"
)

// TestPeersModule runs go vet and go test in internal/benchpeers, the
// module of the peers (gofiber/fiber's idempotency middleware, watermill's
// Deduplicator), which the main module's go test ./... does not reach: it
// is a module of its own so that the library's users never download the
// peers. Its tests run idem bench --quick with the peers, two instances,
// and the consumer comparison, at a small size. Under -race here, under
// -race there.
func TestPeersModule(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and tests another module (-short)")
	}
	goBin := filepath.Join(runtime.GOROOT(), "bin", "go")
	dir, err := filepath.Abs(filepath.Join("..", "benchpeers"))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	testArgs := []string{"test", "-count=1", "-timeout", "8m"}
	if raceEnabled {
		testArgs = append(testArgs, "-race")
	}
	for _, args := range [][]string{{"vet", "./..."}, append(testArgs, "./...")} {
		cmd := exec.CommandContext(ctx, goBin, args...)
		cmd.Dir = dir
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		if err := cmd.Run(); err != nil {
			hint := ""
			if strings.Contains(out.String(), "go.sum") || strings.Contains(out.String(), "go mod tidy") {
				hint = "\n(the main module's requirements changed: run go mod tidy in internal/benchpeers)"
			}
			t.Fatalf("go %s in internal/benchpeers: %v\n%s%s", strings.Join(args, " "), err, out.String(), hint)
		}
		t.Logf("go %s in internal/benchpeers:\n%s", strings.Join(args, " "), out.String())
	}
}
