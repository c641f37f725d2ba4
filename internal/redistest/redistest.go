// Package redistest starts real redis-server processes for tests and
// benchmarks.
//
// Each server listens on its own free loopback port, keeps its files in its
// own temporary directory and persists nothing unless asked to, so tests can
// run in parallel and never touch a Redis that happens to run on the machine
// (for example the Debian service on port 6379).
//
// Tests use [Start]; programs such as benchmarks use [StartProcess].
package redistest

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// ServerEnv is the environment variable that chooses the server binary every
// helper starts: a path (such as ~/.cache/streamq/valkey-8.0.1/bin/valkey-server,
// which `make valkey` builds) or a name looked up on PATH. Unset or empty:
// redis-server on PATH. The binary must accept redis-server's command line
// (Valkey's valkey-server does).
const ServerEnv = "STREAMQ_REDIS_SERVER"

const (
	// binaryName is the executable looked up on PATH when ServerEnv is unset.
	binaryName = "redis-server"
	// installHint tells a developer how to get the binary.
	installHint = "install it with `apt-get install redis-server`, or run `make test`, which installs it"
	// logName is the file, inside the server's directory, that receives the
	// server's stdout and stderr.
	logName = "redis-server.log"

	// readyTimeout bounds how long a start waits for the server to answer PING.
	readyTimeout = 10 * time.Second
	// stopTimeout bounds how long a stop waits for the process to exit.
	stopTimeout = 10 * time.Second
	// startAttempts is how many ports (or, on restart, how many tries of the
	// same port) are used before a bind failure is reported.
	startAttempts = 5
)

// Option configures a server started by [Start] or [StartProcess].
type Option func(*config)

type config struct {
	appendOnly bool
	fsync      string
	args       []string
}

// WithAppendOnly enables the append-only file with the given appendfsync
// policy ("always", "everysec" or "no"). With "always", every write that has
// been acknowledged survives [Server.Kill] followed by [Server.Restart].
func WithAppendOnly(fsync string) Option {
	return func(c *config) {
		c.appendOnly = true
		c.fsync = fsync
	}
}

// WithArgs appends raw redis-server command-line arguments, such as
// "--maxmemory", "10mb". They come after the helper's own arguments, so they
// override them.
func WithArgs(args ...string) Option {
	return func(c *config) {
		c.args = append(c.args, args...)
	}
}

// Server is a redis-server started for a test by [Start]. It is stopped
// automatically when the test and its subtests finish.
type Server struct {
	tb testing.TB
	p  *Process
}

// Start starts a redis-server for tb on a free loopback port, waits until it
// answers PING and registers a cleanup that stops it and reaps the process.
// The server saves nothing and keeps its files in a directory from
// tb.TempDir unless options say otherwise.
//
// The server is redis-server on PATH, or the binary [ServerEnv] names. If
// redis-server is not on PATH, Start fails the test when the environment
// variable CI is non-empty and skips it otherwise; a [ServerEnv] that names
// no executable always fails it. Start must be called from the goroutine
// running the test.
func Start(tb testing.TB, opts ...Option) *Server {
	tb.Helper()
	bin := serverPath(tb)

	// TempDir registers its removal before our cleanup is registered, so the
	// server is stopped before its directory is removed.
	p := newProcess(bin, tb.TempDir(), false, opts)
	if err := p.launch(context.Background(), true); err != nil {
		tb.Fatal(wrap(err))
	}
	// Registered before the stop below, so it still captures during the stop.
	CaptureLog(tb, p.Addr())
	tb.Cleanup(func() {
		if tb.Failed() {
			if tail := p.logTail(0); tail != "" {
				tb.Logf("redistest: log of redis-server on %s:\n%s", p.Addr(), tail)
			}
		}
		if err := p.stop(); err != nil {
			tb.Error(err)
		}
	})
	tb.Logf("redistest: %s pid %d listening on %s", filepath.Base(bin), p.PID(), p.Addr())
	return &Server{tb: tb, p: p}
}

// Addr returns the server's address, "127.0.0.1:port".
func (s *Server) Addr() string { return s.p.Addr() }

// Port returns the server's TCP port. It does not change on [Server.Restart].
func (s *Server) Port() int { return s.p.Port() }

// PID returns the process id of the running server, or 0 if it is not
// running. It changes on [Server.Restart].
func (s *Server) PID() int { return s.p.PID() }

// Dir returns the server's working directory (its --dir), where the RDB and
// AOF files live. It does not change on [Server.Restart].
func (s *Server) Dir() string { return s.p.Dir() }

// Client returns a new go-redis client connected to the server. It is closed
// when tb finishes, before the server is stopped.
func (s *Server) Client(tb testing.TB) *redis.Client {
	tb.Helper()
	c := redis.NewClient(&redis.Options{Addr: s.Addr()})
	tb.Cleanup(func() { _ = c.Close() })
	return c
}

// Kill stops the server abruptly with SIGKILL, as a crash would, and waits
// for the process to exit. Data not yet written to disk is lost. It does
// nothing if the server is not running.
func (s *Server) Kill() {
	s.tb.Helper()
	if err := s.p.Kill(); err != nil {
		s.tb.Error(err)
	}
}

// Shutdown stops the server cleanly and waits for the process to exit. A
// server with persistence (WithAppendOnly or WithArgs) gets SHUTDOWN, so it
// writes what its configuration says to keep; any other gets SHUTDOWN NOSAVE.
// It does nothing if the server is not running.
func (s *Server) Shutdown() {
	s.tb.Helper()
	if err := s.p.Shutdown(); err != nil {
		s.tb.Error(err)
	}
}

// Restart starts the server again on the same port, with the same directory
// and options, and waits until it answers PING. A server that is still
// running is first stopped as by [Server.Shutdown]. Clients from
// [Server.Client] reconnect by themselves.
func (s *Server) Restart(tb testing.TB) {
	tb.Helper()
	if err := s.p.Restart(context.Background()); err != nil {
		tb.Fatal(err)
	}
	tb.Logf("redistest: redis-server restarted, pid %d listening on %s", s.p.PID(), s.p.Addr())
}

// Process is a redis-server started by [StartProcess], for use outside
// tests. Its methods may be called from any goroutine.
type Process struct {
	bin        string
	dir        string
	ownDir     bool // dir was created by StartProcess and is removed by Stop
	persistent bool // Shutdown sends SHUTDOWN rather than SHUTDOWN NOSAVE
	extra      []string

	mu      sync.Mutex
	port    int
	cmd     *exec.Cmd
	done    chan struct{} // closed when cmd has been waited for
	stopped bool          // Stop has been called
}

// StartProcess starts a redis-server on a free loopback port in a new
// temporary directory and waits until it answers PING. ctx bounds only the
// start; the server runs until [Process.Stop] is called. Stop also removes
// the directory.
//
// The server is redis-server on PATH, or the binary [ServerEnv] names. If
// redis-server is not on PATH the error wraps [exec.ErrNotFound]; a
// [ServerEnv] that names no executable gives an error that does not.
func StartProcess(ctx context.Context, opts ...Option) (*Process, error) {
	bin, err := ServerBinary()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "redistest-")
	if err != nil {
		return nil, fmt.Errorf("redistest: %w", err)
	}
	p := newProcess(bin, dir, true, opts)
	if err := p.launch(ctx, true); err != nil {
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("redistest: %w", err)
	}
	return p, nil
}

// ServerBinary returns the path of the server binary the helpers start: the
// one [ServerEnv] names when it is set, redis-server on PATH otherwise. When
// ServerEnv is unset and redis-server is not on PATH, the error wraps
// [exec.ErrNotFound] and says how to install it; when ServerEnv is set but
// names no executable, the error does not wrap exec.ErrNotFound, so that
// callers which skip without a server still fail: the developer asked for
// that server.
func ServerBinary() (string, error) {
	if name := os.Getenv(ServerEnv); name != "" {
		path, err := exec.LookPath(name)
		if err != nil {
			return "", fmt.Errorf("redistest: %s=%q names no executable (%v): set it to the path of a redis-server or valkey-server binary, or unset it to use redis-server on PATH", ServerEnv, name, errors.Unwrap(err))
		}
		return path, nil
	}
	path, err := exec.LookPath(binaryName)
	if err != nil {
		return "", fmt.Errorf("redistest: %w; %s", err, installHint)
	}
	return path, nil
}

// serverPath returns [ServerBinary], or fails (under CI, or when ServerEnv
// names no executable) or skips tb.
func serverPath(tb testing.TB) string {
	tb.Helper()
	bin, err := ServerBinary()
	switch {
	case err == nil:
		return bin
	case !errors.Is(err, exec.ErrNotFound):
		tb.Fatal(err)
	case os.Getenv("CI") != "":
		tb.Fatalf("redistest: %s not found on PATH (CI is set, so this is an error): %s", binaryName, installHint)
	default:
		tb.Skipf("redistest: %s not found on PATH, skipping: %s", binaryName, installHint)
	}
	return ""
}

func newProcess(bin, dir string, ownDir bool, opts []Option) *Process {
	var c config
	for _, o := range opts {
		o(&c)
	}
	extra := []string{"--appendonly", "no"}
	if c.appendOnly {
		extra = []string{"--appendonly", "yes", "--appendfsync", c.fsync}
	}
	extra = append(extra, c.args...)
	return &Process{
		bin:        bin,
		dir:        dir,
		ownDir:     ownDir,
		persistent: c.appendOnly || len(c.args) > 0,
		extra:      extra,
	}
}

// Addr returns the server's address, "127.0.0.1:port".
func (p *Process) Addr() string {
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(p.Port()))
}

// Port returns the server's TCP port. It does not change on [Process.Restart].
func (p *Process) Port() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.port
}

// PID returns the process id of the running server, or 0 if it is not
// running.
func (p *Process) PID() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil || isClosed(p.done) {
		return 0
	}
	return p.cmd.Process.Pid
}

// Dir returns the server's working directory (its --dir).
func (p *Process) Dir() string { return p.dir }

// Kill sends SIGKILL to the server and waits for the process to exit. It
// does nothing if the server is not running.
func (p *Process) Kill() error {
	return wrap(p.kill())
}

func (p *Process) kill() error {
	cmd, done := p.current()
	if cmd == nil || isClosed(done) {
		return nil
	}
	if err := cmd.Process.Kill(); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return fmt.Errorf("kill redis-server pid %d: %w", cmd.Process.Pid, err)
	}
	select {
	case <-done:
		return nil
	case <-time.After(stopTimeout):
		return fmt.Errorf("redis-server pid %d did not exit %v after SIGKILL", cmd.Process.Pid, stopTimeout)
	}
}

// Shutdown stops the server cleanly and waits for the process to exit. A
// server with persistence options gets SHUTDOWN, any other SHUTDOWN NOSAVE.
// If the server refuses or does not exit in time it is killed and an error
// is returned. It does nothing if the server is not running.
func (p *Process) Shutdown() error {
	cmd := "SHUTDOWN NOSAVE"
	if p.persistent {
		cmd = "SHUTDOWN"
	}
	return wrap(p.shutdown(cmd))
}

// Restart starts the server again on the same port and directory, stopping
// it first as [Process.Shutdown] does if it is still running, and waits
// until it answers PING. ctx bounds the start.
func (p *Process) Restart(ctx context.Context) error {
	p.mu.Lock()
	stopped := p.stopped
	p.mu.Unlock()
	if stopped {
		return errors.New("redistest: restart: Stop has been called")
	}
	if err := p.Shutdown(); err != nil {
		return err
	}
	return wrap(p.launch(ctx, false))
}

// Stop stops the server (SHUTDOWN NOSAVE, or SIGKILL if that fails), waits
// for the process to exit and removes the directory created by
// [StartProcess]. Calling Stop again does nothing.
func (p *Process) Stop() error {
	p.mu.Lock()
	if p.stopped {
		p.mu.Unlock()
		return nil
	}
	p.stopped = true
	p.mu.Unlock()

	err := p.stop()
	if p.ownDir {
		if rmErr := os.RemoveAll(p.dir); rmErr != nil && err == nil {
			err = wrap(rmErr)
		}
	}
	return err
}

// stop ends the server quickly, whatever its configuration: SHUTDOWN NOSAVE,
// then SIGKILL if that did not work (shutdown kills on failure).
func (p *Process) stop() error {
	return wrap(p.shutdown("SHUTDOWN NOSAVE"))
}

func (p *Process) current() (*exec.Cmd, chan struct{}) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cmd, p.done
}

// shutdown sends command to the server and waits for the process to exit.
// On failure the process is killed, so it is never left running.
func (p *Process) shutdown(command string) error {
	cmd, done := p.current()
	if cmd == nil || isClosed(done) {
		return nil
	}
	pid := cmd.Process.Pid
	fail := func(err error) error {
		if kerr := p.kill(); kerr != nil {
			return errors.Join(err, kerr)
		}
		return err
	}

	conn, err := net.DialTimeout("tcp", p.Addr(), time.Second)
	if err != nil {
		return fail(fmt.Errorf("%s redis-server pid %d: %w", command, pid, err))
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(stopTimeout))
	if _, err := io.WriteString(conn, command+"\r\n"); err != nil {
		return fail(fmt.Errorf("%s redis-server pid %d: %w", command, pid, err))
	}
	// On success the server closes the connection without replying; any
	// reply is the reason it refused.
	if line, err := bufio.NewReader(conn).ReadString('\n'); err == nil {
		return fail(fmt.Errorf("%s redis-server pid %d: refused: %s", command, pid, strings.TrimSpace(line)))
	}
	select {
	case <-done:
		return nil
	case <-time.After(stopTimeout):
		return fail(fmt.Errorf("%s redis-server pid %d: still running after %v", command, pid, stopTimeout))
	}
}

// launch starts the server and waits until it is ready. With newPort it
// picks a free port for every attempt; otherwise it retries the current
// port, which may be briefly taken by someone else.
func (p *Process) launch(ctx context.Context, newPort bool) error {
	var err error
	for attempt := 1; attempt <= startAttempts; attempt++ {
		if newPort {
			port, perr := freePort()
			if perr != nil {
				return perr
			}
			p.mu.Lock()
			p.port = port
			p.mu.Unlock()
		} else if attempt > 1 {
			select {
			case <-ctx.Done():
				return errors.Join(err, ctx.Err())
			case <-time.After(time.Duration(attempt) * 100 * time.Millisecond):
			}
		}
		var portInUse bool
		portInUse, err = p.startOnce(ctx)
		if err == nil || !portInUse {
			return err
		}
	}
	return err
}

// startOnce starts redis-server on p.port and waits for it to answer PING.
// On failure the process has exited and portInUse tells whether it failed
// because the port was taken.
func (p *Process) startOnce(ctx context.Context) (portInUse bool, err error) {
	port := p.Port()
	logPath := filepath.Join(p.dir, logName)
	logFile, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return false, err
	}
	logStart, _ := logFile.Seek(0, io.SeekEnd)

	args := append([]string{
		"--port", strconv.Itoa(port),
		"--bind", "127.0.0.1",
		"--save", "",
		"--dir", p.dir,
		"--daemonize", "no",
	}, p.extra...)
	cmd := exec.Command(p.bin, args...)
	cmd.Dir = p.dir
	cmd.Stdout = logFile
	cmd.Stderr = logFile
	cmd.SysProcAttr = parentDeathSignal()
	if err := cmd.Start(); err != nil {
		logFile.Close()
		return false, fmt.Errorf("start %s: %w", p.bin, err)
	}
	done := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		logFile.Close()
		close(done)
	}()
	p.mu.Lock()
	p.cmd, p.done = cmd, done
	p.mu.Unlock()

	err = waitReady(ctx, p.Addr(), cmd.Process.Pid, done)
	if err == nil {
		return false, nil
	}
	_ = p.kill()
	tail := p.logTail(logStart)
	portInUse = strings.Contains(tail, "Address already in use")
	return portInUse, fmt.Errorf("redis-server on port %d (%s %s): %w\n%s",
		port, p.bin, strings.Join(quoteArgs(args), " "), err, tail)
}

// waitReady polls addr with a growing back-off until the server with the
// given pid answers PING, the process exits, ctx ends or readyTimeout passes.
func waitReady(ctx context.Context, addr string, pid int, exited <-chan struct{}) error {
	ctx, cancel := context.WithTimeout(ctx, readyTimeout)
	defer cancel()
	delay := 2 * time.Millisecond
	var lastErr error
	for {
		select {
		case <-exited:
			return errors.New("redis-server exited during start")
		default:
		}
		lastErr = probe(ctx, addr, pid, exited)
		if lastErr == nil {
			return nil
		}
		select {
		case <-exited:
			return errors.New("redis-server exited during start")
		case <-ctx.Done():
			return fmt.Errorf("not ready: %w (last probe: %v)", ctx.Err(), lastErr)
		case <-time.After(delay):
		}
		delay = min(delay*2, 100*time.Millisecond)
	}
}

// probe checks that the server on addr answers PING and is the process pid,
// not another server or listener that happens to hold the port. It gives up
// as soon as the process exits or ctx ends.
func probe(ctx context.Context, addr string, pid int, exited <-chan struct{}) error {
	conn, err := (&net.Dialer{Timeout: time.Second}).DialContext(ctx, "tcp", addr)
	if err != nil {
		return err
	}
	defer conn.Close()
	probed := make(chan struct{})
	defer close(probed)
	go func() {
		select {
		case <-exited:
		case <-ctx.Done():
		case <-probed:
			return
		}
		conn.Close() // unblocks the read below
	}()
	_ = conn.SetDeadline(time.Now().Add(2 * time.Second))
	if _, err := io.WriteString(conn, "PING\r\nINFO server\r\n"); err != nil {
		return err
	}
	r := bufio.NewReader(conn)
	pong, err := readReply(r)
	if err != nil {
		return err
	}
	if pong != "PONG" {
		return fmt.Errorf("PING answered %q", pong)
	}
	info, err := readReply(r)
	if err != nil {
		return err
	}
	want := "process_id:" + strconv.Itoa(pid)
	for _, line := range strings.Split(info, "\n") {
		if strings.TrimSpace(line) == want {
			return nil
		}
	}
	return fmt.Errorf("the server on %s is not pid %d", addr, pid)
}

// readReply reads a simple-string, error or bulk-string RESP reply.
func readReply(r *bufio.Reader) (string, error) {
	line, err := r.ReadString('\n')
	if err != nil {
		return "", err
	}
	line = strings.TrimRight(line, "\r\n")
	if line == "" {
		return "", errors.New("empty reply")
	}
	switch line[0] {
	case '+':
		return line[1:], nil
	case '-':
		return "", errors.New(line[1:])
	case '$':
		n, err := strconv.Atoi(line[1:])
		if err != nil || n < 0 {
			return "", fmt.Errorf("bad bulk reply %q", line)
		}
		buf := make([]byte, n+2)
		if _, err := io.ReadFull(r, buf); err != nil {
			return "", err
		}
		return string(buf[:n]), nil
	default:
		return "", fmt.Errorf("unexpected reply %q", line)
	}
}

// logTail returns the end of the server's log from byte offset from on.
func (p *Process) logTail(from int64) string {
	const maxTail = 4 << 10
	data, err := os.ReadFile(filepath.Join(p.dir, logName))
	if err != nil || int64(len(data)) <= from {
		return ""
	}
	data = data[from:]
	if len(data) > maxTail {
		data = data[len(data)-maxTail:]
		if i := bytes.IndexByte(data, '\n'); i >= 0 {
			data = data[i+1:]
		}
	}
	return strings.TrimRight(string(data), "\n")
}

// freePort returns a loopback TCP port that was free a moment ago.
func freePort() (int, error) {
	portsMu.Lock()
	defer portsMu.Unlock()
	for range 100 {
		port, err := kernelPort()
		if err != nil {
			return 0, err
		}
		if !portsGiven[port] {
			portsGiven[port] = true
			return port, nil
		}
	}
	return 0, errors.New("find a free port: the kernel kept offering ports already given to a server of this process")
}

// portsGiven holds every port freePort gave out in this process, never
// handed out again: a server stopped for a restart keeps its port, and the
// kernel, which sees it free, once offered it to another test's server
// started meanwhile, so the restart found it taken for good
// (TestShutdownAppendOnlyKeepsData, Valkey pass).
var (
	portsMu    sync.Mutex
	portsGiven = map[int]bool{}
)

// kernelPort asks the kernel for a free loopback port (a variable, so that
// a test can offer a port twice).
var kernelPort = func() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("find a free port: %w", err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	if err := l.Close(); err != nil {
		return 0, fmt.Errorf("find a free port: %w", err)
	}
	return port, nil
}

// parentDeathSignal asks the kernel to SIGKILL the server if the process
// that started it dies without cleaning up (for example a test binary killed
// by a -timeout panic), so no redis-server is left behind. The field only
// exists on Linux and FreeBSD, hence the reflection: the package still
// builds everywhere.
func parentDeathSignal() *syscall.SysProcAttr {
	attr := &syscall.SysProcAttr{}
	f := reflect.ValueOf(attr).Elem().FieldByName("Pdeathsig")
	sig := reflect.ValueOf(syscall.SIGKILL)
	if f.IsValid() && f.CanSet() && f.Type() == sig.Type() {
		f.Set(sig)
	}
	return attr
}

// wrap prefixes a non-nil error with the package name.
func wrap(err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("redistest: %w", err)
}

func isClosed(ch chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

func quoteArgs(args []string) []string {
	out := make([]string, len(args))
	for i, a := range args {
		if a == "" || strings.ContainsAny(a, " \t\"'") {
			a = strconv.Quote(a)
		}
		out[i] = a
	}
	return out
}
