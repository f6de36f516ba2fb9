//go:build !unix

package msgtest

import "time"

// ProcessCPU is not available on this platform: ok is false.
func ProcessCPU() (d time.Duration, ok bool) { return 0, false }
