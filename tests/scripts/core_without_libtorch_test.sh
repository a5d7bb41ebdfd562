#!/bin/sh
# scripts/check-core-libtorch.sh: dtrain_core needs no LibTorch and dtrain-run loads neither
# LibTorch nor libdtrain. It must pass on the build, and fail, naming what it found, on copies
# of the build's description with LibTorch's include directory planted among dtrain_core's,
# LibTorch among its libraries, a precompiled header, an object whose depfile names
# ATen/ATen.h, and libdtrain (which links LibTorch) in dtrain-run's place; so the check itself
# cannot silently stop checking.
# Usage: core_without_libtorch_test.sh SOURCE_DIR DESCRIPTION
set -u
check="$1/scripts/check-core-libtorch.sh"
description="$2"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# Each failure a line of $tmp/failures, and on stderr.
: >"$tmp/failures"
fail() { echo "FAIL: $*" | tee -a "$tmp/failures" >&2; }

bash "$check" "$description" || fail "the build's dtrain_core or dtrain-run uses LibTorch (above)"

torch_dir="$(sed -n 's/^torch_include_dir=//p' "$description" | head -n 1)"
# One CMake would put on the command line (not the compiler's own, e.g. /usr/include).
sed -n 's/^implicit_include_dir=//p' "$description" >"$tmp/implicit"
api_dir="$(sed -n 's/^torch_include_dir=//p' "$description" | grep -vxF -f "$tmp/implicit" |
  head -n 1)"
libdtrain="$(sed -n 's/^libdtrain=//p' "$description")"
if [ -z "$torch_dir" ] || [ -z "$api_dir" ]; then
  fail "the description names no LibTorch include directory"
fi

# planted NAME PATTERN WHAT: the check fails on $tmp/NAME.txt, with a line matching PATTERN.
planted() {
  if bash "$check" "$tmp/$1.txt" 2>"$tmp/$1.err"; then
    fail "$3 passed the check"
  elif ! grep -q "$2" "$tmp/$1.err"; then
    fail "$3 failed without naming it: $(cat "$tmp/$1.err")"
  fi
}

{ cat "$description"; echo "include_dir=$api_dir"; } >"$tmp/include.txt"
planted include "compiles with LibTorch's include directory $api_dir" \
  "LibTorch's include directory among dtrain_core's"

{ cat "$description"; echo "link_library=torch"; } >"$tmp/library.txt"
planted library "dtrain_core links LibTorch's torch" "LibTorch among dtrain_core's libraries"

{ cat "$description"; echo "precompile_headers=<ATen/ATen.h>"; } >"$tmp/pch.txt"
planted pch "dtrain_core compiles with the precompiled header <ATen/ATen.h>" \
  "a precompiled header for dtrain_core"

# An object of a Makefile build (its depfile beside it) that included ATen.
mkdir -p "$tmp/build/src/CMakeFiles/dtrain_core.dir/core"
object="$tmp/build/src/CMakeFiles/dtrain_core.dir/core/planted.cpp.o"
printf '%s: %s \\\n  %s \\\n  %s\n' "$object" "$1/src/core/errors.cpp" \
  "$torch_dir/ATen/ATen.h" "$1/include/dtrain/errors.h" >"$object.d"
sed -e '/^generator=/d' -e '/^build_dir=/d' -e '/^object=/d' "$description" >"$tmp/header.txt"
printf 'generator=Unix Makefiles\nbuild_dir=%s\nobject=%s\n' "$tmp/build" "$object" \
  >>"$tmp/header.txt"
planted header "core/planted.cpp.o (dtrain_core) includes LibTorch's $torch_dir/ATen/ATen.h" \
  "an object of dtrain_core that includes ATen/ATen.h"

sed "s|^dtrain_run=.*|dtrain_run=$libdtrain|" "$description" >"$tmp/ldd.txt"
planted ldd "loads libtorch" "libdtrain (which links LibTorch) as dtrain-run"

[ -s "$tmp/failures" ] && exit 1
echo "core_without_libtorch_test: passed"
