#!/bin/sh
# Save and load time and bytes per rank of gpt2_train checkpoints, full vs sharded, FSDP at
# 1, 2 and 4 ranks (the tiny preset: 16.1M parameters, fp32 weights + AdamW moments).
#   benchmarks/bench-checkpoint.sh [build dir] [work dir]
set -eu
BUILD=${1:-build}
WORK=${2:-/tmp/dtrain-bench-checkpoint}
TRAIN="$BUILD/examples/gpt2/gpt2_train"
COMMON="--strategy fsdp --model tiny --data random --tokenizer byte --vocab 50257 --batch 1 --ctx 64 --sample_tokens 0 --val_batches 1 --log_every 1"
echo "| ranks | format | save s (rank 0) | bytes written per rank (MiB) | load s (rank 0) | bytes read by rank 0 (MiB) |"
echo "| --- | --- | --- | --- | --- | --- |"
for n in 1 2 4; do
  for fmt in full sharded; do
    rm -rf "$WORK"; mkdir -p "$WORK"
    save=$($TRAIN $COMMON --nproc $n --steps 1 --ckpt_dir "$WORK/ck" --ckpt_format $fmt 2>&1 | grep '^checkpoint:')
    per_rank=$(for f in "$WORK"/ck/step_*/*.safetensors; do
      printf '%s=%.1f ' "$(basename "$f" .safetensors)" "$(stat -c %s "$f" | awk '{print $1/1048576}')"; done)
    load=$($TRAIN $COMMON --nproc $n --steps 2 --ckpt_dir "$WORK/ck" --ckpt_format $fmt --resume 2>&1 | grep '^resume:')
    save_s=$(echo "$save" | sed -E 's/.*written in ([0-9.]+) s.*/\1/')
    load_s=$(echo "$load" | sed -E 's/.*read in ([0-9.]+) s.*/\1/')
    load_mib=$(echo "$load" | sed -E 's/.*\(([0-9.]+) MiB read.*/\1/')
    echo "| $n | $fmt | $save_s | $per_rank | $load_s | $load_mib |"
  done
done
rm -rf "$WORK"
