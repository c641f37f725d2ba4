package streamq

import (
	"encoding/json"
	"errors"
	"fmt"
	"unicode/utf8"
)

// One JSON shape per type, used by the library and by the streamq command
// line alike: a []byte field is base64 (encoding/json's own encoding, so
// decoding into the type works), and when it holds valid UTF-8 its text is
// added in a field of its own ("payload_text", "result_text"), which
// decoding ignores. DESIGN.md lists the shapes.

// deadLetterJSON is DeadLetter without its methods.
type deadLetterJSON DeadLetter

// MarshalJSON encodes the dead letter with its payload in base64
// ("payload"), plus "payload_text" when the payload is valid UTF-8.
func (d DeadLetter) MarshalJSON() ([]byte, error) {
	return json.Marshal(struct {
		deadLetterJSON
		PayloadText *string `json:"payload_text,omitempty"`
	}{deadLetterJSON(d), utf8Text(d.Payload)})
}

// UnmarshalJSON decodes what MarshalJSON encodes ("payload_text" is ignored:
// "payload" holds the bytes).
func (d *DeadLetter) UnmarshalJSON(b []byte) error {
	var v struct {
		deadLetterJSON
		PayloadText *string `json:"payload_text,omitempty"`
	}
	if err := json.Unmarshal(b, &v); err != nil {
		return err
	}
	*d = DeadLetter(v.deadLetterJSON)
	return nil
}

// jobInfoJSON is JobInfo without its methods.
type jobInfoJSON JobInfo

// MarshalJSON encodes the job with its result, payload and a waiting
// follow-up's payload in base64 ("result", "payload", "replacement", absent
// when there is none), plus "result_text", "payload_text" and
// "replacement_text" when they are valid UTF-8.
func (j JobInfo) MarshalJSON() ([]byte, error) {
	return json.Marshal(struct {
		jobInfoJSON
		ResultText      *string `json:"result_text,omitempty"`
		PayloadText     *string `json:"payload_text,omitempty"`
		ReplacementText *string `json:"replacement_text,omitempty"`
	}{jobInfoJSON(j), resultText(j.Result), utf8Text(j.Payload), utf8Text(j.Replacement)})
}

// UnmarshalJSON decodes what MarshalJSON encodes (the "_text" fields are
// ignored: "result", "payload" and "replacement" hold the bytes).
func (j *JobInfo) UnmarshalJSON(b []byte) error {
	var v struct {
		jobInfoJSON
		ResultText      *string `json:"result_text,omitempty"`
		PayloadText     *string `json:"payload_text,omitempty"`
		ReplacementText *string `json:"replacement_text,omitempty"`
	}
	if err := json.Unmarshal(b, &v); err != nil {
		return err
	}
	*j = JobInfo(v.jobInfoJSON)
	return nil
}

// utf8Text returns b as text when it is valid UTF-8, else nil (also for nil b).
func utf8Text(b []byte) *string {
	if b == nil || !utf8.Valid(b) {
		return nil
	}
	s := string(b)
	return &s
}

// dedupNames are the names Dedup encodes as, in JSON and as text.
var dedupNames = [...]string{DedupNone: "none", DedupInflight: "inflight", DedupStored: "stored"}

// MarshalText encodes d as its name: "none", "inflight" or "stored".
func (d Dedup) MarshalText() ([]byte, error) {
	if d < 0 || int(d) >= len(dedupNames) {
		return nil, fmt.Errorf("streamq: no name for Dedup(%d)", int(d))
	}
	return []byte(dedupNames[d]), nil
}

// UnmarshalText decodes a name MarshalText wrote.
func (d *Dedup) UnmarshalText(b []byte) error {
	for i, n := range dedupNames {
		if n == string(b) {
			*d = Dedup(i)
			return nil
		}
	}
	return fmt.Errorf("streamq: unknown Dedup %q (want none, inflight or stored)", b)
}

// resultText is utf8Text for a field encoded with omitempty: no text when
// the field is left out.
func resultText(b []byte) *string {
	if len(b) == 0 {
		return nil
	}
	return utf8Text(b)
}

// childResultJSON is ChildResult's JSON shape: the error as its text.
type childResultJSON struct {
	Queue      string  `json:"queue"`
	ID         string  `json:"id"`
	Result     []byte  `json:"result,omitempty"`
	ResultText *string `json:"result_text,omitempty"`
	Error      string  `json:"error,omitempty"`
}

// MarshalJSON encodes the child's result as base64 ("result", with
// "result_text" when it is valid UTF-8) and its error as text ("error").
func (c ChildResult) MarshalJSON() ([]byte, error) {
	v := childResultJSON{Queue: c.Queue, ID: c.ID, Result: c.Result, ResultText: utf8Text(c.Result)}
	if c.Err != nil {
		v.Error = c.Err.Error()
	}
	return json.Marshal(v)
}

// UnmarshalJSON decodes what MarshalJSON encodes; the error comes back as
// an error with the same text (its type is not kept).
func (c *ChildResult) UnmarshalJSON(b []byte) error {
	var v childResultJSON
	if err := json.Unmarshal(b, &v); err != nil {
		return err
	}
	*c = ChildResult{Queue: v.Queue, ID: v.ID, Result: v.Result}
	if v.Error != "" {
		c.Err = errors.New(v.Error)
	}
	return nil
}
