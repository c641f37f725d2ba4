# streamq developer tasks. `make test` is the test command CI runs.

GO ?= go

# Tests start real redis-server processes on their own free ports
# (internal/redistest); a Redis already running on 6379 is neither needed nor
# used. -race needs cgo, hence the C compiler.
TEST_FLAGS := -race -count=1 -timeout 12m

# apt-get as root, or through sudo otherwise.
APT_GET := $(if $(filter 0,$(shell id -u)),,sudo) env DEBIAN_FRONTEND=noninteractive apt-get

# Fuzz targets of the root package (parsers of bytes read from Redis), each
# run for FUZZ_TIME by `make fuzz`, part of `make test`. A crash is saved under
# testdata/fuzz and from then on runs with every `go test` as a regression test.
FUZZ_TARGETS := $(shell grep -ho '^func Fuzz[A-Za-z0-9_]*' *_test.go | cut -c6-)
FUZZ_TIME ?= 4s

.PHONY: test fuzz modcheck pin redis-server cc chromium bench quickstart doccheck

## test: vet and test the root module, then every nested module (a directory
## below the root with its own go.mod), check that the nested modules can be
## fetched on their own (modcheck), then run the fuzz targets for a while.
test: redis-server cc chromium
	$(GO) mod tidy -diff
	$(GO) vet ./...
	CI=$${CI:-} $(GO) test $(TEST_FLAGS) ./...
	@for mod in $$(find . -name go.mod -not -path ./go.mod -not -path '*/testdata/*' -not -path '*/vendor/*' -not -path './.*' | sort); do \
		dir=$$(dirname $$mod); \
		echo "==> $$dir"; \
		(cd $$dir && $(GO) mod tidy -diff && $(GO) vet ./... && CI=$${CI:-} $(GO) test $(TEST_FLAGS) ./...) || exit 1; \
	done
	@$(MAKE) --no-print-directory modcheck
	@$(MAKE) --no-print-directory fuzz

## modcheck: prove that `go get` of every nested module works from a separate
## module, offline, against a file:// module proxy built from this repository
## (scripts/modcheck.sh). Fails when a nested module requires the core module
## at the placeholder version or at a commit not in HEAD's history.
modcheck:
	GO=$(GO) scripts/modcheck.sh check

## pin: make every nested module require the core module at HEAD's
## pseudo-version (run it on main, then commit the go.mod files).
pin:
	GO=$(GO) scripts/modcheck.sh pin

## fuzz: run each fuzz target for FUZZ_TIME (4s; under a minute in all, startup included).
## Go's fuzzer can end a run with "context deadline exceeded" when a worker is
## slow to stop on a loaded machine, with no failing input: that run is tried
## again once. A real failure saves its input under testdata/fuzz and fails.
fuzz:
	@for f in $(FUZZ_TARGETS); do \
		echo "==> fuzz $$f for $(FUZZ_TIME)"; \
		out=$$($(GO) test -run '^$$' -fuzz "^$$f\$$" -fuzztime $(FUZZ_TIME) . 2>&1); rc=$$?; echo "$$out"; \
		if [ $$rc -ne 0 ] && echo "$$out" | grep -q 'context deadline exceeded' && ! echo "$$out" | grep -q 'Failing input'; then \
			echo "==> fuzz $$f: the fuzzer timed out stopping its workers; trying again"; \
			$(GO) test -run '^$$' -fuzz "^$$f\$$" -fuzztime $(FUZZ_TIME) . || exit 1; \
		elif [ $$rc -ne 0 ]; then exit 1; fi; \
	done

## redis-server: install redis-server with apt-get if it is not on PATH.
redis-server:
	@if ! command -v redis-server >/dev/null 2>&1; then \
		echo "redis-server not found; installing it with apt-get"; \
		$(APT_GET) update && $(APT_GET) install -y redis-server; \
	fi
	@redis-server --version

## chromium: install Chromium with apt-get if it is not on PATH (the
## dashboard's browser test, streamqdash, drives it headless).
chromium:
	@if ! command -v chromium >/dev/null 2>&1; then \
		echo "chromium not found; installing it with apt-get"; \
		$(APT_GET) update && $(APT_GET) install -y chromium; \
	fi
	@chromium --version 2>/dev/null

## cc: install gcc (needed by go test -race) with apt-get if missing.
cc:
	@if ! command -v "$$($(GO) env CC)" >/dev/null 2>&1; then \
		echo "C compiler not found (go test -race needs cgo); installing gcc with apt-get"; \
		$(APT_GET) update && $(APT_GET) install -y gcc libc6-dev; \
	fi

## bench: run every benchmark scenario against a local redis-server.
bench: redis-server
	$(GO) run ./cmd/streamq-bench -scenario all

## doccheck: check the Markdown files alone (part of `make test`, through
## `go test ./...`): every relative link resolves, every Go block of
## README.md and docs/ compiles (internal/doccheck).
doccheck:
	$(GO) test -count=1 ./internal/doccheck

## quickstart: run the quickstart example.
quickstart:
	$(GO) run ./examples/quickstart
