#!/usr/bin/env bash
# Collectives across two "hosts" (network namespaces joined by a veth pair; needs root)
# next to the same ranks on one host over loopback, measured in one run:
#   one host x2 (loopback)   vs  2 hosts x1 (veth)
#   one host x4 (loopback)   vs  2 hosts x2 (veth; two ranks of each host share its end)
# with dtrain_bench_collectives started by dtrain-run --nnodes 2. Writes under
# ${OUT:-report/bench-multinode}/: <case>.csv (Google Benchmark CSV of rank 0), tables.md,
# env.txt. Environment: OPS (default all_reduce,all_gather,reduce_scatter), MIN_BYTES,
# MAX_BYTES (default 1 MiB .. 64 MiB), TARGET_BYTES (iterations = TARGET_BYTES / size),
# TRANSPORT (default auto: shared memory on one host, hierarchical across the two; gloo: TCP
# everywhere, as measured before the shared-memory transport).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${OUT:-$root/report/bench-multinode}"
build="${DTRAIN_BUILD_DIR:-$root/build}"
ops="${OPS:-all_reduce,all_gather,reduce_scatter}"
DTRAIN_BUILD_DIR="$build" "$root/scripts/build.sh" -DDTRAIN_BUILD_BENCHMARKS=ON >/dev/null
bench="$build/benchmarks/dtrain_bench_collectives"
run="$build/src/launcher/dtrain-run"
mkdir -p "$out"
# shellcheck source=../scripts/veth-hosts.sh
. "$root/scripts/veth-hosts.sh"
trap veth_hosts_down EXIT
veth_hosts_up "dtb$$" || exit 1
export OMP_NUM_THREADS=1
args=(--min_bytes="${MIN_BYTES:-1048576}" --max_bytes="${MAX_BYTES:-67108864}" --step=4
  --target_bytes="${TARGET_BYTES:-536870912}" --min_iters=3 --max_iters=50 --ops="$ops"
  --transport="${TRANSPORT:-auto}"
  --benchmark_format=csv)
{
  echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "cpu: $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(getconf _NPROCESSORS_ONLN) cores"
  echo "load average at start: $(cut -d" " -f1-3 /proc/loadavg)"
  echo "veth: $ns_a=$addr_a <-> $ns_b=$addr_b, mtu $(ip -n "$ns_a" -o link |
    awk '!/ lo:/ { for (i = 1; i < NF; i++) if ($i == "mtu") print $(i + 1) }')"
  echo "commit: $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo none)"
} >"$out/env.txt"

port=29600
one_host() {  # NAME NPROC
  port=$((port + 1))
  echo "+ dtrain-run --nproc_per_node $2 -- dtrain_bench_collectives ${args[*]}" >>"$out/env.txt"
  "$run" --nproc_per_node "$2" --master_port "$port" -- "$bench" "${args[@]}" >"$out/$1.csv"
}
two_hosts() {  # NAME NPROC_PER_HOST
  port=$((port + 1))
  echo "+ (each host) dtrain-run --nnodes 2 --node_rank K --nproc_per_node $2 --master_addr $addr_a -- dtrain_bench_collectives ${args[*]}" >>"$out/env.txt"
  ip netns exec "$ns_b" "$run" --nnodes 2 --node_rank 1 --nproc_per_node "$2" \
    --master_addr "$addr_a" --master_port "$port" -- "$bench" "${args[@]}" >/dev/null &
  local other=$!
  ip netns exec "$ns_a" "$run" --nnodes 2 --node_rank 0 --nproc_per_node "$2" \
    --master_addr "$addr_a" --master_port "$port" -- "$bench" "${args[@]}" >"$out/$1.csv"
  wait "$other"
}
one_host loopback_x2 2
two_hosts veth_2x1 1
one_host loopback_x4 4
two_hosts veth_2x2 2

# tables.md: busbw (GB/s) per op and size, one column per case.
awk -F, '
  FNR == 1 { for (i = 1; i <= NF; i++) { h = $i; gsub(/"/, "", h); col[h] = i }
             c = FILENAME; sub(/.*\//, "", c); sub(/\.csv$/, "", c); cases[++nc] = c; next }
  { name = $col["name"]; gsub(/"/, "", name)
    if ($col["error_occurred"] == "true" || name ~ /_(mean|median|stddev|cv)$/) next
    split(name, p, "/"); key = p[1] " " p[3]
    if (!(key in seen)) { seen[key] = 1; keys[++nk] = key }
    bw[key, c] = $col["busbw"] / 1e9 }
  END {
    printf "| collective | size |"; for (i = 1; i <= nc; i++) printf " %s |", cases[i]; print ""
    printf "| --- | --- |"; for (i = 1; i <= nc; i++) printf " --- |"; print ""
    for (k = 1; k <= nk; k++) { split(keys[k], kk, " "); printf "| %s | %s |", kk[1], kk[2]
      for (i = 1; i <= nc; i++) printf " %.3f |", bw[keys[k], cases[i]]; print "" } }
' "$out/loopback_x2.csv" "$out/veth_2x1.csv" "$out/loopback_x4.csv" "$out/veth_2x2.csv" \
  >"$out/tables.md"
cat "$out/tables.md"
