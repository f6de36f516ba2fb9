//go:build !linux

package redistest

import "syscall"

// sysProcAttr returns nil: parent-death signals exist only on Linux, so
// elsewhere servers are cleaned up only by Stop.
func sysProcAttr() *syscall.SysProcAttr { return nil }
