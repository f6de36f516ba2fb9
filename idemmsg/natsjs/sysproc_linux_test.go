//go:build linux

package natsjs

import "syscall"

// sysProcAttr makes the kernel SIGKILL nats-server when the thread that
// started it dies, so it does not outlive a crashed or killed test binary.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
