package keys

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestNewSharesOneHashTag(t *testing.T) {
	k, err := New("orders")
	require.NoError(t, err)
	for _, name := range []string{k.Stream, k.DeadLetter, k.Channel, k.Record("a:b")} {
		require.True(t, strings.HasPrefix(name, "streamq:{orders}:"), name)
	}
	require.Equal(t, "streamq:{orders}:id:a:b", k.Record("a:b"))
}

func TestValidateQueue(t *testing.T) {
	require.Error(t, ValidateQueue(""))
	require.Error(t, ValidateQueue("a{b"))
	require.Error(t, ValidateQueue(strings.Repeat("q", MaxQueueNameLen+1)))
	require.NoError(t, ValidateQueue("jobs.v1"))
}

func TestRecordPatternEscapesGlob(t *testing.T) {
	k, err := New("a*b")
	require.NoError(t, err)
	require.Equal(t, `streamq:{a\*b}:id:*`, k.RecordPattern())
}
