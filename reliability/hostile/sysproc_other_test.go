//go:build unix && !linux

package hostile

import "syscall"

// sysProcAttr: no parent-death signal outside Linux; the tests' cleanups
// kill the children.
func sysProcAttr() *syscall.SysProcAttr { return nil }
