# Sourced by sanitize.sh and fuzz.sh: configures a clang build of dtrain with sanitizer flags.
#   clang_configure BUILD_DIR "FLAGS" [cmake args...]
# Benchmarks and the NCCL backend are left out (they do not run under sanitizers here).
clang_configure() {
  local dir="$1" flags="$2"
  shift 2
  command -v clang++ >/dev/null ||
    { echo "clang++ is missing (scripts/install-deps.sh installs it)" >&2; return 1; }
  cmake -S "$root" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_COMPILER=clang++ -DDTRAIN_BUILD_BENCHMARKS=OFF -DDTRAIN_WITH_NCCL=OFF \
    -DCMAKE_CXX_FLAGS="$flags -fno-omit-frame-pointer" "$@" >/dev/null
}

# AddressSanitizer + UndefinedBehaviorSanitizer (any UB report is fatal), with the libFuzzer
# targets: one build serves sanitize.sh asan and fuzz.sh.
asan_build_dir="${DTRAIN_ASAN_BUILD_DIR:-$root/build-asan}"
asan_configure() {
  clang_configure "$asan_build_dir" "-fsanitize=address,undefined -fno-sanitize-recover=undefined" \
    -DDTRAIN_FUZZ=ON
}
asan_environment() {
  local supp="$root/tests/sanitizers"
  export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_odr_violation=0:detect_leaks=1}"
  export LSAN_OPTIONS="${LSAN_OPTIONS:-suppressions=$supp/lsan.supp:print_suppressions=0}"
  export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
}
