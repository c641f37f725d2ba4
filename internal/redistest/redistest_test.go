package redistest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// helperEnv makes TestMissingBinaryHelper run; it is set only in the child
// process started by TestMissingBinary.
const helperEnv = "REDISTEST_MISSING_BINARY_HELPER"

func TestStartAnswersPing(t *testing.T) {
	t.Parallel()
	s := Start(t)
	require.Equal(t, "127.0.0.1:"+strconv.Itoa(s.Port()), s.Addr())
	require.Positive(t, s.PID())
	require.DirExists(t, s.Dir())

	c := s.Client(t)
	ctx := context.Background()
	require.Equal(t, "PONG", c.Ping(ctx).Val())
	require.NoError(t, c.Set(ctx, "k", "v", 0).Err())
	require.Equal(t, "v", c.Get(ctx, "k").Val())

	info, err := c.Info(ctx, "server").Result()
	require.NoError(t, err)
	require.Contains(t, info, "process_id:"+strconv.Itoa(s.PID()))
}

func TestDefaultConfig(t *testing.T) {
	t.Parallel()
	s := Start(t)
	c := s.Client(t)
	ctx := context.Background()

	want := map[string]string{
		"save":       "",
		"appendonly": "no",
		"bind":       "127.0.0.1",
		"port":       strconv.Itoa(s.Port()),
		"dir":        s.Dir(),
	}
	for key, value := range want {
		got, err := c.ConfigGet(ctx, key).Result()
		require.NoError(t, err)
		require.Equal(t, value, got[key], "config %s", key)
	}
}

func TestWithArgs(t *testing.T) {
	t.Parallel()
	s := Start(t, WithArgs("--maxmemory", "12mb", "--maxmemory-policy", "noeviction"))
	c := s.Client(t)
	got, err := c.ConfigGet(context.Background(), "maxmemory*").Result()
	require.NoError(t, err)
	require.Equal(t, strconv.Itoa(12<<20), got["maxmemory"])
	require.Equal(t, "noeviction", got["maxmemory-policy"])
}

func TestParallelServersAreIndependent(t *testing.T) {
	t.Parallel()
	skipWithoutRedis(t)
	const n = 6
	var (
		mu    sync.Mutex
		ports = map[int]bool{}
	)
	t.Run("group", func(t *testing.T) {
		for i := range n {
			t.Run(strconv.Itoa(i), func(t *testing.T) {
				t.Parallel()
				s := Start(t)
				c := s.Client(t)
				ctx := context.Background()
				require.NoError(t, c.Set(ctx, "who", i, 0).Err())
				require.Equal(t, strconv.Itoa(i), c.Get(ctx, "who").Val())
				require.Equal(t, int64(1), c.DBSize(ctx).Val())
				mu.Lock()
				defer mu.Unlock()
				require.False(t, ports[s.Port()], "port %d used twice", s.Port())
				ports[s.Port()] = true
			})
		}
	})
	require.Len(t, ports, n)
}

func TestKillRestartAppendOnlyAlwaysKeepsData(t *testing.T) {
	t.Parallel()
	s := Start(t, WithAppendOnly("always"))
	c := s.Client(t)
	ctx := context.Background()

	const entries = 50
	for i := range entries {
		require.NoError(t, c.XAdd(ctx, &redis.XAddArgs{
			Stream: "jobs",
			Values: map[string]any{"n": i},
		}).Err())
	}
	require.NoError(t, c.Set(ctx, "last", "written", 0).Err())
	got, err := c.ConfigGet(ctx, "appendfsync").Result()
	require.NoError(t, err)
	require.Equal(t, "always", got["appendfsync"])

	port, pid := s.Port(), s.PID()
	s.Kill()
	require.Zero(t, s.PID())
	requireGone(t, pid)
	requireRefused(t, s.Addr())

	s.Restart(t)
	require.Equal(t, port, s.Port())
	require.NotEqual(t, pid, s.PID())

	// The old client reconnects by itself.
	require.Equal(t, int64(entries), c.XLen(ctx, "jobs").Val())
	require.Equal(t, "written", c.Get(ctx, "last").Val())
}

func TestShutdownRestartWithoutPersistenceLosesData(t *testing.T) {
	t.Parallel()
	s := Start(t)
	c := s.Client(t)
	ctx := context.Background()
	require.NoError(t, c.Set(ctx, "k", "v", 0).Err())

	pid := s.PID()
	s.Shutdown()
	requireGone(t, pid)
	requireRefused(t, s.Addr())
	s.Shutdown() // already stopped: no-op
	s.Kill()     // likewise

	s.Restart(t)
	require.Equal(t, int64(0), c.DBSize(ctx).Val())
	require.NoFileExists(t, s.Dir()+"/dump.rdb")
}

func TestShutdownAppendOnlyKeepsData(t *testing.T) {
	t.Parallel()
	s := Start(t, WithAppendOnly("everysec"))
	c := s.Client(t)
	ctx := context.Background()
	require.NoError(t, c.Set(ctx, "k", "v", 0).Err())

	s.Shutdown()
	s.Restart(t)
	require.Equal(t, "v", c.Get(ctx, "k").Val())
}

func TestRestartWhileRunning(t *testing.T) {
	t.Parallel()
	s := Start(t)
	pid := s.PID()
	s.Restart(t)
	requireGone(t, pid)
	require.NotEqual(t, pid, s.PID())
	require.Equal(t, "PONG", s.Client(t).Ping(context.Background()).Val())
}

func TestRestartRetriesWhilePortIsTaken(t *testing.T) {
	t.Parallel()
	s := Start(t)
	s.Kill()

	// Someone else holds the port for a moment; Restart must wait for it
	// rather than fail or move to another port.
	l, err := net.Listen("tcp", s.Addr())
	require.NoError(t, err)
	release := time.AfterFunc(250*time.Millisecond, func() { l.Close() })
	defer release.Stop()

	s.Restart(t)
	require.Equal(t, "PONG", s.Client(t).Ping(context.Background()).Val())
}

func TestRestartFailsWhenPortStaysTaken(t *testing.T) {
	t.Parallel()
	skipWithoutRedis(t)
	p, err := StartProcess(context.Background())
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Stop() })
	require.NoError(t, p.Kill())

	l, err := net.Listen("tcp", p.Addr())
	require.NoError(t, err)
	defer l.Close()

	err = p.Restart(context.Background())
	require.Error(t, err)
	require.Contains(t, err.Error(), "Address already in use")
	require.Zero(t, p.PID())
}

func TestCleanupStopsServer(t *testing.T) {
	t.Parallel()
	skipWithoutRedis(t)
	var (
		addr string
		pid  int
	)
	t.Run("server", func(t *testing.T) {
		s := Start(t)
		addr, pid = s.Addr(), s.PID()
		require.Equal(t, "PONG", s.Client(t).Ping(context.Background()).Val())
	})
	require.NotZero(t, pid)
	requireGone(t, pid)
	requireRefused(t, addr)
}

func TestCleanupAfterKill(t *testing.T) {
	t.Parallel()
	skipWithoutRedis(t)
	var pid int
	t.Run("server", func(t *testing.T) {
		s := Start(t)
		pid = s.PID()
		s.Kill()
	})
	requireGone(t, pid)
}

func TestStartProcess(t *testing.T) {
	t.Parallel()
	skipWithoutRedis(t)
	ctx := context.Background()
	p, err := StartProcess(ctx, WithAppendOnly("always"))
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Stop() })
	require.DirExists(t, p.Dir())

	c := redis.NewClient(&redis.Options{Addr: p.Addr()})
	defer c.Close()
	require.NoError(t, c.Set(ctx, "k", "v", 0).Err())

	pid := p.PID()
	require.NoError(t, p.Kill())
	requireGone(t, pid)
	require.NoError(t, p.Restart(ctx))
	require.Equal(t, "v", c.Get(ctx, "k").Val())

	pid = p.PID()
	require.NoError(t, p.Stop())
	requireGone(t, pid)
	require.NoDirExists(t, p.Dir())
	require.NoError(t, p.Stop(), "second Stop")
	require.Error(t, p.Restart(ctx), "Restart after Stop")
}

func TestStartProcessCanceledContext(t *testing.T) {
	t.Parallel()
	skipWithoutRedis(t)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	p, err := StartProcess(ctx)
	if err == nil {
		// The server answered before the canceled context was noticed.
		require.NoError(t, p.Stop())
		return
	}
	require.ErrorIs(t, err, context.Canceled)
}

func TestStartProcessBadArgs(t *testing.T) {
	t.Parallel()
	skipWithoutRedis(t)
	start := time.Now()
	_, err := StartProcess(context.Background(), WithArgs("--no-such-option", "1"))
	require.Error(t, err)
	require.Contains(t, err.Error(), "no-such-option")
	require.Less(t, time.Since(start), 5*time.Second, "a server that exits must not be waited for until the timeout")
}

func TestStartProcessMissingBinary(t *testing.T) {
	t.Setenv("PATH", t.TempDir())
	t.Setenv(ServerEnv, "")
	_, err := StartProcess(context.Background())
	require.ErrorIs(t, err, exec.ErrNotFound)
	require.Contains(t, err.Error(), "apt-get install redis-server")
}

// TestMissingBinary runs TestMissingBinaryHelper in a child process whose
// PATH lacks redis-server: with CI set it must fail with an install hint,
// without CI it must skip.
func TestMissingBinary(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		ci       string
		wantFail bool
		want     string
	}{
		{ci: "true", wantFail: true, want: "--- FAIL: TestMissingBinaryHelper"},
		{ci: "", wantFail: false, want: "--- SKIP: TestMissingBinaryHelper"},
	} {
		t.Run(fmt.Sprintf("CI=%q", tc.ci), func(t *testing.T) {
			t.Parallel()
			cmd := exec.Command(os.Args[0], "-test.run=^TestMissingBinaryHelper$", "-test.v", "-test.count=1")
			// GORACE: skip the race detector's one-second sleep at exit.
			cmd.Env = append(os.Environ(), helperEnv+"=1", "PATH="+t.TempDir(), ServerEnv+"=", "CI="+tc.ci, "GORACE=atexit_sleep_ms=0")
			out, err := cmd.CombinedOutput()
			if tc.wantFail {
				var exitErr *exec.ExitError
				require.ErrorAs(t, err, &exitErr, "output:\n%s", out)
			} else {
				require.NoError(t, err, "output:\n%s", out)
			}
			require.Contains(t, string(out), tc.want)
			require.Contains(t, string(out), "redis-server not found on PATH")
			require.Contains(t, string(out), "apt-get install redis-server")
			require.Contains(t, string(out), "make test")
			require.NotContains(t, string(out), "unreachable")
		})
	}
}

func TestMissingBinaryHelper(t *testing.T) {
	if os.Getenv(helperEnv) != "1" {
		t.Skip("run by TestMissingBinary in a child process")
	}
	Start(t)
	t.Error("unreachable: Start returned without redis-server")
}

// skipWithoutRedis skips, like Start does, a test that does not call Start
// at its top level when redis-server is missing and CI is not set.
func skipWithoutRedis(t *testing.T) {
	t.Helper()
	if _, err := ServerBinary(); errors.Is(err, exec.ErrNotFound) && os.Getenv("CI") == "" {
		t.Skipf("redistest: %s not found on PATH, skipping: %s", binaryName, installHint)
	}
}

// TestServerEnv: ServerEnv names the binary, as a name looked up on PATH or
// as a path, and Start, StartProcess and StartCluster run it; a ServerEnv
// that names nothing fails even without CI (the developer asked for that
// server), with an error that names the variable.
func TestServerEnv(t *testing.T) {
	bin, err := ServerBinary()
	if err != nil {
		skipWithoutRedis(t)
		t.Fatal(err)
	}
	dir := t.TempDir()
	custom := filepath.Join(dir, "custom-server")
	require.NoError(t, os.Symlink(bin, custom))

	t.Run("name on PATH", func(t *testing.T) {
		t.Setenv("PATH", dir+string(os.PathListSeparator)+os.Getenv("PATH"))
		t.Setenv(ServerEnv, "custom-server")
		srv := Start(t)
		require.Equal(t, custom, srv.p.bin)
		require.NoError(t, srv.Client(t).Ping(context.Background()).Err())
	})
	t.Run("path", func(t *testing.T) {
		t.Setenv(ServerEnv, custom)
		p, err := StartProcess(context.Background())
		require.NoError(t, err)
		t.Cleanup(func() { _ = p.Stop() })
		require.Equal(t, custom, p.bin)
		c := redis.NewClient(&redis.Options{Addr: p.Addr()})
		t.Cleanup(func() { _ = c.Close() })
		require.NoError(t, c.Ping(context.Background()).Err())
	})
	t.Run("cluster", func(t *testing.T) {
		t.Setenv(ServerEnv, custom)
		c := StartCluster(t, 1, 0)
		for _, n := range c.nodes {
			require.Equal(t, custom, n.bin)
		}
	})
	t.Run("missing", func(t *testing.T) {
		t.Setenv(ServerEnv, filepath.Join(dir, "no-such-server"))
		t.Setenv("CI", "")
		_, err := StartProcess(context.Background())
		require.Error(t, err)
		require.NotErrorIs(t, err, exec.ErrNotFound, "callers skip on ErrNotFound without CI")
		require.Contains(t, err.Error(), ServerEnv)
		require.Contains(t, err.Error(), "no-such-server")
	})
}

// requireGone asserts that process pid has exited and been reaped (no
// zombie remains).
func requireGone(t *testing.T, pid int) {
	t.Helper()
	require.NotZero(t, pid)
	err := syscall.Kill(pid, 0)
	require.ErrorIs(t, err, syscall.ESRCH, "process %d still exists (running or zombie)", pid)
}

// requireRefused asserts that nothing listens on addr.
func requireRefused(t *testing.T, addr string) {
	t.Helper()
	conn, err := net.DialTimeout("tcp", addr, time.Second)
	if err == nil {
		conn.Close()
	}
	require.Error(t, err, "something still listens on %s", addr)
	require.True(t, errors.Is(err, syscall.ECONNREFUSED) || strings.Contains(err.Error(), "refused"), "dial %s: %v", addr, err)
}

// TestFreePortNeverGivesAPortTwice: a port given to one server (which may be
// stopped for a restart) is never given to another, even when the kernel
// offers it again.
func TestFreePortNeverGivesAPortTwice(t *testing.T) {
	offers := []int{61001, 61001, 61002}
	saved := kernelPort
	kernelPort = func() (int, error) {
		p := offers[0]
		offers = offers[1:]
		return p, nil
	}
	t.Cleanup(func() { kernelPort = saved })
	first, err := freePort()
	require.NoError(t, err)
	second, err := freePort()
	require.NoError(t, err)
	require.Equal(t, 61001, first)
	require.Equal(t, 61002, second, "the port offered again was given twice")
}
