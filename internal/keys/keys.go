// Package keys builds every Redis key and channel name of a queue in one place.
//
// All names of one queue share the hash tag "{<queue>}", so every script and
// transaction that touches one queue stays in one Redis Cluster slot.
package keys

import (
	"errors"
	"fmt"
	"strings"
)

// MaxQueueNameLen is the longest queue name accepted.
const MaxQueueNameLen = 128

// Keys holds the names of one queue.
type Keys struct {
	// Queue is the user's queue name.
	Queue string
	// Stream is the stream holding the queue's entries.
	Stream string
	// DeadLetter is the stream holding dead-lettered entries.
	DeadLetter string
	// Channel is the pub/sub channel that carries completion notices.
	Channel string

	recordPrefix string
	startsPrefix string
}

// New returns the names of queue, or an error when the name cannot be used.
func New(queue string) (Keys, error) {
	if err := ValidateQueue(queue); err != nil {
		return Keys{}, err
	}
	return build(queue), nil
}

// build returns the names of a queue or shard whose name was validated.
func build(queue string) Keys {
	base := "streamq:{" + queue + "}:"
	return Keys{
		Queue:        queue,
		Stream:       base + "stream",
		DeadLetter:   base + "dead",
		Channel:      base + "done",
		recordPrefix: base + "id:",
		startsPrefix: base + "starts:",
	}
}

// Record returns the key of the record (dedup marker, then result) of a request id.
func (k Keys) Record(id string) string { return k.recordPrefix + id }

// Starts returns the key of the hash that counts, per entry id, the handler
// starts of the entries of consumer group group.
func (k Keys) Starts(group string) string { return k.startsPrefix + group }

// RecordPattern returns a SCAN pattern that matches every record key of the queue.
func (k Keys) RecordPattern() string {
	return strings.NewReplacer("[", `\[`, "]", `\]`, "*", `\*`, "?", `\?`).Replace(k.recordPrefix) + "*"
}

// ValidateQueue reports why queue cannot be used as a queue name, or nil.
func ValidateQueue(queue string) error {
	switch {
	case queue == "":
		return errors.New("queue name is empty")
	case len(queue) > MaxQueueNameLen:
		return fmt.Errorf("queue name is %d bytes, the limit is %d", len(queue), MaxQueueNameLen)
	case strings.ContainsAny(queue, "{}"):
		return fmt.Errorf("queue name %q contains '{' or '}', which would break its hash tag", queue)
	}
	return nil
}
