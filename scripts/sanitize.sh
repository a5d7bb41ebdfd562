#!/usr/bin/env bash
# Builds dtrain with sanitizers (clang) and runs the tests under them.
#
#   scripts/sanitize.sh [asan|tsan|all]        default: all
#
# asan: AddressSanitizer + UndefinedBehaviorSanitizer (any report is fatal) over the library
#       and its tests, in ${DTRAIN_ASAN_BUILD_DIR:-build-asan}; runs the library's tests and
#       replays the fuzz corpora (the same build carries the libFuzzer targets: fuzz.sh).
# tsan: ThreadSanitizer over the communication layer's thread-based tests (ranks as threads
#       over Gloo and the in-memory and TCP stores), in ${DTRAIN_TSAN_BUILD_DIR:-build-tsan}.
# LibTorch, Gloo and OpenBLAS come from Debian uninstrumented; tests/sanitizers/*.supp name
# the reports that belong to them (nothing of dtrain's is suppressed).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mode="${1:-all}"
jobs="${DTRAIN_JOBS:-$(nproc)}"
supp="$root/tests/sanitizers"

source "$root/scripts/clang-build.sh"

run_asan() {
  asan_configure
  # The library's tests and their helpers, dtrain-run and the fuzz targets; not the example.
  local targets=(dtrain_tests dtrain_test_worker dtrain_fake_openblas dtrain-run)
  for d in "$root"/tests/fuzz/corpus/*/; do targets+=("dtrain_fuzz_$(basename "$d")"); done
  cmake --build "$asan_build_dir" -j "$jobs" --target "${targets[@]}"
  asan_environment
  # Processes start several times slower under ASan: tests that bound a worker's start-up
  # time scale their slack by this.
  export DTRAIN_TEST_TIME_SCALE="${DTRAIN_TEST_TIME_SCALE:-4}"
  # The package test rebuilds a consumer without sanitizers; the two-host test needs root
  # and runs the example: neither is this job's.
  (cd "$asan_build_dir" && ctest --output-on-failure -j 2 --timeout 900 -E '^(package|multinode)\.|_NOT_BUILT')
}

run_tsan() {
  local dir="${DTRAIN_TSAN_BUILD_DIR:-$root/build-tsan}"
  clang_configure "$dir" "-fsanitize=thread" -DDTRAIN_BUILD_EXAMPLES=OFF
  cmake --build "$dir" -j "$jobs" --target dtrain_tests dtrain_test_worker
  export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$supp/tsan.supp"
  # The communication layer's tests: every suite defined in tests/comm/ (stores, Gloo and
  # shared-memory collectives, hierarchical layouts, consistency, failures, rendezvous), ranks
  # as threads and multi-process cases with instrumented workers. The filter is read from
  # the sources so that a new suite cannot be left out; a parameterized suite carries an
  # instantiation prefix ("WorldSizes/Collectives"), hence both patterns.
  local suites
  suites="$(grep -ohE '^(TEST|TEST_F|TEST_P|TYPED_TEST)\( *[A-Za-z0-9_]+' "$root"/tests/comm/*.cpp |
    sed -E 's/.*\( *//' | sort -u | sed -E 's|(.*)|\1.*:*/\1.*|' | paste -sd: -)"
  OMP_NUM_THREADS=1 "$dir/tests/dtrain_tests" --gtest_filter="${DTRAIN_TSAN_FILTER:-$suites}"
}

case "$mode" in
  asan) run_asan ;;
  tsan) run_tsan ;;
  all) run_asan; run_tsan ;;
  *) echo "usage: scripts/sanitize.sh [asan|tsan|all]" >&2; exit 2 ;;
esac
