//go:build !linux

package childproc

import "syscall"

// SysProcAttr returns nil: parent-death signals exist only on Linux, so
// elsewhere children are ended only by the tests' cleanups.
func SysProcAttr() *syscall.SysProcAttr { return nil }

// Stopped reports true at once: without /proc there is nothing to watch.
func Stopped(int) (bool, error) { return true, nil }
