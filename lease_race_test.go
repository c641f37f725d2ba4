package streamq

import (
	"context"
	"errors"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/scripts"
)

// leaseGate is a go-redis hook that holds the next lease.lua call sent while
// it is armed until a release.lua call has been answered (or hold passes),
// so a renewal that snapshotted its entries before a release reaches Redis
// after it, as it can on a loaded machine.
type leaseGate struct {
	hold     time.Duration
	mu       sync.Mutex
	armed    bool
	held     chan struct{} // closed when a lease call is being held
	released chan struct{} // closed when a release call was answered
}

func newLeaseGate(hold time.Duration) *leaseGate {
	return &leaseGate{hold: hold, held: make(chan struct{}), released: make(chan struct{})}
}

func (g *leaseGate) arm() { g.mu.Lock(); g.armed = true; g.mu.Unlock() }

func (g *leaseGate) DialHook(next redis.DialHook) redis.DialHook { return next }

func (g *leaseGate) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

func (g *leaseGate) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		args := cmd.Args()
		if len(args) < 2 || !strings.EqualFold(cmd.Name(), "evalsha") {
			return next(ctx, cmd)
		}
		switch args[1] {
		case scripts.Lease.Hash():
			g.mu.Lock()
			armed := g.armed
			g.armed = false
			g.mu.Unlock()
			if armed {
				close(g.held)
				select {
				case <-g.released:
				case <-time.After(g.hold):
				}
			}
		case scripts.Release.Hash():
			err := next(ctx, cmd)
			select {
			case <-g.released:
			default:
				close(g.released)
			}
			return err
		}
		return next(ctx, cmd)
	}
}

// A lease renewal in flight when a stopping consumer releases its unstarted
// entries must not undo the release: the renewal snapshotted those entries
// while they were held, and reaching Redis after release.lua it set their
// idle time back to 0, so the next consumer waited MinIdle (30 s here) for
// entries that were meant to be claimable at once.
// TestStartsGracefulShutdownUnstartedRunOnce failed on it under load.
func TestReleaseNotUndoneByLeaseInFlight(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	q := queueName(t)
	p := newStringProducer(t, client, q)
	ids := seqIDs("job", 6)
	prs := produceAll(t, p, ids)

	// A's own client, named so that its subscription can be found and cut:
	// the resubscription asks for a lease renewal at once (pokeLease).
	name := "lease-race-" + q
	clientA := redis.NewClient(&redis.Options{Addr: client.Options().Addr, ClientName: name})
	t.Cleanup(func() { _ = clientA.Close() })
	gate := newLeaseGate(3 * time.Second)
	clientA.AddHook(gate)

	stopA := holdSix(t, clientA, client, q)

	// Cut A's subscription and hold the renewal it causes in flight.
	gate.arm()
	killSubscription(t, client, name)
	select {
	case <-gate.held:
	case <-time.After(10 * time.Second):
		t.Fatal("no lease renewal after the subscription was cut")
	}
	stopA()

	// B claims released entries at its first XAUTOCLAIM; with A's leases
	// renewed after the release it would wait the 30 s of MinIdle.
	requireUnstartedRunOnce(t, client, q, ids, prs, 15*time.Second)
}

// dialGate is a go-redis hook that makes new connections of its client
// fail while it is closed, so a subscription cut off stays down. It refuses
// every dial of the client, its command pool's included: a test that needs
// commands to go on while it is closed warms the pool first (warmPool).
type dialGate struct {
	mu     sync.Mutex
	closed bool
	tried  chan struct{} // gets a value per refused dial
}

func (g *dialGate) set(closed bool) { g.mu.Lock(); g.closed = closed; g.mu.Unlock() }

func (g *dialGate) DialHook(next redis.DialHook) redis.DialHook {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		g.mu.Lock()
		closed := g.closed
		g.mu.Unlock()
		if closed {
			select {
			case g.tried <- struct{}{}:
			default:
			}
			return nil, errors.New("dial refused by the test")
		}
		return next(ctx, network, addr)
	}
}

func (g *dialGate) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }

func (g *dialGate) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// warmPool makes client's command pool hold at least n connections, by
// having n blocking reads in flight at once, so that commands need no new
// connection while a dialGate refuses them (go-redis keeps an idle
// connection for 30 minutes).
func warmPool(t *testing.T, client *redis.Client, key string, n int) {
	t.Helper()
	eventually(t, 10*time.Second, func() bool {
		var wg sync.WaitGroup
		for range n {
			wg.Go(func() { _ = client.Do(context.Background(), "BLPOP", key, "0.2").Err() })
		}
		wg.Wait()
		return int(client.PoolStats().TotalConns) >= n
	}, "the pool never held %d connections", n)
}

// killSubscription cuts the pub/sub connection of the client named name.
func killSubscription(t *testing.T, client *redis.Client, name string) {
	t.Helper()
	eventually(t, 10*time.Second, func() bool {
		list, err := client.ClientList(context.Background()).Result()
		require.NoError(t, err)
		for _, line := range strings.Split(list, "\n") {
			if strings.Contains(line, " name="+name+" ") && strings.Contains(line, " sub=1 ") {
				id := strings.TrimPrefix(strings.Fields(line)[0], "id=")
				require.NoError(t, client.Do(context.Background(), "CLIENT", "KILL", "ID", id).Err())
				return true
			}
		}
		return false
	}, "the subscription of %s not found", name)
}

// A running request cancelled while its consumer's cancel notice is lost
// (its subscription down) is stopped by the lease renewal, which finds the
// entry gone; the handler's cause is still ErrCanceled, not ErrLeaseLost.
// The renewal reported every entry it no longer owned as claimed by another
// consumer, and TestCancelRunningHandlerSeesCancel failed when a renewal
// (the one a new subscription asks for) ran between cancel.lua and the
// notice's arrival.
//
// The gate refuses every new connection of the consumer's client, not only
// the subscription's (go-redis dials both through the same hook), so the
// renewal needs a connection the pool already holds. A consumer started
// under load may have dialed only one by then, and its fetcher's blocking
// read (ReadBlock 50 ms, taken again as soon as it returns) holds that one:
// beside two to four CPU burners the test failed 6 of 210 runs, each time
// with a pool of one connection, blocked in XREADGROUP, and all 21 renewals
// of the 10 s failed with the gate's dial error. Nothing guarantees a
// renewal a connection its pool cannot dial, so the pool is warmed with
// more connections than the consumer holds at once before the gate closes:
// only the subscription needs a new one (0 failures in 120 runs).
func TestCancelWithNoticeLostStillErrCanceled(t *testing.T) {
	t.Parallel()
	client := realRedis(t)
	ctx := context.Background()
	q := queueName(t)
	p := newStringProducer(t, client, q)
	a, err := NewAdmin(client, q, nil)
	require.NoError(t, err)

	name := "notice-lost-" + q
	clientC := redis.NewClient(&redis.Options{Addr: client.Options().Addr, ClientName: name, PoolSize: 20})
	t.Cleanup(func() { _ = clientC.Close() })
	gate := &dialGate{tried: make(chan struct{}, 1)}
	clientC.AddHook(gate)
	warmPool(t, clientC, "warm-"+q, 10)

	started := make(chan struct{}, 1)
	cause := make(chan error, 1)
	c, err := NewConsumer(clientC, q, func(ctx context.Context, m *Message[string]) (string, error) {
		started <- struct{}{}
		<-ctx.Done()
		cause <- context.Cause(ctx)
		return "late", nil
	}, &ConsumerOptions{Workers: 1, MinIdle: 1500 * time.Millisecond, ClaimInterval: time.Hour,
		ReadBlock: 50 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	runConsumer(t, c)

	pr := mustProduce(t, p, "job", "x")
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("the handler never started")
	}
	gate.set(true)
	t.Cleanup(func() { gate.set(false) })
	killSubscription(t, client, name)
	select {
	case <-gate.tried: // the subscription is down and cannot come back
	case <-time.After(10 * time.Second):
		t.Fatal("the subscription never tried to reconnect")
	}
	require.NoError(t, a.Cancel(ctx, "job"))
	select {
	case err := <-cause:
		require.ErrorIs(t, err, ErrCanceled)
	case <-time.After(10 * time.Second):
		t.Fatal("the handler never saw its context cancelled")
	}
	gate.set(false)
	_, err = pr.Wait(waitCtx(t, 10*time.Second))
	require.ErrorIs(t, err, ErrCanceled)
}
