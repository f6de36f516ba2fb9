//go:build linux

package hostile

import "syscall"

// sysProcAttr makes the kernel SIGKILL a child process (idem proxy) when the thread that
// started it dies, so children never outlive a crashed test binary.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
