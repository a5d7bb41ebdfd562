#!/bin/sh
# Elastic training across two "hosts" (#32): two network namespaces joined by a veth pair
# (scripts/veth-hosts.sh), an agent of 2 ranks on each, gpt2_train (GPT-2 tiny, DDP) under
# `dtrain-run --nnodes 1:2`, global batch 4 at every world size.
#   c10d: the agents' store is the built-in one, served by host A's agent (--master_addr);
#         host B (its agent and ranks) is killed.
#   etcd: the agents and the ranks meet in an etcd server (run in host B's namespace, reached
#         by both); host A, rank 0's host and the first agent, is killed.
# Job 1: the victim is killed mid-run; the survivor goes on at world 2 within 30 s (the kill
# to the first step of generation 1), finishes, and its final weights equal byte for byte
# (fp32) those of a reference run at world 2 resumed by a plain dtrain-run from a copy of the
# checkpoint generation 1 resumed from. Job 2: the same kill, then the victim's agent is
# started again and is taken in at the next generation (world 4), which finishes the job.
# Usage: elastic_veth_test.sh c10d|etcd path/to/dtrain-run path/to/gpt2_train
# Exit 77 (ctest: skipped) without root / ip(8), or without etcd for the etcd scenario.
set -u
mode="$1"
run="$2"
train="$3"
case "$mode" in c10d | etcd) ;; *)
  echo "usage: $0 c10d|etcd dtrain-run gpt2_train"
  exit 2
  ;;
esac
if [ "$mode" = etcd ] && ! command -v etcd >/dev/null 2>&1; then
  echo "SKIP: etcd is not installed (Debian: etcd-server; scripts/install-deps.sh installs it)"
  exit 77
fi
tmp="$(mktemp -d)"
# shellcheck source=../../scripts/veth-hosts.sh
. "$(dirname "$0")/../../scripts/veth-hosts.sh"

veth_test_hosts "de$$"
# shellcheck disable=SC2154  # set by veth_hosts_up
echo "hosts: a=$ns_a $addr_a, b=$ns_b $addr_b; rendezvous: $mode"

fail() {
  echo "FAIL ($mode): $*"
  for f in "$tmp"/*.out "$tmp"/*.err; do
    [ -e "$f" ] || continue
    echo "--- $f:"
    tail -n 30 "$f"
  done
  exit 1
}

now_ms() { echo $(($(date +%s%N) / 1000000)); }
t_start=$(now_ms)
# elapsed: seconds since the test started, for the log.
elapsed() { echo "$((($(now_ms) - t_start) / 1000)) s"; }

if [ "$mode" = c10d ]; then
  victim=b
  survivor=a
else
  victim=a
  survivor=b
  # etcd in host B's namespace: both hosts reach it at addr_b; killing host A leaves it.
  eport=$((21000 + ($$ % 4000) * 2))
  ip netns exec "$ns_b" env -i PATH=/usr/bin:/bin etcd --name t --data-dir "$tmp/etcd" \
    --listen-client-urls "http://$addr_b:$eport" --advertise-client-urls "http://$addr_b:$eport" \
    --listen-peer-urls "http://127.0.0.1:$((eport + 1))" \
    --initial-advertise-peer-urls "http://127.0.0.1:$((eport + 1))" \
    --initial-cluster "t=http://127.0.0.1:$((eport + 1))" >"$tmp/etcd.log" 2>&1 &
  i=0
  until ip netns exec "$ns_a" env ETCDCTL_API=3 etcdctl --endpoints "$addr_b:$eport" \
    --dial-timeout 1s endpoint health >/dev/null 2>&1; do
    i=$((i + 1))
    [ "$i" -lt 100 ] || {
      cat "$tmp/etcd.log"
      fail "etcd did not start in 20 s"
    }
    sleep 0.2
  done
fi

# The trainer's flags, for the elastic jobs and the reference run alike: --global_batch 4 is
# 1 step of 4 ranks or 2 accumulated micro-batches of 2 ranks.
train_args() {
  echo --data=random --tokenizer=byte --max_tokens=20000 --layers=2 --heads=2 --dim=64 \
    --ctx=32 --steps="$1" --warmup_steps=2 --lr=3e-3 --seed=7 --val_batches=1 \
    --sample_tokens=0 --timeout_s=60 --threads=1 --strategy=ddp --batch=1 --global_batch=4 \
    --ckpt_every=5 --ckpt_keep=1000 --resume
}

# agent JOB HOST STEPS: starts HOST's agent (a or b) of job JOB in HOST's namespace; its pid
# goes to pid_HOST, its output to $tmp/JOB.HOST.out/.err (appended: a restarted agent).
agent() {
  ns="$ns_a"
  [ "$2" = b ] && ns="$ns_b"
  if [ "$mode" = c10d ]; then
    rdzv="--master_addr $addr_a --master_port $((22000 + ($$ % 4000) * 2 + $1))"
  else
    rdzv="--rdzv_backend etcd --rdzv_endpoint $addr_b:$eport --rdzv_id job$$-$1"
  fi
  # shellcheck disable=SC2046,SC2086  # train_args and rdzv: words without spaces
  ip netns exec "$ns" "$run" --nnodes 1:2 --nproc_per_node 2 --host_id "$2" $rdzv \
    --rdzv_last_call_s 2 --heartbeat_timeout_s 10 --grace_s 5 --max_restarts 3 -- \
    "$train" $(train_args "$3") --ckpt_dir="$tmp/ckpt$1" --metrics_out="$tmp/m$1.jsonl" \
    --export="$tmp/elastic$1.safetensors" >>"$tmp/$1.$2.out" 2>>"$tmp/$1.$2.err" &
  eval "pid_$2=\$!"
}

# has_step JOB STEP GEN: step STEP of generation GEN is in job JOB's metrics file.
has_step() {
  grep '"kind": "step"' "$tmp/m$1.jsonl" 2>/dev/null | grep "\"generation\": $3" |
    grep -q "\"step\": $2,"
}
# first_step JOB GEN: the first step generation GEN trained, or nothing.
first_step() {
  grep '"kind": "step"' "$tmp/m$1.jsonl" 2>/dev/null | grep "\"generation\": $2[,}]" |
    head -n 1 | sed 's/.*"step": \([0-9]*\),.*/\1/'
}
# has_generation JOB GEN: generation GEN trained a step.
has_generation() { test -n "$(first_step "$1" "$2")"; }
# wait_for SECONDS WHAT COMMAND...: polls COMMAND every 0.1 s; fails naming WHAT.
wait_for() {
  limit=$(($1 * 10))
  what="$2"
  shift 2
  i=0
  until "$@"; do
    i=$((i + 1))
    [ "$i" -lt "$limit" ] || fail "$what"
    sleep 0.1
  done
}
# kill_host HOST: SIGKILLs every process of HOST's namespace (its agent, supervisors, ranks).
kill_host() {
  ns="$ns_a"
  [ "$1" = b ] && ns="$ns_b"
  if [ "$1" = b ] && [ "$mode" = etcd ]; then fail "the etcd scenario never kills host b"; fi
  ip netns pids "$ns" | xargs -r kill -KILL
}
# kill_victim JOB: once job JOB's generation 0 trained step 12 (a checkpoint at 10), kills the
# victim; waits for generation 1's first step (at most 30 s) and sets recovery_ms.
kill_victim() {
  wait_for 120 "job $1: generation 0 did not reach step 12 in 120 s" has_step "$1" 12 0
  kill_host "$victim"
  t0=$(now_ms)
  eval "wait \$pid_$victim" 2>/dev/null
  wait_for 30 "job $1: no step of generation 1 within 30 s of killing host $victim" \
    has_generation "$1" 1
  recovery_ms=$(($(now_ms) - t0))
  recoveries="$recoveries $recovery_ms"
  grep -q "\"world_size\": 2.*\"generation\": 1" "$tmp/m$1.jsonl" ||
    fail "job $1: generation 1 is not at world 2"
  echo "ok: job $1: host $victim killed; generation 1 (world 2) trained step" \
    "$(first_step "$1" 1) $recovery_ms ms later (at $(elapsed))"
}

recoveries=""
# Job 1: lose the victim, finish on the survivor, compare the weights with a reference.
steps=60
agent 1 a $steps
sleep 0.5
agent 1 b $steps
kill_victim 1
eval "survivor_pid=\$pid_$survivor"
# shellcheck disable=SC2154
wait_for 120 "job 1: the survivor still runs 120 s after the kill" \
  sh -c "! kill -0 $survivor_pid 2>/dev/null"
wait "$survivor_pid"
got=$?
[ "$got" -eq 0 ] || fail "job 1: the agent of host $survivor exited $got, want 0"
grep -q '"world_size": 4.*"generation": 0' "$tmp/m1.jsonl" || fail "job 1: no generation 0 at world 4"
has_step 1 $steps 1 || fail "job 1: generation 1 did not reach step $steps"
first=$(first_step 1 1)
[ $(((first - 1) % 5)) -eq 0 ] || fail "job 1: generation 1's first step is $first, not one after a checkpoint"
from=$(sed -n 's/.*resume: step [0-9]* from \([^ ]*\) (.*/\1/p' "$tmp/1.$survivor.out" \
  "$tmp/1.$survivor.err" | tail -n 1)
if [ -z "$from" ] || [ ! -d "$from" ]; then
  fail "job 1: no checkpoint directory in generation 1's resume line"
fi
[ "$(basename "$from")" = "$(printf 'step_%09d' $((first - 1)))" ] ||
  fail "job 1: generation 1 resumed from $from, not the checkpoint of step $((first - 1))"
mkdir -p "$tmp/ref_ckpt" || fail "cannot create $tmp/ref_ckpt"
cp -r "$from" "$tmp/ref_ckpt/" || fail "cannot copy $from"
# The reference: a plain launch of 2 ranks on one host, the same flags, from the copy.
# shellcheck disable=SC2046
"$run" --nproc_per_node 2 -- "$train" $(train_args $steps) --ckpt_dir="$tmp/ref_ckpt" \
  --export="$tmp/ref.safetensors" >"$tmp/ref.out" 2>"$tmp/ref.err" ||
  fail "the reference run failed"
grep -q "resume: step $((first - 1)) from" "$tmp/ref.out" "$tmp/ref.err" ||
  fail "the reference run did not resume from step $((first - 1))"
[ -s "$tmp/elastic1.safetensors" ] || fail "job 1 wrote no --export file"
cmp -s "$tmp/elastic1.safetensors" "$tmp/ref.safetensors" ||
  fail "job 1: final weights differ from the reference resumed at world 2 from step $((first - 1))"
echo "ok: job 1: finished at world 2; final weights equal the reference's (resumed at step" \
  "$((first - 1))) (at $(elapsed))"

# Job 2: the victim's agent comes back and is taken in at the next generation (world 4).
steps=100
agent 2 a $steps
sleep 0.5
agent 2 b $steps
kill_victim 2
agent 2 "$victim" $steps
wait_for 60 "job 2: host $victim was not taken in at generation 2 within 60 s" \
  grep -q '"world_size": 4.*"generation": 2' "$tmp/m2.jsonl"
has_step 2 $steps 1 && fail "job 2: generation 1 finished before host $victim came back; raise steps"
for h in a b; do
  eval "p=\$pid_$h"
  # shellcheck disable=SC2154
  wait_for 120 "job 2: the agent of host $h still runs after 120 s" \
    sh -c "! kill -0 $p 2>/dev/null"
  wait "$p"
  got=$?
  [ "$got" -eq 0 ] || fail "job 2: the agent of host $h exited $got, want 0"
done
has_step 2 $steps 2 || fail "job 2: generation 2 did not reach step $steps"
echo "ok: job 2: host $victim taken in at generation 2 (world 4, from step $(first_step 2 2));" \
  "finished (at $(elapsed))"
echo "elastic_veth_test ($mode): passed in $(elapsed); from the kill to generation 1's first" \
  "step (ms, jobs 1 and 2):$recoveries"
