#!/usr/bin/env bash
# dtrain vs PyTorch's own (Python) training on the same GPT-2 `tiny` shape, synthetic
# tokens and per-rank batch, alternating runs in one session:
#   PyTorch single process, PyTorch DDP (Gloo, 2 ranks), dtrain single and ddp (2 ranks)
#   each with --loss standard (the same model code as PyTorch's script) and with the
#   default fused LM-head loss, dtrain fsdp (2 ranks). PyTorch 1.13's FSDP cannot run on this CPU-only Python
#   (it fails at import on Python 3.11 and requires CUDA), so FSDP has no peer here.
# Output: ${OUT:-report/bench}/peer.md with medians and dtrain/PyTorch ratios.
# STEPS (25), REPEATS (2), TORCH_MALLOC=dtrain|default (below), OMP_WAIT_POLICY (PASSIVE;
# "default": libgomp's own, see peer-setup.sh).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${DTRAIN_BUILD_DIR:-$root/build}"
out="${OUT:-$root/report/bench}"
steps="${STEPS:-25}"
repeats="${REPEATS:-2}"
mkdir -p "$out"
. "$root/benchmarks/peer-setup.sh"
train="$build/examples/gpt2/gpt2_train"
[ -x "$train" ] || "$root/scripts/build.sh"
peer_same_blas_kernel
dt=(--model tiny --data random --batch 8 --steps "$steps" --val_every 0 --sample_tokens 0 --seed 1)
# PyTorch runs with the malloc setting gpt2_train applies to itself (--malloc_tuning: 4 MiB
# mmap/trim thresholds, huge pages), so the comparison measures training, not page faults
# (docs/benchmarks.md, "Host memory"). TORCH_MALLOC=default: PyTorch as it starts.
torch_env=()
if [ "${TORCH_MALLOC:-dtrain}" = dtrain ] && [ -z "${GLIBC_TUNABLES:-}" ]; then
  torch_env=(env GLIBC_TUNABLES=glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=4194304:glibc.malloc.trim_threshold=4194304)
fi
echo "peer: PyTorch runs with ${torch_env[*]:-its default malloc}" >&2
py() {
  "${torch_env[@]}" /usr/bin/python3 "$root/benchmarks/peer_pytorch_gpt2.py" --batch 8 \
    --steps "$steps" "$@"
}
# dtrain runs twice per strategy: with the model code PyTorch's script runs (--loss standard:
# logits, then cross_entropy) and with the example's default fused LM-head loss.
for i in $(seq 1 "$repeats"); do
  py --nproc 1 --metrics_out "$out/peer_torch_single_$i.jsonl"
  "$train" "${dt[@]}" --strategy single --loss standard \
    --metrics_out "$out/peer_dtrain_single_std_$i.jsonl" >/dev/null
  "$train" "${dt[@]}" --strategy single --metrics_out "$out/peer_dtrain_single_$i.jsonl" >/dev/null
  py --nproc 2 --port $((29600 + i)) --metrics_out "$out/peer_torch_ddp_$i.jsonl"
  "$train" "${dt[@]}" --strategy ddp --nproc 2 --loss standard \
    --metrics_out "$out/peer_dtrain_ddp_std_$i.jsonl" >/dev/null
  "$train" "${dt[@]}" --strategy ddp --nproc 2 --metrics_out "$out/peer_dtrain_ddp_$i.jsonl" >/dev/null
  "$train" "${dt[@]}" --strategy fsdp --nproc 2 --metrics_out "$out/peer_dtrain_fsdp_$i.jsonl" >/dev/null
done
/usr/bin/python3 - "$out" "$repeats" <<'PY' | tee "$out/peer.md"
import json, statistics, sys
out, repeats = sys.argv[1], int(sys.argv[2])
def med(name, key):
    vals = []
    for i in range(1, repeats + 1):
        rows = [json.loads(l) for l in open(f"{out}/peer_{name}_{i}.jsonl") if l.strip()]
        rows = [r for r in rows if r.get("kind") == "step"][5:]
        vals.append(statistics.median(r[key] for r in rows))
    return statistics.median(vals)
def peak(name):
    return max(json.loads(l)["peak_rss_mib"] for i in range(1, repeats + 1)
               for l in open(f"{out}/peer_{name}_{i}.jsonl") if l.strip())
print("| run | tokens/s | peak RSS per rank (MiB) | tokens/s vs PyTorch | RSS vs PyTorch |\n|---|---|---|---|---|")
rows = [("PyTorch single", "torch_single", None),
        ("dtrain single, standard loss", "dtrain_single_std", "torch_single"),
        ("dtrain single, fused loss (default)", "dtrain_single", "torch_single"),
        ("PyTorch DDP, 2 ranks", "torch_ddp", None),
        ("dtrain ddp, 2 ranks, standard loss", "dtrain_ddp_std", "torch_ddp"),
        ("dtrain ddp, 2 ranks, fused loss (default)", "dtrain_ddp", "torch_ddp"),
        ("dtrain fsdp, 2 ranks, fused loss (default)", "dtrain_fsdp", "torch_ddp")]
for label, name, base in rows:
    t, m = med(name, "tokens_per_s"), peak(name)
    r = f"{t/med(base,'tokens_per_s'):.2f}x | {m/peak(base):.2f}x" if base else "1.00x | 1.00x"
    print(f"| {label} | {t:.0f} | {m:.0f} | {r} |")
PY
