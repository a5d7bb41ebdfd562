#!/usr/bin/env bash
# The MPI backend against Gloo and dtrain's shared-memory engine, measured in one run (issue
# 43): all-reduce, all-gather and reduce-scatter bus bandwidth (fp32) at 2 and 4 ranks, 4 KiB to
# 64 MiB, with dtrain_bench_collectives,
#   one host   gloo (TCP over loopback), shm (shared memory), mpi (mpirun -np N --backend mpi:
#              Open MPI's shared memory, vader);
#   two hosts  network namespaces joined by a veth pair (needs root; scripts/veth-hosts.sh),
#              N/2 ranks each: gloo (TCP), shm (hierarchical: shared memory inside a host, Gloo
#              between), mpi (mpirun with an rsh agent entering the namespace: Open MPI's TCP
#              between the hosts, vader inside);
# then GPT-2 tiny DDP x4 (gpt2_train --model tiny, one host) tokens/s on each backend.
# Writes under ${OUT:-report/bench-mpi}/: <case>.csv (Google Benchmark CSV of rank 0),
# tables.md (busbw per case, and each backend's 64 MiB all-reduce time over the best other's),
# gpt2_<backend>.jsonl, env.txt. Environment: OPS, MIN_BYTES (4 KiB), MAX_BYTES (64 MiB),
# TARGET_BYTES (256 MiB: iterations = TARGET_BYTES / size, 3 to 50), GPT2_STEPS (30), TWO_HOSTS
# (1; 0: one host only, e.g. without root).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${OUT:-$root/report/bench-mpi}"
build="${DTRAIN_BUILD_DIR:-$root/build}"
ops="${OPS:-all_reduce,all_gather,reduce_scatter}"
two_hosts="${TWO_HOSTS:-1}"
"$root/scripts/apt-ensure.sh" libopenmpi-dev openmpi-bin
DTRAIN_BUILD_DIR="$build" DTRAIN_TARGETS="dtrain_bench_collectives gpt2_train dtrain-run" \
  "$root/scripts/build.sh" -DDTRAIN_BUILD_BENCHMARKS=ON >/dev/null
bench="$build/benchmarks/dtrain_bench_collectives"
train="$build/examples/gpt2/gpt2_train"
run="$build/src/launcher/dtrain-run"
mkdir -p "$out"
rm -f "$out"/*.csv "$out"/gpt2_*.jsonl
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT
export OMP_NUM_THREADS=1
# 4 ranks on few cores: --oversubscribe; no binding (ranks share cores).
mpirun=(mpirun --allow-run-as-root --oversubscribe --bind-to none -x OMP_NUM_THREADS=1)
args=(--min_bytes="${MIN_BYTES:-4096}" --max_bytes="${MAX_BYTES:-67108864}" --step=4
  --target_bytes="${TARGET_BYTES:-268435456}" --min_iters=3 --max_iters=50 --ops="$ops"
  --benchmark_format=csv)
if [ "$two_hosts" = 1 ]; then
  # shellcheck source=../scripts/veth-hosts.sh
  . "$root/scripts/veth-hosts.sh"
  trap veth_hosts_down EXIT
  veth_hosts_up "dtm$$" || exit 1
  export NETNS_RSH_HOSTS="$addr_a=$ns_a $addr_b=$ns_b"
fi
{
  echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "cpu: $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(getconf _NPROCESSORS_ONLN) cores"
  echo "load average at start: $(cut -d" " -f1-3 /proc/loadavg)"
  echo "mpi: $(mpirun --version 2>&1 | head -1)"
  echo "commit: $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo none)"
} >"$out/env.txt"

port=29700
log() { echo "+ $*" >>"$out/env.txt"; }
one_host() {  # NAME NPROC BACKEND(gloo|shm|mpi)
  port=$((port + 1))
  if [ "$3" = mpi ]; then
    log "mpirun -np $2 dtrain_bench_collectives --backend=mpi ${args[*]}"
    "${mpirun[@]}" -np "$2" -x MASTER_PORT="$port" "$bench" --backend=mpi "${args[@]}" >"$out/$1.csv"
  else
    log "dtrain-run --nproc_per_node $2 -- dtrain_bench_collectives --transport=$3 ${args[*]}"
    "$run" --nproc_per_node "$2" --master_port "$port" -- "$bench" --transport="$3" "${args[@]}" \
      >"$out/$1.csv"
  fi
}
two_hosts() {  # NAME NPROC_PER_HOST BACKEND
  port=$((port + 1))
  if [ "$3" = mpi ]; then
    log "(host a) mpirun --mca plm_rsh_agent tests/multinode/netns_rsh.sh --host a:$2,b:$2 -np $(($2 * 2)) dtrain_bench_collectives --backend=mpi ${args[*]}"
    ip netns exec "$ns_a" "${mpirun[@]}" --mca plm_rsh_agent "$root/tests/multinode/netns_rsh.sh" \
      --host "$addr_a:$2,$addr_b:$2" -np $(($2 * 2)) -x MASTER_ADDR="$addr_a" \
      -x MASTER_PORT="$port" "$bench" --backend=mpi "${args[@]}" >"$out/$1.csv"
    return
  fi
  log "(each host) dtrain-run --nnodes 2 --node_rank K --nproc_per_node $2 --master_addr a -- dtrain_bench_collectives --transport=$3 ${args[*]}"
  ip netns exec "$ns_b" "$run" --nnodes 2 --node_rank 1 --nproc_per_node "$2" \
    --master_addr "$addr_a" --master_port "$port" -- "$bench" --transport="$3" "${args[@]}" \
    >/dev/null &
  local other=$!
  ip netns exec "$ns_a" "$run" --nnodes 2 --node_rank 0 --nproc_per_node "$2" \
    --master_addr "$addr_a" --master_port "$port" -- "$bench" --transport="$3" "${args[@]}" \
    >"$out/$1.csv"
  wait "$other"
}

# Open MPI's own all-reduce at the largest size (benchmarks/mpi_allreduce.c), one host: what
# the MPI library gives without dtrain.
mpicc -O2 -o "$out/mpi_allreduce" "$root/benchmarks/mpi_allreduce.c"
: >"$out/raw_mpi.txt"
for n in 2 4; do
  log "mpirun -np $n mpi_allreduce ${MAX_BYTES:-67108864} 4"
  "${mpirun[@]}" -np "$n" "$out/mpi_allreduce" "${MAX_BYTES:-67108864}" 4 |
    sed "s/^/one_x${n} /" >>"$out/raw_mpi.txt"
done

cases=()
for n in 2 4; do
  for b in gloo shm mpi; do
    one_host "one_x${n}_$b" "$n" "$b"
    cases+=("one_x${n}_$b")
  done
  if [ "$two_hosts" = 1 ]; then
    for b in gloo shm mpi; do
      two_hosts "two_2x$((n / 2))_$b" $((n / 2)) "$b"
      cases+=("two_2x$((n / 2))_$b")
    done
  fi
done

# GPT-2 tiny, DDP x4 on one host, each backend (the same flags; fp32; random tokens).
gpt2=(--model=tiny --data=random --tokenizer=byte --max_tokens=400000 --strategy=ddp
  --steps="${GPT2_STEPS:-30}" --batch=4 --val_batches=0 --sample_tokens=0 --threads=1
  --log_every=1 --seed=7)
for b in gloo shm mpi; do
  port=$((port + 1))
  if [ "$b" = mpi ]; then
    log "mpirun -np 4 gpt2_train ${gpt2[*]} --backend=mpi"
    "${mpirun[@]}" -np 4 -x MASTER_PORT="$port" "$train" "${gpt2[@]}" --backend=mpi \
      --metrics_out="$out/gpt2_mpi.jsonl" >"$out/gpt2_mpi.log" 2>&1
  else
    log "DTRAIN_TRANSPORT=$b dtrain-run --nproc_per_node 4 -- gpt2_train ${gpt2[*]}"
    DTRAIN_TRANSPORT="$b" "$run" --nproc_per_node 4 --master_port "$port" -- "$train" "${gpt2[@]}" \
      --metrics_out="$out/gpt2_$b.jsonl" >"$out/gpt2_$b.log" 2>&1
  fi
done

files=()
for c in "${cases[@]}"; do files+=("$out/$c.csv"); done
# tables.md: busbw (GB/s) per op and size, one column per case; then the 64 MiB all-reduce time
# of each backend over the best of the others, per setting; then GPT-2's tokens/s.
python3 - "$out" "${cases[@]}" >"$out/tables.md" <<'PY'
import csv, json, sys, pathlib
out = pathlib.Path(sys.argv[1]); cases = sys.argv[2:]
bw, t, keys = {}, {}, []
for c in cases:
    with open(out / f"{c}.csv") as f:
        lines = [l for l in f if l.startswith('"') or l.startswith("name")]
    for row in csv.DictReader(lines):
        name = row["name"]
        if row.get("error_occurred") == "true" or name.split("_")[-1] in ("mean", "median", "stddev", "cv"):
            continue
        p = name.split("/")
        key = (p[0], p[2] if len(p) > 2 else p[-1])
        if key not in keys:
            keys.append(key)
        bw[key, c] = float(row["busbw"]) / 1e9
        scale = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}[row["time_unit"]]
        t[key, c] = float(row["real_time"]) * scale  # microseconds
print("Bus bandwidth, GB/s (nccl-tests' convention), rank 0's mean:\n")
print("| collective | size | " + " | ".join(cases) + " |")
print("| --- | --- |" + " --- |" * len(cases))
for k in keys:
    print(f"| {k[0]} | {k[1]} | " + " | ".join(f"{bw.get((k, c), float('nan')):.3f}" for c in cases) + " |")
big = [k for k in keys if k[0] == "all_reduce"][-1]
print(f"\n{big[0]} {big[1]}: each backend's time over the best other backend's time, per setting:\n")
print("| setting | gloo | shm | mpi |\n| --- | --- | --- | --- |")
settings = []
for c in cases:
    if c.rsplit("_", 1)[0] not in settings:
        settings.append(c.rsplit("_", 1)[0])
for setting in settings:
    times = {b: t.get((big, f"{setting}_{b}")) for b in ("gloo", "shm", "mpi")}
    cells = []
    for b in ("gloo", "shm", "mpi"):
        others = [v for o, v in times.items() if o != b and v]
        cells.append(f"{times[b] / min(others):.2f}x" if times[b] and others else "n/a")
    print(f"| {setting} | " + " | ".join(cells) + " |")
print(f"\nOpen MPI's own all-reduce of {big[1]} on one host (benchmarks/mpi_allreduce.c), against dtrain's MPI engine:\n")
print("| setting | call | mean time | busbw GB/s | dtrain mpi time / this |\n| --- | --- | --- | --- | --- |")
for line in open(out / "raw_mpi.txt"):
    setting, call, nbytes, us, busbw = line.split()
    mine = t.get((big, f"{setting}_mpi"))
    ratio = f"{mine / float(us):.2f}x" if mine else "n/a"
    print(f"| {setting} | {call} | {float(us) / 1e3:.1f} ms | {float(busbw):.2f} | {ratio} |")
print("\nGPT-2 tiny, DDP x4 on one host, tokens/s (median of steps 6..end, rank 0):\n")
print("| backend | tokens/s | step_time_s | final loss |\n| --- | --- | --- | --- |")
for b in ("gloo", "shm", "mpi"):
    f = out / f"gpt2_{b}.jsonl"
    steps = [json.loads(l) for l in open(f) if '"kind": "step"' in l] if f.exists() else []
    if not steps:
        print(f"| {b} | failed | | |"); continue
    tail = sorted(s["tokens_per_s"] for s in steps[5:]) or [steps[-1]["tokens_per_s"]]
    st = sorted(s["step_time_s"] for s in steps[5:]) or [steps[-1]["step_time_s"]]
    print(f"| {b} ({steps[-1].get('transport')}) | {tail[len(tail) // 2]:.0f} | {st[len(st) // 2]:.4f} | {steps[-1]['loss']:.6f} |")
PY
cat "$out/tables.md"
