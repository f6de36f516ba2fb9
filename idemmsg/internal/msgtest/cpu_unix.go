//go:build unix

package msgtest

import (
	"syscall"
	"time"
)

// ProcessCPU returns the CPU time, user plus system, this process (the
// test binary: consumers, client libraries, their goroutines) has used
// so far; ok is false where the platform does not tell. Benchmarks take
// it before and after the timed part, beside the server's (redisserver's
// CPUTime), to show where the work of each message goes.
func ProcessCPU() (d time.Duration, ok bool) {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0, false
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()), true
}
