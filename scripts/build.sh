#!/usr/bin/env bash
# Configures and builds dtrain into ${DTRAIN_BUILD_DIR:-build} (Release, Ninja).
# Extra arguments are passed to CMake's configure step (e.g. -DTorch_DIR=...).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${DTRAIN_BUILD_DIR:-$root/build}"
jobs="${DTRAIN_JOBS:-$(nproc)}"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
cmake --build "$build" -j "$jobs"
