// Package reliability holds streamq's end-to-end reliability test: producer
// and consumer processes (the test binary, re-executed) run against a real
// redis-server behind a fault-injecting proxy while a schedule kills
// consumers and producers with SIGKILL, restarts Redis (SHUTDOWN, and SIGKILL
// with appendfsync always), cuts and stalls connections and injects garbage.
// At the end every request id is counted: its result, its executions and its
// producer's view of it.
//
// The short profile runs with plain `go test ./...`. The long one (minutes,
// over 200,000 requests) runs with STREAMQ_RELIABILITY=long; see docs/reliability.md
// at the repository root.
//
// The package has no API: it exists for its tests.
package reliability
