#!/bin/sh
# scripts/check-example-headers.sh: the examples include only dtrain's public headers. It
# must pass on the tree, and fail, naming file and header, on a copy of examples/ with a
# planted private include (#include "comm/front_end.h") and on one with src/ on an include
# path; so the check itself cannot silently stop checking.
# Usage: examples_public_headers_test.sh SOURCE_DIR
set -u
src="$1"
check="$src/scripts/check-example-headers.sh"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
failures=0
fail() {
  echo "FAIL: $*" >&2
  failures=$((failures + 1))
}

bash "$check" "$src" || fail "the tree's examples include a private header (above)"

# copy NAME: a root whose examples/ is a copy, with the real include/, src/ and tests/.
copy() {
  mkdir -p "$tmp/$1"
  cp -R "$src/examples" "$tmp/$1/examples"
  for d in include src tests; do ln -s "$src/$d" "$tmp/$1/$d"; done
}

copy header
sed -i '1i #include "comm/front_end.h"' "$tmp/header/examples/gpt2/trainer.cpp"
if bash "$check" "$tmp/header" 2>"$tmp/header.err"; then
  fail "a planted #include \"comm/front_end.h\" passed the check"
elif ! grep -q 'examples/gpt2/trainer.cpp:1 includes comm/front_end.h, a private header' "$tmp/header.err"; then
  fail "the planted include failed without naming it: $(cat "$tmp/header.err")"
fi

copy cmake
echo 'target_include_directories(bert_model PRIVATE ${PROJECT_SOURCE_DIR}/src)' \
  >>"$tmp/cmake/examples/bert/CMakeLists.txt"
if bash "$check" "$tmp/cmake" 2>"$tmp/cmake.err"; then
  fail "a planted src/ include path passed the check"
elif ! grep -q "examples/bert/CMakeLists.txt:[0-9]* puts the library's src/ on a path" "$tmp/cmake.err"; then
  fail "the planted include path failed without naming it: $(cat "$tmp/cmake.err")"
fi

[ "$failures" -eq 0 ] || exit 1
echo "examples_public_headers_test: passed"
