#!/usr/bin/env bash
# GPT-2 training on 2 hosts x 2 ranks across a throttled link (issue 31): two "hosts" are
# network namespaces joined by a veth pair (scripts/veth-hosts.sh; needs root), the link
# limited by tc tbf to RATE in each direction. One rate per call:
#
#   benchmarks/bench-slow-network.sh RATE [SETTING...]
#
# RATE: tc's rate syntax (100mbit, 1gbit) or "none" (unthrottled). SETTING: any of
#   ddp              uncompressed DDP (fp32 all-reduce), the reference
#   ddp_powersgd1/2/4  DDP + --comm_hook powersgd --powersgd_rank 1, 2, 4
#   ddp_int8, ddp_bf16 DDP + --quantize_grads int8 | bf16
#   fsdp             FSDP FULL_SHARD, uncompressed
#   fsdp_int8        FSDP + --quantize_params int8 --quantize_grads int8 (ZeRO++ qwZ + qgZ)
#   fsdp_host        FSDP + --reshard_after_forward host (ZeRO++ hpZ)
#   fsdp_int8_host   both (ZeRO++ qwZ + qgZ + hpZ)
#   fsdp_int4_host   the same with int4 gradients (ZeRO++'s qgZ sends int4)
# (FSDP's quantised gradients go in two levels across hosts: fp32 inside, quantised between)
# (default: all, ddp first). Every run is the same job (same seed, data order, global batch,
# learning rate: warmup, then constant, so that step k is the same in a longer run) with
# validation every VAL_EVERY steps. ddp runs STEPS steps; its validation loss at 80% of them
# is the target. The others run EXTEND x STEPS steps (default 1.5), so that a setting slower
# per step in loss can still reach the target; their loss "after the same steps" is the
# validation at step STEPS. Writes under ${OUT:-benchmarks/results/slow-network}/RATE/:
# SETTING.jsonl (gpt2_train's metrics), SETTING.log (its output and the link's tc counters
# after the run), env.txt (machine, load, flags; one entry per call); then summarises every
# RATE folder there (slow_network_summary.py): summary.csv, summary.json, tables.md. A
# setting can be rerun alone; the summary takes the files present.
#
# Environment: STEPS (50), VAL_EVERY (5; must divide STEPS and 80% of it), EXTEND (1.5),
# VAL_BATCHES (2), BATCH (4 per rank), MODEL (tiny), TOKENIZER (byte: 256 ids; why in
# docs/strategies.md, "Slow networks: which option for which network"), DATA
# (<repo>/data/sotu.txt; the token cache is written next to it), RUN_TIMEOUT (600 s per
# run), POWERSGD_START (10), EXTRA (more gpt2_train flags), VETH_BURST.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ $# -lt 1 ]; then
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
  exit 2
fi
rate="$1"
shift
all_settings=(ddp ddp_powersgd1 ddp_powersgd2 ddp_powersgd4 ddp_int8 ddp_bf16 fsdp fsdp_int8
  fsdp_host fsdp_int8_host fsdp_int4_host)
settings=("$@")
[ ${#settings[@]} -gt 0 ] || settings=("${all_settings[@]}")
build="${DTRAIN_BUILD_DIR:-$root/build}"
train="$build/examples/gpt2/gpt2_train"
run="$build/src/launcher/dtrain-run"
for exe in "$train" "$run"; do
  [ -x "$exe" ] || {
    echo "missing $exe: build the targets gpt2_train and dtrain-run first" >&2
    exit 1
  }
done
results="${OUT:-$root/benchmarks/results/slow-network}"
out="$results/$rate"
mkdir -p "$out"

steps="${STEPS:-50}"
val_every="${VAL_EVERY:-5}"
long_steps=$(awk -v s="$steps" -v f="${EXTEND:-1.5}" -v v="$val_every" \
  'BEGIN { n = int(s * f / v + 0.5) * v; print (n < s ? s : n) }')
if [ $((steps % val_every)) -ne 0 ] || [ $((steps * 4 % (5 * val_every))) -ne 0 ]; then
  echo "VAL_EVERY=$val_every must divide STEPS=$steps and 80% of it" >&2
  exit 2
fi
flags_of() {  # SETTING -> its gpt2_train flags
  case "$1" in
    ddp) echo "--strategy=ddp" ;;
    ddp_powersgd[0-9]*)
      echo "--strategy=ddp --comm_hook=powersgd --powersgd_rank=${1#ddp_powersgd}" \
        "--powersgd_start_iter=${POWERSGD_START:-10}"
      ;;
    ddp_int8) echo "--strategy=ddp --quantize_grads=int8" ;;
    ddp_bf16) echo "--strategy=ddp --quantize_grads=bf16" ;;
    fsdp) echo "--strategy=fsdp --sharding=full" ;;
    fsdp_int8)
      echo "--strategy=fsdp --sharding=full --quantize_params=int8 --quantize_grads=int8"
      ;;
    fsdp_host) echo "--strategy=fsdp --sharding=full --reshard_after_forward=host" ;;
    fsdp_int8_host)
      echo "--strategy=fsdp --sharding=full --quantize_params=int8 --quantize_grads=int8" \
        "--reshard_after_forward=host"
      ;;
    fsdp_int4_host)
      echo "--strategy=fsdp --sharding=full --quantize_params=int8 --quantize_grads=int4" \
        "--reshard_after_forward=host"
      ;;
    *) return 1 ;;
  esac
}
for s in "${settings[@]}"; do
  flags_of "$s" >/dev/null || {
    echo "unknown setting '$s' (known: ${all_settings[*]})" >&2
    exit 2
  }
done
common=(--model="${MODEL:-tiny}" --tokenizer="${TOKENIZER:-byte}"
  --data="${DATA:-$root/data/sotu.txt}" --batch="${BATCH:-4}" --min_lr_ratio=1
  --val_every="$val_every" --val_batches="${VAL_BATCHES:-2}" --seed=1234 --threads=1
  --sample_tokens=0 --log_every=10 --timeout_s=300)
# shellcheck disable=SC2206 # EXTRA is a list of flags
[ -z "${EXTRA:-}" ] || common+=(${EXTRA})

# shellcheck source=../scripts/veth-hosts.sh
. "$root/scripts/veth-hosts.sh"
trap veth_hosts_down EXIT
if [ "$rate" = none ]; then
  unset VETH_RATE VETH_DELAY
else
  export VETH_RATE="$rate"
  unset VETH_DELAY # sch_netem is missing from some kernels; a delay is opt-in elsewhere
fi
veth_hosts_up "dsn$$" || exit 1
veth_a="dsn$$va"
veth_b="dsn$$vb"
export OMP_NUM_THREADS=1
{
  echo "== settings: ${settings[*]}"
  echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "cpu: $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(getconf _NPROCESSORS_ONLN) cores"
  echo "load average at start: $(cut -d" " -f1-3 /proc/loadavg)"
  if [ "$rate" = none ]; then
    echo "link: unthrottled (no qdisc), no delay"
  else
    echo "link: rate $VETH_RATE each way (tc tbf, burst ${VETH_BURST:-256kb}), no delay"
  fi
  echo "veth: $ns_a=$addr_a <-> $ns_b=$addr_b"
  echo "commit: $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo none)"
  echo "common flags: ${common[*]}"
  echo "steps: ddp $steps, the others $long_steps"
} >"$out/env.call"
cat "$out/env.call" >>"$out/env.txt" # one entry per call
cat "$out/env.call"
rm -f "$out/env.call"

port=$((29700 + $$ % 200))
for s in "${settings[@]}"; do
  port=$((port + 1))
  read -r -a flags <<<"$(flags_of "$s")"
  if [ "$s" = ddp ]; then flags+=(--steps="$steps"); else flags+=(--steps="$long_steps"); fi
  rm -f "$out/$s.jsonl"
  echo "+ (host k of 2) dtrain-run --nnodes 2 --node_rank k --nproc_per_node 2" \
    "--master_addr $addr_a -- gpt2_train ${common[*]} ${flags[*]}" >"$out/$s.log"
  start=$(date +%s%N)
  timeout "${RUN_TIMEOUT:-600}" ip netns exec "$ns_b" "$run" --nnodes 2 --node_rank 1 \
    --nproc_per_node 2 --master_addr "$addr_a" --master_port "$port" -- "$train" \
    "${common[@]}" "${flags[@]}" >"$out/$s.host1.log" 2>&1 &
  other=$!
  status=0
  timeout "${RUN_TIMEOUT:-600}" ip netns exec "$ns_a" "$run" --nnodes 2 --node_rank 0 \
    --nproc_per_node 2 --master_addr "$addr_a" --master_port "$port" -- "$train" \
    "${common[@]}" "${flags[@]}" --metrics_out="$out/$s.jsonl" >>"$out/$s.log" 2>&1 ||
    status=$?
  wait "$other" || status=$((status ? status : $?))
  wall=$((($(date +%s%N) - start) / 1000000))
  {
    echo "wall time of the run (start to exit, both hosts): $wall ms; exit status $status"
    echo "host B's output:"
    sed 's/^/  /' "$out/$s.host1.log"
    echo "tc counters after the run:"
    tc -n "$ns_a" -s qdisc show dev "$veth_a" | sed 's/^/  A /'
    tc -n "$ns_b" -s qdisc show dev "$veth_b" | sed 's/^/  B /'
  } >>"$out/$s.log"
  rm -f "$out/$s.host1.log"
  echo "$rate $s: exit $status, $((wall / 1000)) s"
  # Reset the qdisc counters for the next run (same limits).
  if [ "$rate" != none ]; then
    for end in "$ns_a:$veth_a" "$ns_b:$veth_b"; do
      tc -n "${end%%:*}" qdisc del dev "${end#*:}" root 2>/dev/null || true
    done
    veth_hosts_throttle "$veth_a" "$veth_b" >/dev/null
  fi
done

python3 "$root/benchmarks/slow_network_summary.py" "$results" "$steps"
