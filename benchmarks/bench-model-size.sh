#!/bin/sh
# How large a model each strategy trains on this machine: for single, DDP x4 and FSDP x4
# (full shard), the peak RSS per rank of a few training steps (batch 1, ctx 128, fp32,
# AdamW) for the GPT-2 presets gpt2 (124M), gpt2-medium (350M) and gpt2-large (774M), next
# to the planner's estimate. Each run gets --memory_per_rank = the machine's budget / ranks,
# so the planner refuses what cannot fit ("refused (estimate X GiB)") instead of the
# kernel's OOM killer. Then FSDP x4 gpt2-large: the time to build, initialise and shard the
# model (deferred initialisation), and --init_from of a gpt2-large file (make-hf-weights.sh)
# streamed into the shards, with its peak RSS per rank.
# Writes OUT/model-size.md (markdown table) and OUT/model-size.csv.
#   benchmarks/bench-model-size.sh [build dir] [out dir]
# Environment: PRESETS (default "gpt2 gpt2-medium gpt2-large"), STEPS (2), MEM_GIB (the
# machine's budget in GiB; default MemAvailable), INIT_PRESET (gpt2-large; "none" skips the
# init and --init_from runs).
set -eu
BUILD=${1:-build}
OUT=${2:-model-size}
PRESETS=${PRESETS:-"gpt2 gpt2-medium gpt2-large"}
STEPS=${STEPS:-2}
INIT_PRESET=${INIT_PRESET:-gpt2-large}
TRAIN="$BUILD/examples/gpt2/gpt2_train"
HERE=$(dirname "$0")
if [ -z "${MEM_GIB:-}" ]; then
  MEM_GIB=$(awk '/^MemAvailable:/ {printf "%.2f", $2 / 1048576}' /proc/meminfo)
fi
mkdir -p "$OUT"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
COMMON="--data random --tokenizer byte --vocab 50257 --ctx 128 --batch 1 --steps $STEPS \
--precision fp32 --val_batches 0 --sample_tokens 0 --log_every 1"
MD="$OUT/model-size.md"
CSV="$OUT/model-size.csv"

# run NAME ARGS...: gpt2_train's output in $TMP/NAME.log, metrics in $TMP/NAME.jsonl.
run() {
  name=$1
  shift
  rc=0
  "$TRAIN" $COMMON "$@" --metrics_out "$TMP/$name.jsonl" > "$TMP/$name.log" 2>&1 || rc=$?
  return $rc
}
# The planner's estimate (GiB per rank): accepted or refused.
estimate() {
  sed -n -e 's/.*memory: estimated peak \([0-9.]*\) GiB.*/\1/p' \
    -e 's/.*needs an estimated \([0-9.]*\) GiB.*/\1/p' "$1" | head -1
}
# Peak RSS of the last step record: the largest rank's, and every rank's (MiB).
peak_max() {
  grep '"kind": "step"' "$1" | tail -1 | sed -E 's/.*"peak_rss_mib": ([0-9.e+-]+).*/\1/' |
    xargs printf '%.0f'
}
peak_ranks() {
  grep '"kind": "step"' "$1" | tail -1 |
    sed -E 's/.*"peak_rss_mib_per_rank": \[([^]]*)\].*/\1/' |
    tr ',' '\n' | xargs printf '%.0f ' | sed 's/ $//'
}

echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; budget $MEM_GIB GiB" |
  tee "$MD"
{
  echo
  echo "| preset | strategy | ranks | --memory_per_rank (GiB) | estimate (GiB/rank) | peak RSS (MiB/rank, max) | every rank (MiB) | error (%) |"
  echo "| --- | --- | --- | --- | --- | --- | --- | --- |"
} >> "$MD"
echo "preset,strategy,ranks,memory_per_rank_gib,estimate_gib,peak_rss_mib_max,peak_rss_mib_per_rank,status" > "$CSV"
for preset in $PRESETS; do
  for s in single ddp fsdp; do
    n=4
    [ $s = single ] && n=1
    budget=$(echo "$MEM_GIB $n" | awk '{printf "%.2f", $1 / $2}')
    name="$preset-$s"
    args="--model $preset --strategy $s --memory_per_rank $budget"
    [ $s = single ] || args="$args --nproc $n --threads 1"
    [ $s = fsdp ] && args="$args --sharding full"
    if run "$name" $args; then
      est=$(estimate "$TMP/$name.log")
      peak=$(peak_max "$TMP/$name.jsonl")
      ranks=$(peak_ranks "$TMP/$name.jsonl")
      err=$(echo "$est $peak" | awk '{ if ($2 > 0) printf "%+.0f", ($1 * 1024 - $2) / $2 * 100 }')
      echo "| $preset | $s | $n | $budget | $est | $peak | $ranks | $err |" >> "$MD"
      echo "$preset,$s,$n,$budget,$est,$peak,$ranks,ok" >> "$CSV"
    elif grep -q "needs an estimated" "$TMP/$name.log"; then
      est=$(estimate "$TMP/$name.log")
      echo "| $preset | $s | $n | $budget | refused (estimate $est GiB) | | | |" >> "$MD"
      echo "$preset,$s,$n,$budget,$est,,,refused" >> "$CSV"
    else
      echo "| $preset | $s | $n | $budget | failed: see below | | | |" >> "$MD"
      echo "$preset,$s,$n,$budget,,,,failed" >> "$CSV"
      echo "--- $name failed:" >&2
      tail -20 "$TMP/$name.log" >&2
    fi
  done
done

if [ "$INIT_PRESET" != none ]; then
  budget=$(echo "$MEM_GIB" | awk '{printf "%.2f", $1 / 4}')
  fsdp4="--model $INIT_PRESET --strategy fsdp --sharding full --nproc 4 --threads 1 --memory_per_rank $budget"
  {
    echo
    echo "| FSDP x4 $INIT_PRESET | seconds to build, initialise and shard | peak RSS (MiB/rank, max) | every rank (MiB) |"
    echo "| --- | --- | --- | --- |"
  } >> "$MD"
  if run init $fsdp4; then
    secs=$(sed -n 's/.*model: built, initialised and wrapped in \([0-9.]*\) s.*/\1/p' "$TMP/init.log")
    echo "| deferred initialisation | $secs | $(peak_max "$TMP/init.jsonl") | $(peak_ranks "$TMP/init.jsonl") |" >> "$MD"
    echo "$INIT_PRESET,fsdp-init,4,$budget,,$(peak_max "$TMP/init.jsonl"),$(peak_ranks "$TMP/init.jsonl"),init_s=$secs" >> "$CSV"
  else
    echo "| deferred initialisation | failed | | |" >> "$MD"
    tail -20 "$TMP/init.log" >&2
  fi
  weights="$TMP/$INIT_PRESET.safetensors"
  if sh "$HERE/make-hf-weights.sh" "$INIT_PRESET" "$weights" "$BUILD" 4 > "$TMP/make.log" 2>&1 &&
    run init_from $fsdp4 --init_from "$weights"; then
    secs=$(sed -n 's/.*model: built, initialised and wrapped in \([0-9.]*\) s.*/\1/p' "$TMP/init_from.log")
    echo "| --init_from (streamed) | $secs | $(peak_max "$TMP/init_from.jsonl") | $(peak_ranks "$TMP/init_from.jsonl") |" >> "$MD"
    echo "$INIT_PRESET,fsdp-init_from,4,$budget,,$(peak_max "$TMP/init_from.jsonl"),$(peak_ranks "$TMP/init_from.jsonl"),init_s=$secs" >> "$CSV"
  else
    echo "| --init_from (streamed) | failed | | |" >> "$MD"
    tail -20 "$TMP/make.log" "$TMP/init_from.log" >&2 || true
  fi
fi
cat "$MD"
echo "csv: $CSV"
