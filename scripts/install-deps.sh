#!/usr/bin/env bash
# Installs dtrain's system dependencies from Debian packages. Idempotent: when
# everything is present it returns in well under a second without touching apt.
# Not here, to keep a newcomer's first command lean: Slurm (slurm-wlm, munge) and Open MPI
# (openmpi-bin), needed only by tests/multinode/slurm_test.sh and mpirun_test.sh, which
# install them on first use through scripts/apt-ensure.sh (the same apt lock).
set -euo pipefail

PKGS=(
  build-essential cmake ninja-build pkg-config
  libtorch-dev libgloo-dev libabsl-dev libfmt-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  # OpenMP variant on purpose: it sizes its thread pool from the same OpenMP
  # runtime LibTorch uses, so at::set_num_threads() bounds BLAS too and several
  # ranks on one machine do not oversubscribe the cores (the pthread variant
  # starts one BLAS thread per core in every process).
  libopenblas0-openmp
  gnuplot-nox
  # examples/cnn: Fashion-MNIST's gzip-compressed IDX files, read with zlib.
  zlib1g-dev dataset-fashion-mnist
  # The MPI backend (Backend::kMpi) and its tests under a real mpirun: Open MPI 4.1.
  libopenmpi-dev openmpi-bin
  # scripts/fuzz.sh and scripts/sanitize.sh: clang with libFuzzer and the sanitizer runtimes.
  clang libclang-rt-14-dev
  # scripts/format.sh (and its check in .ci/run): the repository's .clang-format, clang-format 14.
  clang-format-14
  # ip(8): the multi-host test joins two network namespaces with a veth pair.
  iproute2
  # etcd: the etcd store's tests start a real server (the etcd executable, on free ports);
  # the package's own service, where systemd runs it, is not used.
  etcd-server
  # etcdctl: the elastic tests probe the server and read the agents' keys with it.
  etcd-client
  # fetch-data.sh downloads the example's data with the machine's npm client (not an apt
  # package here: the machine provides it, configured for its registry).
  ca-certificates
)

# Missing packages only, one apt at a time on this host (scripts/apt-ensure.sh: the lock that
# scripts/chroot.sh's debootstrap install and the tests' own installs share).
exec "$(dirname "${BASH_SOURCE[0]}")/apt-ensure.sh" "${PKGS[@]}"
