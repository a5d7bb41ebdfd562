#!/usr/bin/env bash
# dtrain vs PyTorch's own (Python) training on the same GPT-2 `tiny` shape, synthetic
# tokens and per-rank batch, alternating runs in one session.
#
# PEER_TORCH=system (default): the machine's Debian python3-torch (bookworm: PyTorch 1.13)
#   against dtrain in ${DTRAIN_BUILD_DIR:-build}: PyTorch single process, PyTorch DDP (Gloo, 2
#   ranks), dtrain single and ddp (2 ranks) each with --loss standard (the same model code as
#   PyTorch's script) and with the default fused LM-head loss, dtrain fsdp (2 ranks).
#   PyTorch 1.13's FSDP cannot run on this CPU-only Python (it fails at import on Python 3.11
#   and requires CUDA), so FSDP has no peer there.
# PEER_TORCH=trixie: everything inside scripts/chroot.sh's trixie `cpu` root: PyTorch 2.6
#   (python3-torch, USE_LIBUV=0: Debian builds it without libuv) against dtrain built on
#   LibTorch 2.6 in build-trixie/ (scripts/ci-legs.sh cpu builds it). PyTorch runs what a 2.x
#   user writes: F.scaled_dot_product_attention, DDP, and FSDP1 (FullyShardedDataParallel,
#   full shard, one unit per block, device_id cpu; 2.6's fully_shard/FSDP2 fails on CPU with
#   "'Stream' object has no attribute 'record_event'"). dtrain's models use
#   at::scaled_dot_product_attention on 2.6 (src/compat/attention.h). Two labelled tables:
#     like for like  dtrain --loss standard (the same model code, fused attention both sides),
#                    so the ratio measures the library, not the example's fused loss;
#     whole example  dtrain's defaults (fused LM-head loss) against the same PyTorch runs.
# PEER_TORCH=forky: the same inside scripts/chroot.sh's forky root: PyTorch 2.14 against dtrain
#   built on LibTorch 2.14 in build-forky/ (scripts/ci-legs.sh forky builds it), one compiler
#   and one OpenBLAS for both. PyTorch's FSDP is FSDP2 (fully_shard on each block, then the
#   root), with FSDP1 as an extra row. Every distributed PyTorch run first checks its step 0
#   against one process on the global batch (peer_pytorch_gpt2.py --check_single) and the
#   script stops if it differs.
#
# Output: ${OUT:-report/bench}/peer.md with medians and dtrain/PyTorch ratios, and with
# PEER_TORCH=forky peer-goals.json: issue 40's goals for benchmarks/results/make-table.py.
# STEPS (25), REPEATS (2), TORCH_MALLOC=dtrain|default (below), OMP_WAIT_POLICY (PASSIVE;
# "default": libgomp's own, see peer-setup.sh).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
peer="${PEER_TORCH:-system}"
case "$peer" in
  system) ;;
  trixie)
    if [ -z "${PEER_IN_ROOT:-}" ]; then
      "$root/scripts/chroot.sh" create cpu
      exec "$root/scripts/chroot.sh" run cpu env PEER_IN_ROOT=1 PEER_TORCH=trixie \
        DTRAIN_BUILD_DIR="${DTRAIN_BUILD_DIR:-$root/build-trixie}" "$root/benchmarks/peer-comparison.sh"
    fi
    ;;
  forky)
    if [ -z "${PEER_IN_ROOT:-}" ]; then
      "$root/scripts/chroot.sh" create forky
      exec "$root/scripts/chroot.sh" run forky env PEER_IN_ROOT=1 PEER_TORCH=forky \
        DTRAIN_BUILD_DIR="${DTRAIN_BUILD_DIR:-$root/build-forky}" "$root/benchmarks/peer-comparison.sh"
    fi
    ;;
  *) echo "peer-comparison: PEER_TORCH must be system, trixie or forky, not '$peer'" >&2; exit 2 ;;
esac
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
# (docs/benchmarks-history.md, "Host memory"). TORCH_MALLOC=default: PyTorch as it starts.
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
torch_attention=explicit
strategies=(single ddp)
torch_fsdp=fsdp  # PyTorch's FSDP of the comparison: FSDP1 on 2.6, FSDP2 on 2.14
check=()         # --check_single: 2.14's runs first prove they train what one process does
if [ "$peer" != system ]; then
  torch_attention=sdpa
  strategies=(single ddp fsdp)
fi
if [ "$peer" = forky ]; then
  torch_fsdp=fsdp2
  check=(--check_single)
fi
echo "peer: $(/usr/bin/python3 -c 'import torch; print("PyTorch", torch.__version__)'), attention $torch_attention" >&2
for i in $(seq 1 "$repeats"); do
  for s in "${strategies[@]}"; do
    if [ "$s" = single ]; then
      py --nproc 1 --attention "$torch_attention" --metrics_out "$out/peer_torch_single_$i.jsonl"
      nproc=()
    else
      ts="$s"
      [ "$s" = fsdp ] && ts="$torch_fsdp"
      py --nproc 2 --strategy "$ts" --attention "$torch_attention" --port $((29600 + i)) \
        --metrics_out "$out/peer_torch_${ts}_$i.jsonl" "${check[@]}"
      if [ "$ts" = fsdp2 ]; then  # FSDP1 as an extra row
        py --nproc 2 --strategy fsdp --attention "$torch_attention" --port $((29620 + i)) \
          --metrics_out "$out/peer_torch_fsdp_$i.jsonl" "${check[@]}"
      fi
      nproc=(--nproc 2)
    fi
    "$train" "${dt[@]}" --strategy "$s" "${nproc[@]}" --loss standard \
      --metrics_out "$out/peer_dtrain_${s}_std_$i.jsonl" >/dev/null
    "$train" "${dt[@]}" --strategy "$s" "${nproc[@]}" --metrics_out "$out/peer_dtrain_${s}_$i.jsonl" >/dev/null
  done
  if [ "$peer" = system ]; then  # no FSDP peer on PyTorch 1.13 (above)
    "$train" "${dt[@]}" --strategy fsdp --nproc 2 --metrics_out "$out/peer_dtrain_fsdp_$i.jsonl" >/dev/null
  fi
done
/usr/bin/python3 - "$out" "$repeats" "$peer" <<'PY' | tee "$out/peer.md"
import json, statistics, sys
out, repeats, peer = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def med(name, key):
    vals = []
    for i in range(1, repeats + 1):
        rows = [json.loads(l) for l in open(f"{out}/peer_{name}_{i}.jsonl") if l.strip()]
        rows = [r for r in rows if r.get("kind") == "step"]
        rows = rows[min(5, len(rows) - 1):]  # warm-up steps out (a smoke run keeps its last)
        vals.append(statistics.median(r[key] for r in rows))
    return statistics.median(vals)
def peak(name):
    return max(json.loads(l)["peak_rss_mib"] for i in range(1, repeats + 1)
               for l in open(f"{out}/peer_{name}_{i}.jsonl") if l.strip())
def table(title, rows):
    print(f"\n{title}\n")
    print("| run | tokens/s | peak RSS per rank (MiB) | tokens/s vs PyTorch | RSS vs PyTorch |\n|---|---|---|---|---|")
    for label, name, base in rows:
        t, m = med(name, "tokens_per_s"), peak(name)
        r = f"{t/med(base,'tokens_per_s'):.2f}x | {m/peak(base):.2f}x" if base else "1.00x | 1.00x"
        print(f"| {label} | {t:.0f} | {m:.0f} | {r} |")
if peer == "system":
    table("PyTorch (machine's python3-torch), explicit attention on both sides", [
        ("PyTorch single", "torch_single", None),
        ("dtrain single, standard loss", "dtrain_single_std", "torch_single"),
        ("dtrain single, fused loss (default)", "dtrain_single", "torch_single"),
        ("PyTorch DDP, 2 ranks", "torch_ddp", None),
        ("dtrain ddp, 2 ranks, standard loss", "dtrain_ddp_std", "torch_ddp"),
        ("dtrain ddp, 2 ranks, fused loss (default)", "dtrain_ddp", "torch_ddp"),
        ("dtrain fsdp, 2 ranks, fused loss (default)", "dtrain_fsdp", "torch_ddp")])
elif peer == "forky":
    table("Like for like: PyTorch 2.14 vs dtrain on LibTorch 2.14, --loss standard, fused attention (SDPA) on both sides", [
        ("PyTorch single", "torch_single", None),
        ("dtrain single, standard loss", "dtrain_single_std", "torch_single"),
        ("PyTorch DDP, 2 ranks", "torch_ddp", None),
        ("dtrain ddp, 2 ranks, standard loss", "dtrain_ddp_std", "torch_ddp"),
        ("PyTorch FSDP2 (fully_shard per block, then the root), 2 ranks", "torch_fsdp2", None),
        ("dtrain fsdp, 2 ranks, standard loss", "dtrain_fsdp_std", "torch_fsdp2"),
        ("PyTorch FSDP1 (full shard, unit per block), 2 ranks (extra row)", "torch_fsdp", None),
        ("dtrain fsdp, 2 ranks, standard loss, vs FSDP1", "dtrain_fsdp_std", "torch_fsdp")])
    table("Whole example: dtrain's defaults (fused LM-head loss) vs the same PyTorch 2.14 runs", [
        ("dtrain single (default)", "dtrain_single", "torch_single"),
        ("dtrain ddp, 2 ranks (default)", "dtrain_ddp", "torch_ddp"),
        ("dtrain fsdp, 2 ranks (default), vs FSDP2", "dtrain_fsdp", "torch_fsdp2")])
    # Issue 40's goals, as benchmarks/results/make-table.py reads them (peer-goals.json; the
    # measurement's date, commit, machine and BLAS are added when it is copied there).
    goals = []
    def goal(text, target, name, base, key):
        get = (lambda n: med(n, key)) if key == "tokens_per_s" else peak
        unit = "tokens/s" if key == "tokens_per_s" else "MiB"
        goals.append({"goal": text, "issue": 40, "target": target, "value": round(get(name)),
                      "reference": round(get(base)), "unit": unit})
    for what, name, base, ref, target in [
            ("single, like for like", "dtrain_single_std", "torch_single", "PyTorch 2.14 single", ">= 1.0"),
            ("DDP x2, like for like", "dtrain_ddp_std", "torch_ddp", "PyTorch 2.14 DDP x2", ">= 1.05"),
            ("FSDP x2, like for like", "dtrain_fsdp_std", "torch_fsdp2", "PyTorch 2.14 FSDP2 x2", ">= 1.15"),
            ("single, whole example", "dtrain_single", "torch_single", "PyTorch 2.14 single", ">= 1.3"),
            ("DDP x2, whole example", "dtrain_ddp", "torch_ddp", "PyTorch 2.14 DDP x2", ">= 1.3"),
            ("FSDP x2, whole example", "dtrain_fsdp", "torch_fsdp2", "PyTorch 2.14 FSDP2 x2", ">= 1.3")]:
        goal(f"{what}: tokens/s vs {ref}", target, name, base, "tokens_per_s")
    for what, name, base, ref in [
            ("single, whole example", "dtrain_single", "torch_single", "PyTorch 2.14 single"),
            ("DDP x2, whole example", "dtrain_ddp", "torch_ddp", "PyTorch 2.14 DDP x2"),
            ("FSDP x2, whole example", "dtrain_fsdp", "torch_fsdp2", "PyTorch 2.14 FSDP2 x2")]:
        goal(f"{what}: peak RSS per rank vs {ref}", "<= 0.6", name, base, "peak_rss_mib")
    json.dump({"goals": goals}, open(f"{out}/peer-goals.json", "w"), indent=1)
else:
    table("Like for like: PyTorch 2.6 vs dtrain on LibTorch 2.6, --loss standard, fused attention (SDPA) on both sides", [
        ("PyTorch single", "torch_single", None),
        ("dtrain single, standard loss", "dtrain_single_std", "torch_single"),
        ("PyTorch DDP, 2 ranks", "torch_ddp", None),
        ("dtrain ddp, 2 ranks, standard loss", "dtrain_ddp_std", "torch_ddp"),
        ("PyTorch FSDP1 (full shard, unit per block), 2 ranks", "torch_fsdp", None),
        ("dtrain fsdp, 2 ranks, standard loss", "dtrain_fsdp_std", "torch_fsdp")])
    table("Whole example: dtrain's defaults (fused LM-head loss) vs the same PyTorch 2.6 runs", [
        ("dtrain single (default)", "dtrain_single", "torch_single"),
        ("dtrain ddp, 2 ranks (default)", "dtrain_ddp", "torch_ddp"),
        ("dtrain fsdp, 2 ranks (default)", "dtrain_fsdp", "torch_fsdp")])
PY
