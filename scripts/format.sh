#!/usr/bin/env bash
# Formats dtrain's C++ sources with the repository's .clang-format (clang-format 14, Debian's
# `clang-format-14`), or with --check fails listing the files that differ from it (CI).
#   scripts/format.sh           rewrite every tracked .h/.cpp in place
#   scripts/format.sh --check   change nothing; exit 1 naming each unformatted file
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
"$root/scripts/install-deps.sh"
fmt=clang-format-14
mode="${1:-fix}"
mapfile -t files < <(git ls-files '*.h' '*.cpp' '*.cc' '*.hpp')
if [ "$mode" = --check ]; then
  bad=()
  for f in "${files[@]}"; do
    "$fmt" --dry-run --Werror "$f" >/dev/null 2>&1 || bad+=("$f")
  done
  if [ "${#bad[@]}" -gt 0 ]; then
    echo "format: ${#bad[@]} file(s) differ from .clang-format (run scripts/format.sh):" >&2
    printf '  %s\n' "${bad[@]}" >&2
    exit 1
  fi
  echo "format: ${#files[@]} files match .clang-format" >&2
elif [ "$mode" = fix ]; then
  "$fmt" -i "${files[@]}"
else
  echo "usage: scripts/format.sh [--check]" >&2
  exit 2
fi
