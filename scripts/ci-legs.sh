#!/usr/bin/env bash
# CI's build matrix beyond the README's test command (leg 1, bookworm + LibTorch 1.13, is
# scripts/test.sh). Each leg runs in a Debian root made by scripts/chroot.sh, with its own
# build directory, and with -DDTRAIN_WERROR=ON (warnings in dtrain's own code are errors;
# LibTorch's and the other dependencies' headers are -isystem and do not count).
#
#   scripts/ci-legs.sh [forky] [cpu] [cuda]     (default: forky cuda, .ci/run's legs)
#
#   forky leg 4: Debian forky (testing), LibTorch 2.14.1 (C++20), GCC 16, CMake 4. The whole
#         build in build-forky/, at -O1 (CMAKE_CXX_FLAGS_RELEASE; leg 1 builds at -O3: CI's
#         75 minutes on two cores hold two whole builds only so), and every test that touches
#         LibTorch: all but DTRAIN_CI_LEG4_SKIP below, the tests of dtrain's own launcher,
#         store and network code, which leg 1 runs and which no LibTorch version changes.
#   cpu   leg 2, not in .ci/run since leg 4 came (docs/libtorch.md says why): trixie,
#         LibTorch 2.6 CPU, GCC 14. In build-trixie/, what the smoke subset of ctest runs
#         (DTRAIN_CI_SMOKE below: the LibTorch-version-sensitive paths): the library, the
#         launcher, dtrain_tests, its worker and gpt2_train_tests (DTRAIN_CI_SMOKE_TARGETS).
#   cuda  leg 3: trixie, CUDA LibTorch 2.6 + CUDA 12.4 + NCCL 2.22, -DDTRAIN_WITH_NCCL=ON, in
#         build-trixie-cuda/. What includes CUDA's or CUDA LibTorch's headers is compiled
#         (DTRAIN_CI_CUDA_TARGETS: the library with the NCCL backend, the GPT-2 trainer with
#         its CUDA memory and autocast paths, the NCCL tests' object; empty: everything) and
#         linked, but nothing runs: libtorch_cuda.so needs cuDNN (libcudnn.so.9), and
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
[ ${#legs[@]} -gt 0 ] || legs=(forky cuda)
jobs="${DTRAIN_JOBS:-$(nproc)}"

# Leg 2's tests: what differs between LibTorch versions (src/compat: autocast, attention,
# autograd hooks and errors, checkpointing's storage tricks), a DDP and an FSDP equivalence
# case, and the installed package; and the targets that hold them (DTRAIN_CI_SMOKE_TARGETS).
smoke='^(gpt2_train[.]|[A-Za-z]+/)?(Autocast|AutocastBf16Cpu|Attention|GptModel|FusedAdamW|ActivationCheckpoint'
smoke+='|Checkpoint|BufferCheckpoint|SyncBatchNorm|SyncBatchNormStrategies|HostSync|HostSyncDebug'
smoke+='|HostSyncGradScaler|HostSyncClip|FakeDevice)[.]'
smoke+='|^Ranks/(DataParallel|Fsdp)Equivalence[.].*_world2$|^package[.]find_package_consumer$'
DTRAIN_CI_SMOKE="${DTRAIN_CI_SMOKE:-$smoke}"
smoke_targets="dtrain_tests dtrain_test_worker gpt2_train_tests dtrain-run dtrain-supervise"
DTRAIN_CI_SMOKE_TARGETS="${DTRAIN_CI_SMOKE_TARGETS-$smoke_targets}"

# What leg 4 leaves to leg 1: dtrain-run's and the elastic agents' shell tests, the network-
# namespace jobs (real Slurm and mpirun among them; they skip inside a root anyway), the TCP and
# etcd stores, and the scripts' and tokenizer's tests: none calls LibTorch beyond allocating a
# tensor. Also the GPT-2 trainer's own logic (its checkpoint resumes, flag errors, memory-based
# sharding choice and BLAS set-up: what LibTorch does under them, checkpoints included, is
# dtrain_tests' and runs here), and the examples' compile against the installed package (the
# package's consumer test, C++20 against the installed headers, runs here). And the MPI
# backend's runs under mpirun (mpi.*): it compiles here, and its engine hands MPI raw buffers,
# nothing LibTorch computes, while DDP and FSDP run here over Gloo.
leg4_skip='^(launcher|multinode|scripts|gpt2_data|mpi)[.]|^(Store|StoreHostile|StoreProtocol|StoreAcceptBackoff'
leg4_skip+='|EtcdStore|EtcdCodec|EtcdRendezvous)[.]'
leg4_skip+='|^gpt2_train[.](TrainerCheckpoint|TrainerErrors|TrainerMemory|TrainerBlas)[.]'
leg4_skip+='|^package[.]examples_against_install$'
DTRAIN_CI_LEG4_SKIP="${DTRAIN_CI_LEG4_SKIP-$leg4_skip}"

# The -Werror build of flavour $1's root in build dir $2 (of the targets $3; empty: all) with
# the extra configure arguments $4, then ctest with the arguments that follow (none: the
# whole suite).
build_and_test() {
  local flavour="$1" dir="$2" targets="" configure="$4"
  [ -z "$3" ] || targets="--target $3"
  shift 4
  "$root/scripts/chroot.sh" run "$flavour" "
    set -euo pipefail
    cmake -S . -B $dir -G Ninja -DCMAKE_BUILD_TYPE=Release -DDTRAIN_WERROR=ON $configure >/dev/null
    cmake --build $dir -j $jobs $targets -- -k 0
    cd $dir
    ctest --output-on-failure -j 2 --timeout 600 $*"
}

# DTRAIN_CI_LEG4_TESTS=all (default): every test but DTRAIN_CI_LEG4_SKIP; smoke: leg 2's subset
# (.ci/run's choice when CI's budget is short).
leg_forky() {
  local select=()
  case "${DTRAIN_CI_LEG4_TESTS:-all}" in
    all) [ -z "$DTRAIN_CI_LEG4_SKIP" ] || select=(-E "'$DTRAIN_CI_LEG4_SKIP'") ;;
    smoke) select=(-R "'$DTRAIN_CI_SMOKE'") ;;
    *) echo "ci-legs.sh: DTRAIN_CI_LEG4_TESTS is all or smoke" >&2; return 2 ;;
  esac
  build_and_test forky build-forky "" "'-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG'" "${select[@]}"
}
leg_cpu() { build_and_test cpu build-trixie "$DTRAIN_CI_SMOKE_TARGETS" "" -R "'$DTRAIN_CI_SMOKE'"; }

# The CUDA-touching sources: the library, the trainer, the NCCL tests, and the tests of the
# device paths (host syncs, FusedAdamW's multi-tensor update) against CUDA LibTorch's headers.
cuda_targets="dtrain gpt2_train tests/CMakeFiles/dtrain_tests.dir/nccl/nccl_test.cpp.o"
cuda_targets+=" tests/CMakeFiles/dtrain_tests.dir/strategy/host_sync_test.cpp.o"
cuda_targets+=" tests/CMakeFiles/dtrain_tests.dir/optim/fused_adamw_test.cpp.o"
DTRAIN_CI_CUDA_TARGETS="${DTRAIN_CI_CUDA_TARGETS-$cuda_targets}"
leg_cuda() {
  local targets=""
  [ -z "$DTRAIN_CI_CUDA_TARGETS" ] || targets="--target $DTRAIN_CI_CUDA_TARGETS"
  "$root/scripts/chroot.sh" run cuda "
    set -euo pipefail
    cmake -S . -B build-trixie-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DDTRAIN_WERROR=ON \
      -DDTRAIN_WITH_NCCL=ON '-DCMAKE_EXE_LINKER_FLAGS=-Wl,--allow-shlib-undefined' \
      -DCMAKE_GTEST_DISCOVER_TESTS_DISCOVERY_MODE=PRE_TEST >/dev/null
    cmake --build build-trixie-cuda -j $jobs $targets -- -k 0"
}

for leg in "${legs[@]}"; do
  case "$leg" in
    forky | cpu | cuda) ;;
    *) echo "ci-legs.sh: unknown leg '$leg' (forky, cpu or cuda)" >&2; exit 2 ;;
  esac
  start=$(date +%s)
  echo "ci-legs: leg $leg started $(date -u +%H:%M:%S)" >&2
  "$root/scripts/chroot.sh" create "$leg"
  made=$(date +%s)
  "leg_$leg"
  echo "ci-legs: leg $leg passed in $(($(date +%s) - start)) s (root creation or update" \
    "$((made - start)) s, build and tests $(($(date +%s) - made)) s)" >&2
done
