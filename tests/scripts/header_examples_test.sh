#!/bin/sh
# scripts/check-header-examples.py: every code example of include/dtrain and README.md is
# compiled in tests/docs/header_examples.cpp. It must pass on the tree, and fail, naming the
# file and line, on a copy with an example edited in its header only, and on one with an
# example outside `// clang-format off` / `on` markers; so the check itself cannot silently
# stop checking.
# Usage: header_examples_test.sh SOURCE_DIR
set -u
src="$1"
check="$src/scripts/check-header-examples.py"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
failures=0
fail() {
  echo "FAIL: $*" >&2
  failures=$((failures + 1))
}

python3 "$check" "$src" || fail "the tree's examples are not all compiled (above)"

# copy NAME: a root with copies of what the check reads.
copy() {
  mkdir -p "$tmp/$1/tests/docs"
  cp -R "$src/include" "$tmp/$1/include"
  cp "$src/README.md" "$tmp/$1/README.md"
  cp "$src/tests/docs/header_examples.cpp" "$tmp/$1/tests/docs/"
}

copy edited
sed -i 's|//   ckpt.wait();  |//   ckpt.wait(1);|' "$tmp/edited/include/dtrain/checkpoint.h"
grep -q 'ckpt.wait(1);' "$tmp/edited/include/dtrain/checkpoint.h" || fail "could not plant the edit"
if python3 "$check" "$tmp/edited" 2>"$tmp/edited.err"; then
  fail "an example edited in checkpoint.h only passed the check"
elif ! grep -q 'include/dtrain/checkpoint.h:[0-9]*: this example is not compiled' "$tmp/edited.err"; then
  fail "the edited example failed without naming it: $(cat "$tmp/edited.err")"
fi

copy unmarked
printf '%s\n' '// Example:' '//' '//   auto w = dtrain::make_widget(comm);' '//' \
  >>"$tmp/unmarked/include/dtrain/work.h"
if python3 "$check" "$tmp/unmarked" 2>"$tmp/unmarked.err"; then
  fail "an unmarked example in work.h passed the check"
elif ! grep -q 'include/dtrain/work.h:[0-9]*: an example outside' "$tmp/unmarked.err"; then
  fail "the unmarked example failed without naming it: $(cat "$tmp/unmarked.err")"
fi

[ "$failures" -eq 0 ] || exit 1
echo "header_examples_test: passed"
