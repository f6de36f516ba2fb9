//go:build !linux

package failover

import "syscall"

func sysProcAttr() *syscall.SysProcAttr { return nil }
