package streamq

// ProduceOption sets something about one request at produce time, for
// Produce, Enqueue and (per job) ProduceBatch. Options apply in order; a later
// option overrides an earlier one that sets the same thing. Options only take
// effect when the call appends a new entry: a call that attaches to a request
// already in flight, or is answered from a stored outcome, changes nothing
// about that request.
type ProduceOption func(*produceSettings)

// produceSettings is what the ProduceOptions of one call set. The zero value
// is a plain request: appended now, no extra entry fields.
type produceSettings struct{}

// applyProduceOptions folds opts into one produceSettings.
func applyProduceOptions(opts []ProduceOption) produceSettings {
	var s produceSettings
	for _, o := range opts {
		if o != nil {
			o(&s)
		}
	}
	return s
}
