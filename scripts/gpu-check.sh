#!/usr/bin/env bash
# GPU acceptance run (docs/nccl.md, "GPU acceptance"): one command a bare GPU machine runs in
# under 9 minutes, writing its results and logs into OUTDIR.
#
#   scripts/gpu-check.sh OUTDIR            # on the GPU machine
#   scripts/gpu-check.sh --dry-run OUTDIR  # anywhere: print the steps and commands only
#
# The machine (see docs/nccl.md): one H100 or H200, x86-64, Python 3 with PyTorch 2.x+cu13x
# (its LibTorch, CUDA and NCCL), CMake, ninja, nvcc; no Gloo, Abseil, fmt or GoogleTest and no
# network. Those travel in the working tree as Debian packages: run `scripts/gpu-deps.sh
# fetch` on a Debian machine first (it fills .gpu-deps/debs, ~3 MiB).
#
# Steps, each logged to OUTDIR/logs/<step>.log and listed with its status and duration in
# OUTDIR/summary.tsv; OUTDIR/results.md collects the results:
#   env        GPU, driver, torch / CUDA / NCCL versions, the C++ ABI, compilers
#   deps       unpack the carried packages into $BUILD/deps-prefix
#   configure  dtrain against the wheel's LibTorch, NCCL on (the wheel's nccl), benchmarks off
#   build      dtrain_tests, its worker, gpt2_train, dtrain-run
#   tests      the CUDA/NCCL tests of dtrain_tests, one process each under ctest (Nccl*, device
#              contract, CUDA generators, CUDA staging)
#   strategies gpt2_train --model tiny, fp32, 8 steps, same global batch: single (reference);
#              ddp and fsdp (full, grad_op, no_shard) on NCCL at world size 1; ddp and fsdp
#              (full, grad_op, no_shard, hybrid) at 2 and 4 ranks with Gloo on CUDA tensors on
#              the one GPU; each run's per-step loss within rtol 1e-3 of single's
#   offload    FSDP --cpu_offload (issue 30) on NCCL at world size 1: the tiny model's per-step
#              loss against single's (rtol 1e-3); GPT-2 350M (gpt2-medium), bf16, batch 4 x 1024,
#              8 steps with and without --cpu_offload: cuda_peak_mib and tokens/s side by side
#   gpt2       GPT-2 124M (--model gpt2), bf16, batch 16 x 1024, 30 steps: gpt2_train and
#              PyTorch eager (benchmarks/gpu_gpt2.py, SDPA), tokens/s (median after 10 steps),
#              MFU and cuda_peak_mib side by side
#   profile    the same GPT-2 124M step on both sides, 8 steps each, Kineto traces of steps 6-8
#              (gpt2_train --trace_out, gpu_gpt2.py torch --trace_out) in OUTDIR/traces, and
#              OUTDIR/profile.md (benchmarks/trace_table.py): kernels, GPU busy and idle time,
#              host syncs and ATen operators per step, the top 20 kernels by time
# A step that fails is recorded and the next ones still run where they can; when the time
# budget (DTRAIN_GPU_BUDGET_S, default 530 s) runs out, the remaining steps are recorded as
# skipped. Exit status: 0 when every step passed, 1 otherwise.
set -uo pipefail

dry_run=0
if [[ "${1:-}" == "--dry-run" ]]; then dry_run=1; shift; fi
if [[ $# -ne 1 ]]; then
  sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="$(mkdir -p "$1" && cd "$1" && pwd)"
build="${DTRAIN_GPU_BUILD:-$root/build-gpu}"
prefix="$build/deps-prefix"
debs="${DTRAIN_GPU_DEBS:-$root/.gpu-deps/debs}"
budget="${DTRAIN_GPU_BUDGET_S:-530}"
jobs="${DTRAIN_JOBS:-$(nproc)}"
python="${PYTHON:-python3}"
mkdir -p "$out/logs" "$out/runs"
: > "$out/summary.tsv"
started=$SECONDS
failed=0

note() { echo "gpu-check: $*" | tee -a "$out/gpu-check.log" >&2; }
left() { echo $((budget - (SECONDS - started))); }

# step NAME LIMIT_S COMMAND...: runs COMMAND (a function or program) with its output in
# logs/NAME.log, bounded by LIMIT_S and by what is left of the budget.
step() {
  local name="$1" limit="$2"
  shift 2
  local log="$out/logs/$name.log" t0=$SECONDS
  if ((dry_run)); then
    echo "== $name (at most ${limit}s)"
    DRY=1 "$@"
    return 0
  fi
  local remaining
  remaining=$(left)
  if ((remaining < 5)); then
    printf '%s\tskipped\t0\ttime budget spent\n' "$name" >> "$out/summary.tsv"
    note "$name: skipped (time budget spent)"
    failed=1
    return 1
  fi
  ((limit > remaining)) && limit=$remaining
  note "$name: started (limit ${limit}s)"
  # The step runs in a subshell under `timeout`: functions are exported for it.
  timeout --kill-after=10 "$limit" bash -c "$(declare -f); $(declare -p root out build prefix debs jobs python 2>/dev/null); \"\$@\"" _ "$@" > "$log" 2>&1
  local rc=$?
  local dt=$((SECONDS - t0)) status=ok
  if ((rc == 124 || rc == 137)); then status=timeout; elif ((rc != 0)); then status="failed($rc)"; fi
  [[ "$status" == ok ]] || failed=1
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$dt" "$(tail -1 "$log" | tr '\t' ' ' | cut -c1-200)" >> "$out/summary.tsv"
  note "$name: $status after ${dt}s (log: logs/$name.log)"
  [[ "$status" == ok ]]
}

# x COMMAND...: runs it, or prints it in a dry run.
x() {
  if [[ -n "${DRY:-}" ]]; then printf '  %q' "$@"; echo; return 0; fi
  echo "+ $*"
  "$@"
}

torch_prefix() { "$python" -c 'import torch;print(torch.utils.cmake_prefix_path)'; }
site_packages() {
  if [[ -n "${DRY:-}" ]]; then echo '<site-packages>'; return; fi
  "$python" -c 'import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))'
}

do_env() {
  x nvidia-smi
  x nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv
  x "$python" -c 'import json,torch; print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "nccl": ".".join(map(str, torch.cuda.nccl.version())), "gpu": torch.cuda.get_device_name(0), "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI), "cmake_prefix_path": torch.utils.cmake_prefix_path}))'
  x nvcc --version
  x cmake --version
  x c++ --version
  x ninja --version
  x nproc
  x lscpu
  x ldd --version
  # Whether the wheel's libtorch_cpu exports Gloo's symbols (it links its own Gloo); see the
  # `build` step for why dtrain then preloads the carried libgloo.
  if [[ -z "${DRY:-}" ]]; then
    local lib
    lib="$(site_packages)/torch/lib/libtorch_cpu.so"
    echo "gloo symbols exported by $lib: $(nm -D --defined-only "$lib" 2>/dev/null | grep -c 'gloo' || true)"
  fi
}

do_deps() {
  if [[ -z "${DRY:-}" ]]; then rm -rf "$prefix"; fi
  x "$root/scripts/gpu-deps.sh" unpack "$debs" "$prefix"
}

# NCCL of the wheel (nvidia-nccl-cu1x): its header and library, which may be named only
# libnccl.so.2.
nccl_include() { find "$(site_packages)/nvidia" -name nccl.h -path '*include*' 2>/dev/null | head -1 | xargs -r dirname; }
nccl_library() { find "$(site_packages)/nvidia" -name 'libnccl.so*' 2>/dev/null | sort | head -1; }

do_configure() {
  local tp nccl_inc nccl_lib cap
  if [[ -n "${DRY:-}" ]]; then
    tp='$(python3 -c "import torch;print(torch.utils.cmake_prefix_path)")'
    nccl_inc='<site-packages>/nvidia/nccl/include'
    nccl_lib='<site-packages>/nvidia/nccl/lib/libnccl.so.2'
    cap='9.0'
  else
    tp="$(torch_prefix)"
    nccl_inc="$(nccl_include)"
    nccl_lib="$(nccl_library)"
    cap="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' ')"
    echo "NCCL: include $nccl_inc, library $nccl_lib; compute capability $cap"
  fi
  local -a args=(-S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release
    -DTorch_DIR="$tp/Torch" -DCMAKE_PREFIX_PATH="$tp"
    $("$root/scripts/gpu-deps.sh" cmake-args "$prefix")
    -DDTRAIN_WITH_NCCL=ON -DNCCL_INCLUDE_DIR="$nccl_inc" -DNCCL_LIBRARY="$nccl_lib"
    -DDTRAIN_BUILD_TESTS=ON -DDTRAIN_BUILD_EXAMPLES=ON -DDTRAIN_BUILD_BENCHMARKS=OFF
    # The carried libraries are found through LD_LIBRARY_PATH at run time only: discover the
    # tests when they run, not when they link.
    -DCMAKE_GTEST_DISCOVER_TESTS_DISCOVERY_MODE=PRE_TEST)
  if [[ -n "${DRY:-}" ]]; then
    x env TORCH_CUDA_ARCH_LIST="$cap" cmake "${args[@]}"
    return 0
  fi
  # The NCCL backend must be on: without it the NCCL tests would not even be compiled.
  x env TORCH_CUDA_ARCH_LIST="$cap" cmake "${args[@]}" | tee /dev/stderr | grep -q 'NCCL backend ON'
}

do_build() {
  x cmake --build "$build" -j "$jobs" --target dtrain_tests dtrain_test_worker gpt2_train dtrain-run -- -k 0
}

# The environment every dtrain program of this run gets: the carried libraries, and the
# carried libgloo preloaded, so that dtrain's Gloo calls bind to the Gloo it was compiled
# against even where the wheel's libtorch_cpu exports its own (newer) Gloo's symbols.
dtrain_env() {
  local lp
  lp="$("$root/scripts/gpu-deps.sh" library-path "$prefix")"
  echo "LD_LIBRARY_PATH=$lp:$(site_packages)/torch/lib:${LD_LIBRARY_PATH:-}"
  echo "LD_PRELOAD=$prefix/usr/lib/libgloo.so.0"
}

run_dtrain() {
  local -a envs
  mapfile -t envs < <(dtrain_env)
  x env "${envs[@]}" "$@"
}

# One process per test (ctest): a crash fails its own test and the others still run.
do_tests() {
  run_dtrain ctest --test-dir "$build" -R '^(Nccl|NcclMaps|DeviceContract|CheckpointRng)[.]|Cuda|CUDA|Staging' \
    -j 4 --timeout 120 --output-on-failure --output-junit "$out/tests.xml"
}

gpt2_train_bin() { echo "$build/examples/gpt2/gpt2_train"; }

# Gloo on CUDA tensors for the trainer: the flag the trainer has for it.
gloo_cuda_flags() {
  if [[ -n "${DRY:-}" ]]; then echo "--backend=gloo"; return; fi
  if run_dtrain "$(gpt2_train_bin)" --help 2>&1 | grep -q -- '--backend'; then
    echo "--backend=gloo"
  fi
}

# One tiny-model run; NAME WORLD ARGS...
train_tiny() {
  local name="$1" world="$2"
  shift 2
  local batch=$((8 / world))
  run_dtrain "$(gpt2_train_bin)" --model tiny --device cuda --data random --max_tokens 200000 \
    --steps 8 --batch "$batch" --seed 7 --threads 2 --sample_tokens 0 --log_every 1 \
    --nproc "$world" --metrics_out "$out/runs/$name.jsonl" "$@"
}

compare_to_single() {
  x "$python" "$root/benchmarks/gpu_gpt2.py" compare --reference "$out/runs/single.jsonl" \
    --candidate "$out/runs/$1.jsonl" --rtol 1e-3
}

do_strategies() {
  local bad=0 gloo
  train_tiny single 1 --strategy single || return 1
  for s in ddp "fsdp full" "fsdp grad_op" "fsdp no_shard"; do
    set -- $s
    local name="nccl1-$1${2:+-$2}"
    { train_tiny "$name" 1 --strategy "$1" ${2:+--sharding "$2"} && compare_to_single "$name"; } || bad=1
  done
  gloo="$(gloo_cuda_flags)"
  if [[ -z "$gloo" ]]; then
    echo "gpt2_train has no --backend flag: Gloo on CUDA tensors cannot be selected; multi-rank runs not done"
    return 1
  fi
  for world in 2 4; do
    for s in ddp "fsdp full" "fsdp grad_op" "fsdp no_shard" "fsdp hybrid"; do
      set -- $s
      local name="gloo$world-$1${2:+-$2}"
      local -a extra=()
      [[ "${2:-}" == hybrid ]] && extra=(--shard_group_size $((world / 2)))
      { train_tiny "$name" "$world" --strategy "$1" ${2:+--sharding "$2"} $gloo "${extra[@]}" &&
        compare_to_single "$name"; } || bad=1
    done
  done
  return $bad
}

# The last step record's FIELD from a metrics file (the epoch's peak fields are there).
last_field() {
  [[ -n "${DRY:-}" ]] && { echo 0; return; }
  "$python" -c "import json,sys
rows=[r for r in map(json.loads, open(sys.argv[1])) if r.get('kind') == 'step']
print(rows[-1].get(sys.argv[2], 'n/a'))" "$1" "$2"
}

do_offload() {
  train_tiny nccl1-fsdp-offload 1 --strategy fsdp --sharding full --cpu_offload &&
    compare_to_single nccl1-fsdp-offload || return 1
  local mode
  for mode in resident offload; do
    run_dtrain "$(gpt2_train_bin)" --model gpt2-medium --device cuda --precision bf16 \
      --data random --max_tokens $((10 * 4 * 1024 * 21 / 20)) --steps 8 --batch 4 \
      --strategy fsdp --sharding full --sample_tokens 0 --log_every 1 \
      $([[ $mode == offload ]] && echo --cpu_offload) \
      --metrics_out "$out/runs/offload-$mode.jsonl" || return 1
  done
  for mode in resident offload; do
    echo "offload $mode: cuda_peak_mib $(last_field "$out/runs/offload-$mode.jsonl" cuda_peak_mib)" \
      "tokens_per_s $(last_field "$out/runs/offload-$mode.jsonl" tokens_per_s)"
  done
}

do_gpt2() {
  local batch=16 steps=30
  run_dtrain "$(gpt2_train_bin)" --model gpt2 --device cuda --precision bf16 --data random \
    --max_tokens $(((steps + 2) * batch * 1024 * 21 / 20)) --steps "$steps" --batch "$batch" \
    --sample_tokens 0 --log_every 10 --metrics_out "$out/runs/gpt2-dtrain.jsonl" || return 1
  x "$python" "$root/benchmarks/gpu_gpt2.py" torch --batch "$batch" --steps "$steps" \
    --metrics_out "$out/runs/gpt2-pytorch.jsonl" || return 1
  local params=124439808
  [[ -n "${DRY:-}" ]] || params=$("$python" -c "import json;print(json.loads(open('$out/runs/gpt2-pytorch.jsonl').readline())['params'])")
  x "$python" "$root/benchmarks/gpu_gpt2.py" report --dtrain "$out/runs/gpt2-dtrain.jsonl" \
    --torch "$out/runs/gpt2-pytorch.jsonl" --params "$params" --warmup 10 --peak_tflops 989
}

# Kineto traces of the same 3 steady-state steps (6 to 8) of both sides, and their table.
do_profile() {
  local batch=16 steps=8 traced=3
  [[ -n "${DRY:-}" ]] || mkdir -p "$out/traces"
  run_dtrain "$(gpt2_train_bin)" --model gpt2 --device cuda --precision bf16 --data random \
    --max_tokens $(((steps + 2) * batch * 1024 * 21 / 20)) --steps "$steps" --batch "$batch" \
    --sample_tokens 0 --log_every 1 --profile_steps "$traced" \
    --trace_out "$out/traces/dtrain.json" --metrics_out "$out/runs/profile-dtrain.jsonl" || return 1
  x "$python" "$root/benchmarks/gpu_gpt2.py" torch --batch "$batch" --steps "$steps" \
    --trace_out "$out/traces/pytorch.json" --trace_start 5 --trace_steps "$traced" \
    --metrics_out "$out/runs/profile-pytorch.jsonl" || return 1
  x "$python" "$root/benchmarks/trace_table.py" --dtrain "$out/traces/dtrain.json" \
    --torch "$out/traces/pytorch.json" --steps "$traced" --top 20 \
    --json_out "$out/traces/summary.json" --md_out "$out/profile.md"
}

write_results() {
  {
    echo "# GPU acceptance run ($(date -u '+%Y-%m-%d %H:%M UTC'))"
    echo
    echo "Total $((SECONDS - started)) s of a ${budget} s budget."
    echo
    echo '| step | status | seconds | last line |'
    echo '|---|---|---|---|'
    while IFS=$'\t' read -r name status secs last; do
      echo "| $name | $status | $secs | ${last//|/\\|} |"
    done < "$out/summary.tsv"
    echo
    echo '## Environment'
    echo '```'
    grep -E '^\{|NVIDIA|release|cmake version|gloo symbols' "$out/logs/env.log" 2>/dev/null
    echo '```'
    echo
    echo '## Strategies (per-step loss vs single, rtol 1e-3)'
    echo '```'
    grep -E '^\{"match"' "$out/logs/strategies.log" 2>/dev/null
    echo '```'
    echo
    echo '## FSDP CPU offload (gpt2-medium, bf16, world 1)'
    echo '```'
    grep -E '^\{"match"|^offload ' "$out/logs/offload.log" 2>/dev/null
    echo '```'
    echo
    echo '## GPT-2 124M, bf16'
    echo '```'
    grep -E '^\{"flops_per_token"|^\||goal' "$out/logs/gpt2.log" 2>/dev/null
    echo '```'
    echo
    echo '## Profile: GPT-2 124M bf16, 3 steps per side (traces in traces/)'
    echo
    cat "$out/profile.md" 2>/dev/null || echo 'no profile (see logs/profile.log)'
  } > "$out/results.md"
}

if ((dry_run)); then
  echo "gpu-check (dry run): OUTDIR=$out BUILD=$build DEBS=$debs budget ${budget}s"
fi
step env 30 do_env
step deps 30 do_deps
if step configure 90 do_configure && step build 330 do_build; then
  step tests 60 do_tests
  step strategies 150 do_strategies
  step gpt2 120 do_gpt2
  step profile 90 do_profile
  step offload 120 do_offload
else
  for s in tests strategies gpt2 profile offload; do
    printf '%s\tskipped\t0\tthe build failed\n' "$s" >> "$out/summary.tsv"
  done
fi
if ((dry_run)); then
  rm -f "$out/summary.tsv"
  rmdir "$out/logs" "$out/runs" 2>/dev/null
  exit 0
fi
write_results
note "done in $((SECONDS - started)) s; results in $out/results.md"
exit $failed
