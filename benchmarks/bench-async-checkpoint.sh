#!/bin/sh
# How long a checkpoint blocks the training step, synchronous vs background (--ckpt_async),
# for the same state (#32): one gpt2_train run per model and mode, a checkpoint after every
# step, the blocked time of each save read from the trainer's own lines ("checkpoint: step N
# to DIR (... written in S s ...)" for a synchronous save, "checkpoint: step N copied in S s"
# for a background one, plus the time that save waited for the previous background write,
# which blocks the step too; the background write's own time is reported as well).
# A checkpoint every CKPT_EVERY steps (default 5): with saves closer together than a write
# takes, each save waits for the previous one, and the wait is counted.
#   benchmarks/bench-async-checkpoint.sh [build dir] [work dir]
# MODELS (default "tiny gpt2-medium"), STEPS (default 4), STRATEGY (default single; fsdp with
# NPROC 2 halves the memory per rank) choose the runs. gpt2-medium (355M) single needs about
# 6 GB for the model, gradients and AdamW plus 4.3 GB for a background save's host copy.
# Prints a table (mean over the saves after the first) and one "RESULT model sync async"
# line per model (mean blocked seconds).
set -eu
BUILD=${1:-build}
WORK=${2:-/tmp/dtrain-bench-async-checkpoint}
TRAIN="$BUILD/examples/gpt2/gpt2_train"
MODELS=${MODELS:-tiny gpt2-medium}
CKPT_EVERY=${CKPT_EVERY:-5}
STEPS=${STEPS:-$((3 * CKPT_EVERY))}
STRATEGY=${STRATEGY:-single}
NPROC=${NPROC:-1}
COMMON="--strategy $STRATEGY --nproc $NPROC --data random --tokenizer byte --vocab 50257 --batch 1 --ctx 64 --steps $STEPS --warmup_steps 1 --sample_tokens 0 --val_batches 1 --log_every 1 --ckpt_every $CKPT_EVERY --ckpt_keep 1"
lscpu | sed -n 's/^Model name: *//p'
echo "strategy $STRATEGY x $NPROC, $STEPS steps, a checkpoint every $CKPT_EVERY steps (the first save not counted)"
echo "| model | mode | blocked per save (s) | background write (s) | step time (s) | state written (MiB) |"
echo "| --- | --- | --- | --- | --- | --- |"
mean_after_first() { awk 'NR > 1 { s += $1; n++ } END { if (n) printf "%.3f", s / n; else print "nan" }'; }
for model in $MODELS; do
  for mode in sync async; do
    rm -rf "$WORK"
    mkdir -p "$WORK"
    flag=""
    [ "$mode" = async ] && flag="--ckpt_async"
    # shellcheck disable=SC2086  # COMMON: words without spaces
    $TRAIN $COMMON --model "$model" --ckpt_dir "$WORK/ck" $flag >"$WORK/out" 2>&1 ||
      { tail -n 20 "$WORK/out"; exit 1; }
    if [ "$mode" = sync ]; then
      blocked=$(sed -n 's/^checkpoint: step [0-9]* to .* written in \([0-9.]*\) s on rank 0.*/\1/p' "$WORK/out" | mean_after_first)
      written=$blocked
      mib=$(sed -n 's/^checkpoint: step [0-9]* to .*(\([0-9.]*\) MiB written.*/\1/p' "$WORK/out" | tail -n1)
      sync_s=$blocked
    else
      blocked=$(sed -n 's/^checkpoint: step [0-9]* copied in \([0-9.]*\) s on rank 0 after \([0-9.]*\) s waiting.*/\1 \2/p' "$WORK/out" |
        awk '{ print $1 + $2 }' | mean_after_first)
      written=$(sed -n 's/^checkpoint: .* written in the background ([0-9.]* MiB in \([0-9.]*\) s.*/\1/p' "$WORK/out" | mean_after_first)
      mib=$(sed -n 's/^checkpoint: .* written in the background (\([0-9.]*\) MiB.*/\1/p' "$WORK/out" | tail -n1)
      async_s=$blocked
    fi
    step_s=$(sed -n 's/^step *[0-9]*.* \([0-9.]*\) s\/step.*/\1/p' "$WORK/out" | mean_after_first)
    echo "| $model | $mode | $blocked | $written | $step_s | $mib |"
  done
  echo "RESULT $model $sync_s $async_s"
done
rm -rf "$WORK"
