#!/bin/sh
# scripts/run-comparison.sh's choice of variants, checked without training (DRY_RUN=1: the
# script probes the CPU with the built dtrain-run, prints its runs, writes the report's
# preamble and stops). A CPU without native bf16 is pretended with the test hook
# DTRAIN_HIDE_NATIVE_BF16=1 (include/dtrain/blas.h), so every case runs on any CPU:
#   - the default skips fsdp-bf16 and the report says so in one line naming the missing feature;
#   - VARIANTS set by the user still runs it, and the report says its bf16 is emulated;
#   - on GPUs (DEVICE=cuda) and with native bf16 nothing is skipped.
# Usage: comparison_variants_test.sh SOURCE_DIR BUILD_DIR
set -u
src="$1"
build="$2"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
failures=0

fail() {
  echo "FAIL: $*" >&2
  failures=$((failures + 1))
}

# plan NAME [VAR=VALUE...]: the dry run with those variables, into $tmp/NAME/ (README.md,
# env.txt) and $tmp/NAME.out (its "run NAME: FLAGS" lines). Variables the caller's environment
# may hold that change the plan are cleared first.
plan() {
  name="$1"
  shift
  env -u VARIANTS -u MODEL -u DEVICE -u NPROC -u GLOBAL_BATCH -u TRAIN_ARGS -u DTRAIN_HIDE_NATIVE_BF16 \
    "$@" DRY_RUN=1 DTRAIN_BUILD_DIR="$build" OUT="$tmp/$name" \
    bash "$src/scripts/run-comparison.sh" >"$tmp/$name.out" 2>"$tmp/$name.err" ||
    fail "$name: the dry run failed: $(cat "$tmp/$name.err")"
}

# runs NAME: the planned runs' names, space-separated.
runs() { sed -n 's/^run \([^:]*\):.*/\1/p' "$tmp/$1.out" | tr '\n' ' ' | sed 's/ $//'; }

expect_runs() {
  got="$(runs "$1")"
  [ "$got" = "$2" ] || fail "$1: runs '$got', want '$2'"
}

# bf16_lines NAME: lines of the report that name the missing feature.
bf16_lines() { grep -c 'missing: avx512_bf16 or amx_bf16' "$tmp/$1/README.md"; }

# 1. No native bf16, default variants: fsdp-bf16 skipped; one line in the report, and the
#    same in env.txt and on stderr.
plan hidden DTRAIN_HIDE_NATIVE_BF16=1
expect_runs hidden "single ddp fsdp ddp-ps"
[ "$(bf16_lines hidden)" = 1 ] || fail "hidden: want one line naming the missing feature: $(cat "$tmp/hidden/README.md")"
grep -q '^Skipped: fsdp-bf16\. This CPU has no native bf16 (missing: avx512_bf16 or amx_bf16)' \
  "$tmp/hidden/README.md" || fail "hidden: no skip line in the report: $(cat "$tmp/hidden/README.md")"
grep -q 'VARIANTS="ddp-ps fsdp-bf16" runs it anyway' "$tmp/hidden/README.md" ||
  fail "hidden: the report does not say how to force it"
grep -q '^cpu_bf16_native: false' "$tmp/hidden/env.txt" || fail "hidden: env.txt lacks cpu_bf16_native: false"
grep -q 'Skipped: fsdp-bf16' "$tmp/hidden.err" || fail "hidden: nothing said on stderr"

# 2. VARIANTS set by the user: run as asked, and the report says the bf16 is emulated.
plan forced DTRAIN_HIDE_NATIVE_BF16=1 "VARIANTS=ddp-ps fsdp-bf16"
expect_runs forced "single ddp fsdp ddp-ps fsdp-bf16"
grep -q '^run fsdp-bf16: .*--precision bf16' "$tmp/forced.out" || fail "forced: fsdp-bf16 lacks --precision bf16"
grep -q '^fsdp-bf16 ran on a CPU without native bf16 (missing: avx512_bf16 or amx_bf16), as VARIANTS asked' \
  "$tmp/forced/README.md" || fail "forced: no emulation line: $(cat "$tmp/forced/README.md")"
grep -q 'Skipped' "$tmp/forced/README.md" && fail "forced: the report says skipped"

# 3. VARIANTS= (empty): the main three, nothing to say about bf16.
plan none DTRAIN_HIDE_NATIVE_BF16=1 VARIANTS=
expect_runs none "single ddp fsdp"
[ "$(bf16_lines none)" = 0 ] || fail "none: a bf16 line without a bf16 run"

# 4. On GPUs the CPU's bf16 does not matter.
plan cuda DTRAIN_HIDE_NATIVE_BF16=1 DEVICE=cuda
expect_runs cuda "single ddp fsdp ddp-ps fsdp-bf16"
[ "$(bf16_lines cuda)" = 0 ] || fail "cuda: a bf16 line on GPUs"

# 5. This CPU as probed: the default follows cpu_bf16_native.
plan probed
if grep -q '^cpu_bf16_native: true' "$tmp/probed/env.txt"; then
  expect_runs probed "single ddp fsdp ddp-ps fsdp-bf16"
  [ "$(bf16_lines probed)" = 0 ] || fail "probed: a bf16 line with native bf16"
elif grep -q '^cpu_bf16_native: false' "$tmp/probed/env.txt"; then
  expect_runs probed "single ddp fsdp ddp-ps"
else
  fail "probed: env.txt has no cpu_bf16_native line: $(cat "$tmp/probed/env.txt")"
fi

if [ "$failures" -ne 0 ]; then
  echo "$failures check(s) failed" >&2
  exit 1
fi
echo "run-comparison variants: all checks passed"
