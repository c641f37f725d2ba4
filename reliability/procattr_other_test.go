//go:build !linux

package reliability

import "syscall"

// childAttr has nothing to add outside Linux.
func childAttr() *syscall.SysProcAttr { return &syscall.SysProcAttr{} }
