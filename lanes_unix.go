//go:build linux || darwin || dragonfly || freebsd || netbsd || openbsd || solaris || illumos

package streamq

import "syscall"

// peekSocket tells, without consuming anything or blocking, whether the
// peer closed the socket, data waits in it, or neither.
func peekSocket(sys syscall.Conn) socketState {
	raw, err := sys.SyscallConn()
	if err != nil {
		return socketUnknown
	}
	state := socketUnknown
	if err := raw.Read(func(fd uintptr) bool {
		var b [1]byte
		n, _, err := syscall.Recvfrom(int(fd), b[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
		switch {
		case n > 0:
			state = socketData
		case n == 0 && err == nil:
			state = socketClosed
		case err == syscall.EAGAIN || err == syscall.EWOULDBLOCK:
			state = socketIdle
		default:
			state = socketClosed // reset, or closed here
		}
		return true // done: never wait for readiness
	}); err != nil {
		return socketClosed
	}
	return state
}
