# streamq developer tasks. `make test` is the test command CI runs.

GO ?= go

# Tests start real redis-server processes on their own free ports
# (internal/redistest); a Redis already running on 6379 is neither needed nor
# used. -race needs cgo, hence the C compiler.
TEST_FLAGS := -race -count=1 -timeout 12m

# apt-get as root, or through sudo otherwise.
APT_GET := $(if $(filter 0,$(shell id -u)),,sudo) env DEBIAN_FRONTEND=noninteractive apt-get

.PHONY: test redis-server cc bench quickstart

## test: vet and test the root module, then every nested module (a directory
## below the root with its own go.mod).
test: redis-server cc
	$(GO) vet ./...
	CI=$${CI:-} $(GO) test $(TEST_FLAGS) ./...
	@for mod in $$(find . -name go.mod -not -path ./go.mod -not -path '*/testdata/*' -not -path '*/vendor/*' -not -path './.*' | sort); do \
		dir=$$(dirname $$mod); \
		echo "==> $$dir"; \
		(cd $$dir && $(GO) vet ./... && CI=$${CI:-} $(GO) test $(TEST_FLAGS) ./...) || exit 1; \
	done

## redis-server: install redis-server with apt-get if it is not on PATH.
redis-server:
	@if ! command -v redis-server >/dev/null 2>&1; then \
		echo "redis-server not found; installing it with apt-get"; \
		$(APT_GET) update && $(APT_GET) install -y redis-server; \
	fi
	@redis-server --version

## cc: install gcc (needed by go test -race) with apt-get if missing.
cc:
	@if ! command -v "$$($(GO) env CC)" >/dev/null 2>&1; then \
		echo "C compiler not found (go test -race needs cgo); installing gcc with apt-get"; \
		$(APT_GET) update && $(APT_GET) install -y gcc libc6-dev; \
	fi

## bench: run every benchmark scenario against a local redis-server.
bench: redis-server
	$(GO) run ./cmd/streamq-bench -scenario all

## quickstart: run the quickstart example.
quickstart:
	$(GO) run ./examples/quickstart
