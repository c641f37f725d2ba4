package streamq

import "github.com/redis/go-redis/v9"

// Queue is a typed queue definition: the queue's name with its request and
// response types, and optionally its codec. Producers and consumers made
// from one Queue agree on Req, Resp and the codec by construction, so a
// mismatch (a producer of []byte beside a consumer of Document) does not
// compile instead of showing up as dead letters at run time. Declare it once,
// for example as a package-level variable shared by the producing and the
// consuming code:
//
//	var Thumbnails = streamq.NewQueue[Document, Thumb]("thumbnails")
//
//	p, err := Thumbnails.NewProducer(rdb, nil)
//	c, err := Thumbnails.NewConsumer(rdb, handle, nil)
//
// NewProducer and NewConsumer remain for code that does not need it. A Queue
// is a small value, safe to copy and to use from many goroutines.
type Queue[Req, Resp any] struct {
	name  string
	codec Codec
}

// NewQueue defines queue name with request type Req and response type Resp.
// The name is checked when a producer, consumer or Admin is made from it.
func NewQueue[Req, Resp any](name string) Queue[Req, Resp] {
	return Queue[Req, Resp]{name: name}
}

// WithCodec returns q with codec c: producers and consumers made from it use
// c unless their options set a Codec. Defaults to nil: the options' Codec,
// or JSONCodec.
func (q Queue[Req, Resp]) WithCodec(c Codec) Queue[Req, Resp] {
	q.codec = c
	return q
}

// Name returns the queue's name.
func (q Queue[Req, Resp]) Name() string { return q.name }

// NewProducer returns a producer of q: NewProducer[Req, Resp](client,
// q.Name(), opts), with q's codec unless opts sets one.
func (q Queue[Req, Resp]) NewProducer(client redis.UniversalClient, opts *ProducerOptions) (*Producer[Req, Resp], error) {
	var o ProducerOptions
	if opts != nil {
		o = *opts
	}
	if o.Codec == nil {
		o.Codec = q.codec
	}
	return NewProducer[Req, Resp](client, q.name, &o)
}

// NewConsumer returns a consumer of q calling handler: NewConsumer(client,
// q.Name(), handler, opts), with q's codec unless opts sets one.
func (q Queue[Req, Resp]) NewConsumer(client redis.UniversalClient, handler Handler[Req, Resp], opts *ConsumerOptions) (*Consumer[Req, Resp], error) {
	var o ConsumerOptions
	if opts != nil {
		o = *opts
	}
	if o.Codec == nil {
		o.Codec = q.codec
	}
	return NewConsumer(client, q.name, handler, &o)
}

// NewAdmin returns an Admin of q: NewAdmin(client, q.Name(), opts).
func (q Queue[Req, Resp]) NewAdmin(client redis.UniversalClient, opts *AdminOptions) (*Admin, error) {
	return NewAdmin(client, q.name, opts)
}
