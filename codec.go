package streamq

import (
	"encoding/json"
	"fmt"
)

// Codec turns requests and responses into bytes and back.
//
// Producers and consumers of one queue must use compatible codecs. When a request
// or response type is []byte, the codec is bypassed and the bytes travel as they are.
// A codec that panics is treated as one that returned an error: the panic is
// recovered and returned (wrapped) by the call that used the codec.
type Codec interface {
	// Marshal encodes v.
	Marshal(v any) ([]byte, error)
	// Unmarshal decodes data into the value v points to.
	Unmarshal(data []byte, v any) error
}

// JSONCodec is the default Codec: encoding/json.
type JSONCodec struct{}

// Marshal encodes v as JSON.
func (JSONCodec) Marshal(v any) ([]byte, error) { return json.Marshal(v) }

// Unmarshal decodes JSON data into v.
func (JSONCodec) Unmarshal(data []byte, v any) error { return json.Unmarshal(data, v) }

// encode encodes v, passing []byte through untouched. A panic in the codec is
// returned as an error: a user codec must not crash the caller's goroutine.
func encode[T any](c Codec, v T) (b []byte, err error) {
	if b, ok := any(v).([]byte); ok {
		return b, nil
	}
	defer func() {
		if r := recover(); r != nil {
			b, err = nil, codecPanic("encode", v, r)
		}
	}()
	b, err = c.Marshal(v)
	if err != nil {
		return nil, fmt.Errorf("streamq: encode %T: %w", v, err)
	}
	return b, nil
}

// decode decodes data into a T, passing []byte through untouched. A panic in
// the codec is returned as an error.
func decode[T any](c Codec, data []byte) (v T, err error) {
	if p, ok := any(&v).(*[]byte); ok {
		*p = data
		return v, nil
	}
	defer func() {
		if r := recover(); r != nil {
			var zero T
			v, err = zero, codecPanic("decode", zero, r)
		}
	}()
	if err := c.Unmarshal(data, &v); err != nil {
		return v, fmt.Errorf("streamq: decode %T: %w", v, err)
	}
	return v, nil
}

// codecPanic turns a codec's panic value into an error that wraps it when it
// is an error.
func codecPanic(op string, v any, r any) error {
	if e, ok := r.(error); ok {
		return fmt.Errorf("streamq: %s %T: the codec panicked: %w", op, v, e)
	}
	return fmt.Errorf("streamq: %s %T: the codec panicked: %v", op, v, r)
}
