package redistest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

const (
	// cliName is the executable that creates clusters (redis-cli --cluster create).
	cliName = "redis-cli"
	// cliHint tells a developer how to get it.
	cliHint = "install it with `apt-get install redis-tools` (Debian's redis-server package depends on it), or run `make test`, which installs redis-server"

	// clusterTimeout bounds cluster creation and every wait for a healthy cluster.
	clusterTimeout = 60 * time.Second
	// slotCount is the number of Redis Cluster hash slots.
	slotCount = 16384
	// clusterNodeTimeout is the cluster-node-timeout in milliseconds: how long
	// a master must be unreachable before its replica takes over. Failover
	// completes a few node timeouts after a master dies.
	clusterNodeTimeout = 2000
)

// Cluster is a Redis Cluster of redis-server processes started for a test by
// [StartCluster]. It is stopped automatically when the test and its subtests
// finish. Its methods may be called from any goroutine, except those that take
// a testing.TB, which follow that TB's rules.
type Cluster struct {
	tb    testing.TB
	nodes []*Process // in creation order: masters first, then replicas
	byAdr map[string]*Process

	mu     sync.Mutex
	killed map[string]bool // addresses of nodes killed with KillMaster
}

// StartCluster starts a Redis Cluster of masters masters with
// replicasPerMaster replicas each, for tb. Every node is a redis-server on a
// free loopback port with its own directory from tb.TempDir, cluster mode on
// (nodes.conf in its directory), cluster-node-timeout 2000 ms and no
// persistence. The hash slots are split evenly over the masters.
//
// With three masters or more the cluster is created by
// `redis-cli --cluster create ... --cluster-replicas R --cluster-yes`; redis-cli
// refuses fewer than three masters, so smaller clusters are assembled with
// CLUSTER ADDSLOTSRANGE, CLUSTER MEET and CLUSTER REPLICATE.
//
// StartCluster returns when every node reports cluster_state:ok, every slot
// is served by a master and every replica is in sync with its master. The
// nodes are stopped when tb finishes.
//
// The nodes run redis-server on PATH, or the binary [ServerEnv] names;
// redis-cli is always taken from PATH (Debian's redis-cli creates Valkey
// clusters too). If redis-server, or redis-cli when it is needed, is not on
// PATH, StartCluster fails the test when the environment variable CI is
// non-empty and skips it otherwise. It must be called from the goroutine running the
// test.
func StartCluster(tb testing.TB, masters, replicasPerMaster int) *Cluster {
	tb.Helper()
	if masters < 1 || replicasPerMaster < 0 {
		tb.Fatalf("redistest: StartCluster(%d, %d): need at least one master and no negative replica count", masters, replicasPerMaster)
	}
	bin := serverPath(tb)
	var cli string
	if masters >= 3 {
		cli = lookPath(tb, cliName, cliHint)
	}

	n := masters * (1 + replicasPerMaster)
	c := &Cluster{tb: tb, byAdr: make(map[string]*Process, n), killed: map[string]bool{}}
	opts := []Option{WithArgs(
		"--cluster-enabled", "yes",
		"--cluster-config-file", "nodes.conf",
		"--cluster-node-timeout", strconv.Itoa(clusterNodeTimeout),
		// A lone node does not learn its own address (no MEET), so say it.
		"--cluster-announce-ip", "127.0.0.1",
		"--appendonly", "no",
		"--save", "",
	)}
	for range n {
		// TempDir registers its removal before the cleanup below, so the node
		// is stopped before its directory is removed.
		c.nodes = append(c.nodes, newProcess(bin, tb.TempDir(), false, opts))
	}
	// Registered before the stop, so it still captures during the stop.
	logs := captureLog(tb)
	tb.Cleanup(c.stop)

	errs := make([]error, n)
	var wg sync.WaitGroup
	for i, p := range c.nodes {
		wg.Go(func() { errs[i] = p.launch(context.Background(), true) })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		tb.Fatal(wrap(err))
	}
	for _, p := range c.nodes {
		c.byAdr[p.Addr()] = p
		logs.addAddrs(p.Addr())
	}

	ctx, cancel := context.WithTimeout(context.Background(), clusterTimeout)
	defer cancel()
	var err error
	if cli != "" {
		err = c.createWithCLI(ctx, cli, replicasPerMaster)
	} else {
		err = c.assemble(ctx, masters)
	}
	if err != nil {
		tb.Fatal(wrap(err))
	}
	if err := c.waitHealthy(ctx, n); err != nil {
		tb.Fatal(wrap(err))
	}
	tb.Logf("redistest: Redis Cluster of %d masters and %d replicas each on %s",
		masters, replicasPerMaster, strings.Join(c.Addrs(), " "))
	return c
}

// lookPath finds an executable, or fails (under CI) or skips tb.
func lookPath(tb testing.TB, name, hint string) string {
	tb.Helper()
	path, err := exec.LookPath(name)
	if err != nil {
		if os.Getenv("CI") != "" {
			tb.Fatalf("redistest: %s not found on PATH (CI is set, so this is an error): %s", name, hint)
		}
		tb.Skipf("redistest: %s not found on PATH, skipping: %s", name, hint)
	}
	return path
}

// stop stops every node, logging their logs' ends when the test failed.
func (c *Cluster) stop() {
	failed := c.tb.Failed()
	var wg sync.WaitGroup
	for _, p := range c.nodes {
		if failed {
			if tail := p.logTail(0); tail != "" {
				c.tb.Logf("redistest: log of cluster node %s:\n%s", p.Addr(), tail)
			}
		}
		wg.Go(func() {
			if err := p.stop(); err != nil {
				c.tb.Error(err)
			}
		})
	}
	wg.Wait()
}

// createWithCLI runs redis-cli --cluster create over every node.
func (c *Cluster) createWithCLI(ctx context.Context, cli string, replicas int) error {
	args := append([]string{"--cluster", "create"}, c.Addrs()...)
	args = append(args, "--cluster-replicas", strconv.Itoa(replicas), "--cluster-yes")
	out, err := exec.CommandContext(ctx, cli, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %w\n%s", cli, strings.Join(args, " "), err, out)
	}
	return nil
}

// assemble builds the cluster by hand: the first masters nodes get equal slot
// ranges, every node meets the first, and the others replicate the masters in
// turn.
func (c *Cluster) assemble(ctx context.Context, masters int) error {
	ids := make([]string, len(c.nodes))
	for i, p := range c.nodes {
		err := withNode(ctx, p.Addr(), func(cl *redis.Client) error {
			id, err := cl.ClusterMyID(ctx).Result()
			ids[i] = id
			if err != nil || i >= masters {
				return err
			}
			lo, hi := i*slotCount/masters, (i+1)*slotCount/masters-1
			return cl.ClusterAddSlotsRange(ctx, lo, hi).Err()
		})
		if err != nil {
			return fmt.Errorf("set up node %s: %w", p.Addr(), err)
		}
	}
	first := c.nodes[0]
	for _, p := range c.nodes[1:] {
		err := withNode(ctx, p.Addr(), func(cl *redis.Client) error {
			return cl.ClusterMeet(ctx, "127.0.0.1", strconv.Itoa(first.Port())).Err()
		})
		if err != nil {
			return fmt.Errorf("CLUSTER MEET from %s: %w", p.Addr(), err)
		}
	}
	// A replica can only replicate a master it knows.
	err := waitFor(ctx, func() error {
		for _, p := range c.nodes {
			var known int
			err := withNode(ctx, p.Addr(), func(cl *redis.Client) error {
				info, err := clusterInfo(ctx, cl)
				known, _ = strconv.Atoi(info["cluster_known_nodes"])
				return err
			})
			if err != nil {
				return err
			}
			if known != len(c.nodes) {
				return fmt.Errorf("node %s knows %d of %d nodes", p.Addr(), known, len(c.nodes))
			}
		}
		return nil
	})
	if err != nil {
		return err
	}
	for i, p := range c.nodes[masters:] {
		master := ids[i%masters]
		err := withNode(ctx, p.Addr(), func(cl *redis.Client) error {
			return cl.ClusterReplicate(ctx, master).Err()
		})
		if err != nil {
			return fmt.Errorf("CLUSTER REPLICATE on %s: %w", p.Addr(), err)
		}
	}
	return nil
}

// Addrs returns the addresses of every node, masters and replicas, in
// creation order, including nodes that were killed.
func (c *Cluster) Addrs() []string {
	out := make([]string, len(c.nodes))
	for i, p := range c.nodes {
		out[i] = p.Addr()
	}
	return out
}

// PIDs returns the process ids of the running nodes, in creation order; a
// killed node is left out.
func (c *Cluster) PIDs() []int {
	var out []int
	for _, p := range c.nodes {
		if pid := p.PID(); pid != 0 {
			out = append(out, pid)
		}
	}
	return out
}

// ClientReloadInterval is the ClusterStateReloadInterval of the clients that
// [Cluster.Options] describes. go-redis reloads its slot map on MOVED, but
// not when a master stops answering, and by default only every 60 s; after a
// failover its commands would go to the dead master until then (go-redis
// issue 3979). One second keeps failover tests short.
const ClientReloadInterval = time.Second

// Options returns new options of a cluster client that knows every node and
// reloads the slot map every [ClientReloadInterval].
func (c *Cluster) Options() *redis.ClusterOptions {
	return &redis.ClusterOptions{Addrs: c.Addrs(), ClusterStateReloadInterval: ClientReloadInterval}
}

// Client returns a new cluster client with [Cluster.Options]. It is closed
// when tb finishes, before the nodes are stopped.
func (c *Cluster) Client(tb testing.TB) *redis.ClusterClient {
	tb.Helper()
	cl := redis.NewClusterClient(c.Options())
	tb.Cleanup(func() { _ = cl.Close() })
	return cl
}

// Masters returns the addresses of the masters serving slots, ordered by
// their lowest slot, as a live node sees the cluster now. During a failover
// the answer may still name a dead master; call [Cluster.WaitHealthy] first.
func (c *Cluster) Masters() []string {
	c.tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var lastErr error
	for _, addr := range c.live() {
		var slots []redis.ClusterSlot
		lastErr = withNode(ctx, addr, func(cl *redis.Client) error {
			var err error
			slots, err = cl.ClusterSlots(ctx).Result()
			return err
		})
		if lastErr == nil {
			return mastersOf(slots)
		}
	}
	c.tb.Errorf("redistest: no live cluster node answered CLUSTER SLOTS: %v", lastErr)
	return nil
}

// mastersOf returns the distinct masters of a CLUSTER SLOTS reply, ordered by
// their lowest slot.
func mastersOf(slots []redis.ClusterSlot) []string {
	sort.Slice(slots, func(i, j int) bool { return slots[i].Start < slots[j].Start })
	var out []string
	seen := map[string]bool{}
	for _, s := range slots {
		if len(s.Nodes) == 0 {
			continue
		}
		if a := s.Nodes[0].Addr; !seen[a] {
			seen[a] = true
			out = append(out, a)
		}
	}
	return out
}

// KillMaster kills the i-th master of [Cluster.Masters] with SIGKILL, as a
// crash would, waits for the process to exit and returns its address. Its
// replica takes over after about cluster-node-timeout (2 s); use
// [Cluster.WaitHealthy] to wait for that. A master without a replica leaves
// its slots unserved: the cluster stays down.
func (c *Cluster) KillMaster(i int) string {
	c.tb.Helper()
	masters := c.Masters()
	if i < 0 || i >= len(masters) {
		c.tb.Fatalf("redistest: KillMaster(%d): the cluster has %d masters", i, len(masters))
	}
	addr := masters[i]
	c.mu.Lock()
	c.killed[addr] = true
	c.mu.Unlock()
	if err := c.byAdr[addr].Kill(); err != nil {
		c.tb.Error(err)
	}
	c.tb.Logf("redistest: killed cluster master %s", addr)
	return addr
}

// FailoverMaster promotes a replica of the i-th master of [Cluster.Masters]
// with CLUSTER FAILOVER, as an operator does before maintenance: the old
// master becomes a replica of the new one and keeps running. It waits until
// every node sees the new master and the cluster is healthy, and returns the
// addresses of the old and the new master.
func (c *Cluster) FailoverMaster(tb testing.TB, i int) (oldMaster, newMaster string) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), clusterTimeout)
	defer cancel()
	var slots []redis.ClusterSlot
	err := withNode(ctx, c.live()[0], func(cl *redis.Client) error {
		var err error
		slots, err = cl.ClusterSlots(ctx).Result()
		return err
	})
	if err != nil {
		tb.Fatal(wrap(err))
	}
	masters := mastersOf(slots)
	if i < 0 || i >= len(masters) {
		tb.Fatalf("redistest: FailoverMaster(%d): the cluster has %d masters", i, len(masters))
	}
	oldMaster = masters[i]
	var masterID string
	for _, s := range slots {
		if len(s.Nodes) > 0 && s.Nodes[0].Addr == oldMaster {
			masterID = s.Nodes[0].ID
		}
	}
	// CLUSTER SLOTS leaves out replicas that have no data yet (7.0), so ask
	// for the replicas by name: "<id> <ip:port@cport> <flags> ...".
	err = withNode(ctx, oldMaster, func(cl *redis.Client) error {
		lines, err := cl.ClusterSlaves(ctx, masterID).Result()
		for _, line := range lines {
			f := strings.Fields(line)
			if len(f) > 2 && !strings.Contains(f[2], "fail") {
				newMaster, _, _ = strings.Cut(f[1], "@")
				break
			}
		}
		return err
	})
	if err != nil {
		tb.Fatal(wrap(err))
	}
	if newMaster == "" {
		tb.Fatalf("redistest: FailoverMaster(%d): master %s has no replica", i, oldMaster)
	}
	err = withNode(ctx, newMaster, func(cl *redis.Client) error { return cl.ClusterFailover(ctx).Err() })
	if err != nil {
		tb.Fatal(wrap(fmt.Errorf("CLUSTER FAILOVER on %s: %w", newMaster, err)))
	}
	err = waitFor(ctx, func() error {
		if err := c.healthy(ctx, -1); err != nil {
			return err
		}
		for _, addr := range c.live() {
			var ms []string
			err := withNode(ctx, addr, func(cl *redis.Client) error {
				slots, err := cl.ClusterSlots(ctx).Result()
				ms = mastersOf(slots)
				return err
			})
			if err != nil {
				return err
			}
			if slices.Contains(ms, oldMaster) || !slices.Contains(ms, newMaster) {
				return fmt.Errorf("node %s sees masters %v", addr, ms)
			}
		}
		// The new master relays sharded pub/sub messages to the replicas it
		// knows: wait until it knows the old master as one.
		return withNode(ctx, newMaster, func(cl *redis.Client) error {
			nodes, err := cl.ClusterNodes(ctx).Result()
			if err != nil {
				return err
			}
			var myID string
			for _, line := range strings.Split(nodes, "\n") {
				if f := strings.Fields(line); len(f) > 2 && strings.Contains(f[2], "myself") {
					myID = f[0]
				}
			}
			for _, line := range strings.Split(nodes, "\n") {
				f := strings.Fields(line)
				if len(f) > 3 && strings.HasPrefix(f[1], oldMaster+"@") && strings.Contains(f[2], "slave") && f[3] == myID {
					return nil
				}
			}
			return fmt.Errorf("new master %s does not list %s as its replica yet", newMaster, oldMaster)
		})
	})
	if err != nil {
		tb.Fatal(wrap(err))
	}
	tb.Logf("redistest: failover: %s replaced master %s", newMaster, oldMaster)
	return oldMaster, newMaster
}

// WaitHealthy waits until the cluster is whole again: every live node reports
// cluster_state:ok, every slot is served by a live master, all live nodes
// agree on the masters and every live replica is in sync. After
// [Cluster.KillMaster] this is when a replica has been promoted. It fails tb
// after a minute.
func (c *Cluster) WaitHealthy(tb testing.TB) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), clusterTimeout)
	defer cancel()
	start := time.Now()
	if err := c.waitHealthy(ctx, -1); err != nil {
		tb.Fatal(wrap(err))
	}
	tb.Logf("redistest: cluster healthy after %v, masters %s", time.Since(start).Round(time.Millisecond), strings.Join(c.Masters(), " "))
}

// live returns the addresses of the nodes not killed.
func (c *Cluster) live() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []string
	for _, p := range c.nodes {
		if a := p.Addr(); !c.killed[a] {
			out = append(out, a)
		}
	}
	return out
}

// waitHealthy polls until healthy reports nil or ctx ends. known, when not
// negative, is the number of nodes every node must know.
func (c *Cluster) waitHealthy(ctx context.Context, known int) error {
	return waitFor(ctx, func() error { return c.healthy(ctx, known) })
}

// healthy reports why the cluster is not healthy, or nil.
func (c *Cluster) healthy(ctx context.Context, known int) error {
	live := c.live()
	isLive := map[string]bool{}
	for _, a := range live {
		isLive[a] = true
	}
	var view []string
	for _, addr := range live {
		err := withNode(ctx, addr, func(cl *redis.Client) error {
			info, err := clusterInfo(ctx, cl)
			if err != nil {
				return err
			}
			if info["cluster_state"] != "ok" {
				return fmt.Errorf("cluster_state:%s", info["cluster_state"])
			}
			if info["cluster_slots_ok"] != strconv.Itoa(slotCount) {
				return fmt.Errorf("cluster_slots_ok:%s", info["cluster_slots_ok"])
			}
			if known >= 0 && info["cluster_known_nodes"] != strconv.Itoa(known) {
				return fmt.Errorf("cluster_known_nodes:%s, want %d", info["cluster_known_nodes"], known)
			}
			slots, err := cl.ClusterSlots(ctx).Result()
			if err != nil {
				return err
			}
			covered := 0
			for _, s := range slots {
				covered += s.End - s.Start + 1
				if len(s.Nodes) == 0 || !isLive[s.Nodes[0].Addr] {
					return fmt.Errorf("slots %d-%d are served by a dead master", s.Start, s.End)
				}
			}
			if covered != slotCount {
				return fmt.Errorf("CLUSTER SLOTS covers %d slots", covered)
			}
			masters := mastersOf(slots)
			if view == nil {
				view = masters
			} else if !slices.Equal(view, masters) {
				return fmt.Errorf("sees masters %v, another node sees %v", masters, view)
			}
			repl, err := cl.Info(ctx, "replication").Result()
			if err != nil {
				return err
			}
			if strings.Contains(repl, "role:slave") && !strings.Contains(repl, "master_link_status:up") {
				return errors.New("replica not in sync with its master")
			}
			return nil
		})
		if err != nil {
			return fmt.Errorf("node %s: %w", addr, err)
		}
	}
	return nil
}

// waitFor calls check until it returns nil, backing off from 10 ms to 200 ms,
// and returns ctx's error joined with check's last error when ctx ends.
func waitFor(ctx context.Context, check func() error) error {
	delay := 10 * time.Millisecond
	for {
		err := check()
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("cluster not ready: %w (last check: %v)", ctx.Err(), err)
		case <-time.After(delay):
		}
		delay = min(2*delay, 200*time.Millisecond)
	}
}

// withNode runs fn with a short-lived client of one node.
func withNode(ctx context.Context, addr string, fn func(*redis.Client) error) error {
	cl := redis.NewClient(&redis.Options{
		Addr: addr, DialTimeout: time.Second, ReadTimeout: 2 * time.Second,
		MaxRetries: -1, PoolSize: 1,
	})
	defer cl.Close()
	return fn(cl)
}

// clusterInfo returns the fields of CLUSTER INFO.
func clusterInfo(ctx context.Context, cl *redis.Client) (map[string]string, error) {
	s, err := cl.ClusterInfo(ctx).Result()
	if err != nil {
		return nil, err
	}
	out := map[string]string{}
	for _, line := range strings.Split(s, "\n") {
		if k, v, ok := strings.Cut(strings.TrimSpace(line), ":"); ok {
			out[k] = v
		}
	}
	return out, nil
}
