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

# Valkey, the second server the real-server tests run on (`make test-valkey`,
# part of `make test`). It is built once from the source tarball kept next to
# the repository (../shared/servers) into a cache outside it, and the tests
# take it through STREAMQ_REDIS_SERVER (internal/redistest).
VALKEY_VERSION := 8.0.1
VALKEY_SHA256 := bccb382a0f583fb419526348ed07c3d19e0b6fe8f5492aa3b3037793016ea478
VALKEY_TARBALL ?= ../shared/servers/valkey-$(VALKEY_VERSION).tar.gz
STREAMQ_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/streamq
VALKEY_HOME := $(STREAMQ_CACHE)/valkey-$(VALKEY_VERSION)
VALKEY_SERVER := $(VALKEY_HOME)/bin/valkey-server
VALKEY_JOBS ?= 2
# The Valkey pass: the root package (every real-server test of the library,
# standalone and cluster) and the test helpers themselves, without -race (the
# Redis pass runs them with it) to keep `make test` short.
VALKEY_PACKAGES := . ./internal/redistest
VALKEY_TEST_FLAGS := -count=1 -timeout 12m

.PHONY: test test-valkey valkey fuzz modcheck pin redis-server cc chromium bench quickstart doccheck

## test: vet and test the root module, then every nested module (a directory
## below the root with its own go.mod), check that the nested modules can be
## fetched on their own (modcheck), run the real-server tests a second time on
## Valkey (test-valkey), then run the fuzz targets for a while.
test: redis-server cc chromium
	$(GO) mod tidy -diff
	$(GO) vet ./...
	CI=$${CI:-} $(GO) test $(TEST_FLAGS) ./...
	@for mod in $$(find . -name go.mod -not -path ./go.mod -not -path '*/testdata/*' -not -path '*/vendor/*' -not -path './.*' | sort); do \
		dir=$$(dirname $$mod); \
		echo "==> $$dir"; \
		(cd $$dir && $(GO) mod tidy -diff && $(GO) vet ./... && CI=$${CI:-} $(GO) test $(TEST_FLAGS) ./...) || exit 1; \
	done
	@$(MAKE) --no-print-directory test-valkey
	@$(MAKE) --no-print-directory modcheck
	@$(MAKE) --no-print-directory fuzz

## test-valkey: run VALKEY_PACKAGES on Valkey VALKEY_VERSION (built by
## `make valkey`), without -race. Skipped with a message when Valkey can be
## neither found nor built, except under CI, where that is an error.
test-valkey: valkey
	@if [ ! -x "$(VALKEY_SERVER)" ]; then \
		echo "==> Valkey pass skipped: no Valkey server at $(VALKEY_SERVER) (see above)"; \
		exit 0; \
	fi; \
	echo "==> Valkey $(VALKEY_VERSION) pass ($(VALKEY_SERVER)): $(VALKEY_PACKAGES)"; \
	start=$$(date +%s); \
	STREAMQ_REDIS_SERVER="$(VALKEY_SERVER)" CI=$${CI:-} $(GO) test $(VALKEY_TEST_FLAGS) $(VALKEY_PACKAGES) || exit 1; \
	echo "==> Valkey pass took $$(( $$(date +%s) - start )) s"

## valkey: build Valkey VALKEY_VERSION from VALKEY_TARBALL into VALKEY_HOME
## (under $$XDG_CACHE_HOME or ~/.cache) unless it is there already; one to two
## minutes on two cores. A missing tarball is an error under CI and a notice
## otherwise.
valkey: cc
	@set -e; \
	if [ -x "$(VALKEY_SERVER)" ]; then "$(VALKEY_SERVER)" --version; exit 0; fi; \
	if [ ! -f "$(VALKEY_TARBALL)" ]; then \
		if [ -n "$${CI:-}" ]; then \
			echo "valkey: $(VALKEY_TARBALL) not found (CI is set, so this is an error): the Valkey pass of make test needs the Valkey $(VALKEY_VERSION) source tarball there, or a build in $(VALKEY_HOME)" >&2; \
			exit 1; \
		fi; \
		echo "valkey: $(VALKEY_TARBALL) not found; the Valkey pass will be skipped (put the Valkey $(VALKEY_VERSION) source tarball there, or set VALKEY_TARBALL)"; \
		exit 0; \
	fi; \
	if ! echo "$(VALKEY_SHA256)  $(VALKEY_TARBALL)" | sha256sum -c --status; then \
		echo "valkey: $(VALKEY_TARBALL) does not have the SHA-256 of the Valkey $(VALKEY_VERSION) release ($(VALKEY_SHA256)); replace it with the release tarball" >&2; \
		exit 1; \
	fi; \
	echo "valkey: building Valkey $(VALKEY_VERSION) into $(VALKEY_HOME) (about two minutes)"; \
	mkdir -p "$(STREAMQ_CACHE)"; \
	tmp=$$(mktemp -d "$(STREAMQ_CACHE)/valkey-build.XXXXXX"); \
	trap 'rm -rf "$$tmp"' EXIT; \
	tar -xzf "$(VALKEY_TARBALL)" -C "$$tmp"; \
	$(MAKE) --no-print-directory -s -C "$$tmp/valkey-$(VALKEY_VERSION)" -j$(VALKEY_JOBS) BUILD_TLS=no MALLOC=libc >"$$tmp/build.log" 2>&1 || { tail -n 50 "$$tmp/build.log" >&2; exit 1; }; \
	mkdir -p "$$tmp/install/bin"; \
	cp "$$tmp/valkey-$(VALKEY_VERSION)/src/valkey-server" "$$tmp/valkey-$(VALKEY_VERSION)/src/valkey-cli" "$$tmp/install/bin/"; \
	rm -rf "$(VALKEY_HOME)"; \
	mv -T "$$tmp/install" "$(VALKEY_HOME)"; \
	"$(VALKEY_SERVER)" --version

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
