#!/usr/bin/env bash
# What the OpenBLAS kernel family is worth here: sgemm GFLOP/s (dtrain_bench_sgemm, 1024²
# fp32, 1 and 2 threads) and gpt2_train tokens/s (tiny, single, random data, 8 steps, 2
# threads) per family, forced with OPENBLAS_CORETYPE ("-" = unset: OpenBLAS's own pick),
# alternating the families round by round. Writes ${OUT:-report/bench}/blas.md (medians and
# ratios to the first family) and blas-env.txt (machine, BLAS, commands).
#   KERNELS="Prescott SkylakeX Haswell -" ROUNDS=3 STEPS=8 scripts/bench-blas.sh
# Needs a build (scripts/build.sh) and the GPT-2 vocabulary (scripts/fetch-data.sh). Run it on
# a quiet machine: no build or other benchmark at the same time.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${DTRAIN_BUILD_DIR:-$root/build}"
out="${OUT:-$root/report/bench}"
read -r -a kernels <<<"${KERNELS:-Prescott SkylakeX Haswell -}"
rounds="${ROUNDS:-3}"
steps="${STEPS:-8}"
sgemm="$build/benchmarks/dtrain_bench_sgemm"
train="$build/examples/gpt2/gpt2_train"
mkdir -p "$out"
rm -f "$out"/blas_*.json "$out"/blas_*.jsonl
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"

# with_kernel K CMD...: runs CMD with OPENBLAS_CORETYPE=K, or without it for "-".
with_kernel() {
  local k="$1"
  shift
  if [ "$k" = - ]; then env -u OPENBLAS_CORETYPE "$@"; else OPENBLAS_CORETYPE="$k" "$@"; fi
}

{
  echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "cpu (/proc/cpuinfo): $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)," \
    "$(getconf _NPROCESSORS_ONLN) cores"
  echo "load average at start: $(cut -d" " -f1-3 /proc/loadavg)"
  echo "commit: $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo none)"
  echo "OMP_WAIT_POLICY=$OMP_WAIT_POLICY OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE-(unset)}"
  env -u OPENBLAS_CORETYPE "$build/src/launcher/dtrain-run" --blas_info
  echo "+ OPENBLAS_CORETYPE=<K> $sgemm --benchmark_filter=sgemm/n:1024/ --benchmark_format=json"
  echo "+ OPENBLAS_CORETYPE=<K> $train --model tiny --strategy single --data random" \
    "--steps $steps --threads 2 --metrics_out <file>"
} >"$out/blas-env.txt"

for r in $(seq 1 "$rounds"); do
  for k in "${kernels[@]}"; do
    echo "bench-blas: round $r, kernel $k" >&2
    with_kernel "$k" "$sgemm" --benchmark_filter=sgemm/n:1024/ --benchmark_format=json \
      >"$out/blas_sgemm_${k}_$r.json"
    with_kernel "$k" "$train" --model tiny --strategy single --data random --steps "$steps" \
      --threads 2 --metrics_out "$out/blas_train_${k}_$r.jsonl" >"$out/blas_train_${k}_$r.log"
  done
done

/usr/bin/python3 - "$out" "$rounds" "${kernels[@]}" <<'PY' | tee "$out/blas.md"
import json, statistics, sys
out, rounds, kernels = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def sgemm(k, threads):
    vals = []
    for r in range(1, rounds + 1):
        for b in json.load(open(f"{out}/blas_sgemm_{k}_{r}.json"))["benchmarks"]:
            if b["name"].startswith(f"sgemm/n:1024/threads:{threads}/"):
                vals.append(b["GFLOP"])
    return statistics.median(vals), vals
def train(k):
    vals, kernel = [], "?"
    for r in range(1, rounds + 1):
        rows = [json.loads(l) for l in open(f"{out}/blas_train_{k}_{r}.jsonl") if l.strip()]
        epoch = [x for x in rows if x["kind"] == "epoch"][-1]
        vals.append(epoch["tokens_per_s"])
        kernel = epoch["blas_kernel"]
    return statistics.median(vals), vals, kernel
rows = [(k, sgemm(k, 1), sgemm(k, 2), train(k)) for k in kernels]
base = rows[0]
print("| OPENBLAS_CORETYPE | kernel that ran | sgemm 1 thread (GFLOP/s) | vs " + base[0] +
      " | sgemm 2 threads | vs " + base[0] + " | gpt2_train tokens/s | vs " + base[0] + " |")
print("|---|---|---:|---:|---:|---:|---:|---:|")
for k, s1, s2, t in rows:
    print(f"| {'(unset)' if k == '-' else k} | {t[2]} | {s1[0]:.1f} | {s1[0] / base[1][0]:.2f}x "
          f"| {s2[0]:.1f} | {s2[0] / base[2][0]:.2f}x | {t[0]:.0f} | {t[0] / base[3][0]:.2f}x |")
print()
print("Runs (round order): " + "; ".join(
    f"{'(unset)' if k == '-' else k}: sgemm 1t {', '.join(f'{v:.0f}' for v in s1[1])}, "
    f"2t {', '.join(f'{v:.0f}' for v in s2[1])}, tokens/s {', '.join(f'{v:.0f}' for v in t[1])}"
    for k, s1, s2, t in rows))
PY
