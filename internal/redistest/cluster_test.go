package redistest

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// cliHelperEnv makes TestClusterMissingCLIHelper run; it is set only in the
// child process started by TestClusterMissingCLI.
const cliHelperEnv = "REDISTEST_MISSING_CLI_HELPER"

// TestStartClusterFailover creates a 3-master cluster with one replica each
// through redis-cli, writes keys over every master, fails one master over by
// hand, kills another and checks that its replica took over with the data.
func TestStartClusterFailover(t *testing.T) {
	t.Parallel()
	c := StartCluster(t, 3, 1)
	require.Len(t, c.Addrs(), 6)
	masters := c.Masters()
	require.Len(t, masters, 3)
	for _, m := range masters {
		require.Contains(t, c.Addrs(), m)
	}
	requireClusterOK(t, c.Addrs())

	ctx := context.Background()
	cl := c.Client(t)
	const keys = 300
	for i := range keys {
		require.NoError(t, cl.Set(ctx, "k"+strconv.Itoa(i), i, 0).Err())
	}
	// Replication is asynchronous: make sure every master's replica has the
	// writes before one of them dies.
	require.NoError(t, cl.ForEachMaster(ctx, func(ctx context.Context, m *redis.Client) error {
		n, err := m.Wait(ctx, 1, 5*time.Second).Result()
		if err == nil && n < 1 {
			err = fmt.Errorf("WAIT on %s: %d replicas acknowledged", m.Options().Addr, n)
		}
		return err
	}))
	// A manual failover swaps master 0 with its replica, both staying up.
	oldM, newM := c.FailoverMaster(t, 0)
	require.Equal(t, masters[0], oldM)
	require.NotEqual(t, oldM, newM)
	masters = c.Masters()
	require.Equal(t, newM, masters[0])
	require.NotContains(t, masters, oldM)

	killed := c.KillMaster(1)
	require.Equal(t, masters[1], killed)
	c.WaitHealthy(t)
	after := c.Masters()
	require.Len(t, after, 3, "the replica took over the dead master's slots")
	require.NotContains(t, after, killed)
	require.Equal(t, masters[0], after[0])
	require.Equal(t, masters[2], after[2])

	// The client finds the new master by itself (its periodic reload).
	for i := range keys {
		var got int
		require.Eventually(t, func() bool {
			var err error
			got, err = cl.Get(ctx, "k"+strconv.Itoa(i)).Int()
			return err == nil
		}, 30*time.Second, 10*time.Millisecond, "key k%d after failover", i)
		require.Equal(t, i, got)
	}
}

// TestStartClusterSmall covers the clusters redis-cli refuses to create.
func TestStartClusterSmall(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ masters, replicas int }{{1, 0}, {2, 1}} {
		t.Run(fmt.Sprintf("%dx%d", tc.masters, tc.replicas), func(t *testing.T) {
			t.Parallel()
			c := StartCluster(t, tc.masters, tc.replicas)
			require.Len(t, c.Addrs(), tc.masters*(1+tc.replicas))
			require.Len(t, c.Masters(), tc.masters)
			requireClusterOK(t, c.Addrs())
			ctx := context.Background()
			cl := c.Client(t)
			for i := range 100 {
				require.NoError(t, cl.Set(ctx, "k"+strconv.Itoa(i), i, 0).Err())
			}
			for i := range 100 {
				require.Equal(t, strconv.Itoa(i), cl.Get(ctx, "k"+strconv.Itoa(i)).Val())
			}
		})
	}
}

// requireClusterOK checks every node's own view: cluster_state:ok and all
// slots assigned.
func requireClusterOK(t *testing.T, addrs []string) {
	t.Helper()
	ctx := context.Background()
	for _, a := range addrs {
		cl := redis.NewClient(&redis.Options{Addr: a})
		info, err := clusterInfo(ctx, cl)
		cl.Close()
		require.NoError(t, err)
		require.Equal(t, "ok", info["cluster_state"], a)
		require.Equal(t, "16384", info["cluster_slots_assigned"], a)
		require.Equal(t, strconv.Itoa(len(addrs)), info["cluster_known_nodes"], a)
	}
}

// TestClusterMissingCLI runs TestClusterMissingCLIHelper in a child process
// whose PATH has redis-server but not redis-cli: with CI set it must fail
// with an install hint, without CI it must skip.
func TestClusterMissingCLI(t *testing.T) {
	t.Parallel()
	server, err := ServerBinary()
	if err != nil {
		t.Skipf("needs %s: %v", binaryName, err)
	}
	dir := t.TempDir()
	require.NoError(t, os.Symlink(server, filepath.Join(dir, binaryName)))
	for _, tc := range []struct {
		ci       string
		wantFail bool
		want     string
	}{
		{ci: "true", wantFail: true, want: "--- FAIL: TestClusterMissingCLIHelper"},
		{ci: "", wantFail: false, want: "--- SKIP: TestClusterMissingCLIHelper"},
	} {
		t.Run(fmt.Sprintf("CI=%q", tc.ci), func(t *testing.T) {
			t.Parallel()
			cmd := exec.Command(os.Args[0], "-test.run=^TestClusterMissingCLIHelper$", "-test.v", "-test.count=1")
			cmd.Env = append(os.Environ(), cliHelperEnv+"=1", "PATH="+dir, "CI="+tc.ci, "GORACE=atexit_sleep_ms=0")
			out, err := cmd.CombinedOutput()
			if tc.wantFail {
				var exitErr *exec.ExitError
				require.ErrorAs(t, err, &exitErr, "output:\n%s", out)
			} else {
				require.NoError(t, err, "output:\n%s", out)
			}
			require.Contains(t, string(out), tc.want)
			require.Contains(t, string(out), "redis-cli not found on PATH")
			require.Contains(t, string(out), "apt-get install redis-tools")
			require.NotContains(t, string(out), "unreachable")
		})
	}
}

func TestClusterMissingCLIHelper(t *testing.T) {
	if os.Getenv(cliHelperEnv) != "1" {
		t.Skip("run by TestClusterMissingCLI in a child process")
	}
	StartCluster(t, 3, 0)
	t.Error("unreachable: StartCluster returned without redis-cli")
}
