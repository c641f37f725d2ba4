// Package s3fetch is a streamq.Source for S3 and S3-compatible object stores
// (MinIO, Ceph, R2, GCS interoperability...), on the AWS SDK for Go v2.
//
// Use it as the Source of a streamq.CacheFetcher, so that a consumer fetches
// the payloads of upcoming messages from the cache or the bucket while its
// handlers work:
//
//	src := s3fetch.New(s3.NewFromConfig(cfg), "requests")
//	c, err := streamq.NewConsumer(rdb, "thumbnails", handle, &streamq.ConsumerOptions{
//		Fetcher: &streamq.CacheFetcher{Client: rdb, Source: src},
//	})
//
// It is a module of its own so that the streamq core does not depend on the
// AWS SDK.
package s3fetch

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	"github.com/aws/aws-sdk-go-v2/service/s3/types"
	"github.com/aws/smithy-go"

	"github.com/streamq/streamq"
)

// ErrNotFound matches (with errors.Is) the error of a Get whose object does not
// exist. The SDK's own error (*types.NoSuchKey, or an API error with code
// "NotFound") stays reachable with errors.As.
var ErrNotFound = errors.New("s3fetch: object not found")

// ErrTooLarge matches the error of a Get whose object exceeds Source.MaxBytes.
var ErrTooLarge = errors.New("s3fetch: object larger than MaxBytes")

// getObjectAPI is the part of *s3.Client that Source uses.
type getObjectAPI interface {
	GetObject(ctx context.Context, in *s3.GetObjectInput, optFns ...func(*s3.Options)) (*s3.GetObjectOutput, error)
}

// Source reads objects from one bucket. It is safe for concurrent use.
// Set its fields before first use; do not change them afterwards.
type Source struct {
	client getObjectAPI
	bucket string

	// KeyPrefix is prepended to every key given to Get, e.g. "requests/".
	// Defaults to "".
	KeyPrefix string

	// MaxBytes is the largest object Get returns; a larger one is an error
	// matching ErrTooLarge, read no further than MaxBytes+1 bytes. It bounds a
	// consumer's memory at Prefetch x MaxBytes. Defaults to 0: no limit.
	MaxBytes int64

	// PermanentNotFound makes a missing object a permanent failure
	// (streamq.Permanent): the message is dead-lettered at once instead of being
	// retried. Defaults to false, because an object may be written after the
	// message that refers to it is produced.
	PermanentNotFound bool
}

var _ streamq.Source = (*Source)(nil)

// New returns a Source that reads the objects of bucket with client.
func New(client *s3.Client, bucket string) *Source {
	return &Source{client: client, bucket: bucket}
}

// Get returns the object stored under KeyPrefix+key. Its errors are *Error
// values that name the bucket and the key and wrap the SDK's error; a missing
// object matches ErrNotFound.
func (s *Source) Get(ctx context.Context, key string) ([]byte, error) {
	key = s.KeyPrefix + key
	out, err := s.client.GetObject(ctx, &s3.GetObjectInput{Bucket: aws.String(s.bucket), Key: aws.String(key)})
	if err != nil {
		return nil, s.wrap(key, err)
	}
	defer out.Body.Close()
	if s.MaxBytes > 0 && out.ContentLength != nil && *out.ContentLength > s.MaxBytes {
		return nil, s.wrap(key, fmt.Errorf("%w: %d bytes, MaxBytes is %d", ErrTooLarge, *out.ContentLength, s.MaxBytes))
	}
	var body io.Reader = out.Body
	if s.MaxBytes > 0 {
		body = io.LimitReader(out.Body, s.MaxBytes+1)
	}
	b, err := io.ReadAll(body)
	if err != nil {
		return nil, s.wrap(key, fmt.Errorf("read body: %w", err))
	}
	if s.MaxBytes > 0 && int64(len(b)) > s.MaxBytes {
		return nil, s.wrap(key, fmt.Errorf("%w: more than %d bytes", ErrTooLarge, s.MaxBytes))
	}
	return b, nil
}

func (s *Source) wrap(key string, err error) error {
	e := &Error{Bucket: s.bucket, Key: key, Err: err, notFound: isNotFound(err)}
	if e.notFound && s.PermanentNotFound {
		return streamq.Permanent(e)
	}
	return e
}

// isNotFound recognises a missing object in the SDK's errors. A missing bucket
// is not a missing object: it is a configuration error.
func isNotFound(err error) bool {
	var nsk *types.NoSuchKey
	if errors.As(err, &nsk) {
		return true
	}
	var nf *types.NotFound
	if errors.As(err, &nf) {
		return true
	}
	var api smithy.APIError
	if errors.As(err, &api) {
		switch api.ErrorCode() {
		case "NoSuchKey", "NotFound":
			return true
		}
	}
	return false
}

// Error is the error of a failed Get.
type Error struct {
	// Bucket and Key name the object (Key includes KeyPrefix).
	Bucket, Key string
	// Err is the SDK's error, or the reason the object was refused.
	Err error

	notFound bool
}

// Error implements error.
func (e *Error) Error() string {
	return fmt.Sprintf("s3fetch: get s3://%s/%s: %v", e.Bucket, e.Key, e.Err)
}

// Unwrap returns the wrapped error, and ErrNotFound when the object is missing.
func (e *Error) Unwrap() []error {
	if e.notFound {
		return []error{ErrNotFound, e.Err}
	}
	return []error{e.Err}
}

// IsNotFound reports whether err says that an object does not exist.
func IsNotFound(err error) bool { return errors.Is(err, ErrNotFound) }
