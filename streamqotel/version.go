package streamqotel

// Version is the version of this instrumentation, reported as the
// instrumentation scope's version.
func Version() string { return "0.1.0" }
