//go:build linux

package redistest

import "syscall"

// sysProcAttr makes the kernel SIGKILL a child process when the thread that
// started it dies, so servers do not outlive a crashed or killed test binary.
// (Go only ends an OS thread when a goroutine exits while locked to it with
// runtime.LockOSThread; do not start servers from such a goroutine.)
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
