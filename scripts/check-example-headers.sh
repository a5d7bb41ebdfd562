#!/usr/bin/env bash
# The examples build against dtrain's public headers only (docs/architecture.md): every
# #include in examples/ must be a public header (dtrain/..., in include/dtrain), a file of the
# examples themselves (examples/*/), test support (tests/support, from an example's tests/)
# or a header from outside the project; never a header of the library's src/. No
# CMakeLists.txt under examples/ may put src/ on an include path.
# Usage: check-example-headers.sh [ROOT] (default: this checkout). Exit 0 when clean,
# 1 with one line per violation otherwise. tests/scripts/examples_public_headers_test.sh runs
# it in CTest (also on planted violations).
set -euo pipefail
root="${1:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
cd "$root"
failures=0
fail() {
  echo "check-example-headers: $*" >&2
  failures=$((failures + 1))
}

while IFS= read -r -d '' file; do
  dir="$(dirname "$file")"
  # `#include "X"` and `#include <X>`, with the line number.
  while IFS=: read -r line header; do
    [ -n "$header" ] || continue
    case "$header" in
      dtrain/config.h) continue ;;  # generated into the build (and install) tree
      dtrain/*)
        [ -f "include/$header" ] ||
          fail "$file:$line includes $header, which is not a public header (include/dtrain)"
        continue
        ;;
    esac
    [ -f "$dir/$header" ] && continue
    found=0
    for d in examples/*/; do
      if [ -f "$d$header" ]; then found=1; break; fi
    done
    [ "$found" = 1 ] && continue
    case "$file" in
      */tests/*) [ -f "tests/$header" ] && continue ;;
    esac
    first="${header%%/*}"
    if [ -f "src/$header" ] || { [ "$first" != "$header" ] && [ -d "src/$first" ]; }; then
      fail "$file:$line includes $header, a private header of the library (src/); use or add a public header in include/dtrain"
    fi
  done < <(grep -n '^[[:space:]]*#[[:space:]]*include' "$file" |
             sed -n 's/^\([0-9]*\):[[:space:]]*#[[:space:]]*include[[:space:]]*[<"]\([^>"]*\)[>"].*/\1:\2/p')
done < <(find examples -type f \( -name '*.h' -o -name '*.hpp' -o -name '*.cpp' -o -name '*.cc' \) -print0)

# An include path into src/ (PROJECT_SOURCE_DIR/src, CMAKE_SOURCE_DIR/src, ../src, ...),
# outside comments.
while IFS= read -r -d '' file; do
  while IFS= read -r hit; do
    fail "$file:${hit%%:*} puts the library's src/ on a path: ${hit#*:}"
  done < <(sed 's/#.*//' "$file" | grep -nE '(\}|\.\.|^|[[:space:]])/?src(/|[[:space:]]|\)|$)' || true)
done < <(find examples -name CMakeLists.txt -print0)

if [ "$failures" -gt 0 ]; then
  echo "check-example-headers: $failures violation(s)" >&2
  exit 1
fi
echo "check-example-headers: every include in examples/ is public, the examples' own or external"
