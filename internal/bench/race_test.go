//go:build race

package bench

// raceEnabled: this test binary runs under the race detector, and so does
// TestPeersModule's go test of internal/benchpeers.
const raceEnabled = true
