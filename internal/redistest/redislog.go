package redistest

import (
	"context"
	"fmt"
	"io"
	"strings"
	"sync"
	"testing"

	"github.com/redis/go-redis/v9"
)

// go-redis logs through one process-wide logger (redis.SetLogger): failed
// dials, reconnects, pool errors. Tests that kill or restart Redis make it
// print many "connection refused" lines to stderr, which bury the output of
// the test that failed. LogToTests routes those lines to the logs of the tests
// that are running (t.Log: shown under -v, or when that test fails).

// maxUncaptured bounds the lines kept while no test is capturing.
const maxUncaptured = 200

var redisLog struct {
	install    sync.Once
	mu         sync.Mutex
	captures   []*capture // in registration order
	uncaptured []string   // the last lines logged while no test captured
}

type capture struct {
	tb    testing.TB
	addrs []string
}

// LogToTests makes go-redis log to the running tests instead of stderr. It is
// idempotent; CaptureLog, Start and StartCluster call it. Call it from
// TestMain to catch lines logged before any test captures, and print
// UncapturedLog there when the run fails.
func LogToTests() {
	redisLog.install.Do(func() { redis.SetLogger(testLogging{}) })
}

// CaptureLog sends go-redis's log lines to tb until tb ends. A line that names
// one of addrs (a server's address) goes to the tests that registered that
// address only; any other line goes to every capturing test, since the logger
// is process-wide and the line cannot be told apart. Start and StartCluster
// call it with their servers' addresses.
func CaptureLog(tb testing.TB, addrs ...string) {
	captureLog(tb).addAddrs(addrs...)
}

// addAddrs routes the lines that name addrs to c's test.
func (c *capture) addAddrs(addrs ...string) {
	redisLog.mu.Lock()
	c.addrs = append(c.addrs, addrs...)
	redisLog.mu.Unlock()
}

func captureLog(tb testing.TB) *capture {
	LogToTests()
	c := &capture{tb: tb}
	redisLog.mu.Lock()
	redisLog.captures = append(redisLog.captures, c)
	redisLog.mu.Unlock()
	// The lock is held while a line is logged, so no line reaches tb after
	// this cleanup, which runs before tb completes.
	tb.Cleanup(func() {
		redisLog.mu.Lock()
		defer redisLog.mu.Unlock()
		for i, x := range redisLog.captures {
			if x == c {
				redisLog.captures = append(redisLog.captures[:i], redisLog.captures[i+1:]...)
				break
			}
		}
	})
	return c
}

// UncapturedLog writes the last lines go-redis logged while no test was
// capturing (at most 200) to w, and forgets them.
func UncapturedLog(w io.Writer) {
	redisLog.mu.Lock()
	lines := redisLog.uncaptured
	redisLog.uncaptured = nil
	redisLog.mu.Unlock()
	for _, l := range lines {
		fmt.Fprintln(w, "go-redis:", l)
	}
}

// testLogging is go-redis's logger during tests.
type testLogging struct{}

func (testLogging) Printf(_ context.Context, format string, v ...any) {
	line := strings.TrimRight(fmt.Sprintf(format, v...), "\n")
	redisLog.mu.Lock()
	defer redisLog.mu.Unlock()
	var to []testing.TB
	for _, c := range redisLog.captures {
		for _, a := range c.addrs {
			if strings.Contains(line, a) {
				to = append(to, c.tb)
				break
			}
		}
	}
	if len(to) == 0 {
		for _, c := range redisLog.captures {
			to = append(to, c.tb)
		}
	}
	if len(to) == 0 {
		if len(redisLog.uncaptured) == maxUncaptured {
			redisLog.uncaptured = redisLog.uncaptured[1:]
		}
		redisLog.uncaptured = append(redisLog.uncaptured, line)
		return
	}
	for _, tb := range to {
		tb.Log("go-redis: " + line)
	}
}
