#!/usr/bin/env bash
# dtrain under a real Open MPI mpirun (Debian's 4.1): gpt2_train (GPT-2, a few layers, random
# bytes) takes its rank from OMPI_COMM_WORLD_* (LaunchInfo::from_env, docs/multinode.md).
#   one host   mpirun -np 4: per-step losses equal 4 ranks under dtrain-run (1e-6 relative);
#              also with --backend mpi (the collectives over Open MPI, Backend::kMpi), which
#              dtrain-run's ranks (no MPI job) refuse, naming the launchers that work;
#   two hosts  two network namespaces joined by a veth pair (scripts/veth-hosts.sh), mpirun
#              in host A starting 2 ranks there and 2 in host B through an rsh agent that
#              enters B's namespace instead of ssh (tests/multinode/netns_rsh.sh; mpirun
#              --mca plm_rsh_agent), MASTER_ADDR passed with -x: the same losses, with bytes
#              between the hosts; without -x MASTER_ADDR every rank refuses to start, saying
#              so (mpirun publishes no host list); --backend mpi across the namespaces too;
# and after each job no process is left in either namespace (orted, ranks).
# Usage: mpirun_test.sh BUILD_DIR (with examples/gpt2/gpt2_train and src/launcher/dtrain-run)
# Exit 77 (ctest: skipped) when network namespaces cannot be made (not root) or openmpi-bin
# cannot be installed (scripts/apt-ensure.sh; not in install-deps.sh). About 30 s.
set -u -o pipefail
build="$1"
root="$(cd "$(dirname "$0")/../.." && pwd)"
train="$build/examples/gpt2/gpt2_train"
run="$build/src/launcher/dtrain-run"
for f in "$train" "$run"; do
  [ -x "$f" ] || {
    echo "FAIL: $f is missing (build it first)"
    exit 1
  }
done
# Nothing from the caller's launch environment may reach the ranks.
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT
for v in $(env | sed -n 's/^\(SLURM_[A-Z_]*\|OMPI_[A-Z_]*\|PMIX_[A-Z_]*\)=.*/\1/p'); do unset "$v"; done

tmp="$(mktemp -d)"
failures=0
t_start=$(date +%s)
# shellcheck source=../../scripts/veth-hosts.sh source-path=SCRIPTDIR
. "$root/scripts/veth-hosts.sh"
veth_test_hosts "dm$$" # exits 77 without namespaces; removes them and $tmp at exit
if ! apt_out=$("$root/scripts/apt-ensure.sh" openmpi-bin 2>&1); then
  why=$(echo "$apt_out" | grep -m 1 '^E:' || echo "$apt_out" | tail -n 1)
  echo "SKIP: openmpi-bin cannot be installed here ($why)"
  exit 77
fi
echo "hosts: a=$ns_a $addr_a, b=$ns_b $addr_b"

fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}

# 4 ranks on 2 cores: --oversubscribe (mpirun counts cores as slots), --bind-to none (its
# default binding would pin ranks to cores they then share).
mpirun=(mpirun --allow-run-as-root --oversubscribe --bind-to none)

common="--data=random --tokenizer=byte --max_tokens=40000 --layers=2 --heads=2 --dim=64
  --ctx=32 --steps=6 --warmup_steps=2 --lr=3e-3 --seed=7 --batch=2 --val_batches=0
  --sample_tokens=0 --timeout_s=60 --threads=1 --log_every=1 --strategy=ddp"

. "$root/tests/multinode/losses.sh"

# same_losses NAME REF RUN: equal step count (>= 5), each loss within 1e-6 relative.
same_losses() {
  why=$(losses_differ "$2" "$3")
  if [ -n "$why" ]; then
    fail "$1: losses differ from dtrain-run's 4 ranks on one host: $why"
    return 1
  fi
}

# no_leftovers NAME: nothing runs in either namespace any more (10 s at most).
no_leftovers() {
  for _ in $(seq 1 20); do
    [ -z "$(ip netns pids "$ns_a")$(ip netns pids "$ns_b")" ] && return 0
    sleep 0.5
  done
  fail "$1: processes left: $(ip netns pids "$ns_a" | tr '\n' ' ') $(ip netns pids "$ns_b" | tr '\n' ' ')"
  return 1
}

# shellcheck disable=SC2086
"$run" --nproc_per_node 4 -- "$train" $common --metrics_out="$tmp/ref.jsonl" >"$tmp/ref.log" 2>&1 ||
  {
    fail "the dtrain-run reference failed"
    tail -n 20 "$tmp/ref.log"
  }

# --- one host: MASTER_ADDR defaults to 127.0.0.1 (every rank is local).
# shellcheck disable=SC2086
if "${mpirun[@]}" -np 4 "$train" $common --metrics_out="$tmp/one.jsonl" >"$tmp/one.log" 2>&1; then
  same_losses "one host" "$tmp/ref.jsonl" "$tmp/one.jsonl" &&
    echo "ok: one host: mpirun -np 4: $(wc -l <"$tmp/lb") step losses equal dtrain-run's within 1e-6 ($(paste -s -d ' ' "$tmp/lb"))"
else
  fail "one host: mpirun -np 4 failed"
  tail -n 20 "$tmp/one.log"
fi

# --- one host, --backend mpi: the collectives over Open MPI itself (Backend::kMpi).
# shellcheck disable=SC2086
if "${mpirun[@]}" -np 4 "$train" $common --backend=mpi --metrics_out="$tmp/one_mpi.jsonl" \
  >"$tmp/one_mpi.log" 2>&1; then
  transport=$(grep -o '"transport": "[a-z_]*"' "$tmp/one_mpi.jsonl" | sort -u | paste -s -d ' ')
  if [ "$transport" != '"transport": "mpi"' ]; then
    fail "one host, --backend mpi: the metrics say $transport, not mpi"
  elif same_losses "one host, --backend mpi" "$tmp/ref.jsonl" "$tmp/one_mpi.jsonl"; then
    echo "ok: one host: mpirun -np 4 --backend mpi: $(wc -l <"$tmp/lb") step losses equal dtrain-run's (Gloo) within 1e-6"
  fi
else
  fail "one host: mpirun -np 4 --backend mpi failed"
  tail -n 20 "$tmp/one_mpi.log"
fi

# --- --backend mpi without an MPI launcher: each process is an MPI world of its own; refused.
# shellcheck disable=SC2086
if timeout 60 "$run" --nproc_per_node 2 -- "$train" $common --backend=mpi >"$tmp/nompi.log" 2>&1; then
  fail "dtrain-run --backend mpi: started although the ranks are no MPI job"
elif grep -q 'Backend::kMpi needs every rank to be a process of one MPI job, but rank 0 is MPI rank 0 of 1 and rank 1 is MPI rank 0 of 1: start the job with an MPI launcher' "$tmp/nompi.log"; then
  echo "ok: dtrain-run --backend mpi: refused ('Backend::kMpi needs every rank to be a process of one MPI job, ...')"
else
  fail "dtrain-run --backend mpi: no rank names the fix"
  tail -n 20 "$tmp/nompi.log"
fi

# --- two hosts: mpirun in A; orted in B through the agent; ranks 0-1 in A, 2-3 in B.
export NETNS_RSH_HOSTS="$addr_a=$ns_a $addr_b=$ns_b"
two=("${mpirun[@]}" --mca plm_rsh_agent "$root/tests/multinode/netns_rsh.sh"
  --host "$addr_a:2,$addr_b:2" -np 4)
# shellcheck disable=SC2086
if ip netns exec "$ns_a" "${two[@]}" -x MASTER_ADDR="$addr_a" -x MASTER_PORT=29400 \
  "$train" $common --metrics_out="$tmp/two.jsonl" >"$tmp/two.log" 2>&1; then
  inter=$(last_field "$tmp/two.jsonl" wire_bytes_inter_host)
  if same_losses "two hosts" "$tmp/ref.jsonl" "$tmp/two.jsonl"; then
    if awk -v b="$inter" 'BEGIN { exit !(b + 0 > 0) }'; then
      echo "ok: two hosts: mpirun over the rsh agent, -x MASTER_ADDR: $(wc -l <"$tmp/lb") step losses equal dtrain-run's on one host within 1e-6; $inter bytes between hosts per step"
    else
      fail "two hosts: no bytes between hosts ($inter): did ranks 2-3 run in $ns_b?"
    fi
  fi
else
  fail "two hosts: mpirun failed"
  tail -n 20 "$tmp/two.log"
fi
no_leftovers "two hosts"

# --- two hosts, --backend mpi: Open MPI's own TCP between the namespaces.
# shellcheck disable=SC2086
if ip netns exec "$ns_a" "${two[@]}" -x MASTER_ADDR="$addr_a" -x MASTER_PORT=29401 \
  "$train" $common --backend=mpi --metrics_out="$tmp/two_mpi.jsonl" >"$tmp/two_mpi.log" 2>&1; then
  same_losses "two hosts, --backend mpi" "$tmp/ref.jsonl" "$tmp/two_mpi.jsonl" &&
    echo "ok: two hosts: mpirun --backend mpi across the namespaces: $(wc -l <"$tmp/lb") step losses equal dtrain-run's within 1e-6"
else
  fail "two hosts: mpirun --backend mpi failed"
  tail -n 20 "$tmp/two_mpi.log"
fi
no_leftovers "two hosts, --backend mpi"

# --- two hosts without MASTER_ADDR: every rank fails at once, naming the fix.
# shellcheck disable=SC2086
if ip netns exec "$ns_a" timeout 60 "${two[@]}" "$train" $common >"$tmp/noaddr.log" 2>&1; then
  fail "no MASTER_ADDR: mpirun across hosts succeeded"
else
  n=$(grep -c 'mpirun started 4 ranks on several hosts (2 on this one) but MASTER_ADDR is not set' \
    "$tmp/noaddr.log")
  if [ "$n" -ge 1 ]; then
    echo "ok: no MASTER_ADDR across hosts: the ranks refuse to start ('mpirun started 4 ranks on several hosts (2 on this one) but MASTER_ADDR is not set; ...')"
  else
    fail "no MASTER_ADDR: no rank says MASTER_ADDR is missing"
    tail -n 20 "$tmp/noaddr.log"
  fi
fi
no_leftovers "no MASTER_ADDR"

echo "mpirun test: $(($(date +%s) - t_start)) s"
if [ "$failures" -ne 0 ]; then
  echo "$failures failure(s)"
  exit 1
fi
echo "all mpirun checks passed"
