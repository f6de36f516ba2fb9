//go:build !linux

package proctest

import "syscall"

// SysProcAttr returns nil: parent-death signals exist only on Linux, so
// elsewhere children are ended only by the tests' cleanups.
func SysProcAttr() *syscall.SysProcAttr { return nil }
