// Package childproc holds what every child process the project starts
// needs, whether a test starts it or a command (idem bench's private
// redis-server): a parent-death signal on Linux ([SysProcAttr]), so that no
// child outlives a crashed parent, and a pause that returns once the child
// has really stopped ([Pause]).
package childproc

import (
	"fmt"
	"os"
	"syscall"
	"time"
)

// Pause stops p with SIGSTOP and returns once every thread of it is
// stopped (see Stopped), or an error after timeout.
func Pause(p *os.Process, timeout time.Duration) error {
	if err := p.Signal(syscall.SIGSTOP); err != nil {
		return err
	}
	deadline := time.Now().Add(timeout)
	for {
		ok, err := Stopped(p.Pid)
		if err != nil || ok {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("childproc: process %d not stopped %v after SIGSTOP", p.Pid, timeout)
		}
		time.Sleep(time.Millisecond)
	}
}
