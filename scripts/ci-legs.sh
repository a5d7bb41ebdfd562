#!/usr/bin/env bash
# CI's build matrix beyond the README's test command (leg 1, bookworm + LibTorch 1.13, is
# scripts/test.sh). Each leg runs in a Debian 13 "trixie" root made by scripts/chroot.sh,
# with its own build directory, and with -DDTRAIN_WERROR=ON (warnings in dtrain's own code
# are errors; LibTorch's and the other dependencies' headers are -isystem and do not count).
#
#   scripts/ci-legs.sh [cpu] [cuda]        (default: both, in that order)
#
#   cpu   leg 2: trixie, LibTorch 2.6 CPU, GCC 14. The whole build (library, tests, examples,
#         benchmarks) in build-trixie/ and the whole ctest suite.
#   cuda  leg 3: trixie, CUDA LibTorch 2.6 + CUDA 12.4 + NCCL 2.22, -DDTRAIN_WITH_NCCL=ON, in
#         build-trixie-cuda/. Everything is compiled (the NCCL backend and its tests included)
#         and linked, but nothing runs: libtorch_cuda.so needs cuDNN (libcudnn.so.9), and
#         Debian's nvidia-cudnn package downloads cuDNN from NVIDIA in its install script,
#         which fails here, so cuDNN is absent. Executables are therefore linked with
#         -Wl,--allow-shlib-undefined: the linker still resolves every symbol dtrain's own
#         objects use (an undefined one of ours fails the link), it only stops checking the
#         undefined symbols *inside* the shared libraries (libtorch_cuda.so -> cuDNN). Such
#         executables cannot start, so this leg ends at the link. There is no GPU here either.
#         For the same reason GoogleTest's test discovery is moved from build time (it runs
#         each test binary to list its tests) to ctest time (PRE_TEST), which this leg never
#         reaches.
#
# Ninja keeps going after a failed compile (-k 0), so one run shows every error of a leg.
# Prints each leg's wall time; ctest's summary gives the test counts. Build directories are
# kept between runs (CI starts from a clean clone, so there they start empty).
# DTRAIN_JOBS: parallel compile jobs (default: nproc).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
legs=("$@")
[ ${#legs[@]} -gt 0 ] || legs=(cpu cuda)
jobs="${DTRAIN_JOBS:-$(nproc)}"

leg_cpu() {
  "$root/scripts/chroot.sh" run cpu "
    set -euo pipefail
    cmake -S . -B build-trixie -G Ninja -DCMAKE_BUILD_TYPE=Release -DDTRAIN_WERROR=ON >/dev/null
    cmake --build build-trixie -j $jobs -- -k 0
    cd build-trixie
    ctest --output-on-failure -j 2 --timeout 600"
}

leg_cuda() {
  "$root/scripts/chroot.sh" run cuda "
    set -euo pipefail
    cmake -S . -B build-trixie-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DDTRAIN_WERROR=ON \
      -DDTRAIN_WITH_NCCL=ON '-DCMAKE_EXE_LINKER_FLAGS=-Wl,--allow-shlib-undefined' \
      -DCMAKE_GTEST_DISCOVER_TESTS_DISCOVERY_MODE=PRE_TEST >/dev/null
    cmake --build build-trixie-cuda -j $jobs -- -k 0"
}

for leg in "${legs[@]}"; do
  case "$leg" in
    cpu | cuda) ;;
    *) echo "ci-legs.sh: unknown leg '$leg' (cpu or cuda)" >&2; exit 2 ;;
  esac
  start=$(date +%s)
  echo "ci-legs: leg $leg started $(date -u +%H:%M:%S)" >&2
  "$root/scripts/chroot.sh" create "$leg"
  made=$(date +%s)
  "leg_$leg"
  echo "ci-legs: leg $leg passed in $(($(date +%s) - start)) s (root creation or update" \
    "$((made - start)) s, build and tests $(($(date +%s) - made)) s)" >&2
done
