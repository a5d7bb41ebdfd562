#!/usr/bin/env bash
# dtrain under a real Slurm (Debian's 22.05) on this machine: scripts/slurm-cluster.sh makes
# 2 nodes x 2 CPUs (dtnode1, dtnode2: network and UTS namespaces) and this test runs jobs on
# it, gpt2_train (GPT-2, a few layers, random bytes) taking its rank from Slurm's own
# variables (LaunchInfo::from_env, docs/multinode.md):
#   env   the variables srun gives 2 x 2 tasks (SLURM_PROCID, _LOCALID, _NODEID,
#         _STEP_NODELIST, _STEP_TASKS_PER_NODE) are what dtrain reads;
#   a     sbatch -N 2 --ntasks-per-node=2, srun gpt2_train: its per-step losses equal those
#         of 4 ranks on one host under dtrain-run (1e-6 relative), with bytes between hosts;
#   a2    the same with srun --mpi=pmix and gpt2_train --backend mpi (collectives over Open
#         MPI, PMIx from Slurm): the same losses;
#   b     one dtrain-run agent per node under srun: the same losses;
#   c     preemption: `scancel --signal=TERM` mid-run makes every rank write a checkpoint
#         and exit; a new job resumes; and a job of the "urgent" partition preempts a
#         --requeue job (SIGTERM, then Slurm requeues it), which resumes. Both end with the
#         final weights of an uninterrupted job, byte for byte;
#   d     a rank SIGKILLed mid-run: the job fails within seconds, the other ranks naming the
#         cause, and no process of the job is left on either node.
# At exit the cluster goes down, leaving no process, namespace or state (checked).
# Usage: slurm_test.sh BUILD_DIR (with examples/gpt2/gpt2_train and src/launcher/dtrain-run)
# Exit 77 (ctest: skipped) when network namespaces cannot be made (not root) or the Slurm
# packages cannot be installed (scripts/apt-ensure.sh: slurm-wlm, munge; not in
# install-deps.sh). About 2 minutes on 2 cores.
set -u -o pipefail
build="$1"
root="$(cd "$(dirname "$0")/../.." && pwd)"
cluster="$root/scripts/slurm-cluster.sh"
train="$build/examples/gpt2/gpt2_train"
run="$build/src/launcher/dtrain-run"
for f in "$train" "$run"; do
  [ -x "$f" ] || {
    echo "FAIL: $f is missing (build it first)"
    exit 1
  }
done

if ! ip netns add "dtslurmprobe$$" 2>/dev/null; then
  echo "SKIP: cannot create network namespaces here (needs root and ip(8))"
  exit 77
fi
ip netns del "dtslurmprobe$$"
if ! apt_out=$("$root/scripts/apt-ensure.sh" slurm-wlm munge 2>&1); then
  why=$(echo "$apt_out" | grep -m 1 '^E:' || echo "$apt_out" | tail -n 1)
  echo "SKIP: the Slurm packages (slurm-wlm, munge) cannot be installed here ($why)"
  exit 77
fi

# Nothing from the caller's launch environment may leak into the jobs (sbatch exports it).
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT
for v in $(env | sed -n 's/^\(SLURM_[A-Z_]*\|OMPI_[A-Z_]*\)=.*/\1/p'); do unset "$v"; done

# /tmp: the "nodes" share this machine's file system, as a cluster shares its home.
tmp="$(mktemp -d /tmp/dtrain-slurm-test.XXXXXX)"
failures=0
t_start=$(date +%s)
owned=0
bg_pids=""

fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}

# Kills what this script started in the background, then takes the cluster down (when this
# script brought it up) and checks that nothing of it is left.
# shellcheck disable=SC2317  # called by the trap
cleanup() {
  status=$?
  for p in $bg_pids; do kill "$p" 2>/dev/null; done
  if [ "$owned" -eq 1 ]; then
    "$cluster" down >/dev/null 2>&1
    left=$(pgrep -a -f "/run/dtrain-slurm|$tmp")
    if [ -n "$left" ] || ip netns list | grep -q '^dtslurm'; then
      echo "FAIL: left after slurm-cluster.sh down: ${left:-} $(ip netns list | grep '^dtslurm')"
      status=1
    else
      echo "ok: down: no process, namespace or state of the cluster left"
    fi
  fi
  rm -rf "$tmp"
  exit "$status"
}
trap cleanup EXIT

if "$cluster" status >/dev/null 2>&1; then
  echo "note: a cluster was already up; using it and leaving it up"
else
  owned=1
  if ! "$cluster" up >"$tmp/up.log" 2>&1; then
    cat "$tmp/up.log"
    echo "FAIL: slurm-cluster.sh up"
    exit 1
  fi
fi
# shellcheck source=/dev/null  # written by slurm-cluster.sh up
. /run/dtrain-slurm/env
read -r ns_a ns_b <<<"$DTRAIN_SLURM_NETNS"
echo "cluster: $DTRAIN_SLURM_NODES at $DTRAIN_SLURM_ADDRS (namespaces $ns_a $ns_b)"

# Clients run on dtnode1, as on a login node that is also the head node.
on() { "$cluster" on dtnode1 "$@"; }

# leftovers: processes on the nodes other than Slurm's daemons (job steps, ranks, agents).
leftovers() {
  for ns in "$ns_a" "$ns_b"; do
    for p in $(ip netns pids "$ns"); do
      c=$(cat "/proc/$p/comm" 2>/dev/null) || continue
      case "$c" in slurmd | slurmctld | slurmscriptd) ;; *) echo "$ns:$p:$c" ;; esac
    done
  done
}

# no_leftovers NAME: within 15 s (slurmstepd ends after its tasks), only daemons are left.
no_leftovers() {
  for _ in $(seq 1 30); do
    [ -z "$(leftovers)" ] && return 0
    sleep 0.5
  done
  fail "$1: processes left on the nodes: $(leftovers | tr '\n' ' ')"
  return 1
}

# A model small enough for seconds per run; byte vocabulary and random tokens: no files.
common="--data=random --tokenizer=byte --max_tokens=40000 --layers=2 --heads=2 --dim=64
  --ctx=32 --steps=6 --warmup_steps=2 --lr=3e-3 --seed=7 --batch=2 --val_batches=0
  --sample_tokens=0 --timeout_s=60 --threads=1 --log_every=1 --strategy=ddp"
# Long enough (300 steps, ~10 s) to be interrupted mid-run.
long="--data=random --tokenizer=byte --max_tokens=40000 --layers=2 --heads=4 --dim=128
  --ctx=64 --steps=300 --warmup_steps=2 --lr=3e-3 --seed=7 --batch=2 --val_batches=0
  --sample_tokens=0 --timeout_s=20 --threads=1 --log_every=10 --strategy=ddp"
# shellcheck disable=SC2116,SC2086  # one line: they go into sbatch --wrap and scripts
common=$(echo $common)
# shellcheck disable=SC2116,SC2086
long=$(echo $long)

. "$root/tests/multinode/losses.sh"

# same_losses NAME REF RUN: equal step count (>= 5), each loss within 1e-6 relative; and RUN
# (two nodes) sent bytes between hosts.
same_losses() {
  why=$(losses_differ "$2" "$3")
  if [ -n "$why" ]; then
    fail "$1: losses differ from 4 ranks on one host: $why"
    return
  fi
  n=$(wc -l <"$tmp/lb")
  inter=$(last_field "$3" wire_bytes_inter_host)
  if ! awk -v b="$inter" 'BEGIN { exit !(b + 0 > 0) }'; then
    fail "$1: no bytes between hosts ($inter): did the ranks run on both nodes?"
    return
  fi
  echo "ok: $1: $n step losses equal 4 ranks on one host within 1e-6 ($(paste -s -d ' ' "$tmp/lb")); $inter bytes between hosts per step"
}

# wait_step FILE N: until the metrics FILE has step N (60 s at most).
wait_step() {
  for _ in $(seq 1 600); do
    grep -q "\"step\": $2," "$1" 2>/dev/null && return 0
    sleep 0.1
  done
  return 1
}

# wait_gone JOB: until the job left the queue, requeued runs included (120 s at most).
wait_gone() {
  for _ in $(seq 1 240); do
    [ -z "$(on squeue -h -j "$1" 2>/dev/null)" ] && return 0
    sleep 0.5
  done
  return 1
}

# --- env: what srun gives 2 nodes x 2 tasks.
# shellcheck disable=SC2016  # expanded by the tasks
if on sbatch -N 2 --ntasks-per-node=2 --wait -o "$tmp/env.out" --wrap 'srun sh -c "echo \
  PROCID=\$SLURM_PROCID LOCALID=\$SLURM_LOCALID NODEID=\$SLURM_NODEID HOST=\$(hostname) \
  NODELIST=\$SLURM_STEP_NODELIST TASKS_PER_NODE=\$SLURM_STEP_TASKS_PER_NODE"' >/dev/null; then
  sort "$tmp/env.out" >"$tmp/env.sorted"
  cat >"$tmp/env.expected" <<'EOF'
PROCID=0 LOCALID=0 NODEID=0 HOST=dtnode1 NODELIST=dtnode[1-2] TASKS_PER_NODE=2(x2)
PROCID=1 LOCALID=1 NODEID=0 HOST=dtnode1 NODELIST=dtnode[1-2] TASKS_PER_NODE=2(x2)
PROCID=2 LOCALID=0 NODEID=1 HOST=dtnode2 NODELIST=dtnode[1-2] TASKS_PER_NODE=2(x2)
PROCID=3 LOCALID=1 NODEID=1 HOST=dtnode2 NODELIST=dtnode[1-2] TASKS_PER_NODE=2(x2)
EOF
  if cmp -s "$tmp/env.sorted" "$tmp/env.expected"; then
    echo "ok: env: srun's 4 tasks: PROCID 0-3, LOCALID 0/1 per node, NODELIST dtnode[1-2], TASKS_PER_NODE 2(x2)"
  else
    fail "env: srun's variables:"
    cat "$tmp/env.out"
  fi
else
  fail "env: the job failed"
  cat "$tmp/env.out"
fi

# --- a: srun starts the ranks; dtrain reads SLURM_*, MASTER_ADDR is the first node (dtnode1,
# resolved inside the nodes), MASTER_PORT 29500 + job id % 1000.
# shellcheck disable=SC2086
"$run" --nproc_per_node 4 -- "$train" $common --metrics_out="$tmp/one.jsonl" \
  >"$tmp/one.log" 2>&1 || {
  fail "one-host reference run failed"
  cat "$tmp/one.log"
}
if on sbatch -N 2 --ntasks-per-node=2 --wait -o "$tmp/a.out" \
  --wrap "srun $train $common --metrics_out=$tmp/a.jsonl" >/dev/null; then
  same_losses "a (srun gpt2_train, 2 nodes x 2 tasks)" "$tmp/one.jsonl" "$tmp/a.jsonl"
else
  fail "a: the job failed"
  tail -n 20 "$tmp/a.out"
fi
no_leftovers a

# --- a2: the same job with the collectives over MPI: srun --mpi=pmix starts Open MPI's ranks
# (PMIx), gpt2_train --backend mpi (Backend::kMpi) moves the gradients through Open MPI.
# MPI's bytes are not counted (wire_stats.h): each rank writes its host name instead.
cat >"$tmp/a2.sh" <<EOF
#!/bin/sh
srun --mpi=pmix sh -c 'hostname >$tmp/a2.host.\$SLURM_PROCID && exec "\$0" "\$@"' \
  $train $common --backend=mpi --metrics_out=$tmp/a2.jsonl
EOF
if on sbatch -N 2 --ntasks-per-node=2 --wait -o "$tmp/a2.out" "$tmp/a2.sh" >/dev/null; then
  transport=$(grep -o '"transport": "[a-z_]*"' "$tmp/a2.jsonl" | sort -u | paste -s -d ' ')
  hosts=$(cat "$tmp"/a2.host.* | sort -u | paste -s -d ' ')
  why=$(losses_differ "$tmp/one.jsonl" "$tmp/a2.jsonl")
  if [ "$transport" != '"transport": "mpi"' ]; then
    fail "a2: the metrics say $transport, not mpi"
  elif [ "$hosts" != "dtnode1 dtnode2" ]; then
    fail "a2: the ranks ran on '$hosts', not on both nodes"
  elif [ -n "$why" ]; then
    fail "a2: losses differ from 4 ranks on one host: $why"
  else
    echo "ok: a2 (srun --mpi=pmix gpt2_train --backend mpi): $(wc -l <"$tmp/lb") step losses equal 4 ranks on one host within 1e-6, ranks on $hosts, transport mpi"
  fi
else
  fail "a2: the job failed"
  tail -n 20 "$tmp/a2.out"
fi
no_leftovers a2

# --- b: one dtrain-run agent per node (one task of 2 CPUs each); the agents' RANK wins.
cat >"$tmp/b.sh" <<EOF
#!/bin/bash
head=\$(scontrol show hostnames "\$SLURM_JOB_NODELIST" | head -n 1)
srun sh -c 'exec "\$0" --nnodes 2 --node_rank "\$SLURM_NODEID" --nproc_per_node 2 \
  --master_addr "\$1" --master_port \$((29500 + SLURM_JOB_ID % 1000)) -- "\$2" \$3' \
  "$run" "\$head" "$train" "$common --metrics_out=$tmp/b.jsonl"
EOF
if on sbatch -N 2 --ntasks-per-node=1 --cpus-per-task=2 --wait -o "$tmp/b.out" \
  "$tmp/b.sh" >/dev/null; then
  same_losses "b (srun dtrain-run, one agent per node)" "$tmp/one.jsonl" "$tmp/b.jsonl"
else
  fail "b: the job failed"
  tail -n 20 "$tmp/b.out"
fi
no_leftovers b

# --- c: preemption. One batch script for all three jobs: NAME picks the checkpoint
# directory, metrics and final weights; the output is appended, so a requeued run adds to it.
cat >"$tmp/ckpt_job.sh" <<EOF
#!/bin/bash
#SBATCH -N 2 --ntasks-per-node=2 --open-mode=append
echo "run \${SLURM_RESTART_COUNT:-0} of job \$SLURM_JOB_ID"
srun $train $long --ckpt_dir=$tmp/\$1.ckpt --resume --metrics_out=$tmp/\$1.jsonl \
  --export=$tmp/\$1.safetensors
EOF
on sbatch -N 2 --ntasks-per-node=2 --wait -o "$tmp/ref.out" "$tmp/ckpt_job.sh" ref >/dev/null ||
  {
    fail "c: the uninterrupted job failed"
    tail -n 20 "$tmp/ref.out"
  }

# stopped_at NAME.out: the step at which the ranks stopped on SIGTERM (empty if they did not).
stopped_at() {
  sed -n 's/.*stopped by Terminated after step \([0-9]*\): checkpoint written.*/\1/p' "$1" |
    sort -u
}

# same_weights NAME: its final weights equal the uninterrupted job's, byte for byte.
same_weights() {
  if [ -s "$tmp/$1.safetensors" ] && cmp -s "$tmp/$1.safetensors" "$tmp/ref.safetensors"; then
    return 0
  fi
  fail "c: $1: final weights differ from the uninterrupted job's (or are missing)"
  return 1
}

# c1: scancel --signal=TERM, then a new job with the same flags.
j=$(on sbatch --parsable -o "$tmp/term.out" "$tmp/ckpt_job.sh" term)
if ! wait_step "$tmp/term.jsonl" 3; then
  fail "c: term: no step 3 within 60 s"
else
  on scancel --signal=TERM "$j"
  wait_gone "$j" || fail "c: term: job $j still queued 120 s after SIGTERM"
  at=$(stopped_at "$tmp/term.out")
  if [ -z "$at" ] || [ "$at" -ge 300 ] || [ "$(grep -c 'stopped by Terminated' "$tmp/term.out")" -ne 4 ]; then
    fail "c: term: the 4 ranks did not all stop at one step before the end with a checkpoint"
    tail -n 20 "$tmp/term.out"
  elif on sbatch --wait -o "$tmp/term.out" "$tmp/ckpt_job.sh" term >/dev/null &&
    grep -q "resume: step $at from" "$tmp/term.out" && same_weights term; then
    echo "ok: c: scancel --signal=TERM: 4 ranks checkpointed at step $at and exited; a new job resumed there; final weights equal the uninterrupted job's"
  else
    fail "c: term: the second job did not resume from step $at"
    tail -n 20 "$tmp/term.out"
  fi
fi
no_leftovers "c (term)"

# c2: the "urgent" partition preempts the job (PreemptMode=REQUEUE): SIGTERM to its steps and
# batch shell, SIGKILL KillWait (10 s) later; Slurm requeues it and runs it again.
j=$(on sbatch --parsable --requeue -o "$tmp/preempt.out" "$tmp/ckpt_job.sh" preempt)
if ! wait_step "$tmp/preempt.jsonl" 3; then
  fail "c: preempt: no step 3 within 60 s"
else
  on sbatch -p urgent -N 2 --ntasks-per-node=2 -o "$tmp/urgent.out" --wrap 'hostname' >/dev/null
  wait_gone "$j" || fail "c: preempt: job $j still queued after 120 s"
  at=$(stopped_at "$tmp/preempt.out")
  if ! grep -q "DUE TO PREEMPTION" "$tmp/preempt.out"; then
    fail "c: preempt: Slurm did not preempt the job"
    tail -n 20 "$tmp/preempt.out"
  elif [ -z "$at" ] || [ "$at" -ge 300 ]; then
    fail "c: preempt: the ranks did not stop with a checkpoint before the end"
    tail -n 20 "$tmp/preempt.out"
  elif grep -q "^run 1 of job $j" "$tmp/preempt.out" &&
    grep -q "resume: step $at from" "$tmp/preempt.out" && same_weights preempt; then
    echo "ok: c: preempted by a job of the urgent partition: checkpoint at step $at; Slurm requeued job $j, which resumed there; final weights equal the uninterrupted job's"
  else
    fail "c: preempt: the requeued run did not resume from step $at and finish"
    tail -n 20 "$tmp/preempt.out"
  fi
fi
no_leftovers "c (preempt)"

# --- d: SIGKILL to rank 3 (on dtnode2) mid-run; the others must fail on their own, quickly.
on sbatch -N 2 --ntasks-per-node=2 --wait -o "$tmp/d.out" \
  --wrap "srun $train $long --metrics_out=$tmp/d.jsonl" >"$tmp/d.sbatch" 2>&1 &
sbatch_pid=$!
bg_pids="$sbatch_pid"
if ! wait_step "$tmp/d.jsonl" 3; then
  fail "d: no step 3 within 60 s"
else
  victim=""
  for p in $(ip netns pids "$ns_b"); do
    tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx 'SLURM_PROCID=3' && victim=$p
  done
  killed_at=$(date +%s)
  [ -n "$victim" ] && kill -KILL "$victim"
  wait "$sbatch_pid"
  st=$?
  took=$(($(date +%s) - killed_at))
  if [ -z "$victim" ]; then
    fail "d: rank 3 not found on dtnode2"
  elif [ "$st" -eq 0 ]; then
    fail "d: the job succeeded although rank 3 was killed"
  elif [ "$took" -gt 40 ]; then
    fail "d: the job took $took s to fail after the kill"
  elif ! grep -q "rank 3 (pid $victim) exited or was killed" "$tmp/d.out"; then
    fail "d: no rank names the killed rank"
    tail -n 20 "$tmp/d.out"
  elif no_leftovers d; then
    echo "ok: d: rank 3 killed: the job failed in $took s ($(grep -m 1 'exited or was killed' "$tmp/d.out")); no process left on either node"
  fi
fi
bg_pids=""

echo "slurm test: $(($(date +%s) - t_start)) s"
if [ "$failures" -ne 0 ]; then
  echo "$failures failure(s)"
  exit 1
fi
echo "all Slurm checks passed"
