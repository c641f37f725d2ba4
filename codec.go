package streamq

import (
	"encoding/json"
	"fmt"
)

// Codec turns requests and responses into bytes and back.
//
// Producers and consumers of one queue must use compatible codecs. When a request
// or response type is []byte, the codec is bypassed and the bytes travel as they are.
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

// encode encodes v, passing []byte through untouched.
func encode[T any](c Codec, v T) ([]byte, error) {
	if b, ok := any(v).([]byte); ok {
		return b, nil
	}
	b, err := c.Marshal(v)
	if err != nil {
		return nil, fmt.Errorf("streamq: encode %T: %w", v, err)
	}
	return b, nil
}

// decode decodes data into a T, passing []byte through untouched.
func decode[T any](c Codec, data []byte) (T, error) {
	var v T
	if p, ok := any(&v).(*[]byte); ok {
		*p = data
		return v, nil
	}
	if err := c.Unmarshal(data, &v); err != nil {
		return v, fmt.Errorf("streamq: decode %T: %w", v, err)
	}
	return v, nil
}
