#!/usr/bin/env bash
# Where a training step's time goes, dtrain vs PyTorch's own (Python) training, operator by
# operator: the same GPT-2 `tiny` runs as benchmarks/peer-comparison.sh (synthetic tokens,
# batch 8 per rank, seed 1), each profiled over PROFILE_STEPS steps after 5 warm-up steps
# with the same ATen RecordFunction events on both sides (gpt2_train --profile_out,
# examples/gpt2/op_profile.h; peer_pytorch_gpt2.py --profile_out, torch.autograd.profiler).
#   PyTorch single process, dtrain single with --loss standard (the same model code as
#   PyTorch's script) and with its default fused LM-head loss; with DDP=1 also PyTorch DDP
#   and dtrain ddp (fused loss), with FSDP=1 also PyTorch FSDP1 (full shard, a unit per block)
#   and dtrain fsdp with --loss standard (the like-for-like pair)
#   (Gloo, 2 ranks; rank 0 is profiled). PyTorch 2.x runs F.scaled_dot_product_attention, as
#   dtrain does on LibTorch 2.x (benchmarks/peer-comparison.sh's like-for-like setting).
# Output under ${OUT:-report/bench}: profile_<run>.json per run, their metrics .jsonl, and
# profile.md: per run pair, the top ${TOP:-25} operators by self time (the larger of the two
# sides), per step, then the sum of self times of all recorded operators, the measured step
# time, and the difference (time outside every recorded operator: the Python interpreter, or
# dtrain's own C++ between operators, waits). Profiling adds a little time per operator call
# on both sides; compare the profiled step times with peer-comparison.sh's to see how much.
# PEER_TORCH=forky: everything inside scripts/chroot.sh's forky root (PyTorch 2.14, dtrain
# built in build-forky/), and the FSDP pair is FSDP2 (fully_shard per block, then the root).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ "${PEER_TORCH:-system}" = forky ] && [ -z "${PEER_IN_ROOT:-}" ]; then
  "$root/scripts/chroot.sh" create forky
  # chroot.sh passes OUT and DTRAIN_* on; this script's other knobs go explicitly.
  exec "$root/scripts/chroot.sh" run forky env PEER_IN_ROOT=1 PEER_TORCH=forky \
    DDP="${DDP:-0}" FSDP="${FSDP:-0}" PROFILE_STEPS="${PROFILE_STEPS:-5}" TOP="${TOP:-25}" \
    DTRAIN_BUILD_DIR="${DTRAIN_BUILD_DIR:-$root/build-forky}" "$root/benchmarks/peer-profile.sh"
fi
build="${DTRAIN_BUILD_DIR:-$root/build}"
out="${OUT:-$root/report/bench}"
profile_steps="${PROFILE_STEPS:-5}"
steps=$((5 + profile_steps))
top="${TOP:-25}"
mkdir -p "$out"
. "$root/benchmarks/peer-setup.sh"
train="$build/examples/gpt2/gpt2_train"
if [ -f "$build/CMakeCache.txt" ]; then
  # An existing build may predate --profile_out: bring the trainer up to date (a no-op if it is).
  cmake --build "$build" -j "${DTRAIN_JOBS:-$(nproc)}" --target gpt2_train dtrain-run >/dev/null
else
  "$root/scripts/build.sh"
fi
peer_same_blas_kernel
dt=(--model tiny --data random --batch 8 --steps "$steps" --val_every 0 --sample_tokens 0 --seed 1
  --profile_steps "$profile_steps")
attention=explicit
if /usr/bin/python3 -c 'import sys, torch.nn.functional as F; sys.exit(not hasattr(F, "scaled_dot_product_attention"))'; then
  attention=sdpa
fi
py() { /usr/bin/python3 "$root/benchmarks/peer_pytorch_gpt2.py" --batch 8 --steps "$steps" \
  --attention "$attention" --profile_steps "$profile_steps" "$@"; }
py --nproc 1 --metrics_out "$out/profile_torch_single.jsonl" \
  --profile_out "$out/profile_torch_single.json"
"$train" "${dt[@]}" --strategy single --loss standard \
  --metrics_out "$out/profile_dtrain_single_std.jsonl" \
  --profile_out "$out/profile_dtrain_single_std.json" >/dev/null
"$train" "${dt[@]}" --strategy single --metrics_out "$out/profile_dtrain_single.jsonl" \
  --profile_out "$out/profile_dtrain_single.json" >/dev/null
pairs=("single process, dtrain with the same model code (--loss standard):torch_single:dtrain_single_std"
  "single process, dtrain with its default fused LM-head loss:torch_single:dtrain_single")
if [ "${DDP:-0}" = 1 ]; then
  py --nproc 2 --port 29641 --metrics_out "$out/profile_torch_ddp.jsonl" \
    --profile_out "$out/profile_torch_ddp.json"
  "$train" "${dt[@]}" --strategy ddp --nproc 2 --metrics_out "$out/profile_dtrain_ddp.jsonl" \
    --profile_out "$out/profile_dtrain_ddp.json" >/dev/null
  pairs+=("DDP, 2 ranks (rank 0):torch_ddp:dtrain_ddp")
fi
if [ "${FSDP:-0}" = 1 ]; then
  torch_fsdp=fsdp  # FSDP1; PyTorch 2.14 (forky): FSDP2
  [ "${PEER_TORCH:-system}" = forky ] && torch_fsdp=fsdp2
  py --nproc 2 --strategy "$torch_fsdp" --port 29643 --metrics_out "$out/profile_torch_fsdp.jsonl" \
    --profile_out "$out/profile_torch_fsdp.json"
  "$train" "${dt[@]}" --strategy fsdp --nproc 2 --loss standard \
    --metrics_out "$out/profile_dtrain_fsdp_std.jsonl" \
    --profile_out "$out/profile_dtrain_fsdp_std.json" >/dev/null
  pairs+=("FSDP, 2 ranks (rank 0), PyTorch ${torch_fsdp^^}, dtrain with the same model code (--loss standard):torch_fsdp:dtrain_fsdp_std")
fi
/usr/bin/python3 - "$out" "$top" "${pairs[@]}" <<'PY' | tee "$out/profile.md"
import json, sys
out, top, pairs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
print("Per-operator CPU time per step (self time: inclusive minus nested recorded operators), "
      "GPT-2 tiny, batch 8 per rank, synthetic tokens; `calls` per step.\n")
for pair in pairs:
    label, a_name, b_name = pair.split(":")
    a, b = (json.load(open(f"{out}/profile_{n}.json")) for n in (a_name, b_name))
    pa, pb = ({o["name"]: o for o in d["ops"]} for d in (a, b))
    na, nb = a["steps"], b["steps"]
    def ms(d, n, name, key="self_s"):
        return d[name][key] * 1e3 / n if name in d else 0.0
    def calls(d, n, name):
        return f"{d[name]['calls'] / n:g}" if name in d else "-"
    names = sorted(set(pa) | set(pb), key=lambda k: -max(ms(pa, na, k), ms(pb, nb, k)))
    print(f"### {label}: PyTorch {na} steps, dtrain {nb} steps\n")
    print("| op | PyTorch ms/step | dtrain ms/step | dtrain − PyTorch (ms/step) "
          "| PyTorch calls/step | dtrain calls/step |")
    print("|---|---:|---:|---:|---:|---:|")
    for k in names[:top]:
        x, y = ms(pa, na, k), ms(pb, nb, k)
        print(f"| `{k}` | {x:.2f} | {y:.2f} | {y - x:+.2f} | {calls(pa, na, k)} | {calls(pb, nb, k)} |")
    rest = names[top:]
    x = sum(ms(pa, na, k) for k in rest)
    y = sum(ms(pb, nb, k) for k in rest)
    print(f"| other {len(rest)} ops | {x:.2f} | {y:.2f} | {y - x:+.2f} | | |")
    sa = sum(o["self_s"] for o in a["ops"]) * 1e3 / na
    sb = sum(o["self_s"] for o in b["ops"]) * 1e3 / nb
    wa, wb = a["wall_s"] * 1e3 / na, b["wall_s"] * 1e3 / nb
    ca = sum(o["calls"] for o in a["ops"]) / na
    cb = sum(o["calls"] for o in b["ops"]) / nb
    print(f"| **sum of self times, all recorded ops** | {sa:.2f} | {sb:.2f} | {sb - sa:+.2f} "
          f"| {ca:g} | {cb:g} |")
    print(f"| **measured wall time per step** | {wa:.2f} | {wb:.2f} | {wb - wa:+.2f} | | |")
    print(f"| **outside recorded ops (wall − sum)** | {wa - sa:.2f} | {wb - sb:.2f} "
          f"| {(wb - sb) - (wa - sa):+.2f} | | |")
    print()
PY
