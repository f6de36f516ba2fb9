//go:build linux

package childproc

import (
	"bytes"
	"fmt"
	"os"
	"syscall"
)

// SysProcAttr makes the kernel SIGKILL a child process (a server, an idem
// proxy, a client) when the thread that started it dies, so children never
// outlive a crashed or killed test binary. (Go only ends an OS thread when
// a goroutine exits while locked to it with runtime.LockOSThread; do not
// start children from such a goroutine.)
func SysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}

// Stopped reports whether every thread of process pid is stopped (state T
// in /proc/PID/task/TID/stat). A SIGSTOP takes effect after kill returns:
// until every thread has stopped, a busy process may still read from its
// sockets and answer.
func Stopped(pid int) (bool, error) {
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		return false, err
	}
	for _, task := range tasks {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/stat", pid, task.Name()))
		if err != nil {
			return false, nil // the thread ended meanwhile: look again
		}
		// pid (comm) state ...: comm may hold spaces and parentheses.
		i := bytes.LastIndexByte(b, ')')
		if i < 0 || i+2 >= len(b) || b[i+2] != 'T' {
			return false, nil
		}
	}
	return len(tasks) > 0, nil
}
