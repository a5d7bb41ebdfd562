#!/usr/bin/env bash
# What a training step costs the host, dtrain against PyTorch 2.14 eager (issue 41), both in
# scripts/chroot.sh's forky root (LibTorch 2.14.1 / PyTorch 2.14.1, one compiler, one OpenBLAS),
# dtrain built in build-forky/ (scripts/ci-legs.sh forky builds it; this builds the two targets):
#
#   1. Launch accounting: outermost ATen calls per steady-state step for GPT-2 124M's topology
#      (12 layers, 12 heads, dim 768, vocab 50257; ctx 64, batch 1: the count does not depend
#      on them). dtrain: dtrain_bench_launches on the fake accelerator (the CUDA code path),
#      with --loss standard (PyTorch's model code) and fused (the example's default); PyTorch:
#      benchmarks/launch_pytorch.py --mode count (torch.autograd.profiler's events, the same
#      counting rule). Also dtrain's host reads of device memory per step.
#   2. The overhead-bound proxy: the same topology with tiny widths (dim 48, ctx 64, batch 1,
#      one thread), where a step's time is mostly the framework's own cost per operator.
#      Like for like: dtrain_bench_launches --device cpu --loss standard against
#      launch_pytorch.py --mode time, the same step; also with vocab 512 (the 50257-wide LM
#      head is then no longer the step's largest cost). Whole example: gpt2_train's own
#      step_time_s (dtrain's defaults: fused loss) at the same shape. Medians of each run's
#      median over STEPS steps after 10 warm-up steps, ROUNDS alternating rounds.
#
#   benchmarks/launch-overhead.sh            # OUT=report/launch, ROUNDS=3, STEPS=50
# Writes OUT/launch.md (the tables), OUT/*.jsonl (every run's line) and OUT/launch-overhead.json
# (benchmarks/results/make-table.py's format, with date, commit, machine and BLAS).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${PEER_IN_ROOT:-}" ]; then
  "$root/scripts/chroot.sh" create forky
  exec "$root/scripts/chroot.sh" run forky env PEER_IN_ROOT=1 OUT="${OUT:-}" \
    ROUNDS="${ROUNDS:-}" STEPS="${STEPS:-}" DTRAIN_BUILD_DIR="${DTRAIN_BUILD_DIR:-$root/build-forky}" \
    "$root/benchmarks/launch-overhead.sh"
fi
build="${DTRAIN_BUILD_DIR:-$root/build-forky}"
out="${OUT:-$root/report/launch}"
[ -n "$out" ] || out="$root/report/launch"
rounds="${ROUNDS:-3}"
[ -n "$rounds" ] || rounds=3
steps="${STEPS:-50}"
[ -n "$steps" ] || steps=50
mkdir -p "$out"
. "$root/benchmarks/peer-setup.sh"
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDTRAIN_WERROR=ON
fi
cmake --build "$build" -j "${DTRAIN_JOBS:-$(nproc)}" --target dtrain_bench_launches gpt2_train dtrain-run >/dev/null
peer_same_blas_kernel
bench="$build/benchmarks/dtrain_bench_launches"
py=(/usr/bin/python3 "$root/benchmarks/launch_pytorch.py")
topology=(--layers 12 --heads 12 --vocab 50257)

# 1. Launch accounting (deterministic: one run each).
"$bench" --device fake "${topology[@]}" --dim 768 --ctx 64 --loss standard > "$out/count_dtrain_std.jsonl"
"$bench" --device fake "${topology[@]}" --dim 768 --ctx 64 --loss fused > "$out/count_dtrain_fused.jsonl"
"${py[@]}" --mode count "${topology[@]}" --dim 768 --ctx 64 2>/dev/null > "$out/count_torch.jsonl"
# The fake device has no fused attention kernel: SDPA runs its math backend there. PyTorch
# with the same backend is the like-for-like count.
"${py[@]}" --mode count --attention math "${topology[@]}" --dim 768 --ctx 64 2>/dev/null \
  > "$out/count_torch_math.jsonl"

# 2. The proxy, alternating sides each round.
proxy=(--layers 12 --heads 12 --dim 48 --ctx 64 --batch 1 --threads 1 --warmup 10 --steps "$steps")
for i in $(seq 1 "$rounds"); do
  for vocab in 50257 512; do
    "${py[@]}" --mode time "${proxy[@]}" --vocab "$vocab" > "$out/time_torch_v${vocab}_$i.jsonl"
    "$bench" --device cpu "${proxy[@]}" --vocab "$vocab" --loss standard > "$out/time_dtrain_v${vocab}_$i.jsonl"
  done
  "$build/examples/gpt2/gpt2_train" --model gpt2 --layers 12 --heads 12 --dim 48 --ctx 64 \
    --batch 1 --threads 1 --data random --steps $((steps + 10)) --val_every 0 --sample_tokens 0 \
    --log_every 1000 --seed 1 --metrics_out "$out/time_gpt2_train_$i.jsonl" >/dev/null
done

/usr/bin/python3 - "$out" "$rounds" "$root" <<'PY' | tee "$out/launch.md"
import json, platform, statistics, subprocess, sys, datetime
out, rounds, root = sys.argv[1], int(sys.argv[2]), sys.argv[3]
line = lambda path: json.loads(open(path).readline())
d_std, d_fused, t_flash, t = (line(f"{out}/count_{n}.jsonl")
                              for n in ("dtrain_std", "dtrain_fused", "torch", "torch_math"))
print("Launch accounting: outermost ATen calls per steady-state training step, GPT-2 124M's "
      "topology (12 layers, 12 heads, dim 768, vocab 50257; ctx 64, batch 1), fp32, SDPA, "
      "fused AdamW, foreach clip at 1.0. dtrain on the fake accelerator (the CUDA code path), "
      "whose SDPA has no fused kernel and runs its math backend; PyTorch on CPU tensors with "
      "that backend (like for like) and with its flash kernel (what CUDA runs)\n")
print("| side | ATen calls per step | vs PyTorch (math attention) | host reads per step |\n|---|---|---|---|")
print(f"| PyTorch {t['torch']} eager, SDPA math backend | {t['ops_per_step']:g} | 1.00x | n/a |")
print(f"| PyTorch {t['torch']} eager, SDPA flash kernel | {t_flash['ops_per_step']:g} "
      f"| {t_flash['ops_per_step'] / t['ops_per_step']:.2f}x | n/a |")
for label, d in (("dtrain, fake accelerator, --loss standard (like for like)", d_std),
                 ("dtrain, fake accelerator, fused LM-head loss (whole example's loss)", d_fused)):
    print(f"| {label} | {d['ops_per_step']:g} | {d['ops_per_step'] / t['ops_per_step']:.2f}x "
          f"| {d['host_reads_per_step']:g} |")
names = sorted(set(d_std["by_name"]) | set(t["by_name"]),
               key=lambda n: -max(d_std["by_name"].get(n, 0), t["by_name"].get(n, 0)))
print("\nWhere the calls differ (like for like: dtrain vs PyTorch with math attention), per step:\n")
print("| operator | dtrain | PyTorch |\n|---|---|---|")
for n in names:
    a, b = d_std["by_name"].get(n, 0), t["by_name"].get(n, 0)
    if a != b:
        print(f"| `{n}` | {a:g} | {b:g} |")

def med(pattern, key="median_step_s"):
    return statistics.median(line(f"{out}/{pattern}_{i}.jsonl")[key] for i in range(1, rounds + 1))
def trainer_med():
    vals = []
    for i in range(1, rounds + 1):
        rows = [json.loads(l) for l in open(f"{out}/time_gpt2_train_{i}.jsonl") if l.strip()]
        rows = [r for r in rows if r.get("kind") == "step"][10:]
        vals.append(statistics.median(r["step_time_s"] for r in rows))
    return statistics.median(vals)
tv, dv = med("time_torch_v50257"), med("time_dtrain_v50257")
ts, ds = med("time_torch_v512"), med("time_dtrain_v512")
gt = trainer_med()
print(f"\nOverhead-bound proxy: 12 layers, 12 heads, dim 48, ctx 64, batch 1, one thread, fp32; "
      f"median step time (ms), medians of {rounds} alternating rounds\n")
print("| comparison | vocab | PyTorch eager | dtrain | dtrain / PyTorch |\n|---|---|---|---|---|")
print(f"| like for like (the same step: dtrain_bench_launches vs launch_pytorch.py) | 50257 | {tv*1e3:.2f} | {dv*1e3:.2f} | {dv/tv:.2f}x |")
print(f"| like for like | 512 | {ts*1e3:.2f} | {ds*1e3:.2f} | {ds/ts:.2f}x |")
print(f"| whole example (gpt2_train's step_time_s, fused loss) | 50257 | {tv*1e3:.2f} | {gt*1e3:.2f} | {gt/tv:.2f}x |")

commit = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                        text=True).stdout.strip() or None
model = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
flags = next((l.split(":", 1)[1].split() for l in open("/proc/cpuinfo") if l.startswith("flags")), [])
isa = "AVX-512" if "avx512f" in flags else ("AVX2" if "avx2" in flags else "no AVX2")
blas = subprocess.run([f"{root}/build-forky/src/launcher/dtrain-run", "--blas_info"], capture_output=True,
                      text=True).stdout.splitlines()
blas = blas[0].removeprefix("blas: ") if blas else None
goals = [
    {"goal": "launch accounting: ATen calls per GPT-2 124M step (fake accelerator, like for like: SDPA math backend on both sides) vs PyTorch 2.14 eager's",
     "issue": 41, "target": "<= 1.0", "value": d_std["ops_per_step"], "reference": t["ops_per_step"], "unit": "calls/step"},
    {"goal": "blocking device-to-host reads per steady-state step (fake accelerator, default path)",
     "issue": 41, "target": "<= 0", "value": d_std["host_reads_per_step"], "unit": "reads/step"},
    {"goal": "overhead-bound proxy (dim 48, vocab 50257), like for like: step time vs PyTorch 2.14 eager",
     "issue": 41, "target": "<= 0.5", "value": round(dv * 1e3, 3), "reference": round(tv * 1e3, 3), "unit": "ms"},
    {"goal": "overhead-bound proxy (dim 48, vocab 512), like for like: step time vs PyTorch 2.14 eager",
     "issue": 41, "target": "<= 0.5", "value": round(ds * 1e3, 3), "reference": round(ts * 1e3, 3), "unit": "ms"},
    {"goal": "overhead-bound proxy (dim 48, vocab 50257), whole example (gpt2_train): step time vs PyTorch 2.14 eager",
     "issue": 41, "target": "<= 0.5", "value": round(gt * 1e3, 3), "reference": round(tv * 1e3, 3), "unit": "ms"},
]
json.dump({
    "measurement": f"Host cost of a training step, dtrain vs PyTorch {t['torch']} eager in the forky root: ATen calls per GPT-2 124M step (dtrain on the fake accelerator, the CUDA code path) and the overhead-bound proxy's step time (dim 48, one thread), medians of {rounds} alternating rounds",
    "date": datetime.date.today().isoformat(), "commit": commit,
    "machine": f"{model}, {isa}, {subprocess.run(['nproc'], capture_output=True, text=True).stdout.strip()} cores",
    "blas": blas, "command": "benchmarks/launch-overhead.sh",
    "source": "benchmarks/results/launch-overhead/ (launch.md: the tables; *.jsonl: every run)",
    "goals": goals}, open(f"{out}/launch-overhead.json", "w"), indent=1)
PY
