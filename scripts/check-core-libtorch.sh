#!/usr/bin/env bash
# dtrain_core (src/CMakeLists.txt), the objects libdtrain and dtrain-run share, needs no
# LibTorch, and dtrain-run links neither LibTorch nor libdtrain (docs/architecture.md, "Build
# and dependencies"). Five checks, on the description of a build that CMake writes
# (tests/CMakeLists.txt: BUILD/tests/core_without_libtorch.txt, `key=value` lines):
#   1. none of dtrain_core's include directories (its own and its dependencies', less the
#      compiler's `implicit_include_dir=`) is one of LibTorch's (`include_dir=` against
#      `torch_include_dir=`);
#   2. none of the libraries it links is LibTorch's (`link_library=` against `torch_library=`);
#   3. it uses no precompiled header (`precompile_headers=`, `pch_reuse_from=`): dtrain's
#      holds ATen, and what a precompiled header holds is missing from the records below;
#   4. no header its objects were compiled from is LibTorch's (ATen/, c10/, caffe2/, torch/
#      under one of LibTorch's include directories), as the build recorded them: ninja's deps
#      log, else each object's compiler depfile (OBJECT.d). Debian's LibTorch lives in
#      /usr/include, so an #include of it compiles without any include directory: only this
#      check sees it;
#   5. `ldd` of dtrain-run (`dtrain_run=`) names no libtorch*, libc10* or libdtrain*.
# Usage: check-core-libtorch.sh DESCRIPTION. Exit 0 when clean, 1 with one line per violation
# otherwise. tests/scripts/core_without_libtorch_test.sh runs it in CTest (also on planted
# violations).
set -euo pipefail
description="$1"
failures=0
fail() {
  echo "check-core-libtorch: $*" >&2
  failures=$((failures + 1))
}

# values KEY: the description's values of KEY, one a line, empty ones left out.
values() {
  awk -v k="$1=" 'index($0, k) == 1 && length($0) > length(k) { print substr($0, length(k) + 1) }' \
    "$description"
}
one() { values "$1" | awk 'NR == 1'; }
mapfile -t torch_dirs < <(values torch_include_dir)
mapfile -t torch_libs < <(values torch_library)
# CMake writes objects as DIR/./FILE.o; ninja's log names them without the "./".
mapfile -t objects < <(values object | sed 's|/\./|/|g')
generator="$(one generator)"
build_dir="$(one build_dir)"
[ "${#torch_dirs[@]}" -gt 0 ] || fail "the description names no LibTorch include directory"
[ "${#objects[@]}" -gt 0 ] || fail "the description names no object of dtrain_core"

# 1. Include directories; not the compiler's own (/usr/include, where Debian's LibTorch is,
# comes with fmt's target; CMake leaves it out of the command line, and check 4 covers it).
mapfile -t implicit_dirs < <(values implicit_include_dir)
while IFS= read -r dir; do
  for i in "${implicit_dirs[@]}"; do [ "${dir%/}" = "${i%/}" ] && continue 2; done
  for t in "${torch_dirs[@]}"; do
    [ "${dir%/}" = "${t%/}" ] && fail "dtrain_core compiles with LibTorch's include directory $dir"
  done
done < <(values include_dir)

# 2. Libraries: one of LibTorch's as CMake names it, or a file or target called torch*/c10*.
while IFS= read -r lib; do
  name="${lib##*/}"
  name="${name##*::}"
  hit=0
  for t in "${torch_libs[@]}"; do [ "$lib" = "$t" ] && hit=1; done
  case "$name" in torch | torch_* | libtorch* | c10 | c10_* | libc10*) hit=1 ;; esac
  [ "$hit" = 1 ] && fail "dtrain_core links LibTorch's $lib"
done < <(values link_library)

# 3. Precompiled headers.
while IFS= read -r h; do
  fail "dtrain_core compiles with the precompiled header $h"
done < <(values precompile_headers)
while IFS= read -r t; do
  fail "dtrain_core reuses the precompiled headers of $t"
done < <(values pch_reuse_from)

# 4. Headers: every object's recorded dependencies.
# is_torch_header PATH: under one of LibTorch's include directories, in one of its trees.
is_torch_header() {
  local t rest
  for t in "${torch_dirs[@]}"; do
    case "$1" in "${t%/}"/*) ;; *) continue ;; esac
    rest="${1#"${t%/}"/}"
    case "$rest" in ATen/* | c10/* | caffe2/* | torch/*) return 0 ;; esac
  done
  return 1
}
deps="$(mktemp)"
trap 'rm -f "$deps"' EXIT
# Lines "OBJECT<TAB>HEADER", one per recorded dependency; "OBJECT<TAB>" alone when none is.
if [[ "$generator" == Ninja* ]]; then
  rel=()
  for o in "${objects[@]}"; do rel+=("${o#"${build_dir%/}"/}"); done
  if ! log="$("$(one make_program)" -C "$build_dir" -t deps "${rel[@]}" 2>&1)"; then
    fail "ninja's deps log of $build_dir does not have dtrain_core's objects: $log"
  fi
  printf '%s\n' "$log" |
    awk '/^[^ \t]/ { obj = $0; sub(/: .*/, "", obj); if ($0 ~ /#deps [1-9]/) next; print obj "\t"; next }
         /^[ \t]+[^ \t]/ { h = $0; sub(/^[ \t]+/, "", h); print obj "\t" h }' >"$deps"
else
  for o in "${objects[@]}"; do
    if [ -f "$o.d" ]; then
      # A make rule: "OBJECT: DEP DEP \" continued over lines; the first token is the target.
      tr -s ' \\\n\t' '\n' <"$o.d" | sed '1d;/^$/d' | sed "s|^|${o}\t|" >>"$deps"
    else
      printf '%s\t\n' "$o" >>"$deps"
    fi
  done
fi
headers=0
for o in "${objects[@]}"; do
  key="${o#"${build_dir%/}"/}"
  n="$(awk -F'\t' -v o="$o" -v k="$key" '($1 == o || $1 == k) && $2 != "" { n++ } END { print n + 0 }' "$deps")"
  [ "$n" -gt 0 ] || fail "the build recorded no headers for $o (build dtrain_core first)"
  headers=$((headers + n))
done
# One line per object: the first LibTorch header it reached (the one it includes, or the
# header of ours that does), and how many more.
declare -A first more
order=()
while IFS=$'\t' read -r obj header; do
  [ -n "$header" ] || continue
  is_torch_header "$header" || continue
  if [ -z "${first[$obj]:-}" ]; then
    first[$obj]="$header"
    more[$obj]=0
    order+=("$obj")
  else
    more[$obj]=$((more[$obj] + 1))
  fi
done <"$deps"
for obj in "${order[@]}"; do
  fail "${obj##*/dtrain_core.dir/} (dtrain_core) includes LibTorch's ${first[$obj]}" \
    "(and ${more[$obj]} more of its headers)"
done

# 5. What dtrain-run loads.
dtrain_run="$(one dtrain_run)"
if ! libs="$(ldd "$dtrain_run" 2>&1)"; then
  fail "ldd $dtrain_run failed: $libs"
else
  while IFS= read -r line; do
    fail "$dtrain_run loads ${line%% *}; it must need neither LibTorch nor libdtrain"
  done < <(printf '%s\n' "$libs" | sed 's/^[[:space:]]*//' | grep -E '^lib(torch|c10|dtrain)[^ ]*\.so' || true)
fi

if [ "$failures" -gt 0 ]; then
  echo "check-core-libtorch: $failures violation(s)" >&2
  exit 1
fi
echo "check-core-libtorch: dtrain_core's ${#objects[@]} objects ($headers headers) and dtrain-run use no LibTorch"
