package streamq

import (
	"context"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestWaitingJobRecord reads the record key out of a waiting keyed job's
// element in both of fair.lua's encodings, and out of MessagePack as the
// server's own cmsgpack packs record keys of every header size.
func TestWaitingJobRecord(t *testing.T) {
	require.Equal(t, "rec", waitingJobRecord("3:rec1:s1:0"))
	require.Equal(t, "", waitingJobRecord("9:rec"), "a length past the end")
	require.Equal(t, "", waitingJobRecord(""))
	require.Equal(t, "", waitingJobRecord("\x01junk"))
	require.Equal(t, "ab", waitingJobRecord("\x93\xa2ab\xa0\xa10"))

	client := realRedis(t)
	for _, n := range []int{1, 31, 32, 255, 256, 70000} {
		rec := strings.Repeat("r", n)
		el, err := client.Eval(context.Background(), `return cmsgpack.pack({ARGV[1], "", "0", "id", "x"})`, nil, rec).Text()
		require.NoError(t, err)
		require.Equal(t, rec, waitingJobRecord(el), "record key of %d bytes", n)
		at := strings.Index(el, rec)
		require.Equal(t, "", waitingJobRecord(el[:at+n-1]), "cut short")
	}
}
