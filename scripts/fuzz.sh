#!/usr/bin/env bash
# Runs dtrain's libFuzzer targets (tests/fuzz/) under AddressSanitizer and
# UndefinedBehaviorSanitizer, built with clang in ${DTRAIN_ASAN_BUILD_DIR:-build-asan} (shared
# with scripts/sanitize.sh asan).
#
#   scripts/fuzz.sh [SECONDS] [NAME...]     default: 30 seconds each, every target
#
# Seeds come from tests/fuzz/corpus/NAME/ (read only); what libFuzzer finds goes to the build
# directory. A crash leaves its input in BUILD/crashes/ and fails the script: after fixing the
# cause, copy the input into tests/fuzz/corpus/NAME/ so the ctest fuzz.NAME replays it forever.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
seconds="${1:-30}"
shift || true
names=("$@")
if [ "${#names[@]}" -eq 0 ]; then
  for d in "$root"/tests/fuzz/corpus/*/; do names+=("$(basename "$d")"); done
fi
source "$root/scripts/clang-build.sh"
build="$asan_build_dir"
asan_configure
targets=()
for n in "${names[@]}"; do targets+=("dtrain_fuzz_$n"); done
cmake --build "$build" -j "${DTRAIN_JOBS:-$(nproc)}" --target "${targets[@]}"

mkdir -p "$build/crashes"
asan_environment
status=0
for n in "${names[@]}"; do
  mkdir -p "$build/corpus/$n"
  echo "fuzz.sh: $n for ${seconds}s" >&2
  if ! "$build/tests/fuzz/dtrain_fuzz_$n" -max_total_time="$seconds" -rss_limit_mb=4096 \
      -timeout=10 -print_final_stats=1 -artifact_prefix="$build/crashes/$n-" \
      "$build/corpus/$n" "$root/tests/fuzz/corpus/$n" 2>"$build/crashes/$n.log"; then
    tail -n 40 "$build/crashes/$n.log" >&2
    echo "fuzz.sh: $n FAILED; input in $build/crashes/ (log $build/crashes/$n.log)" >&2
    status=1
  else
    grep -E '^stat::(number_of_executed_units|new_units_added)' "$build/crashes/$n.log" | sed "s/^/$n: /" >&2 || true
  fi
done
exit $status
