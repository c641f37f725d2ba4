package streamq

import (
	"fmt"
	"strings"
)

// PriorityLevel is a request's priority: one of PriorityHigh, PriorityNormal
// (the default) and PriorityLow. Each level other than PriorityNormal has a
// stream of its own per shard ("streamq:{Q}:stream:high", ":low"), under the
// queue's hash tag, so a queue that never uses priorities has exactly one
// stream per shard. Consumers take higher levels first, without starving
// lower ones (see ConsumerOptions.PriorityWeights and StrictPriority).
type PriorityLevel int

// The priority levels.
const (
	PriorityLow    PriorityLevel = -1
	PriorityNormal PriorityLevel = 0
	PriorityHigh   PriorityLevel = 1
)

// String returns the level's name: "high", "normal" or "low".
func (p PriorityLevel) String() string {
	switch p {
	case PriorityHigh:
		return "high"
	case PriorityNormal:
		return "normal"
	case PriorityLow:
		return "low"
	}
	return fmt.Sprintf("PriorityLevel(%d)", int(p))
}

// MarshalText encodes the level as its name, so JSON shows "high", "normal"
// or "low".
func (p PriorityLevel) MarshalText() ([]byte, error) {
	if _, ok := levelOf[p]; !ok {
		return nil, fmt.Errorf("streamq: %v is not a priority level", p)
	}
	return []byte(p.String()), nil
}

// UnmarshalText decodes a level's name ("high", "normal", "low").
func (p *PriorityLevel) UnmarshalText(b []byte) error {
	for _, v := range levelValue {
		if strings.EqualFold(string(b), v.String()) {
			*p = v
			return nil
		}
	}
	return fmt.Errorf("streamq: %q is not a priority level (high, normal, low)", b)
}

// Priority sets the request's priority level: PriorityHigh, PriorityNormal or
// PriorityLow (another value fails the call with ErrInvalidOptions). The
// level is part of the request: delayed requests and retries keep it, and
// deduplication does not depend on it (an id produced at two levels is one
// request, run once at the level of the call that appended it). Default:
// PriorityNormal.
func Priority(p PriorityLevel) ProduceOption {
	return func(s *produceSettings) { s.priority, s.prioritySet = p, true }
}

// The levels in the consumer's order: index 0 is the default level, whose
// stream is the shard's own, so that a consumer's first len(shards) streams
// are today's. levelNames[i] names level i's stream suffix; levelRank[i] is
// its rank in the ring (0 first).
const (
	numLevels   = 3
	levelNormal = 0
	levelHigh   = 1
	levelLow    = 2
)

var (
	levelNames = [numLevels]string{"", "high", "low"}
	// levelOrder lists the levels from the highest.
	levelOrder = [numLevels]int{levelHigh, levelNormal, levelLow}
	levelOf    = map[PriorityLevel]int{PriorityNormal: levelNormal, PriorityHigh: levelHigh, PriorityLow: levelLow}
	levelValue = [numLevels]PriorityLevel{PriorityNormal, PriorityHigh, PriorityLow}
	// weightIndex maps a level to its index in PriorityWeights (high,
	// normal, low).
	weightIndex = [numLevels]int{levelNormal: 1, levelHigh: 0, levelLow: 2}
)

// DefaultPriorityWeights are the shares of the levels (high, normal, low)
// while each has work waiting: see ConsumerOptions.PriorityWeights.
var DefaultPriorityWeights = [3]int{6, 3, 1}

// flagLevelPrefix starts an item's flag naming its level for produce.lua:
// "H" (high) or "L" (low).
var levelFlags = [numLevels]string{"", "H", "L"}
