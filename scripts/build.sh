#!/usr/bin/env bash
# Configures and builds dtrain into ${DTRAIN_BUILD_DIR:-build} (Release, Ninja), with the one
# set of flags both README commands use (-DDTRAIN_WERROR=ON: warnings in dtrain's own code are
# errors), so that the main job and the tests share one build: the second command compiles
# only what the first did not need, never the library again.
#   DTRAIN_TARGETS="gpt2_train dtrain-run"   build only these (default: everything)
# Extra arguments are passed to CMake's configure step (e.g. -DTorch_DIR=...).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${DTRAIN_BUILD_DIR:-$root/build}"
jobs="${DTRAIN_JOBS:-$(nproc)}"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDTRAIN_WERROR=ON "$@" >/dev/null
targets=()
for t in ${DTRAIN_TARGETS:-}; do targets+=(--target "$t"); done
cmake --build "$build" -j "$jobs" "${targets[@]}"
