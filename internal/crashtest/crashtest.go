// Package crashtest runs a test binary's own helper test as a child process,
// so that tests can kill a consumer with SIGKILL and watch what survives.
//
// The pattern: the test binary re-executes itself (os.Args[0]) with
// -test.run selecting one helper test, and passes that helper its settings as
// JSON in an environment variable. The helper test calls [Config]; outside a
// child process Config reports false and the helper returns at once.
//
//	func TestHelperProcess(t *testing.T) {
//		var cfg myConfig
//		if !crashtest.Config(&cfg) {
//			return // not a child: nothing to do
//		}
//		... run until killed ...
//	}
//
//	p := crashtest.Start(t, "TestHelperProcess", myConfig{...})
//	... wait for a state in Redis ...
//	p.Kill()
package crashtest

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"reflect"
	"sync"
	"syscall"
	"testing"
	"time"
)

// EnvConfig is the environment variable carrying the child's JSON settings.
const EnvConfig = "STREAMQ_CRASHTEST_CONFIG"

// Config decodes the child's settings into v and reports whether this process
// is a child started by [Start]. It panics when the settings do not decode,
// since that is a bug in the test.
func Config(v any) bool {
	s, ok := os.LookupEnv(EnvConfig)
	if !ok {
		return false
	}
	if err := json.Unmarshal([]byte(s), v); err != nil {
		panic(fmt.Sprintf("crashtest: decode %s: %v", EnvConfig, err))
	}
	return true
}

// Proc is a running child process.
type Proc struct {
	tb   testing.TB
	cmd  *exec.Cmd
	out  *syncBuffer
	done chan struct{}
	err  error // Wait's error; read after done is closed
}

// Start runs helperTest of the current test binary in a child process, with
// config (JSON-encoded) in [EnvConfig]. The child's stdout and stderr are
// kept and logged when the test fails. The child is killed when the test ends,
// and by the kernel if the test binary dies first (Linux).
func Start(tb testing.TB, helperTest string, config any) *Proc {
	tb.Helper()
	cfg, err := json.Marshal(config)
	if err != nil {
		tb.Fatalf("crashtest: encode config: %v", err)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^"+helperTest+"$", "-test.count=1", "-test.timeout=5m")
	cmd.Env = append(os.Environ(), EnvConfig+"="+string(cfg))
	out := &syncBuffer{}
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = parentDeathSignal()
	if err := cmd.Start(); err != nil {
		tb.Fatalf("crashtest: start %s: %v", helperTest, err)
	}
	p := &Proc{tb: tb, cmd: cmd, out: out, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	tb.Cleanup(func() {
		p.Kill()
		if tb.Failed() {
			tb.Logf("crashtest: output of child %d (%s):\n%s", cmd.Process.Pid, helperTest, out.String())
		}
	})
	return p
}

// PID returns the child's process id.
func (p *Proc) PID() int { return p.cmd.Process.Pid }

// Done is closed when the child has exited.
func (p *Proc) Done() <-chan struct{} { return p.done }

// Kill sends SIGKILL to the child and waits until it has exited. It is a
// no-op when the child has exited already.
func (p *Proc) Kill() {
	select {
	case <-p.done:
		return
	default:
	}
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	select {
	case <-p.done:
	case <-time.After(30 * time.Second):
		p.tb.Errorf("crashtest: child %d did not exit 30s after SIGKILL", p.PID())
	}
}

// Wait waits up to timeout for the child to exit and returns its wait status
// error (nil for exit code 0), or an error when it is still running.
func (p *Proc) Wait(timeout time.Duration) error {
	select {
	case <-p.done:
		return p.err
	case <-time.After(timeout):
		return fmt.Errorf("crashtest: child %d still running after %v", p.PID(), timeout)
	}
}

// KilledBy reports whether the child has exited because of signal sig.
func (p *Proc) KilledBy(sig syscall.Signal) bool {
	select {
	case <-p.done:
	default:
		return false
	}
	var ee *exec.ExitError
	if !errors.As(p.err, &ee) {
		return false
	}
	ws, ok := ee.Sys().(syscall.WaitStatus)
	return ok && ws.Signaled() && ws.Signal() == sig
}

// Output returns what the child has written to stdout and stderr so far.
func (p *Proc) Output() string { return p.out.String() }

// syncBuffer is a bytes.Buffer safe for the writer goroutines of exec.Cmd and
// concurrent readers.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// parentDeathSignal asks the kernel to SIGKILL the child when the test binary
// dies, so no consumer outlives its test. The field exists only on some
// systems, hence the reflection.
func parentDeathSignal() *syscall.SysProcAttr {
	attr := &syscall.SysProcAttr{}
	f := reflect.ValueOf(attr).Elem().FieldByName("Pdeathsig")
	sig := reflect.ValueOf(syscall.SIGKILL)
	if f.IsValid() && f.CanSet() && f.Type() == sig.Type() {
		f.Set(sig)
	}
	return attr
}
