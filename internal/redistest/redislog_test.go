package redistest

import (
	"bytes"
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// recordingTB keeps what is logged to it; everything else goes to the real test.
type recordingTB struct {
	testing.TB
	mu    sync.Mutex
	lines []string
}

func (r *recordingTB) Log(args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, a := range args {
		r.lines = append(r.lines, a.(string))
	}
}

func (r *recordingTB) logged() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.lines...)
}

// A line naming a server goes to the tests of that server only; other lines go
// to every capturing test; lines logged while nobody captures are kept for
// TestMain.
func TestRedisLogRouting(t *testing.T) {
	// Not parallel: it checks what happens while no other test captures.
	var a, b *recordingTB
	t.Run("captured", func(t *testing.T) {
		a, b = &recordingTB{TB: t}, &recordingTB{TB: t}
		CaptureLog(a, "127.0.0.1:1111")
		CaptureLog(b, "127.0.0.1:2222")
		testLogging{}.Printf(context.Background(), "dial tcp %s: connect: connection refused\n", "127.0.0.1:1111")
		testLogging{}.Printf(context.Background(), "something about no server")
		require.Equal(t, []string{"go-redis: dial tcp 127.0.0.1:1111: connect: connection refused",
			"go-redis: something about no server"}, a.logged())
		require.Equal(t, []string{"go-redis: something about no server"}, b.logged())
	})
	// Both captures ended with the subtest.
	testLogging{}.Printf(context.Background(), "after the tests")
	require.Len(t, a.logged(), 2)
	var out bytes.Buffer
	UncapturedLog(&out)
	require.Equal(t, "go-redis: after the tests\n", out.String())
	out.Reset()
	UncapturedLog(&out)
	require.Empty(t, out.String(), "printed once")
}

// go-redis's own lines (here: the pool's "failed to dial" once the server is
// gone) reach the test that started the server, not stderr.
func TestRedisLogOfAKillGoesToTheTest(t *testing.T) {
	t.Parallel()
	rec := &recordingTB{TB: t}
	s := Start(rec)
	c := redis.NewClient(&redis.Options{Addr: s.Addr(), MaxRetries: -1})
	defer c.Close()
	require.NoError(t, c.Ping(context.Background()).Err())
	s.Kill()
	require.Eventually(t, func() bool {
		_ = c.Ping(context.Background()).Err()
		for _, l := range rec.logged() {
			if strings.HasPrefix(l, "go-redis: ") && strings.Contains(l, s.Addr()) {
				return true
			}
		}
		return false
	}, 10*time.Second, 10*time.Millisecond, "no go-redis line about %s reached the test: %q", s.Addr(), rec.logged())
}
