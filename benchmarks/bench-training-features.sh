#!/bin/sh
# gpt2_train's training features against their baselines, measured in the same run:
#  1. --precision bf16 (ATen autocast) vs fp32: tokens/s of the tiny preset (16.1M
#     parameters, ctx 128), single (batch 8) and DDP x2 (batch 4 per rank), runs alternating.
#  2. --activation_checkpointing vs none at a shape where activations dominate (the tiny
#     preset at ctx 512, batch 8 single): peak RSS and tokens/s.
# Says whether the CPU has native bf16 instructions (AVX-512 BF16 / AMX): it decides the gain.
#   benchmarks/bench-training-features.sh [build dir] [rounds]
set -eu
BUILD=${1:-build}
ROUNDS=${2:-3}
TRAIN="$BUILD/examples/gpt2/gpt2_train"
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
COMMON="--model tiny --data random --tokenizer byte --vocab 50257 --sample_tokens 0 --val_batches 0"
# Mean tokens/s over the last 10 step records of $OUT/m.jsonl; the last peak RSS (MiB).
tokens_per_s() {
  grep '"kind": "step"' "$OUT/m.jsonl" | tail -10 |
    sed -E 's/.*"tokens_per_s": ([0-9.e+-]+).*/\1/' | awk '{s+=$1} END {printf "%.0f", s/NR}'
}
peak_rss() {
  grep '"kind": "step"' "$OUT/m.jsonl" | tail -1 |
    sed -E 's/.*"peak_rss_mib": ([0-9.e+-]+).*/\1/' | xargs printf '%.0f'
}
flags=$(grep -m1 '^flags' /proc/cpuinfo)
native=""
for f in avx512_bf16 amx_bf16; do
  case "$flags" in *" $f"*) native="$native $f" ;; esac
done
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; native bf16:${native:- none}"

echo
echo "| run | precision | tokens/s (mean of last 10 of 20 steps), one per round | mean | vs fp32 |"
echo "| --- | --- | --- | --- | --- |"
for run in "single --batch 8" "ddp --nproc 2 --batch 4"; do
  r_fp32=""; r_bf16=""
  i=0
  while [ $i -lt "$ROUNDS" ]; do
    for p in fp32 bf16; do
      "$TRAIN" $COMMON --strategy $run --steps 20 --precision $p \
        --metrics_out "$OUT/m.jsonl" > "$OUT/log" 2>&1
      [ -z "${blas_line:-}" ] && blas_line=$(grep -m1 '^blas:' "$OUT/log" || echo "blas: not reported")
      eval "r_$p=\"\$r_$p $(tokens_per_s)\""
    done
    i=$((i + 1))
  done
  m_fp32=$(echo $r_fp32 | awk '{for (i = 1; i <= NF; ++i) s += $i; printf "%.0f", s / NF}')
  m_bf16=$(echo $r_bf16 | awk '{for (i = 1; i <= NF; ++i) s += $i; printf "%.0f", s / NF}')
  name=$(echo "$run" | cut -d' ' -f1)
  echo "| $name | fp32 |$r_fp32 | $m_fp32 | 1.00 |"
  echo "| $name | bf16 |$r_bf16 | $m_bf16 | $(awk "BEGIN {printf \"%.2f\", $m_bf16 / $m_fp32}") |"
done

echo
echo "| activation checkpointing (single, ctx 512, batch 8) | peak RSS (MiB) | tokens/s (mean of last 10 of 12 steps), one per round |"
echo "| --- | --- | --- |"
for ac in false true; do
  rss=""; tps=""
  i=0
  while [ $i -lt "$ROUNDS" ]; do
    "$TRAIN" $COMMON --strategy single --ctx 512 --batch 8 --steps 12 \
      --activation_checkpointing=$ac --metrics_out "$OUT/m.jsonl" > "$OUT/log" 2>&1
    rss="$rss $(peak_rss)"; tps="$tps $(tokens_per_s)"
    i=$((i + 1))
  done
  echo "| $ac |$rss |$tps |"
done
echo
echo "$blas_line"
