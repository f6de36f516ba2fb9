//go:build linux

package proctest

import "syscall"

// SysProcAttr makes the kernel SIGKILL a child process (a server, an idem
// proxy, a client) when the thread that started it dies, so children never
// outlive a crashed or killed test binary. (Go only ends an OS thread when
// a goroutine exits while locked to it with runtime.LockOSThread; do not
// start children from such a goroutine.)
func SysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
