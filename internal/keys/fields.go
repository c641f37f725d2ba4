package keys

// The data format of a queue: the field names of stream entries and dead
// letters, and the first byte of a request's record. The Lua scripts in
// internal/scripts write the same names; the Go side (the root package,
// streamqtest, streamq-bench) reads and writes them through these constants.

// Fields of a stream entry.
const (
	// FieldID is the request id.
	FieldID = "id"
	// FieldPayload is the encoded request (absent when a Fetcher supplies it).
	FieldPayload = "p"
	// FieldGroup names the only group that runs the entry (set by Requeue).
	FieldGroup = "g"
	// FieldFetchFailures counts the failed fetches in a row of a retried
	// entry (set by retry.lua); the handler did not start on any of them.
	FieldFetchFailures = "f"
	// FieldStarts is a promoted retry's start count so far.
	FieldStarts = "n"
	// FieldHeaders is a JSON object of string values (Message.Headers).
	FieldHeaders = "h"
	// FieldDeadline is the request's deadline in Unix milliseconds.
	FieldDeadline = "dl"
	// FieldPriority names a non-default level ("high", "low"): retries and
	// delayed requests carry it through the schedule, and dead letters keep it.
	FieldPriority = "pr"
	// FieldParent is a flow child's: the flow hash of its parent.
	FieldParent = "pa"
	// FieldFlow is a flow parent's: "1".
	FieldFlow = "fp"
	// FieldFlowFailed is a flow parent's whose children failed (policy
	// FailOnChildFailure): its failure.
	FieldFlowFailed = "ff"
	// FieldKey is a keyed request's key (streamq.Key): fair queuing and
	// per-key limits (see internal/scripts/fair.lua).
	FieldKey = "k"
)

// Fields of a dead letter (complete.lua writes them), besides FieldID,
// FieldPayload and FieldPriority.
const (
	// DeadEntry is the stream entry id the request had.
	DeadEntry = "entry"
	// DeadError is the last error.
	DeadError = "error"
	// DeadDeliveries is the number of starts.
	DeadDeliveries = "deliveries"
	// DeadConsumer is the consumer that dead-lettered it.
	DeadConsumer = "consumer"
	// DeadAt is when, in Unix milliseconds.
	DeadAt = "at"
)

// The first byte of a request's record (the value of its record key); the
// rest depends on it.
const (
	RecordInflight = 'P' // rest: the stream entry id
	RecordResult   = 'R' // rest: the encoded response
	RecordFailed   = 'E' // rest: the error message
	RecordDead     = 'L' // rest: the error message; the request was dead-lettered
	RecordNoResult = 'N' // completed; the result was not stored
	RecordCanceled = 'C' // rest: a message; Admin.Cancel cancelled the scheduled request
)
