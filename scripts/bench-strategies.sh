#!/usr/bin/env bash
# Strategy benchmarks on the GPT-2 `tiny` model (synthetic tokens), measured with the
# trainer itself so the numbers are what users get:
#   1. DataParallel at world size 1 vs SingleDevice (per-step overhead of DDP's machinery)
#   2. DDP with 2 ranks: exposed communication (comm_wait_s) vs total (comm_total_s)
#   3. FSDP FULL_SHARD vs DDP at 4 ranks: model-state memory and peak RSS per rank
#   4. FSDP vs DDP throughput at 2 ranks
#   5. DDP step time vs bucket_cap_mb at 2 ranks: the Google Benchmark program
#      dtrain_bench_bucketing (same model, batch and optimizer), run REPEATS times
# Runs of the strategies being compared alternate, several times, in one session.
# Output: ${OUT:-report/bench}/strategies.md (Markdown tables) and the raw JSONL.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${DTRAIN_BUILD_DIR:-$root/build}"
out="${OUT:-$root/report/bench}"
steps="${STEPS:-25}"
repeats="${REPEATS:-3}"
mkdir -p "$out"
train="$build/examples/gpt2/gpt2_train"
bucketing="$build/benchmarks/dtrain_bench_bucketing"
[ -x "$train" ] && [ -x "$bucketing" ] || "$root/scripts/build.sh"
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"  # spinning OpenMP threads distort shared-core timings
common=(--model tiny --data random --batch 8 --steps "$steps" --val_every 0 --sample_tokens 0 --seed 1)

run() {  # run NAME ARGS... -> $out/NAME.jsonl
  local name=$1
  shift
  "$train" "${common[@]}" "$@" --metrics_out "$out/$name.jsonl" >"$out/$name.log" 2>&1 ||
    { echo "bench-strategies: $name failed, see $out/$name.log" >&2; exit 1; }
}

for i in $(seq 1 "$repeats"); do
  run "single_$i" --strategy single
  run "ddp1_$i" --strategy ddp --nproc 1
done
for i in $(seq 1 "$repeats"); do
  run "ddp2_$i" --strategy ddp --nproc 2
  run "fsdp2_$i" --strategy fsdp --nproc 2
done
run ddp4 --strategy ddp --nproc 4 --steps 6
run fsdp4 --strategy fsdp --nproc 4 --steps 6
buckets="0.25,1,5,25,100"
for i in $(seq 1 "$repeats"); do
  "$bucketing" --nproc=2 --model=tiny --batch=8 --bucket_cap_mb="$buckets" --warmup=3 --steps=10 \
    --benchmark_out="$out/bucketing_$i.json" --benchmark_out_format=json >"$out/bucketing_$i.log" 2>&1 ||
    { echo "bench-strategies: dtrain_bench_bucketing failed, see $out/bucketing_$i.log" >&2; exit 1; }
done

python3 - "$out" "$steps" "$repeats" <<'PY' | tee "$out/strategies.md"
import json, statistics, sys, subprocess
out, steps, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def steps_of(name):
    rows = [json.loads(l) for l in open(f"{out}/{name}.jsonl") if l.strip()]
    return [r for r in rows if r.get("kind") == "step"]
def steady(name, skip=5):
    s = steps_of(name)
    return s[skip:] if len(s) > skip + 2 else s[1:]
def med(name, key, skip=5):
    return statistics.median(r[key] for r in steady(name, skip) if r.get(key) is not None)
def pooled(prefix, key):
    return statistics.median(med(f"{prefix}_{i}", key) for i in range(1, repeats + 1))
cpu = subprocess.run(["sh", "-c", "lscpu | sed -n 's/^Model name: *//p'"], capture_output=True, text=True).stdout.strip()
print(f"Machine: {cpu}, {subprocess.run(['nproc'], capture_output=True, text=True).stdout.strip()} cores. "
      f"GPT-2 tiny (4 layers, 4 heads, dim 256, ctx 128, 16.1M parameters), synthetic tokens, batch 8 per rank, "
      f"{steps} steps per run, medians over steps after the first 5 and over {repeats} alternating runs.\n")
s, d = pooled("single", "step_time_s"), pooled("ddp1", "step_time_s")
print("| world 1 | step time (s) | tokens/s | vs single |\n|---|---|---|---|")
print(f"| single | {s:.4f} | {pooled('single','tokens_per_s'):.0f} | 1.000 |")
print(f"| ddp (1 rank) | {d:.4f} | {pooled('ddp1','tokens_per_s'):.0f} | {d/s:.3f} |\n")
w, t = pooled("ddp2", "comm_wait_s"), pooled("ddp2", "comm_total_s")
print("| DDP, 2 ranks | median per step |\n|---|---|")
print(f"| gradient all-reduce, first launch to last completion (comm_total_s) | {t:.4f} s |")
print(f"| exposed: waited after backward (comm_wait_s) | {w:.4f} s |")
print(f"| hidden behind backward | {100*(1-w/t):.0f}% |\n")
dd, ff = pooled("ddp2", "tokens_per_s"), pooled("fsdp2", "tokens_per_s")
print("| 2 ranks | tokens/s | vs DDP |\n|---|---|---|")
print(f"| ddp | {dd:.0f} | 1.000 |\n| fsdp (FULL_SHARD) | {ff:.0f} | {ff/dd:.3f} |\n")
def last(name, key): return steps_of(name)[-1][key]
print("| 4 ranks, per rank | model state (MiB) | peak RSS (MiB) |\n|---|---|---|")
for n in ("ddp4", "fsdp4"):
    print(f"| {n[:-1]} | {last(n,'model_state_mib'):.1f} | {last(n,'peak_rss_mib'):.0f} |")
print(f"\nFSDP/DDP model state: {last('fsdp4','model_state_mib')/last('ddp4','model_state_mib'):.3f}; "
      f"peak RSS: {last('fsdp4','peak_rss_mib')/last('ddp4','peak_rss_mib'):.3f}\n")
# dtrain_bench_bucketing: one JSON per run; medians over the runs of each bucket size.
runs = [json.load(open(f"{out}/bucketing_{i}.json"))["benchmarks"] for i in range(1, repeats + 1)]
caps = [b["bucket_cap_mb"] for b in runs[0]]
def bmed(cap, key):
    return statistics.median(b[key] for r in runs for b in r if b["bucket_cap_mb"] == cap)
base = bmed(25.0, "real_time")
print(f"dtrain_bench_bucketing, 2 ranks, {runs[0][0]['iterations']} timed steps after 3 warm-up steps, "
      f"median over {repeats} runs:\n")
print("| bucket_cap_mb | buckets | step time (ms) | vs 25 MiB (default) | tokens/s | all-reduce, first launch to last completion (ms) | exposed (ms) | hidden |\n|---|---|---|---|---|---|---|---|")
for cap in caps:
    t = bmed(cap, "real_time")
    print(f"| {cap:g} | {bmed(cap,'buckets'):.0f} | {t:.0f} | {t/base:.3f} | {bmed(cap,'tokens_per_s'):.0f} | "
          f"{bmed(cap,'comm_total_ms'):.0f} | {bmed(cap,'comm_wait_ms'):.0f} | {100*bmed(cap,'hidden'):.0f}% |")
PY
