#!/usr/bin/env bash
# Builds dtrain (scripts/build.sh) and runs its communication benchmarks:
# dtrain_bench_collectives at each world size in WORLD_SIZES, then dtrain_bench_overlap at
# 2 ranks. Writes under ${OUT:-report/bench}/:
#   collectives_np<N>.json|.csv   Google Benchmark output (JSON via --benchmark_out, CSV)
#   overlap.json|.csv             the same for the overlap benchmark
#   busbw_<op>_np<N>.dat          bytes, algbw GB/s, busbw GB/s, mean and median time per
#                                 call in us (the plot's input)
#   tables.md                     Markdown tables as used in docs/benchmarks-history.md
#   busbw.png                     bus bandwidth vs message size (benchmarks/plot_busbw.gp)
#   env.txt                       machine, date, versions, the commands that ran
#
# Environment (all optional):
#   OUT=report/bench         output folder
#   DTRAIN_BUILD_DIR=build   build folder (scripts/build.sh)
#   WORLD_SIZES="2 4"        ranks (processes) of the collectives runs
#   TRANSPORT=auto           --transport of dtrain's benchmarks: auto (shared memory on one
#                            host), gloo (TCP loopback) or shm
#   MAX_BYTES=268435456      largest message (256 MiB)
#   TARGET_BYTES=1073741824  iterations per size = TARGET_BYTES / size, clamped to [3, 100]
#   OVERLAP_ARGS=--sleep_ms=20  extra flags for dtrain_bench_overlap (--unit_bytes=...,
#                            --matmul=...); the default adds a CPU-free compute stand-in
#   PYTORCH=1                also measure torch.distributed's Gloo all-reduce the same way,
#                            with Debian's /usr/bin/python3 (apt-get install python3-torch)
# Arguments are passed to CMake's configure step.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${OUT:-$root/report/bench}"
build="${DTRAIN_BUILD_DIR:-$root/build}"
world_sizes="${WORLD_SIZES:-2 4}"
transport="${TRANSPORT:-auto}"
max_bytes="${MAX_BYTES:-268435456}"
target_bytes="${TARGET_BYTES:-1073741824}"
min_iters=3
max_iters=100
collectives="all_reduce all_gather reduce_scatter broadcast"

DTRAIN_BUILD_DIR="$build" "$root/scripts/build.sh" -DDTRAIN_BUILD_BENCHMARKS=ON "$@"
bin="$build/benchmarks"
mkdir -p "$out"
rm -f "$out"/busbw_*.dat

export OMP_NUM_THREADS=1
{
  echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "cpu: $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(getconf _NPROCESSORS_ONLN) cores"
  echo "load average at start: $(cut -d" " -f1-3 /proc/loadavg)"
  echo "os: $(. /etc/os-release && echo "$PRETTY_NAME"), kernel $(uname -r)"
  echo "libtorch: $(dpkg-query -W -f='${Version}' libtorch-dev 2>/dev/null || echo '?')," \
    "gloo: $(dpkg-query -W -f='${Version}' libgloo-dev 2>/dev/null || echo '?')"
  echo "commit: $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo none)"
  "$build/src/launcher/dtrain-run" --blas_info || echo "blas: dtrain-run --blas_info failed"
} >"$out/env.txt"

# Google Benchmark CSV -> one .dat per (collective, ranks). Sizes come from the benchmark
# name ("64MiB"): the CSV prints counters with 6 significant digits.
csv_to_dat() {
  awk -F, -v dir="$out" -v prefix="$2" '
    function size_bytes(s) {
      if (s ~ /GiB$/) return substr(s, 1, length(s) - 3) * 1073741824
      if (s ~ /MiB$/) return substr(s, 1, length(s) - 3) * 1048576
      if (s ~ /KiB$/) return substr(s, 1, length(s) - 3) * 1024
      return substr(s, 1, length(s) - 1) + 0
    }
    NR == 1 { for (i = 1; i <= NF; i++) { h = $i; gsub(/"/, "", h); col[h] = i }; next }
    {
      name = $col["name"]; gsub(/"/, "", name)
      if ($col["error_occurred"] == "true" || name ~ /_(mean|median|stddev|cv)$/) next
      split(name, part, "/"); sub(/^ranks:/, "", part[2])
      f = sprintf("%s/busbw_%s%s_np%s.dat", dir, prefix, part[1], part[2])
      p50 = ("t_p50_us" in col) ? $col["t_p50_us"] : $col["real_time"]
      printf "%.0f %.4f %.4f %.1f %.1f\n", size_bytes(part[3]), $col["algbw"] / 1e9,
             $col["busbw"] / 1e9, $col["real_time"], p50 >> f
    }' "$1"
}

for n in $world_sizes; do
  cmd=("$bin/dtrain_bench_collectives" --nproc="$n" --transport="$transport" --max_bytes="$max_bytes"
    --target_bytes="$target_bytes" --min_iters="$min_iters" --max_iters="$max_iters"
    --benchmark_out="$out/collectives_np$n.json" --benchmark_out_format=json
    --benchmark_format=csv)
  echo "+ ${cmd[*]#"$root/"}" | tee -a "$out/env.txt" >&2
  start=$(date +%s)
  "${cmd[@]}" >"$out/collectives_np$n.csv"
  echo "  ($(($(date +%s) - start)) s)" | tee -a "$out/env.txt" >&2
  csv_to_dat "$out/collectives_np$n.csv" ""
done

cmd=("$bin/dtrain_bench_overlap" --nproc=2 --transport="$transport" ${OVERLAP_ARGS---sleep_ms=20}
  --benchmark_out="$out/overlap.json" --benchmark_out_format=json --benchmark_format=csv)
echo "+ ${cmd[*]#"$root/"}" | tee -a "$out/env.txt" >&2
start=$(date +%s)
"${cmd[@]}" >"$out/overlap.csv"
echo "  ($(($(date +%s) - start)) s)" | tee -a "$out/env.txt" >&2

if [ "${PYTORCH:-0}" = 1 ]; then
  # The same method as dtrain_bench_collectives: fp32, one process per rank, one intra-op
  # thread, closed-form check, one barrier then back-to-back calls each timed, same
  # iteration counts.
  cat >"$out/pytorch_gloo.py" <<'EOF'
import os, sys, time
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

def worker(rank, world, port, sizes, target, lo, hi):
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for nbytes in sizes:
        n = nbytes // 4
        base = (torch.arange(n, dtype=torch.int32) % 13 + 1).float()
        t = base * (rank + 1)
        dist.all_reduce(t)
        if not torch.equal(t, base * (world * (world + 1) / 2)):
            raise SystemExit(f"rank {rank}: all_reduce of {nbytes} B: wrong result")
        k = max(min(target // nbytes, hi), min(lo, hi))
        times = []
        dist.barrier()
        for _ in range(k):
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
        if rank == 0:
            total = sum(times)
            algbw = nbytes * k / total
            p50 = sorted(times)[len(times) // 2]
            size = f"{nbytes >> 20}MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10}KiB"
            print(f'"all_reduce/ranks:{world}/{size}",{k},{total / k * 1e6:.1f},false,'
                  f"{algbw:.6g},{algbw * 2 * (world - 1) / world:.6g},{p50 * 1e6:.1f}",
                  flush=True)
    dist.barrier()
    dist.destroy_process_group()

if __name__ == "__main__":
    world, port, max_bytes, target, lo, hi = (int(a) for a in sys.argv[1:7])
    sizes = [4096 << (2 * i) for i in range(16) if 4096 << (2 * i) <= max_bytes]
    print("name,iterations,real_time,error_occurred,algbw,busbw,t_p50_us", flush=True)
    mp.spawn(worker, args=(world, port, sizes, target, lo, hi), nprocs=world)
EOF
  for n in $world_sizes; do
    cmd=(/usr/bin/python3 "$out/pytorch_gloo.py" "$n" "$((20000 + RANDOM % 12000))" "$max_bytes"
      "$target_bytes" "$min_iters" "$max_iters")
    echo "+ ${cmd[*]#"$root/"}" | tee -a "$out/env.txt" >&2
    "${cmd[@]}" >"$out/pytorch_np$n.csv"
    csv_to_dat "$out/pytorch_np$n.csv" "pytorch_"
  done
  echo "pytorch: $(/usr/bin/python3 -c 'import torch; print(torch.__version__)')" >>"$out/env.txt"
fi

# One Markdown table for world size $1: a row per message size, a column per collective,
# each cell the .dat columns listed in $2 (awk expression) printed with format $3.
size_by_collective_table() {
  local n=$1 fields=$2 format=$3
  echo "| size | $(echo $collectives | sed 's/ / | /g') |"
  echo "|---:|$(for c in $collectives; do printf -- '---:|'; done)"
  for c in $collectives; do
    f="$out/busbw_${c}_np$n.dat"
    [ -s "$f" ] && awk -v c="$c" -v fmt="$format" "{ print \$1, c, sprintf(fmt, $fields) }" "$f"
  done | awk -v cols="$collectives" '
    { b = $1; c0 = $2; $1 = ""; $2 = ""; sub(/^  /, ""); cell[b, c0] = $0; sizes[b] = 1 }
    END {
      k = split(cols, c, " ")
      n = 0; for (s in sizes) order[++n] = s + 0
      for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++)
        if (order[j] < order[i]) { t = order[i]; order[i] = order[j]; order[j] = t }
      for (i = 1; i <= n; i++) {
        b = order[i]
        line = "| " (b >= 1048576 ? (b / 1048576) " MiB" : (b / 1024) " KiB") " |"
        for (j = 1; j <= k; j++) line = line " " (((b, c[j]) in cell) ? cell[b, c[j]] : "-") " |"
        print line
      }
    }'
}

# Markdown tables: per world size, algbw / busbw (GB/s) and the median time per call.
{
  for n in $world_sizes; do
    echo "#### $n ranks: algbw / busbw (GB/s)"
    echo
    size_by_collective_table "$n" '$2, $3' '%.3f / %.3f'
    echo
    echo "#### $n ranks: median time per call (µs)"
    echo
    size_by_collective_table "$n" '$5' '%.0f'
    echo
    if [ -s "$out/busbw_pytorch_all_reduce_np$n.dat" ]; then
      echo "#### $n ranks: all_reduce, dtrain vs PyTorch Gloo (busbw in GB/s)"
      echo
      echo "| size | dtrain busbw | PyTorch busbw | dtrain median µs | PyTorch median µs |"
      echo "|---:|---:|---:|---:|---:|"
      awk 'NR == FNR { pt[$1] = $3; pm[$1] = $5; next }
           { printf "| %s | %.3f | %s | %.0f | %s |\n",
               ($1 >= 1048576 ? ($1 / 1048576) " MiB" : ($1 / 1024) " KiB"), $3,
               ($1 in pt) ? sprintf("%.3f", pt[$1]) : "-", $5,
               ($1 in pm) ? sprintf("%.0f", pm[$1]) : "-" }' \
        "$out/busbw_pytorch_all_reduce_np$n.dat" "$out/busbw_all_reduce_np$n.dat"
      echo
    fi
  done
  echo "#### Overlap, 2 ranks (times in ms, means over the timed iterations)"
  echo
  echo "| unit | compute kernel | GFLOP/s | compute | comm | both | overlap efficiency |"
  echo "|---:|---|---:|---:|---:|---:|---:|"
  awk -F, '
    NR == 1 { for (i = 1; i <= NF; i++) { h = $i; gsub(/"/, "", h); col[h] = i }; next }
    $col["error_occurred"] != "true" {
      kernel = $col["sleep_ms"] > 0 ? sprintf("sleep %d ms", $col["sleep_ms"]) \
                                    : sprintf("matmul %d", $col["matmul_n"])
      printf "| %.0f MiB | %s | %s | %.2f | %.2f | %.2f | %.2f |\n",
        $col["unit_bytes"] / 1048576, kernel,
        ($col["sleep_ms"] > 0 ? "-" : sprintf("%.1f", $col["matmul_gflops"])),
        $col["compute_ms"], $col["comm_ms"], $col["both_ms"], $col["overlap_eff"]
    }' "$out/overlap.csv"
} >"$out/tables.md"

echo "load average at end: $(cut -d" " -f1-3 /proc/loadavg)" >>"$out/env.txt"

if command -v gnuplot >/dev/null; then
  gnuplot -e "dir='$out'; out='$out/busbw.png'; ranks='$world_sizes'" \
    "$root/benchmarks/plot_busbw.gp"
  echo "bench-collectives: plot $out/busbw.png" >&2
else
  echo "bench-collectives: gnuplot not found (scripts/install-deps.sh installs it); no plot" >&2
fi
echo "bench-collectives: results in $out (tables.md, *.json, *.csv)" >&2
