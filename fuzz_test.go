package streamq

// Fuzz targets for every parser of bytes read from Redis. Each is seeded with
// values captured from a real run against redis-server 7.0 (a producer, a
// consumer, a permanent failure, an id with multi-byte characters, an entry
// deleted while pending), and checks properties, not only the absence of a
// panic. `make test` runs each for a few seconds (see the Makefile's fuzz step);
// a crash it finds is saved under testdata/fuzz and then runs with every
// `go test` as a regression test.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/streamq/streamq/internal/keys"
)

// Completion notices as published by complete.lua (one per batch).
var noticeSeeds = []string{
	`8:order-4229:R"result of payload order-42"`,
	`6:fail-126:Lbad input: payload fail-1`,
	`15:ünï/cödé id36:R"result of payload ünï/cödé id"`,
	`8:order-4229:R"result of payload order-42"6:fail-126:Lbad input: payload fail-1`,
	`3:abc1:N`,
	``,
}

// encodeNotice builds a notice the way complete.lua does: for each request,
// "<byte length>:<id><byte length>:<record>".
func encodeNotice(pairs [][2]string) string {
	var b strings.Builder
	for _, p := range pairs {
		fmt.Fprintf(&b, "%d:%s%d:%s", len(p[0]), p[0], len(p[1]), p[1])
	}
	return b.String()
}

// A notice that parses is made of exactly the pairs it yields: encoding them
// again gives the same bytes, up to how the lengths were spelled.
func FuzzParseNotice(f *testing.F) {
	for _, s := range noticeSeeds {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		var pairs [][2]string
		err := parseNotice(s, func(id, record string) { pairs = append(pairs, [2]string{id, record}) })
		if err != nil {
			return
		}
		total := 0
		for _, p := range pairs {
			total += len(p[0]) + len(p[1])
		}
		require.LessOrEqual(t, total, len(s))
		again := encodeNotice(pairs)
		var twice [][2]string
		require.NoError(t, parseNotice(again, func(id, record string) { twice = append(twice, [2]string{id, record}) }))
		require.Equal(t, pairs, twice)
		if isCanonicalNotice(s) {
			require.Equal(t, s, again)
		}
	})
}

// isCanonicalNotice reports whether every length in s is written in plain
// decimal (no sign, no leading zero), as complete.lua writes them.
func isCanonicalNotice(s string) bool {
	for len(s) > 0 {
		colon := strings.IndexByte(s, ':')
		if colon <= 0 {
			return false
		}
		n, err := strconv.Atoi(s[:colon])
		if err != nil || strconv.Itoa(n) != s[:colon] || colon+1+n > len(s) {
			return false
		}
		s = s[colon+1+n:]
	}
	return true
}

// Whatever ids and records complete.lua puts in a notice, producers read them
// back exactly, however many share one notice.
func FuzzNoticeRoundTrip(f *testing.F) {
	f.Add("order-42", `R"result of payload order-42"`, "fail-1", "Lbad input: payload fail-1", uint8(2))
	f.Add("ünï/cödé id", `R"result of payload ünï/cödé id"`, "", "N", uint8(1))
	f.Add("12:ab", "3:xyz", "1", ":", uint8(3))
	f.Fuzz(func(t *testing.T, id1, rec1, id2, rec2 string, n uint8) {
		var pairs [][2]string
		for i := range int(n % 8) {
			if i%2 == 0 {
				pairs = append(pairs, [2]string{id1, rec1})
			} else {
				pairs = append(pairs, [2]string{id2, rec2})
			}
		}
		var got [][2]string
		require.NoError(t, parseNotice(encodeNotice(pairs), func(id, record string) { got = append(got, [2]string{id, record}) }))
		require.Equal(t, pairs, got)
	})
}

// Records as read with GET/MGET: P (in flight), R (result), L (dead letter),
// E (failed), N (no result), and a foreign value.
var recordSeeds = []string{
	`R"result of payload order-42"`,
	`Lbad input: payload fail-1`,
	`R"result of payload ünï/cödé id"`,
	`Efailed`,
	`N`,
	`P1796110074717-0`,
	`P@1796110074717`,
	`Ccanceled by Admin.Cancel at 2026-12-01T11:00:00Z`,
	``,
	`R`,
	`R{"not":"a string"}`,
	`hello`,
}

// Each kind of record decodes to its documented outcome, and a response
// encoded by the codec decodes to itself.
func FuzzDecodeRecord(f *testing.F) {
	for _, s := range recordSeeds {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, record string) {
		resp, err := decodeRecord[string](JSONCodec{}, record, nil)
		var re *RequestError
		switch {
		case record == "":
			require.Error(t, err)
		case record[0] == keys.RecordResult:
			var want string
			if json.Unmarshal([]byte(record[1:]), &want) == nil {
				require.NoError(t, err)
				require.Equal(t, want, resp)
			} else {
				require.Error(t, err)
			}
		case record[0] == keys.RecordDead:
			require.ErrorAs(t, err, &re)
			require.True(t, re.DeadLettered)
			require.Equal(t, record[1:], re.Message)
		case record[0] == keys.RecordFailed:
			require.ErrorAs(t, err, &re)
			require.False(t, re.DeadLettered)
			require.Equal(t, record[1:], re.Message)
		case record[0] == keys.RecordNoResult:
			require.ErrorIs(t, err, ErrNoResult)
		case record[0] == keys.RecordCanceled:
			require.ErrorIs(t, err, ErrCanceled)
			require.False(t, errors.As(err, &re), "a cancellation is not a request error: %v", err)
		default:
			require.Error(t, err)
			require.False(t, errors.As(err, &re), "a foreign record is not a request error: %v", err)
		}

		// Round trip: the record the consumer would write for resp.
		if !utf8.ValidString(record) {
			return // JSON replaces invalid UTF-8; the text changes by design
		}
		enc, err := JSONCodec{}.Marshal(record)
		require.NoError(t, err)
		back, err := decodeRecord[string](JSONCodec{}, string(keys.RecordResult)+string(enc), nil)
		require.NoError(t, err)
		require.Equal(t, record, back)
	})
}

// Replies of resume.lua and claim.lua, as sent by redis-server 7.0 (RESP2):
// {cursor, entries, delivery counts, deleted ids}. The second has an entry
// deleted while pending.
var scriptReplySeeds = []string{
	"*4\r\n$15\r\n1796110074717-2\r\n*2\r\n*2\r\n$15\r\n1796110074717-0\r\n*4\r\n$2\r\nid\r\n$8\r\norder-42\r\n$1\r\np\r\n$18\r\n\"payload order-42\"\r\n*2\r\n$15\r\n1796110074717-2\r\n*4\r\n$2\r\nid\r\n$15\r\nünï/cödé id\r\n$1\r\np\r\n$25\r\n\"payload ünï/cödé id\"\r\n*2\r\n:1\r\n:1\r\n*1\r\n$15\r\n1796110074717-1\r\n",
	"*4\r\n$3\r\n0-0\r\n*2\r\n*2\r\n$15\r\n1796110074717-0\r\n*4\r\n$2\r\nid\r\n$8\r\norder-42\r\n$1\r\np\r\n$18\r\n\"payload order-42\"\r\n*2\r\n$15\r\n1796110074717-2\r\n*4\r\n$2\r\nid\r\n$15\r\nünï/cödé id\r\n$1\r\np\r\n$25\r\n\"payload ünï/cödé id\"\r\n*2\r\n:1\r\n:1\r\n*0\r\n",
	"*4\r\n$0\r\n\r\n*0\r\n*0\r\n*0\r\n",
	// A foreign entry without our fields, and one with an odd field list.
	"*4\r\n$3\r\n0-0\r\n*2\r\n*2\r\n$3\r\n1-1\r\n*2\r\n$1\r\nx\r\n$1\r\ny\r\n*2\r\n$3\r\n1-2\r\n*1\r\n$2\r\nid\r\n*2\r\n:3\r\n:1\r\n*0\r\n",
}

// parseEntries keeps every well-formed entry of a script reply, in order,
// with exactly its fields, and skips the rest.
func FuzzParseEntries(f *testing.F) {
	for _, s := range scriptReplySeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		reply, rest, err := readRESP(raw, 0)
		if err != nil || len(rest) != 0 {
			return
		}
		// The whole reply, and its entries element as the consumer uses it.
		targets := []any{reply}
		if res, ok := reply.([]any); ok && len(res) == 4 {
			targets = append(targets, res[1])
		}
		for _, v := range targets {
			msgs := parseEntries(v)
			list, _ := v.([]any)
			var want []redis.XMessage
			for _, e := range list {
				pair, _ := e.([]any)
				if len(pair) != 2 {
					continue
				}
				id, _ := pair[0].(string)
				fields, _ := pair[1].([]any)
				m := redis.XMessage{ID: id, Values: map[string]any{}}
				for i := 0; i+1 < len(fields); i += 2 {
					if k, ok := fields[i].(string); ok {
						m.Values[k] = fields[i+1]
					}
				}
				want = append(want, m)
			}
			require.Len(t, msgs, len(want))
			for i := range want {
				require.Equal(t, want[i].ID, msgs[i].ID)
				require.Equal(t, want[i].Values, msgs[i].Values)
				// What admission reads must not panic, whatever the types.
				_, _ = msgs[i].Values[keys.FieldID].(string)
				_, _ = msgs[i].Values[keys.FieldPayload].(string)
				_ = fieldNames(msgs[i].Values)
			}
		}
	})
}

// readRESP decodes one RESP2 value: arrays become []any, bulk and simple
// strings string, integers int64, nulls nil and errors error, as go-redis
// hands script replies to the library. depth bounds nesting.
func readRESP(b []byte, depth int) (any, []byte, error) {
	if depth > 16 {
		return nil, nil, errors.New("too deep")
	}
	line, rest, ok := strings.Cut(string(b), "\r\n")
	if !ok || line == "" {
		return nil, nil, errors.New("no line")
	}
	body := line[1:]
	switch line[0] {
	case '+':
		return body, []byte(rest), nil
	case '-':
		return errors.New(body), []byte(rest), nil
	case ':':
		n, err := strconv.ParseInt(body, 10, 64)
		return n, []byte(rest), err
	case '$':
		n, err := strconv.Atoi(body)
		if err != nil || n < -1 {
			return nil, nil, errors.New("bad bulk length")
		}
		if n == -1 {
			return nil, []byte(rest), nil
		}
		if len(rest) < n+2 || rest[n:n+2] != "\r\n" {
			return nil, nil, errors.New("short bulk")
		}
		return rest[:n], []byte(rest[n+2:]), nil
	case '*':
		n, err := strconv.Atoi(body)
		if err != nil || n < -1 || n > len(rest) {
			return nil, nil, errors.New("bad array length")
		}
		if n == -1 {
			return nil, []byte(rest), nil
		}
		out := make([]any, 0, n)
		r := []byte(rest)
		for range n {
			var v any
			v, r, err = readRESP(r, depth+1)
			if err != nil {
				return nil, nil, err
			}
			out = append(out, v)
		}
		return out, r, nil
	}
	return nil, nil, errors.New("unknown type")
}

// Dead letters as read with XRANGE from the dead-letter stream.
var deadLetterSeeds = [][8]string{
	{"1796110074714-0", "fail-1", "1796110074713-0", `"payload fail-1"`, "bad input: payload fail-1", "1", "vm-1626-9b9a71aa", "1796110074714"},
	{"1796110074714-1", "", "1796110074713-5", "", "undecodable entry: fields \"id\" and \"p\" are required, got \"x\"", "5", "c", "0"},
	{"1-1", "x", "1-0", "p", "e", "-3", "", "-1"},
	{"1-1", "x", "1-0", "p", "e", "99999999999999999999", "", "not a time"},
}

// A dead letter's fields come through unchanged; numbers that do not parse
// read as zero, never as garbage.
func FuzzParseDeadLetter(f *testing.F) {
	for _, s := range deadLetterSeeds {
		f.Add(s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7])
	}
	f.Fuzz(func(t *testing.T, streamID, id, entry, payload, reason, deliveries, consumer, at string) {
		m := redis.XMessage{ID: streamID, Values: map[string]any{
			"id": id, "entry": entry, "p": payload, "error": reason,
			"deliveries": deliveries, "consumer": consumer, "at": at,
		}}
		d := parseDeadLetter(m)
		require.Equal(t, streamID, d.DeadLetterID)
		require.Equal(t, id, d.ID)
		require.Equal(t, entry, d.EntryID)
		require.Equal(t, payload, string(d.Payload))
		require.Equal(t, reason, d.Error)
		require.Equal(t, consumer, d.Consumer)
		if n, err := strconv.Atoi(deliveries); err == nil {
			require.Equal(t, n, d.Deliveries)
		} else {
			require.Zero(t, d.Deliveries)
		}
		if ms, err := strconv.ParseInt(at, 10, 64); err == nil {
			require.Equal(t, ms, d.At.UnixMilli())
		} else {
			require.True(t, d.At.IsZero())
		}
		// A dead letter missing every field (another program's entry) parses too.
		require.Equal(t, DeadLetter{DeadLetterID: streamID, Payload: []byte{}}, parseDeadLetter(redis.XMessage{ID: streamID}))
	})
}

// The DeadLetterIDs that DeadLetters builds for a sharded queue
// ("<shard>/<stream id>") split back into their parts; anything else is
// ErrInvalidDeadLetterID (a bad shard prefix also ErrNotFound, as before),
// never a shard out of range or a partial stream id.
func FuzzSplitDeadLetterID(f *testing.F) {
	f.Add("1/1796110074714-0", uint16(2))
	f.Add("1796110074714-0", uint16(1))
	f.Add("-1/1-0", uint16(4))
	f.Add("4/1-0", uint16(4))
	f.Add("+1/1-0", uint16(4))
	f.Fuzz(func(t *testing.T, id string, n uint16) {
		shards := int(n%keys.MaxShards) + 1
		shard, rest, err := splitDeadLetterID(id, shards)
		if err != nil {
			require.ErrorIs(t, err, ErrInvalidDeadLetterID)
			return
		}
		require.True(t, fullStreamID(rest), "%q split into the partial stream id %q", id, rest)
		require.GreaterOrEqual(t, shard, 0)
		require.Less(t, shard, shards)
		if shards == 1 {
			require.Equal(t, id, rest)
			return
		}
		// What DeadLetters builds splits back exactly.
		built := fmt.Sprintf("%d/%s", shard, rest)
		s2, r2, err := splitDeadLetterID(built, shards)
		require.NoError(t, err)
		require.Equal(t, shard, s2)
		require.Equal(t, rest, r2)
	})
}

// The shard count recorded in the queue's meta key, as Admin reads it: a value
// another program wrote there is refused (ErrWrongType) or is exactly the
// number written, and a count beyond MaxShards is refused before any key is
// built.
func FuzzQueueShards(f *testing.F) {
	client, m := miniRedis(f)
	ctx := context.Background()
	for _, s := range []string{"1", "2", "16", "1024", "1025", "0", "-1", "+2", "02", " 2", "two", ""} {
		f.Add(s)
	}
	q := queueName(f)
	f.Fuzz(func(t *testing.T, v string) {
		require.NoError(t, m.Set(keys.Meta(q), v))
		n, err := queueShards(ctx, client, q)
		if err != nil {
			require.ErrorIs(t, err, ErrWrongType)
			return
		}
		require.GreaterOrEqual(t, n, 1)
		want, perr := strconv.Atoi(v)
		require.NoError(t, perr)
		require.Equal(t, want, n)
		_, err = keys.Shards(q, n)
		if n <= keys.MaxShards {
			require.NoError(t, err)
		} else {
			require.Error(t, err)
		}
	})
}
