package s3fetch

import (
	"bytes"
	"context"
	"io"
	"testing"

	"github.com/aws/aws-sdk-go-v2/service/s3"
	"github.com/stretchr/testify/require"
)

// unsizedObject answers GetObject with a body of n bytes and no
// Content-Length, as a store streaming a chunked response would, and counts
// the bytes read from it.
type unsizedObject struct {
	n    int
	read int
}

func (u *unsizedObject) GetObject(context.Context, *s3.GetObjectInput, ...func(*s3.Options)) (*s3.GetObjectOutput, error) {
	return &s3.GetObjectOutput{Body: io.NopCloser(&countingReader{r: bytes.NewReader(make([]byte, u.n)), n: &u.read})}, nil
}

type countingReader struct {
	r io.Reader
	n *int
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	*c.n += n
	return n, err
}

func TestGetMaxBytesWithoutContentLength(t *testing.T) {
	api := &unsizedObject{n: 1 << 20}
	src := &Source{client: api, bucket: "b", MaxBytes: 1000}
	_, err := src.Get(context.Background(), "k")
	require.ErrorIs(t, err, ErrTooLarge)
	require.LessOrEqual(t, api.read, 1001, "read past MaxBytes+1")

	api = &unsizedObject{n: 1000}
	src.client = api
	b, err := src.Get(context.Background(), "k")
	require.NoError(t, err)
	require.Len(t, b, 1000)
}
