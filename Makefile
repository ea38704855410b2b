# Front door for users and CI. Every target installs missing Debian packages
# first (scripts/install-deps.sh), then configures and builds as needed.
#   make demo   run the main job (kvferry demo)
#   make test   build and run the tests a change is checked with first (ctest: C
#               unit/e2e tests, fuzz-corpus replays, pytest; not label `slow`), < 1 min
#   make test-all  every test, the `slow` ones too (faults, floods, UCX reruns)
#   make test-slow only the `slow` ones (CI runs `make test` then this: every test once)
#   make faults the fault suite (tests/faults: kills, stops, a partition, hostile
#               peers, seeded random fault runs on one host and across namespaces;
#               FAULTS_ARGS="--n 1000" for more faults)
#   make asan   the test suite under AddressSanitizer + UndefinedBehaviorSanitizer (not the
#               reruns over UCX's tcp, label software_rma: make test-slow runs them)
#   make tsan   the threaded tests under ThreadSanitizer
#   make fuzz   build the libFuzzer targets and run each briefly
#   make bench  run the benchmarks
JOBS ?= $(shell nproc)
BUILD ?= build
CMAKE_FLAGS ?=

.PHONY: all deps build demo test test-all test-slow faults asan tsan fuzz bench install clean format

all: build

deps:
	@scripts/install-deps.sh

$(BUILD)/CMakeCache.txt: | deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo $(CMAKE_FLAGS)

build: deps $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS)

demo: build
	$(BUILD)/kvferry demo $(DEMO_ARGS)

# Label `slow` (tests/CMakeLists.txt, KVF_SLOW_CASES): multi-second fault,
# flood and UCX-rerun cases, left to test-all.
test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) -LE slow $(CTEST_ARGS)

test-all: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) $(CTEST_ARGS)

test-slow: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) -L slow $(CTEST_ARGS)

FAULTS_TIMEOUT ?= 1200
FAULTS_TESTS ?= tests/faults
faults: build
	KVFERRY_CLI=$(CURDIR)/$(BUILD)/kvferry KVFERRY_TESTPEER=$(CURDIR)/$(BUILD)/kvferry-testpeer KVFERRY_LIB=$(CURDIR)/$(BUILD)/libkvferry.so PYTHONPATH=$(CURDIR)/python \
	  timeout $(FAULTS_TIMEOUT) /usr/bin/python3 -m pytest -q -rxXs -p no:cacheprovider $(FAULTS_TESTS) $(FAULTS_ARGS)

asan: deps
	cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_COMPILER=clang -DKVF_SANITIZE=address
	cmake --build build-asan -j $(JOBS)
	cd build-asan && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  ctest --output-on-failure -j $(JOBS) -LE software_rma $(CTEST_ARGS)

tsan: deps
	cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_COMPILER=clang -DKVF_SANITIZE=thread
	cmake --build build-tsan -j $(JOBS)
	cd build-tsan && TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:suppressions=$(CURDIR)/tests/tsan.supp \
	  ctest --output-on-failure -j $(JOBS) -L threaded $(CTEST_ARGS)

FUZZ_SECONDS ?= 20
fuzz: deps
	cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_COMPILER=clang -DKVF_FUZZ=ON -DKVF_TESTS=OFF
	cmake --build build-fuzz -j $(JOBS) --target $$(cd tests/fuzz && ls fuzz_*.c | sed 's/\.c$$//' | tr '\n' ' ')
	scripts/run-fuzzers.sh build-fuzz $(FUZZ_SECONDS)

bench: build
	$(BUILD)/kvferry bench $(BENCH_ARGS)

install: build
	cmake --install $(BUILD)

clean:
	rm -rf $(BUILD) build-asan build-tsan build-fuzz

# Reformat every C source with .clang-format (CI checks it: scripts/check-format.sh).
format: deps
	find src include tests bench -type f \( -name '*.c' -o -name '*.h' \) | xargs clang-format -i --style=file
