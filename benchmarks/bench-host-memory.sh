#!/bin/sh
# Peak RSS per rank and throughput of gpt2_train with --malloc_tuning on (dtrain's default:
# glibc serves blocks >= 64 KiB with mmap and trims the heap), off (glibc's defaults), and
# off with jemalloc preloaded, for DDP and FSDP at 4 ranks (8 layers, dim 512, ctx 64,
# batch 2: the shape of issue 16), then tokens/s of the tiny preset single and DDP x2 with
# tuning on and off, alternating runs.
#   benchmarks/bench-host-memory.sh [build dir] [rounds]
set -eu
BUILD=${1:-build}
ROUNDS=${2:-3}
TRAIN="$BUILD/examples/gpt2/gpt2_train"
JEMALLOC=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
COMMON="--data random --tokenizer byte --vocab 50257 --sample_tokens 0 --val_batches 0 --threads 1"
last() { grep '"kind": "step"' "$1" | tail -1; }
field() { sed -E "s/.*\"$2\": ([0-9.e+-]+).*/\1/" "$1"; }
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores"
echo "| strategy x4 | allocator | peak RSS per rank (MiB, max) | model state (MiB) |"
echo "| --- | --- | --- | --- |"
for s in ddp fsdp; do
  for mode in on off jemalloc; do
    pre=""; tune=true
    [ $mode = off ] && tune=false
    if [ $mode = jemalloc ]; then
      if [ ! -f "$JEMALLOC" ]; then echo "| $s | jemalloc | (apt install libjemalloc2 to compare) | |"; continue; fi
      tune=false; pre="LD_PRELOAD=$JEMALLOC"
    fi
    env $pre "$TRAIN" $COMMON --strategy $s --nproc 4 --layers 8 --heads 8 --dim 512 --ctx 64 \
      --batch 2 --steps 5 --malloc_tuning=$tune --metrics_out "$OUT/m.jsonl" > "$OUT/log" 2>&1
    [ $s$mode = ddpon ] && blas_line=$(grep -m1 '^blas:' "$OUT/log" || echo "blas: not reported")
    last "$OUT/m.jsonl" > "$OUT/l"
    echo "| $s | $mode | $(field "$OUT/l" peak_rss_mib | xargs printf '%.0f') | $(field "$OUT/l" model_state_mib | xargs printf '%.0f') |"
  done
done
echo
echo "| run | malloc_tuning | tokens/s (mean of last 10 steps), rounds |"
echo "| --- | --- | --- |"
for run in "single" "ddp --nproc 2"; do
  for tune in true false; do eval "r_$tune=''"; done
  i=0
  while [ $i -lt "$ROUNDS" ]; do
    for tune in true false; do
      batch=8; case "$run" in ddp*) batch=4 ;; esac
      "$TRAIN" $COMMON --model tiny --strategy $run --batch $batch --steps 20 --malloc_tuning=$tune \
        --metrics_out "$OUT/m.jsonl" > "$OUT/log" 2>&1
      tps=$(grep '"kind": "step"' "$OUT/m.jsonl" | tail -10 | sed -E 's/.*"tokens_per_s": ([0-9.e+-]+).*/\1/' | awk '{s+=$1} END {printf "%.0f", s/NR}')
      eval "r_$tune=\"\$r_$tune $tps\""
    done
    i=$((i + 1))
  done
  echo "| $run | true | $r_true |"
  echo "| $run | false | $r_false |"
done
echo
echo "$blas_line"
