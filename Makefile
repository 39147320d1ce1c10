# The two commands of the README:
#   make run    install what is missing, build release, generate demo data on first run,
#               and serve it on 127.0.0.1:7420 from a data directory (writes are kept)
#   make test   install what is missing, check generated code, build, run every test
#               (and the protobuf-c shim tests again under AddressSanitizer)
# Other targets: deps, generate, check-generated, build, check-deploy, test-doors, test-ingestion, test-console, test-nearcache, test-asan,
# bench-codec, bench-resolver, bench-store, bench-check (the microbenchmarks' malloc counts
# against benchmarks/Thresholds), bench-thresholds (records them), fuzz (FUZZ_SECONDS
# each; CI runs 60), clean.

SHELL := /bin/bash
SWIFT ?= swift
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
export PIP_ROOT_USER_ACTION := ignore
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: bench run demo-data test deps generate check-generated build test-unit check-deploy test-doors test-ingestion test-events test-console test-nearcache test-asan bench-codec bench-resolver bench-store bench-check bench-thresholds fuzz clean

DEMO_SNAPSHOT ?= .build/demo/demo.snap
DEMO_DATA ?= .build/demo/data
DEMO_CUSTOMERS ?= 100000

run: deps
	$(SWIFT) build -c release --product entitlements
	@if [ ! -f $(DEMO_SNAPSHOT) ]; then \
	  mkdir -p $(dir $(DEMO_SNAPSHOT)) && \
	  .build/release/entitlements snapshot generate --customers $(DEMO_CUSTOMERS) --seed 1 --output $(DEMO_SNAPSHOT); \
	fi
	.build/release/entitlements serve --data-dir $(DEMO_DATA) --snapshot $(DEMO_SNAPSHOT)

# New demo data (the demo's subscriptions are generated active as of the day it is made).
demo-data: deps
	$(SWIFT) build -c release --product entitlements
	rm -rf $(DEMO_SNAPSHOT) $(DEMO_DATA)
	mkdir -p $(dir $(DEMO_SNAPSHOT))
	.build/release/entitlements snapshot generate --customers $(DEMO_CUSTOMERS) --seed 1 --output $(DEMO_SNAPSHOT)

test: deps check-generated test-unit check-deploy test-doors test-ingestion test-events test-console test-nearcache test-asan

# Side by side with Redis (benchmarks/README.md); BENCH_FLAGS=--quick for a 2 s smoke run.
bench: deps
	benchmarks/run.sh $(BENCH_FLAGS)

# Debian packages for protobuf-c (library, protoc-c), Google's protoc (used by the tests
# and codegen) and pkg-config (SwiftPM finds libprotobuf-c with it); PostgreSQL's server
# (the fleet tests start their own, docs/fleet.md); Python's protobuf package for
# codegen/protoc-gen-swift-shim; the doors' foreign clients (grpc-go with the protobuf 1.5
# runtime and protoc-gen-go from Debian, curl; grpcio, grpcio-tools,
# grpcio-health-checking and h2 from PyPI); opentelemetry-proto from PyPI for the tracing
# test's OTLP receiver; cryptography from PyPI for the Google Play test's loopback Google
# (RS256 signatures); chromium and chromium-driver from Debian with selenium from PyPI for
# the console's browser test. Installs only what is missing.
deps:
	@missing=""; \
	command -v pkg-config >/dev/null || missing="$$missing pkg-config"; \
	pkg-config --exists libprotobuf-c 2>/dev/null || missing="$$missing libprotobuf-c-dev"; \
	command -v protoc-c >/dev/null || missing="$$missing protobuf-c-compiler"; \
	command -v protoc >/dev/null || missing="$$missing protobuf-compiler"; \
	command -v python3 >/dev/null || missing="$$missing python3 python3-protobuf"; \
	ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing="$$missing postgresql"; \
	command -v go >/dev/null || missing="$$missing golang-go"; \
	[ -d /usr/share/gocode/src/google.golang.org/grpc ] || missing="$$missing golang-google-grpc-dev"; \
	[ -d /usr/share/gocode/src/github.com/golang/protobuf/proto ] || missing="$$missing golang-github-golang-protobuf-1-5-dev"; \
	command -v protoc-gen-go >/dev/null || missing="$$missing protoc-gen-go"; \
	command -v curl >/dev/null || missing="$$missing curl"; \
	command -v openssl >/dev/null || missing="$$missing openssl"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	command -v chromedriver >/dev/null || missing="$$missing chromium-driver"; \
	if [ -n "$$missing" ]; then \
	  echo "make deps: installing$$missing"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing >/dev/null; \
	fi
	@python3 -c 'import google.protobuf' 2>/dev/null \
	  || python3 -m pip install --quiet protobuf 2>/dev/null \
	  || { $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq python3-protobuf >/dev/null; }
	@python3 -c 'import google.protobuf' \
	  || { echo "make deps: python3 cannot import google.protobuf; install it with pip or apt (python3-protobuf)" >&2; exit 1; }
	@python3 -c 'import grpc, grpc_tools, grpc_health.v1, h2, opentelemetry.proto' 2>/dev/null \
	  || python3 -m pip install --quiet grpcio grpcio-tools grpcio-health-checking h2 opentelemetry-proto
	@python3 -c 'from cryptography.hazmat.primitives.asymmetric import padding' 2>/dev/null \
	  || python3 -m pip install --quiet cryptography \
	  || { $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq python3-cryptography >/dev/null; }
	@python3 -c 'import selenium.webdriver' 2>/dev/null \
	  || python3 -m pip install --quiet selenium
	@python3 -c 'import yaml' 2>/dev/null \
	  || { $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq python3-yaml >/dev/null; } \
	  || python3 -m pip install --quiet pyyaml

generate: deps
	codegen/generate.sh

check-generated: deps
	codegen/generate.sh --check
	python3 dev/module-graph.py --check

build: deps
	$(SWIFT) build

# The near-cache's correctness test under load runs on its own, after the others: it needs
# the machine's cores for its writer and checkers, and other suites running beside it
# would leave it too few writes to say anything.
test-unit: deps
	$(SWIFT) build --build-tests
	SWIFTNIO_STRICT=1 $(SWIFT) test --skip-build --skip NearCacheLoadTests
	SWIFTNIO_STRICT=1 $(SWIFT) test --skip-build --filter NearCacheLoadTests

# deploy/ against the code: manifests parse, flags are accepted, the unit verifies.
check-deploy: deps
	$(SWIFT) build --product entitlements
	python3 deploy/check.py .build/debug/entitlements

# The gRPC and HTTP/JSON doors driven by real foreign clients: Python (grpcio), Go
# (grpc-go from Debian) and curl (Tests/doors/run.sh, docs/doors.md).
test-doors: deps
	$(SWIFT) build --product entitlements
	Tests/doors/run.sh .build/debug/entitlements

# Google Play end to end (docs/ingestion.md): the server against a loopback Google (OAuth
# token endpoint, JWKS, Play Developer API, Pub/Sub) built from Google's documents, with
# keys made by openssl; single node and fleet mode on a PostgreSQL the test starts.
test-ingestion: deps
	$(SWIFT) build --product entitlements
	python3 Tests/googleplay/test_googleplay.py .build/debug/entitlements
	python3 Tests/appstore/test_appstore.py .build/debug/entitlements

# Outbound events (docs/events.md): the server POSTs to a real HTTP receiver that verifies
# every signature; kill -9, outages, filters, redelivery.
test-events: deps
	$(SWIFT) build --product entitlements
	python3 Tests/events/test_events.py .build/debug/entitlements

# The support console (docs/console.md) in a real browser: Debian's chromium, headless,
# driven by Selenium (PyPI) through Debian's chromedriver.
test-console: deps
	$(SWIFT) build --product entitlements
	python3 Tests/console/test_console.py .build/debug/entitlements

# The near-cache rules of docs/PROTOCOL.md ("Keeping answers") in another language: the
# Python reference (Tests/nearcache/near_cache.py, grpcio) under the correctness test the
# Swift client's near-cache also runs (Tests/EntitlementsServerTests/NearCacheTests.swift).
test-nearcache: deps
	$(SWIFT) build --product entitlements
	python3 Tests/nearcache/test_nearcache.py .build/debug/entitlements

# The shim's tests under AddressSanitizer (with LeakSanitizer): every unpacked message
# and every arena chunk must be freed. A separate scratch path keeps the normal build.
test-asan: deps
	ASAN_OPTIONS=detect_leaks=1 LSAN_OPTIONS=suppressions=$(CURDIR)/Tests/lsan-suppressions.txt:print_suppressions=0 \
	  $(SWIFT) test --sanitize=address --scratch-path .build-asan --filter EntitlementsMessagesTests

# Microbenchmarks (package-benchmark, release): the protobuf-c shim and frame codec, and
# the resolver. See benchmarks/README.md.
bench-codec: deps
	cd benchmarks && $(SWIFT) package --allow-writing-to-package-directory benchmark --target CodecBenchmarks

bench-resolver: deps
	cd benchmarks && $(SWIFT) package --allow-writing-to-package-directory benchmark --target ResolverBenchmarks

bench-store: deps
	cd benchmarks && $(SWIFT) package --allow-writing-to-package-directory benchmark --target StoreBenchmarks

# The microbenchmarks' thresholds are their malloc counts (p90 per iteration), exact: time
# varies by 25% between hours on a shared VM, allocations do not.
bench-check: deps
	cd benchmarks && $(SWIFT) package benchmark thresholds check --metric mallocCountTotal --path Thresholds

bench-thresholds: deps
	cd benchmarks && $(SWIFT) package --allow-writing-to-package-directory benchmark thresholds update --metric mallocCountTotal --path Thresholds

# libFuzzer targets (fuzz/): frame decoder, protobuf-c message decoding, snapshot reader,
# log replay; each runs FUZZ_SECONDS on a copy of its committed seed corpus. A crash
# leaves its input in .build-fuzz/ and fails the target.
FUZZ_SECONDS ?= 60
FUZZ_FLAGS := -Xswiftc -sanitize=fuzzer,address -Xswiftc -Xclang-linker -Xswiftc -fuse-ld=lld
fuzz: deps
	@set -e; for target in frames:FuzzFrameDecoder:4096 messages:FuzzMessages:4096 snapshot:FuzzSnapshot:300000 log:FuzzLog:4096; do \
	  corpus=$${target%%:*}; rest=$${target#*:}; product=$${rest%%:*}; maxlen=$${rest#*:}; \
	  $(SWIFT) build --package-path fuzz --product $$product $(FUZZ_FLAGS); \
	  rm -rf .build-fuzz/$$corpus && mkdir -p .build-fuzz && cp -r fuzz/corpus/$$corpus .build-fuzz/$$corpus; \
	  echo "== $$product for $(FUZZ_SECONDS) s"; \
	  fuzz/.build/debug/$$product -max_total_time=$(FUZZ_SECONDS) -max_len=$$maxlen \
	    -artifact_prefix=.build-fuzz/$$product- .build-fuzz/$$corpus; \
	done

clean:
	rm -rf .build .build-asan .build-fuzz benchmarks/.build fuzz/.build
