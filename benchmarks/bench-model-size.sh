#!/bin/sh
# How large a model each strategy trains on this machine (issue 30): for single, DDP x4 and
# FSDP x4 (full shard), the peak RSS per rank of 2 training steps (batch 1, ctx 128, fp32,
# AdamW) for the GPT-2 presets gpt2 (124M), gpt2-medium (350M) and gpt2-large (774M), next
# to the planner's estimate. Each run gets --memory_per_rank = the machine's budget / ranks,
# so the planner refuses what cannot fit ("refused (estimate X GiB)") instead of the
# kernel's OOM killer. Every run's setup line gives the time to build, initialise and
# shard the model and every rank's peak RSS until then.
#   benchmarks/bench-model-size.sh [build dir] [out dir]
# Parts (PARTS, default "train init_from refuse"), each run appending its log to OUT/runs/:
#   train      PRESETS x STRATEGIES (default "gpt2 gpt2-medium gpt2-large" x "single ddp fsdp")
#   init_from  FSDP x4 INIT_PRESET (gpt2-large) --init_from a file make-hf-weights.sh writes
#              (kept as OUT/INIT_PRESET.safetensors while the run needs it, then removed)
#   refuse     single and DDP x4 INIT_PRESET with --memory_per_rank REFUSE_GIB (4): refused
#              up front by the planner
#   fit        FSDP x4 INIT_PRESET with --activation_checkpointing at --memory_per_rank
#              REFUSE_GIB: what the planner accepts within that budget (not a default part)
# Then benchmarks/model-size-table.py OUT writes OUT/model-size.{md,csv,json} from every run
# in OUT/runs (so the parts can run as separate commands, one preset at a time).
# Environment: STEPS (2), MEM_GIB (the machine's budget in GiB; default MemAvailable).
set -eu
BUILD=${1:-build}
OUT=${2:-model-size}
PRESETS=${PRESETS:-"gpt2 gpt2-medium gpt2-large"}
STRATEGIES=${STRATEGIES:-"single ddp fsdp"}
PARTS=${PARTS:-"train init_from refuse"}
STEPS=${STEPS:-2}
INIT_PRESET=${INIT_PRESET:-gpt2-large}
REFUSE_GIB=${REFUSE_GIB:-4}
TRAIN="$BUILD/examples/gpt2/gpt2_train"
HERE=$(dirname "$0")
if [ -z "${MEM_GIB:-}" ]; then
  MEM_GIB=$(awk '/^MemAvailable:/ {printf "%.2f", $2 / 1048576}' /proc/meminfo)
fi
RUNS="$OUT/runs"
mkdir -p "$RUNS"
COMMON="--data random --tokenizer byte --vocab 50257 --ctx 128 --batch 1 --steps $STEPS \
--precision fp32 --val_batches 1 --sample_tokens 0 --log_every 1"
{
  echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores"
  echo "memory: $(free -g | awk '/^Mem:/ {print $2 " GiB total, " $7 " GiB available"}')"
  echo "commit: $(git -C "$HERE" rev-parse --short HEAD 2>/dev/null || echo unknown)"
} > "$RUNS/machine.txt"

# run NAME ARGS...: gpt2_train's output in $RUNS/NAME.log, metrics in NAME.jsonl, the
# command in NAME.cmd, the exit status in NAME.rc; the same name again replaces the run.
run() {
  name=$1
  shift
  rm -f "$RUNS/$name".*
  echo "$TRAIN $COMMON $* --metrics_out $RUNS/$name.jsonl" > "$RUNS/$name.cmd"
  rc=0
  # shellcheck disable=SC2086
  "$TRAIN" $COMMON "$@" --metrics_out "$RUNS/$name.jsonl" > "$RUNS/$name.log" 2>&1 || rc=$?
  echo "$rc" > "$RUNS/$name.rc"
  echo "$name: exit $rc ($(grep -c '"kind": "step"' "$RUNS/$name.jsonl" 2>/dev/null || echo 0) steps)"
}

ranks_args() {  # strategy -> ranks and flags
  case $1 in
    single) echo "1 --strategy single" ;;
    ddp) echo "4 --strategy ddp --nproc 4 --threads 1" ;;
    fsdp) echo "4 --strategy fsdp --sharding full --nproc 4 --threads 1" ;;
    *) echo "unknown strategy $1" >&2 && exit 2 ;;
  esac
}

for part in $PARTS; do
  case $part in
    train)
      for preset in $PRESETS; do
        for s in $STRATEGIES; do
          set -- $(ranks_args "$s")
          n=$1
          shift
          budget=$(echo "$MEM_GIB $n" | awk '{printf "%.2f", $1 / $2}')
          run "train-$preset-$s" --model "$preset" "$@" --memory_per_rank "$budget"
        done
      done
      ;;
    init_from)
      budget=$(echo "$MEM_GIB" | awk '{printf "%.2f", $1 / 4}')
      weights="$OUT/$INIT_PRESET.safetensors"
      sh "$HERE/make-hf-weights.sh" "$INIT_PRESET" "$weights" "$BUILD" 4 > "$RUNS/make-hf-weights.log" 2>&1
      set -- $(ranks_args fsdp)
      shift
      run "init_from-$INIT_PRESET-fsdp" --model "$INIT_PRESET" "$@" --memory_per_rank "$budget" \
        --init_from "$weights"
      rm -f "$weights"
      ;;
    fit)
      set -- $(ranks_args fsdp)
      shift
      run "fit-$INIT_PRESET-fsdp" --model "$INIT_PRESET" "$@" --memory_per_rank "$REFUSE_GIB" \
        --activation_checkpointing
      ;;
    refuse)
      for s in single ddp; do
        set -- $(ranks_args "$s")
        shift
        run "refuse-$INIT_PRESET-$s" --model "$INIT_PRESET" "$@" --memory_per_rank "$REFUSE_GIB"
      done
      ;;
    *)
      echo "unknown part $part (train, init_from, refuse, fit)" >&2
      exit 2
      ;;
  esac
done
python3 "$HERE/model-size-table.py" "$OUT"
