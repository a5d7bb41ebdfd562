#!/usr/bin/env bash
# SyncBatchNorm's cost (#44 item 10) on the CNN example (examples/cnn: two conv-BN-ReLU-pool
# blocks and a linear layer, Fashion-MNIST, global batch 64, AdamW): the median step's wall
# time (cnn_train's step_ms_median, 128 steps, 1 intra-op thread per rank) of
#   single: BatchNorm2d, and dtrain::SyncBatchNorm at one rank (no communication);
#   ddp x2: BatchNorm2d, and SyncBatchNorm (two all-reduces per layer and step);
#   fsdp x2 with SyncBatchNorm;
# REPEATS rounds (default 3) in alternating order; the medians and the SyncBatchNorm / BatchNorm
# ratios of this run, with the CPU and the BLAS kernel, into ${OUT:-report/bench}/sync-batch-norm.json.
# PEER_TORCH=forky also runs the same model in PyTorch 2.14 inside scripts/chroot.sh's forky
# root (benchmarks/cnn_pytorch.py: BatchNorm2d at 1 and 2 ranks, SyncBatchNorm at 1 rank, where
# it is BatchNorm; at 2 ranks PyTorch refuses SyncBatchNorm on CPU tensors, which is recorded;
# USE_LIBUV=0: Debian's PyTorch has no libuv for its TCP store).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${DTRAIN_BUILD_DIR:-$root/build}"
out="${OUT:-$root/report/bench}"
repeats="${REPEATS:-3}"
mkdir -p "$out"
cmake --build "$build" -j "${DTRAIN_JOBS:-$(nproc)}" --target cnn_train dtrain-run dtrain-supervise >/dev/null
train="$build/examples/cnn/cnn_train"
run="$build/src/launcher/dtrain-run"
args=(--epochs 1 --train_limit 8192 --test_limit 500 --global_batch 64 --threads 1)
raw="$out/sync-batch-norm.raw"
: >"$raw"
one() { # NAME NPROC ARGS...
  local name="$1" nproc="$2" m="$out/sbn_$1.jsonl"
  shift 2
  rm -f "$m"
  if [ "$nproc" = 1 ]; then
    "$train" "${args[@]}" --metrics_out "$m" "$@" >/dev/null
  else
    "$run" --nproc_per_node "$nproc" -- "$train" "${args[@]}" --metrics_out "$m" "$@" >/dev/null
  fi
  echo "$name $(sed -n 's/.*"step_ms_median":\([0-9.]*\).*/\1/p' "$m")" >>"$raw"
}
runs=("single_bn 1 --strategy single" "single_syncbn 1 --strategy single --sync_bn"
  "ddp2_bn 2 --strategy ddp" "ddp2_syncbn 2 --strategy ddp --sync_bn"
  "fsdp2_syncbn 2 --strategy fsdp --sync_bn")
for r in $(seq 1 "$repeats"); do
  if [ $((r % 2)) = 1 ]; then order=(0 1 2 3 4); else order=(4 3 2 1 0); fi
  for i in "${order[@]}"; do
    # shellcheck disable=SC2086
    one ${runs[$i]}
  done
done
if [ "${PEER_TORCH:-}" = forky ]; then
  "$root/scripts/chroot.sh" create forky >/dev/null
  for r in $(seq 1 "$repeats"); do
    for cfg in "torch_single_bn 1" "torch_single_syncbn 1 --sync_bn" "torch_ddp2_bn 2" \
      "torch_ddp2_syncbn 2 --sync_bn"; do
      # shellcheck disable=SC2086
      set -- $cfg
      name="$1" nproc="$2"
      shift 2
      port=$((29600 + RANDOM % 1000))
      line=$("$root/scripts/chroot.sh" run forky "
        for rank in \$(seq 0 $((nproc - 1))); do
          USE_LIBUV=0 RANK=\$rank WORLD_SIZE=$nproc MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
            python3 benchmarks/cnn_pytorch.py $* >/tmp/cnn_py.\$rank 2>&1 &
        done
        wait || true
        cat /tmp/cnn_py.0" | tail -n 1)
      echo "$name $line" >>"$raw"
    done
  done
fi
blas=$("$run" --blas_info | sed -n 's/^blas: //p' | head -n1)
cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n1)
python3 - "$raw" "$out/sync-batch-norm.json" "$cpu" "$blas" "$repeats" <<'PY'
import json, statistics, sys
raw, dest, cpu, blas, repeats = sys.argv[1:]
runs, errors, torch_version = {}, {}, None
for line in open(raw):
    name, _, rest = line.strip().partition(" ")
    if not rest.startswith("{"):
        try:
            float(rest)
        except ValueError:  # a failed PyTorch run: its last line
            errors[name] = rest
            continue
    if rest.startswith("{"):
        d = json.loads(rest)
        torch_version = d.get("torch", torch_version)
        if "error" in d:
            errors[name] = d["error"]
            continue
        rest = str(d["step_ms_median"])
    if rest:
        runs.setdefault(name, []).append(float(rest))
med = {k: statistics.median(v) for k, v in runs.items()}
def ratio(a, b):
    return round(med[a] / med[b], 3) if a in med and b in med else None
result = {
    "what": "median step wall time (ms) of examples/cnn, global batch 64, 1 thread per rank",
    "cpu": cpu, "blas": blas, "repeats": int(repeats), "torch_peer": torch_version,
    "step_ms": {k: round(v, 3) for k, v in med.items()}, "samples": runs, "errors": errors,
    "ratios": {
        "single: SyncBatchNorm / BatchNorm": ratio("single_syncbn", "single_bn"),
        "ddp x2: SyncBatchNorm / BatchNorm": ratio("ddp2_syncbn", "ddp2_bn"),
        "ddp x2 SyncBatchNorm: dtrain / PyTorch BatchNorm (like for like model)": ratio("ddp2_syncbn", "torch_ddp2_bn"),
        "ddp x2 BatchNorm: dtrain / PyTorch (like for like)": ratio("ddp2_bn", "torch_ddp2_bn"),
        "single BatchNorm: dtrain / PyTorch (like for like)": ratio("single_bn", "torch_single_bn"),
    },
}
json.dump(result, open(dest, "w"), indent=1)
print(json.dumps(result, indent=1))
PY
