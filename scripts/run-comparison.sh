#!/usr/bin/env bash
# The main job: GPT-2 trained single-device, with DDP and with FSDP on the same model, data
# and global batch, compared the way the papers in docs/gpt2.md do (throughput, peak memory,
# time per epoch, gradient norm, loss per epoch). MODEL=bert-tiny or MODEL=bert runs the same
# comparison for the report's second model, BERT trained as a masked language model
# (docs/bert.md), into report/<model>/ by default.
#
# Installs dependencies (scripts/install-deps.sh), builds (scripts/build.sh), fetches the
# SOTU corpus and GPT-2 vocabulary (scripts/fetch-data.sh), then runs gpt2_train once per
# configuration and writes under ${OUT:-report}/:
#   <run>.jsonl   gpt2_train --metrics_out: one line per step and one per epoch
#   <run>.log     the run's console output (GPT-2: ends with a generated sample)
#   README.md     summary table (each strategy vs single as a ratio) and the figures
#   *.png         throughput, gradient norm, time, memory per epoch; loss curves (gnuplot)
#   env.txt       machine, load, versions, the BLAS and its kernel, whether the CPU computes
#                 bf16 natively (cpu_bf16_native), the exact commands
#
# The default is sized for a 2-core CPU (how long it takes, per CPU class: docs/gpt2.md, "How
# long the main job takes"): the tiny preset (16.1M parameters, context 128), a global batch
# of 8 sequences, and "epochs" of 20 steps over the first 21.5K training tokens of the corpus
# (MAX_TOKENS=24576, 1/8 held out for validation), 4 epochs, plus two variants. On a CPU
# without native bf16 (no avx512_bf16 or AMX-BF16: dtrain-run --blas_info's cpu_bf16_native)
# the default skips fsdp-bf16, whose bf16 is emulated there and was 19-24x slower than fp32,
# and the report says so; setting VARIANTS runs exactly what it names.
# Environment (all optional) to scale it up, e.g. on GPUs:
#   MODEL=tiny            preset: tiny | paper-27m | gpt2 (GPT-2), bert-tiny | bert (BERT: masked
#                         LM, 15% of positions predicted; no text samples; default OUT
#                         report/<model>); every variant below applies to both models
#   EPOCHS=4              epochs per run
#   MAX_TOKENS=24576      corpus prefix (0: the whole 2.07M-token corpus)
#   GLOBAL_BATCH=8        sequences per optimizer step, split over the ranks
#   NPROC=2               ranks of the ddp and fsdp runs
#   DEVICE=cpu            cpu | cuda (one GPU per rank; needs the NCCL backend)
#   VARIANTS="ddp-ps fsdp-bf16"  extra runs: ddp-ps (parameter-server reduction),
#                         ddp-bf16 (bf16-compressed all-reduce), fsdp-bf16 (FSDP bf16 mixed
#                         precision), fsdp-grad_op (ZeRO-2); VARIANTS= runs the main three.
#                         Unset: "ddp-ps fsdp-bf16", less fsdp-bf16 without native bf16
#   TRAIN_ARGS="..."      more gpt2_train flags for every run, after the defaults (e.g. "--ctx 256 --lr 6e-4")
#   OUT=report  DTRAIN_BUILD_DIR=build  DTRAIN_DATA_DIR=data
#   DRY_RUN=1             install, build and train nothing: probe the CPU with an already built
#                         dtrain-run, print the runs, write README.md's preamble (with the
#                         bf16 line) and env.txt into OUT (unset: a new temporary folder, never
#                         the last report) and stop. With DTRAIN_HIDE_NATIVE_BF16=1 (a test hook,
#                         include/dtrain/blas.h) the probe reports no native bf16 on any CPU:
#                         tests/scripts/comparison_variants_test.sh checks the selection so.
# e.g. on an 8-GPU machine:
#   DEVICE=cuda NPROC=8 MODEL=gpt2 GLOBAL_BATCH=64 MAX_TOKENS=0 EPOCHS=3 scripts/run-comparison.sh
# or BERT, briefly, on 2 cores (measured in docs/bert.md):
#   MODEL=bert-tiny EPOCHS=2 MAX_TOKENS=12288 scripts/run-comparison.sh
# Arguments are passed to CMake's configure step.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
model="${MODEL:-tiny}"
# What the report calls the model, where it is explained, and its default folder (BERT's
# beside GPT-2's report rather than over it).
case "$model" in
  bert | bert-tiny) title="BERT (masked language model)" guide=docs/bert.md out="${OUT:-$root/report/$model}" ;;
  *) title="GPT-2" guide=docs/gpt2.md out="${OUT:-$root/report}" ;;
esac
build="${DTRAIN_BUILD_DIR:-$root/build}"
epochs="${EPOCHS:-4}"
max_tokens="${MAX_TOKENS:-24576}"
global_batch="${GLOBAL_BATCH:-8}"
nproc="${NPROC:-2}"
device="${DEVICE:-cpu}"
# VARIANTS set (even empty): exactly those. Unset: the defaults, which the CPU may trim below.
if [ -n "${VARIANTS+set}" ]; then
  variants="$VARIANTS" variants_forced=1
else
  variants="ddp-ps fsdp-bf16" variants_forced=0
fi
train_args="${TRAIN_ARGS:-}"
dry_run="${DRY_RUN:-0}"
started=$(date +%s)

# The variants that compute in bf16 (gpt2_train --precision bf16).
is_bf16_compute() { [ "$1" = fsdp-bf16 ]; }

# select_variants NATIVE FORCED VARIANT...: what runs, into `selected`, and the report's line
# about bf16 into `variant_note` ("" when there is nothing to say). NATIVE is the probe's
# true/false (unknown when it failed); FORCED=1 when the user set VARIANTS, which is never
# trimmed. Without native bf16 the default bf16 variant is skipped: emulated, it was 19-24x
# slower than fp32 (18.9 vs 0.8-1.0 s/step on a 2-core AVX2-only AMD EPYC), and it alone would
# take longer than the rest of the job.
select_variants() {
  local native="$1" forced="$2" v
  shift 2
  selected=()
  local skipped=() bf16=()
  for v in "$@"; do
    if is_bf16_compute "$v" && [ "$native" = false ] && [ "$forced" = 0 ]; then
      skipped+=("$v")
    else
      selected+=("$v")
      if is_bf16_compute "$v"; then bf16+=("$v"); fi
    fi
  done
  variant_note=""
  if [ "${#skipped[@]}" -gt 0 ]; then
    variant_note="Skipped: ${skipped[*]}. This CPU has no native bf16 (missing: avx512_bf16 or"
    variant_note+=" amx_bf16), so bf16 is emulated there, 19-24x slower than fp32 where measured"
    variant_note+=" (docs/gpt2.md, \"bf16 on CPUs\"); VARIANTS=\"${variants}\" runs it anyway."
  elif [ "${#bf16[@]}" -gt 0 ] && [ "$native" = false ]; then
    variant_note="${bf16[*]} ran on a CPU without native bf16 (missing: avx512_bf16 or"
    variant_note+=" amx_bf16), as VARIANTS asked: its bf16 is emulated, so its numbers show the"
    variant_note+=" emulation, not bf16's speed (docs/gpt2.md, \"bf16 on CPUs\")."
  elif [ "${#bf16[@]}" -gt 0 ] && [ "$native" = unknown ]; then
    variant_note="Whether this CPU computes bf16 natively is unknown (dtrain-run --blas_info"
    variant_note+=" failed): ${bf16[*]} may show emulated bf16 (docs/gpt2.md, \"bf16 on CPUs\")."
  fi
}

if [ $((global_batch % nproc)) -ne 0 ]; then
  echo "run-comparison: GLOBAL_BATCH=$global_batch is not a multiple of NPROC=$nproc" >&2
  exit 1
fi

if [ "$dry_run" != 1 ]; then
  "$root/scripts/install-deps.sh"
  # Only what the runs use (the tests' command, scripts/test.sh, builds the rest in the same
  # build directory with the same flags).
  DTRAIN_BUILD_DIR="$build" DTRAIN_TARGETS="gpt2_train dtrain-run dtrain-supervise" \
    "$root/scripts/build.sh" "$@"
  "$root/scripts/fetch-data.sh"
else
  if [ ! -x "$build/src/launcher/dtrain-run" ]; then
    echo "run-comparison: DRY_RUN=1 needs a built $build/src/launcher/dtrain-run (scripts/build.sh)" >&2
    exit 1
  fi
  # Never over the last real report.
  if [ -z "${OUT:-}" ]; then out="$(mktemp -d)"; fi
fi
bin="$build/examples/gpt2/gpt2_train"
mkdir -p "$out"
rm -f "$out"/*.jsonl "$out"/*.log "$out"/*.png "$out"/*.dat "$out/README.md"

# The BLAS and CPU probe the runs share (gpt2_train decides the same way; docs/blas.md): into
# env.txt, and its cpu_bf16_native line decides the bf16 variant.
if probe=$("$build/src/launcher/dtrain-run" --blas_info); then
  cpu_bf16_native=$(sed -n 's/^cpu_bf16_native: \([a-z]*\).*/\1/p' <<<"$probe")
else
  probe="blas: dtrain-run --blas_info failed"
fi
[ -n "${cpu_bf16_native:-}" ] || cpu_bf16_native=unknown
# On GPUs the CPU's bf16 does not matter.
bf16_here=$cpu_bf16_native
[ "$device" = cpu ] || bf16_here=true
# shellcheck disable=SC2086
select_variants "$bf16_here" "$variants_forced" $variants
if [ -n "$variant_note" ]; then echo "run-comparison: $variant_note" >&2; fi

# Idle OpenMP workers sleep instead of spinning: on a shared or oversubscribed CPU spinning
# threads steal the cores the other ranks (and the single run's second thread) compute on.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"

per_rank=$((global_batch / nproc))
# lr 3e-4 rather than gpt2_train's 6e-4: at 6e-4 this small corpus gives one loss spike
# (gradient norm ~400 at step 33, clipped) that dwarfs the per-epoch gradient-norm figure.
common=(--model "$model" --epochs "$epochs" --max_tokens "$max_tokens" --val_fraction 0.125
  --val_batches 4 --lr 3e-4 --device "$device" --seed 1234 --log_every 5)
# shellcheck disable=SC2206
[ -n "$train_args" ] && common+=($train_args)

# name | gpt2_train flags
runs=("single|--strategy single --batch $global_batch"
  "ddp|--strategy ddp --nproc $nproc --batch $per_rank"
  "fsdp|--strategy fsdp --nproc $nproc --batch $per_rank")
for v in "${selected[@]}"; do
  case "$v" in
    ddp-ps) runs+=("ddp-ps|--strategy ddp --nproc $nproc --batch $per_rank --comm_hook ps") ;;
    ddp-bf16) runs+=("ddp-bf16|--strategy ddp --nproc $nproc --batch $per_rank --comm_hook bf16") ;;
    fsdp-bf16) runs+=("fsdp-bf16|--strategy fsdp --nproc $nproc --batch $per_rank --precision bf16") ;;
    fsdp-grad_op) runs+=("fsdp-grad_op|--strategy fsdp --nproc $nproc --batch $per_rank --sharding grad_op") ;;
    *)
      echo "run-comparison: unknown variant '$v'" >&2
      exit 1
      ;;
  esac
done

{
  echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "cpu: $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(getconf _NPROCESSORS_ONLN) cores"
  echo "load average at start: $(cut -d" " -f1-3 /proc/loadavg)"
  echo "os: $(. /etc/os-release && echo "$PRETTY_NAME"), kernel $(uname -r)"
  echo "libtorch: $(dpkg-query -W -f='${Version}' libtorch-dev 2>/dev/null || echo '?')"
  echo "commit: $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo none)"
  echo "OMP_WAIT_POLICY=$OMP_WAIT_POLICY"
  # The BLAS the runs load and its kernel; gpt2_train --blas_kernel auto (the default) decides
  # what "ranks get" says the same way, for its ranks and its single process (docs/blas.md).
  # cpu_bf16_native: whether the CPU computes bf16 natively (docs/gpt2.md, "bf16 on CPUs").
  echo "$probe"
  if [ -n "$variant_note" ]; then echo "variants: $variant_note"; fi
} >"$out/env.txt"

# The report's opening: title, where to read about it, the configuration, the bf16 line.
report_preamble() {
  echo "# $title: single device vs DDP vs FSDP"
  echo
  echo "Generated by \`scripts/run-comparison.sh\` on $(date -u '+%Y-%m-%d %H:%M UTC');" \
    "how to read it: $guide. Machine and commands: [env.txt](env.txt)."
  echo
  echo "Configuration: model \`$model\`, $epochs epochs over the first $max_tokens corpus tokens" \
    "(1/8 held out for validation), global batch $global_batch sequences, ranks: $nproc for" \
    "ddp/fsdp, device $device. Every run sees the same data in the same order and starts" \
    "from the same weights. Extra flags: \`${train_args:-none}\`."
  echo
  if [ -n "$variant_note" ]; then
    echo "$variant_note"
    echo
  fi
}

if [ "$dry_run" = 1 ]; then
  {
    report_preamble
    echo "Dry run (DRY_RUN=1): nothing was trained."
  } >"$out/README.md"
  for run in "${runs[@]}"; do echo "run ${run%%|*}: ${run#*|}"; done
  echo "run-comparison: dry run; the report's preamble is in $out/README.md" >&2
  exit 0
fi

failed=()
names=()
for run in "${runs[@]}"; do
  name="${run%%|*}"
  # shellcheck disable=SC2206
  flags=(${run#*|})
  cmd=("$bin" "${flags[@]}" "${common[@]}" --metrics_out "$out/$name.jsonl")
  echo "+ ${cmd[*]#"$root/"}" | tee -a "$out/env.txt" >&2
  t0=$(date +%s)
  if "${cmd[@]}" 2>&1 | tee "$out/$name.log"; then
    names+=("$name")
  else
    failed+=("$name")
    echo "run-comparison: run '$name' failed (see $out/$name.log)" >&2
  fi
  echo "  ($(($(date +%s) - t0)) s)" | tee -a "$out/env.txt" >&2
done

# ---- Tables and plot data from the JSON lines ----------------------------------------
# JSON field `key` of a line written by gpt2_train ("?" when null or absent).
read -r -d '' json_awk <<'EOF' || true
function get(line, key,    v) {
  if (!match(line, "\"" key "\": (\\[[^]]*\\]|\"[^\"]*\"|[^,}]*)")) return "?"
  v = substr(line, RSTART + length(key) + 4, RLENGTH - length(key) - 4)
  gsub(/"/, "", v)
  return v == "null" ? "?" : v
}
EOF

for name in "${names[@]}"; do
  f="$out/$name.jsonl"
  # epoch tokens_per_s grad_norm epoch_time_s peak_rss_mib model_state_mib loss val_loss
  awk "$json_awk"'
    /"kind": "epoch"/ { print get($0, "epoch"), get($0, "tokens_per_s"), get($0, "grad_norm"),
                               get($0, "epoch_time_s"), get($0, "peak_rss_mib"),
                               get($0, "model_state_mib"), get($0, "loss"), get($0, "val_loss") }' \
    "$f" >"$out/$name.epochs.dat"
  # step loss grad_norm tokens_per_s
  awk "$json_awk"'
    /"kind": "step"/ { print get($0, "step"), get($0, "loss"), get($0, "grad_norm"),
                              get($0, "tokens_per_s") }' "$f" >"$out/$name.steps.dat"
done

# One summary row per run: tokens/s over all epochs, mean time per epoch, per-rank peak
# RSS and model state, final losses and gradient norm, mean exposed communication wait.
summary() {
  awk "$json_awk"'
    /"kind": "epoch"/ {
      n++; tokens += get($0, "tokens_per_s") * get($0, "epoch_time_s"); time += get($0, "epoch_time_s")
      rss = get($0, "peak_rss_mib_per_rank"); state = get($0, "model_state_mib")
      loss = get($0, "loss"); val = get($0, "val_loss"); wait += get($0, "comm_wait_s")
      world = get($0, "world_size")
    }
    /"kind": "step"/ { grad = get($0, "grad_norm") }
    END {
      gsub(/[][ ]/, "", rss); k = split(rss, r, ","); max = 0
      for (i = 1; i <= k; i++) if (r[i] + 0 > max) max = r[i] + 0
      printf "%s %.1f %.2f %.0f %.1f %.4f %s %.3f %.3f %s ", world, tokens / time, time / n, max,
        state, loss, (val == "?" ? "-" : sprintf("%.4f", val)), grad, wait / n, n
      for (i = 1; i <= k; i++) printf "%s%.0f", (i > 1 ? "/" : ""), r[i]
      print ""
    }' "$1"
}

{
  report_preamble
  # What each run's rank 0 reported loading (the metrics' blas and blas_kernel).
  blas_runs=$(for name in "${names[@]}"; do
    awk "$json_awk"'/"kind": "step"/ { print get($0, "blas") ", kernel " get($0, "blas_kernel"); exit }' \
      "$out/$name.jsonl"
  done | sort -u | paste -sd ';' | sed 's/;/; /g')
  echo "BLAS: ${blas_runs:-unknown} (how it is chosen: docs/blas.md)."
  echo
  echo "| run | ranks | tokens/s | vs single | time/epoch (s) | vs single | peak RSS/rank (MiB) | max vs single | model state/rank (MiB) | vs single | final loss | final val loss | final grad norm | comm wait/step (s) |"
  echo "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"
  base=""
  ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf (b > 0 ? "%.2fx" : "-"), a / b }'; }
  for name in "${names[@]}"; do
    read -r world tps tpe rss state loss val grad wait _ per_rank_rss <<<"$(summary "$out/$name.jsonl")"
    [ -z "$base" ] && [ "$name" = single ] && base="$tps $tpe $rss $state"
    read -r btps btpe brss bstate <<<"${base:-$tps $tpe $rss $state}"
    echo "| $name | $world | $tps | $(ratio "$tps" "$btps") | $tpe | $(ratio "$tpe" "$btpe") |" \
      "$per_rank_rss | $(ratio "$rss" "$brss") | $state | $(ratio "$state" "$bstate") |" \
      "$loss | $val | $grad | $wait |"
  done
  for name in "${failed[@]}"; do
    echo "| $name | failed: see [$name.log]($name.log) |||||||||||||"
  done
  echo
  echo "tokens/s: training tokens of all epochs / their time (validation excluded)." \
    "Peak RSS: VmHWM of each rank's process (rank 0/rank 1/...); \"max vs single\" compares" \
    "the largest rank. Model state: parameters, gradients, communication buffers and AdamW" \
    "state held by one rank. Final loss: mean training loss of the last epoch; grad norm:" \
    "global norm before clipping at the last step. Comm wait: time a step waited on" \
    "communication after backward (DDP/FSDP's exposed, non-overlapped part)."
  echo
  for fig in throughput grad_norm epoch_time memory loss; do
    echo "![$fig]($fig.png)"
    echo
  done
  if [ "$guide" = docs/bert.md ]; then
    echo "Loss: cross-entropy over the masked positions (15% of each sequence's tokens)." \
      "No samples: a masked language model does not generate text."
  else
    echo "## Samples"
    echo
    for name in "${names[@]}"; do
      echo "- **$name**: \`$(grep -m1 '^sample' "$out/$name.log" | sed 's/^sample ([^)]*): //' |
        tr -d '`' | tr '\n' ' ' | cut -c1-200)\`"
    done
  fi
} >"$out/README.md"

if command -v gnuplot >/dev/null && [ "${#names[@]}" -gt 0 ]; then
  # One plot element per run, run i in colour i: $1 data file suffix, $2 using, $3 style,
  # $4 title suffix.
  plot_list() {
    local sep="" line="" i=0
    for name in "${names[@]}"; do
      i=$((i + 1))
      line+="$sep'$out/$name.$1' using $2 with $3 linecolor $i title '$name${4:-}'"
      sep=", "
    done
    echo "$line"
  }
  gnuplot <<EOF
set terminal pngcairo size 900,560 font "sans,10"
set datafile missing "?"
set grid
set key outside right
set xlabel "epoch"
set xtics 1
set output "$out/throughput.png"
set title "Throughput per epoch (global tokens/s)"
set ylabel "tokens/s"
plot $(plot_list epochs.dat 1:2 linespoints)
set output "$out/grad_norm.png"
set title "Gradient norm per epoch (mean over the epoch's steps, before clipping)"
set ylabel "global gradient L2 norm"
plot $(plot_list epochs.dat 1:3 linespoints)
set output "$out/epoch_time.png"
set title "Training time per epoch"
set ylabel "seconds"
plot $(plot_list epochs.dat 1:4 linespoints)
set output "$out/memory.png"
set title "Memory per epoch: peak RSS of the largest rank (solid), model state per rank (dashed)"
set ylabel "MiB"
set yrange [0:*]
plot $(plot_list epochs.dat 1:5 linespoints " peak RSS"), $(plot_list epochs.dat 1:6 "linespoints dashtype 2" " state")
EOF
  # Validation losses are plotted at the step that ended their epoch.
  for name in "${names[@]}"; do
    awk "$json_awk"'/"kind": "epoch"/ { print get($0, "step"), get($0, "val_loss") }' \
      "$out/$name.jsonl" >"$out/$name.val.dat"
  done
  gnuplot <<EOF
set terminal pngcairo size 900,560 font "sans,10"
set datafile missing "?"
set grid
set key outside right
set output "$out/loss.png"
set title "Loss per step (lines) and validation loss per epoch (points); equal strategies overlap"
set xlabel "step"
set ylabel "cross-entropy"
plot $(plot_list steps.dat 1:2 lines), $(plot_list val.dat 1:2 "points pointsize 1.5" " val")
EOF
else
  echo "run-comparison: gnuplot not found (scripts/install-deps.sh installs it); no figures" >&2
fi

elapsed=$(($(date +%s) - started))
echo "total wall time of run-comparison.sh: ${elapsed} s" | tee -a "$out/env.txt" >&2
echo >>"$out/README.md"
echo "Wall time of the whole script (install check, build, data, all runs, report):" \
  "$((elapsed / 60)) min $((elapsed % 60)) s." >>"$out/README.md"
echo "run-comparison: report in $out/README.md" >&2
[ "${#failed[@]}" -eq 0 ]
