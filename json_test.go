package streamq

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestJSONShapes: DeadLetter and JobInfo encode their []byte fields as
// base64 (what decoding into them expects) and add the text when it is
// UTF-8, in a field of its own; both round-trip. Dedup encodes as its name.
func TestJSONShapes(t *testing.T) {
	at := time.UnixMilli(1700000000123).UTC()
	d := DeadLetter{DeadLetterID: "1-2", ID: "a", EntryID: "1-1", Payload: []byte(`{"x":1}`), Error: "e", Deliveries: 2, Consumer: "c", At: at}
	b, err := json.Marshal(d)
	require.NoError(t, err)
	var m map[string]any
	require.NoError(t, json.Unmarshal(b, &m))
	require.Equal(t, "eyJ4IjoxfQ==", m["payload"], "payload is base64, as for []byte")
	require.Equal(t, `{"x":1}`, m["payload_text"])
	var back DeadLetter
	require.NoError(t, json.Unmarshal(b, &back))
	require.Equal(t, d, back)

	d.Payload = []byte{0xff, 0xfe}
	b, err = json.Marshal(d)
	require.NoError(t, err)
	require.NotContains(t, string(b), "payload_text", "no text for a payload that is not UTF-8")
	back = DeadLetter{}
	require.NoError(t, json.Unmarshal(b, &back))
	require.Equal(t, d, back)

	j := JobInfo{ID: "a", State: JobSucceeded, Result: []byte(`"ok"`), Payload: []byte(`{"n":1}`), TTL: time.Minute,
		Finished: time.UnixMilli(1_800_000_000_000).UTC()}
	b, err = json.Marshal(j)
	require.NoError(t, err)
	m = nil
	require.NoError(t, json.Unmarshal(b, &m))
	require.Equal(t, "Im9rIg==", m["result"])
	require.Equal(t, `"ok"`, m["result_text"])
	require.Equal(t, `{"n":1}`, m["payload_text"])
	require.Equal(t, "2027-01-15T08:00:00Z", m["finished"])
	var jb JobInfo
	require.NoError(t, json.Unmarshal(b, &jb))
	require.Equal(t, j, jb)
	j.Result, j.Payload, j.Finished = nil, nil, time.Time{}
	b, err = json.Marshal(j)
	require.NoError(t, err)
	require.NotContains(t, string(b), "result")
	require.NotContains(t, string(b), "payload")
	require.NotContains(t, string(b), "finished")

	for _, dd := range []Dedup{DedupNone, DedupInflight, DedupStored} {
		b, err := json.Marshal(dd)
		require.NoError(t, err)
		require.NotRegexp(t, `^[0-9]`, string(b), "a name, not a number")
		var got Dedup
		require.NoError(t, json.Unmarshal(b, &got))
		require.Equal(t, dd, got)
	}
	b, err = json.Marshal(struct{ D Dedup }{DedupInflight})
	require.NoError(t, err)
	require.JSONEq(t, `{"D":"inflight"}`, string(b))
	var bad Dedup
	require.Error(t, json.Unmarshal([]byte(`"sideways"`), &bad))
}
