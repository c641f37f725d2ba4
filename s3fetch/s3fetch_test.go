package s3fetch_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	"github.com/aws/aws-sdk-go-v2/service/s3/types"
	"github.com/johannesboyne/gofakes3"
	"github.com/johannesboyne/gofakes3/backend/s3mem"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq"
	"github.com/streamq/streamq/s3fetch"
)

// fakeS3 starts an in-process S3 fake on loopback and returns a client of it
// with a bucket of the given name.
func fakeS3(t *testing.T, bucket string) *s3.Client {
	t.Helper()
	srv := httptest.NewServer(gofakes3.New(s3mem.New()).Server())
	t.Cleanup(srv.Close)
	client := s3.New(s3.Options{
		Region:       "us-east-1",
		BaseEndpoint: aws.String(srv.URL),
		UsePathStyle: true,
		Credentials:  credentials.NewStaticCredentialsProvider("test-key", "test-secret", ""),
		HTTPClient:   srv.Client(),
	})
	_, err := client.CreateBucket(context.Background(), &s3.CreateBucketInput{Bucket: aws.String(bucket)})
	require.NoError(t, err)
	return client
}

func put(t *testing.T, client *s3.Client, bucket, key string, body []byte) {
	t.Helper()
	_, err := client.PutObject(context.Background(), &s3.PutObjectInput{
		Bucket: aws.String(bucket), Key: aws.String(key), Body: bytes.NewReader(body),
	})
	require.NoError(t, err)
}

func TestGet(t *testing.T) {
	ctx := context.Background()
	client := fakeS3(t, "payloads")
	put(t, client, "payloads", "a/one.json", []byte(`{"n":1}`))
	put(t, client, "payloads", "empty", nil)

	src := s3fetch.New(client, "payloads")
	b, err := src.Get(ctx, "a/one.json")
	require.NoError(t, err)
	require.Equal(t, `{"n":1}`, string(b))

	b, err = src.Get(ctx, "empty")
	require.NoError(t, err)
	require.Empty(t, b)

	src.KeyPrefix = "a/"
	b, err = src.Get(ctx, "one.json")
	require.NoError(t, err)
	require.Equal(t, `{"n":1}`, string(b))
}

func TestGetNotFound(t *testing.T) {
	ctx := context.Background()
	client := fakeS3(t, "payloads")

	_, err := s3fetch.New(client, "payloads").Get(ctx, "missing/key")
	require.Error(t, err)
	require.ErrorIs(t, err, s3fetch.ErrNotFound)
	require.True(t, s3fetch.IsNotFound(err))
	var nsk *types.NoSuchKey
	require.ErrorAs(t, err, &nsk, "the SDK's error stays reachable")
	var e *s3fetch.Error
	require.ErrorAs(t, err, &e)
	require.Equal(t, "payloads", e.Bucket)
	require.Equal(t, "missing/key", e.Key)
	require.Contains(t, err.Error(), "s3://payloads/missing/key")
	require.False(t, streamq.IsPermanent(err), "missing objects are retried unless PermanentNotFound")

	src := s3fetch.New(client, "payloads")
	src.PermanentNotFound = true
	_, err = src.Get(ctx, "missing/key")
	require.True(t, streamq.IsPermanent(err))
	require.ErrorIs(t, err, s3fetch.ErrNotFound)

	// A missing bucket is a configuration error, not a missing object.
	_, err = s3fetch.New(client, "no-such-bucket").Get(ctx, "k")
	require.Error(t, err)
	require.NotErrorIs(t, err, s3fetch.ErrNotFound)
	require.Contains(t, err.Error(), "s3://no-such-bucket/k")
	require.Contains(t, err.Error(), "NoSuchBucket")
}

func TestGetMaxBytes(t *testing.T) {
	ctx := context.Background()
	client := fakeS3(t, "payloads")
	put(t, client, "payloads", "big", bytes.Repeat([]byte("x"), 100))
	src := s3fetch.New(client, "payloads")
	src.MaxBytes = 100
	b, err := src.Get(ctx, "big")
	require.NoError(t, err)
	require.Len(t, b, 100)

	src.MaxBytes = 99
	_, err = src.Get(ctx, "big")
	require.ErrorIs(t, err, s3fetch.ErrTooLarge)
	require.Contains(t, err.Error(), "s3://payloads/big")
}

func TestGetContextCancelled(t *testing.T) {
	client := fakeS3(t, "payloads")
	put(t, client, "payloads", "k", []byte("v"))
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := s3fetch.New(client, "payloads").Get(ctx, "k")
	require.ErrorIs(t, err, context.Canceled)
	require.NotErrorIs(t, err, s3fetch.ErrNotFound)
}

// End to end: a miniredis-backed consumer fetches payloads with a
// CacheFetcher whose Source is the bucket.
func TestCacheFetcherSourceEndToEnd(t *testing.T) {
	ctx := context.Background()
	const n = 30
	bucket := "requests"
	s3c := fakeS3(t, bucket)
	mr := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	t.Cleanup(func() { _ = rdb.Close() })

	type doc struct{ Name, Text string }
	key := func(i int) string { return fmt.Sprintf("doc-%02d", i) }
	for i := range n {
		put(t, s3c, bucket, "in/"+key(i), fmt.Appendf(nil, `{"Name":%q,"Text":"from the bucket"}`, key(i)))
		if i%3 == 0 {
			require.NoError(t, rdb.Set(ctx, "cache:"+key(i), fmt.Sprintf(`{"Name":%q,"Text":"from the cache"}`, key(i)), time.Minute).Err())
		}
	}

	src := s3fetch.New(s3c, bucket)
	src.KeyPrefix = "in/"
	src.PermanentNotFound = true
	var bucketReads atomic.Int64
	logger := slog.New(slog.DiscardHandler)
	consumer, err := streamq.NewConsumer(rdb, "docs",
		func(ctx context.Context, m *streamq.Message[doc]) (string, error) {
			if m.Payload.Text == "from the bucket" {
				bucketReads.Add(1)
			}
			return m.Payload.Name + ": " + m.Payload.Text, nil
		},
		&streamq.ConsumerOptions{
			Workers: 2,
			Fetcher: &streamq.CacheFetcher{
				Client:           rdb,
				CacheKey:         func(e streamq.Entry) string { return "cache:" + string(e.Data) },
				Source:           src,
				DeleteOnComplete: true,
			},
			FetchBackoff: time.Millisecond,
			ReadBlock:    50 * time.Millisecond,
			Logger:       logger,
		})
	require.NoError(t, err)
	runCtx, stop := context.WithCancel(ctx)
	runDone := make(chan error, 1)
	go func() { runDone <- consumer.Run(runCtx) }()
	t.Cleanup(func() {
		stop()
		require.NoError(t, <-runDone)
	})

	producer, err := streamq.NewProducer[[]byte, string](rdb, "docs", &streamq.ProducerOptions{Logger: logger})
	require.NoError(t, err)
	t.Cleanup(func() { _ = producer.Close() })
	var promises []*streamq.Promise[string]
	for i := range n {
		pr, err := producer.Produce(ctx, key(i), []byte(key(i)))
		require.NoError(t, err)
		promises = append(promises, pr)
	}
	missing, err := producer.Produce(ctx, "ghost", []byte("ghost"))
	require.NoError(t, err)

	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	for i, pr := range promises {
		got, err := pr.Wait(wctx)
		require.NoError(t, err)
		want := key(i) + ": from the bucket"
		if i%3 == 0 {
			want = key(i) + ": from the cache"
		}
		require.Equal(t, want, got)
	}
	require.EqualValues(t, n-(n+2)/3, bucketReads.Load())

	// A missing object with PermanentNotFound is dead-lettered at its first
	// fetch, with the bucket and key in the error; its handler never started,
	// so the dead letter counts no delivery.
	_, err = missing.Wait(wctx)
	require.ErrorIs(t, err, streamq.ErrDeadLettered)
	require.Contains(t, err.Error(), "s3://requests/in/ghost")
	admin, err := streamq.NewAdmin(rdb, "docs", nil)
	require.NoError(t, err)
	dls, err := admin.DeadLetters(ctx, "", 10)
	require.NoError(t, err)
	require.Len(t, dls, 1)
	require.Equal(t, "ghost", dls[0].ID)
	require.Equal(t, 0, dls[0].Deliveries)
	require.True(t, strings.Contains(dls[0].Error, "NoSuchKey"), "error %q", dls[0].Error)

	// The cache keys of completed messages are deleted.
	require.Eventually(t, func() bool {
		keys, err := rdb.Keys(ctx, "cache:*").Result()
		return err == nil && len(keys) == 0
	}, 10*time.Second, 5*time.Millisecond, "cache keys not deleted")
}
