package reliability

import "syscall"

// childAttr makes the kernel SIGKILL a worker when the test process dies, so a
// test binary killed by -timeout leaves no worker behind.
func childAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
