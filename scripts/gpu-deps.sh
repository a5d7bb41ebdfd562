#!/usr/bin/env bash
# The build dependencies scripts/gpu-check.sh carries to a GPU machine that has LibTorch
# (Python's torch), CMake, ninja and nvcc but no Gloo, Abseil, fmt or GoogleTest, and no
# network: Debian bookworm's packages, as .deb files in an ignored folder of the working tree.
#
#   scripts/gpu-deps.sh fetch [DIR]          # here (Debian bookworm, apt): download the .debs
#                                            # into DIR (default .gpu-deps/debs), ~3 MiB
#   scripts/gpu-deps.sh unpack DEBS PREFIX   # anywhere with dpkg: unpack them into PREFIX and
#                                            # make their CMake packages relocatable; prints
#                                            # the CMake arguments that select them
#   scripts/gpu-deps.sh check [DIR]          # here: unpack into a temporary prefix and
#                                            # configure dtrain against it with the local
#                                            # LibTorch, proving the carried prefix works
#
# What is carried and why: libgloo-dev + libgloo0 (the CPU collectives) with the shared
# libraries libgloo0 needs at run time (libhiredis0.14, libibverbs1, libnl-3-200,
# libnl-route-3-200); libabsl-dev + libabsl20220623 (flags of the trainer and tools);
# libfmt-dev + libfmt9; libgtest-dev (static libraries, the tests). Google Benchmark is not
# carried: gpu-check.sh builds without benchmarks. All are built with the CXX11 ABI, as the
# torch wheels (2.x) are; they need glibc >= 2.34 and libstdc++ >= 12.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

packages=(libgloo-dev libgloo0 libhiredis0.14 libibverbs1 libnl-3-200 libnl-route-3-200
          libabsl-dev libabsl20220623 libfmt-dev libfmt9 libgtest-dev)
max_bytes=$((32 * 1024 * 1024))  # the working tree carries at most 64 MiB in all

fetch() {
  local dir="${1:-$root/.gpu-deps/debs}"
  mkdir -p "$dir"
  (cd "$dir" && rm -f ./*.deb && apt-get download "${packages[@]}")
  local bytes
  bytes=$(du -cb "$dir"/*.deb | tail -1 | cut -f1)
  echo "gpu-deps: $(ls "$dir"/*.deb | wc -l) packages, $bytes bytes in $dir"
  if ((bytes > max_bytes)); then
    echo "gpu-deps: $bytes bytes is over the $max_bytes allowed" >&2
    exit 1
  fi
}

# Unpacks every .deb of $1 into $2; Debian's Gloo package names its library by absolute path:
# rewrite it relative to the package, as the others already are.
unpack() {
  local debs="$1" prefix="$2"
  mkdir -p "$prefix"
  local n=0
  for deb in "$debs"/*.deb; do
    dpkg -x "$deb" "$prefix"
    n=$((n + 1))
  done
  if ((n == 0)); then
    echo "gpu-deps: no .deb in $debs (run scripts/gpu-deps.sh fetch on a Debian machine)" >&2
    exit 1
  fi
  local gloo="$prefix/usr/share/cmake/Gloo"
  sed -i 's|"/usr/lib/libgloo|"${_IMPORT_PREFIX}/lib/libgloo|g' "$gloo"/GlooTargets-*.cmake
  if grep -q '"/usr/' "$gloo"/GlooTargets*.cmake; then
    echo "gpu-deps: $gloo still names /usr" >&2
    exit 1
  fi
  # The .so symlinks of the -dev packages point to the runtime packages' files, unpacked too.
  echo "gpu-deps: unpacked $n packages into $prefix" >&2
}

# CMake arguments that select the unpacked packages (explicit package directories, so that
# packages installed on the machine are not picked instead).
cmake_args() {
  local p="$1/usr" multi="lib/x86_64-linux-gnu"
  echo "-DGloo_DIR=$p/share/cmake/Gloo -Dabsl_DIR=$p/$multi/cmake/absl" \
       "-Dfmt_DIR=$p/$multi/cmake/fmt -DGTest_DIR=$p/$multi/cmake/GTest"
}

# Directories of the unpacked shared libraries, for LD_LIBRARY_PATH (libgloo's own
# dependencies are found through it, not through the executables' RUNPATH).
library_path() {
  echo "$1/usr/lib:$1/usr/lib/x86_64-linux-gnu"
}

check() {
  local debs="${1:-$root/.gpu-deps/debs}"
  # Global: the EXIT trap runs after this function returned.
  check_tmp="$(mktemp -d /tmp/gpu-deps-check.XXXXXX)"
  local tmp="$check_tmp"
  trap 'rm -rf "$check_tmp"' EXIT
  unpack "$debs" "$tmp/prefix"
  # shellcheck disable=SC2046
  cmake -S "$root" -B "$tmp/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DDTRAIN_BUILD_BENCHMARKS=OFF -DDTRAIN_WITH_NCCL=OFF $(cmake_args "$tmp/prefix") \
    > "$tmp/configure.log"
  local bad=0
  for var in Gloo_DIR absl_DIR fmt_DIR GTest_DIR; do
    local value
    value=$(grep "^$var:" "$tmp/build/CMakeCache.txt" | cut -d= -f2-)
    echo "gpu-deps: $var=$value"
    [[ "$value" == "$tmp/prefix/"* ]] || bad=1
  done
  # A program that uses each carried package, built against the prefix alone and run: proves
  # the headers, CMake packages and shared libraries work together (building all of dtrain
  # here would take long on a shared machine; gpu-check.sh does that on the GPU machine).
  mkdir -p "$tmp/probe"
  cat > "$tmp/probe/CMakeLists.txt" <<'CMAKE'
cmake_minimum_required(VERSION 3.18)
project(gpu_deps_probe CXX)
set(CMAKE_CXX_STANDARD 17)
find_package(Gloo REQUIRED)
find_package(fmt REQUIRED)
find_package(absl REQUIRED)
find_package(GTest REQUIRED)
add_executable(probe probe.cpp)
target_link_libraries(probe PRIVATE gloo fmt::fmt absl::flags absl::flags_parse GTest::gtest)
CMAKE
  cat > "$tmp/probe/probe.cpp" <<'CPP'
#include <absl/flags/flag.h>
#include <absl/flags/parse.h>
#include <fmt/format.h>
#include <gloo/allreduce.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/hash_store.h>
#include <gloo/transport/tcp/device.h>
#include <gtest/gtest.h>
ABSL_FLAG(int, n, 4, "elements");
TEST(Probe, GlooAllReduceOfOneRank) {
  auto dev = gloo::transport::tcp::CreateDevice(gloo::transport::tcp::attr("127.0.0.1"));
  gloo::rendezvous::HashStore store;
  auto ctx = std::make_shared<gloo::rendezvous::Context>(0, 1);
  ctx->connectFullMesh(store, dev);
  std::vector<float> v(static_cast<size_t>(absl::GetFlag(FLAGS_n)), 2.0f);
  gloo::AllreduceOptions o(ctx);
  o.setOutput(v.data(), v.size());
  o.setReduceFunction(static_cast<void (*)(void*, const void*, const void*, size_t)>(
      &gloo::sum<float>));
  gloo::allreduce(o);
  EXPECT_EQ(fmt::format("{}", v[0]), "2");
}
int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  absl::ParseCommandLine(argc, argv);
  return RUN_ALL_TESTS();
}
CPP
  # shellcheck disable=SC2046
  cmake -S "$tmp/probe" -B "$tmp/probe/build" -G Ninja $(cmake_args "$tmp/prefix") \
    > "$tmp/probe.log"
  cmake --build "$tmp/probe/build" >> "$tmp/probe.log" || { cat "$tmp/probe.log"; bad=1; }
  local lib
  lib=$(LD_LIBRARY_PATH="$(library_path "$tmp/prefix")" ldd "$tmp/probe/build/probe" \
        | grep -E 'libgloo|libfmt|libibverbs|libhiredis' || true)
  echo "$lib" | sed 's/^/gpu-deps: /'
  echo "$lib" | grep -q "$tmp/prefix/usr/lib/libgloo" || bad=1
  LD_LIBRARY_PATH="$(library_path "$tmp/prefix")" "$tmp/probe/build/probe" --n 8 \
    > "$tmp/probe.run" 2>&1 || { cat "$tmp/probe.run"; bad=1; }
  grep -q "PASSED.*1 test" "$tmp/probe.run" || bad=1
  if ((bad)); then
    echo "gpu-deps: the build did not use the carried packages (see above)" >&2
    exit 1
  fi
  echo "gpu-deps: dtrain configured, and a Gloo/fmt/Abseil/GoogleTest program built and run," \
       "against the carried prefix: ok"
}

case "${1:-}" in
  fetch) fetch "${2:-}" ;;
  unpack) unpack "$2" "$3"; cmake_args "$3" ;;
  cmake-args) cmake_args "$2" ;;
  library-path) library_path "$2" ;;
  check) check "${2:-}" ;;
  *) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
