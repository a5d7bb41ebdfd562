#!/usr/bin/env bash
# A real Slurm cluster on one machine: 2 hosts x 2 CPUs, for testing dtrain's Slurm launch
# (tests/multinode/slurm_test.sh; docs/multinode.md, "A real Slurm cluster on one machine").
#
#   scripts/slurm-cluster.sh up        # install (first time), start; idempotent
#   scripts/slurm-cluster.sh status    # exit 0 when every daemon runs and both nodes are up
#   scripts/slurm-cluster.sh on dtnode1 sbatch -N 2 --ntasks-per-node=2 --wait job.sh
#   scripts/slurm-cluster.sh down      # stop everything, remove namespaces and state
#
# Each host is a network namespace (scripts/veth-hosts.sh: a veth pair, 10.214.0.1 and .2)
# and a UTS namespace whose hostname is the node's name, dtnode1 or dtnode2, so `hostname`,
# SLURMD_NODENAME and SLURM_STEP_NODELIST agree as on real machines. The node names resolve
# through /run/dtrain-slurm/etc/hosts, bind-mounted over /etc/hosts in a private mount
# namespace of each daemon (jobs inherit it): the machine's /etc/hosts is not touched.
# dtnode1 runs slurmctld and a slurmd, dtnode2 a slurmd; munged runs outside (its Unix
# socket is reached from every namespace). Clients (sbatch, srun, squeue, scancel) run on a
# node: `on NODE CMD...` (or `ip netns exec dtslurma` with SLURM_CONF from
# /run/dtrain-slurm/env, without the names).
#
# Everything generated (slurm.conf, munge key, spool, logs, pid files) lives in
# /run/dtrain-slurm; /etc/slurm and the system's munge are not used. Debian's slurm-wlm
# (22.05) and munge are installed on first use through scripts/apt-ensure.sh (not by
# install-deps.sh: only these tests need them). Needs root.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=veth-hosts.sh source-path=SCRIPTDIR
. "$here/veth-hosts.sh"
run_dir=/run/dtrain-slurm
conf="$run_dir/etc/slurm.conf"
tag=dtslurm # namespaces dtslurma and dtslurmb, veth dtslurmva/vb
net=10.214.0
nodes=(dtnode1 dtnode2)
netns=("${tag}a" "${tag}b")
addrs=("$net.1" "$net.2")
munge_socket="$run_dir/munge/munge.socket"

say() { echo "slurm-cluster: $*" >&2; }

# host_exec I CMD...: CMD on host I: its network namespace, its hostname, and our hosts file
# over /etc/hosts in a private mount namespace, where $run_dir/pmix is the host's own
# directory (PMIx's per-step directories are named after the job, not the host: on one shared
# /tmp the second node's step could not start). Not `ip netns exec`: that mounts a new /sys,
# which hides /sys/fs/cgroup, and Debian's slurmd 22.05 will not start without a cgroup
# file system even with proctrack/linuxproc and task/none ("Unable to initialize cgroup
# plugin").
host_exec() {
  local i="$1"
  shift
  # shellcheck disable=SC2016 # expanded by that sh
  nsenter --net="/run/netns/${netns[$i]}" unshare --mount --uts env SLURM_CONF="$conf" sh -c \
    'h=$1 && t=$2 && p=$3 && shift 3 && mount --bind "$h" /etc/hosts && mount --bind "$t" "$p" &&
     hostname "$0" && exec "$@"' \
    "${nodes[$i]}" "$run_dir/etc/hosts" "$run_dir/${nodes[$i]}/tmp" "$run_dir/pmix" "$@"
}

# on NODE CMD...: CMD on that host, e.g. a client (sbatch, srun, squeue).
on() {
  local i
  i=$(node_index "$1") || return 1
  shift
  host_exec "$i" "$@"
}

node_index() {
  case "$1" in
    "${nodes[0]}") echo 0 ;;
    "${nodes[1]}") echo 1 ;;
    *)
      say "unknown node '$1' (${nodes[*]})"
      return 1
      ;;
  esac
}

pid_alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

write_config() {
  mkdir -p "$run_dir/etc" "$run_dir/ctld"
  for n in "${nodes[@]}"; do mkdir -p "$run_dir/$n/spool" "$run_dir/$n/tmp"; done
  mkdir -p "$run_dir/pmix"
  # Why each setting (docs/multinode.md has the long version):
  # - SlurmUser/SlurmdUser root: no slurm account needed; jobs run as the submitting root.
  # - AuthInfo socket: our own munged, not /run/munge of the system; cred_expire 10 s (default
  #   120): a requeued job is held that long plus 1 s before it may start again.
  # - proctrack/linuxproc, task/none, jobacct_gather/none: no systemd and no cgroup
  #   hierarchy to delegate here (proctrack/cgroup needs one); linuxproc finds a step's
  #   processes through /proc parentage, enough to signal and kill them.
  # - %n in the slurmd paths: two slurmd on one file system need their own spool and pid.
  # - NodeAddr: the namespace's address; slurmctld and srun reach the slurmd there.
  # - CR_CPU: 2 tasks on a node of 2 CPUs without a core/socket layout to match.
  # - MinJobAge 4 s: `sbatch --wait` polls every 2 s only while 2 s < MinJobAge / 2, else
  #   every 8, then 32 s (a 12 s job took 42 s to report); finished jobs leave squeue and
  #   `scontrol show job` 4 s after they end (there is no accounting database).
  # - sched_interval 2 s: a requeued job starts when its hold ends, not up to 60 s later.
  # - KillWait 10 s: SIGTERM to SIGKILL when a job or step is ended (default 30 s).
  # - Two partitions on the same nodes: a job in "urgent" preempts jobs of "debug" (the
  #   default): SIGTERM to their processes, SIGKILL KillWait later, then they are requeued.
  cat >"$conf" <<EOF
ClusterName=dtrain
SlurmctldHost=${nodes[0]}(${addrs[0]})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$munge_socket,cred_expire=10
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$run_dir/ctld
SlurmctldPidFile=$run_dir/ctld/slurmctld.pid
SlurmctldLogFile=$run_dir/ctld/slurmctld.log
SlurmdSpoolDir=$run_dir/%n/spool
SlurmdPidFile=$run_dir/%n/slurmd.pid
SlurmdLogFile=$run_dir/%n/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
JobRequeue=1
KillWait=10
MinJobAge=4
SchedulerParameters=sched_interval=2
NodeName=${nodes[0]} NodeAddr=${addrs[0]} CPUs=2 State=UNKNOWN
NodeName=${nodes[1]} NodeAddr=${addrs[1]} CPUs=2 State=UNKNOWN
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1
PartitionName=urgent Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
EOF
  # srun --mpi=pmix (Open MPI's jobs under srun): each node's PMIx files in its own directory.
  echo "PMIxCliTmpDirBase=$run_dir/pmix" >"$run_dir/etc/mpi.conf"
  printf '127.0.0.1 localhost\n%s %s\n%s %s\n' "${addrs[0]}" "${nodes[0]}" \
    "${addrs[1]}" "${nodes[1]}" >"$run_dir/etc/hosts"
  cat >"$run_dir/env" <<EOF
# . $run_dir/env (written by scripts/slurm-cluster.sh up)
export SLURM_CONF=$conf
export DTRAIN_SLURM_NODES="${nodes[*]}"
export DTRAIN_SLURM_NETNS="${netns[*]}"
export DTRAIN_SLURM_ADDRS="${addrs[*]}"
EOF
}

start_munge() {
  mkdir -p "$run_dir/munge"
  chmod 0755 "$run_dir/munge" # munged: clients need to reach the socket
  [ -s "$run_dir/munge/munge.key" ] || mungekey -c -k "$run_dir/munge/munge.key" -b 1024
  munged --socket="$munge_socket" --key-file="$run_dir/munge/munge.key" \
    --pid-file="$run_dir/munge/munged.pid" --log-file="$run_dir/munge/munged.log" \
    --seed-file="$run_dir/munge/munged.seed"
}

# Every daemon alive and both nodes up (idle, mixed or allocated) for slurmctld.
healthy() {
  pid_alive "$run_dir/munge/munged.pid" && pid_alive "$run_dir/ctld/slurmctld.pid" || return 1
  for n in "${nodes[@]}"; do pid_alive "$run_dir/$n/slurmd.pid" || return 1; done
  local states
  states=$(on "${nodes[0]}" sinfo -h -N -o '%N %t' 2>/dev/null | sort -u) || return 1
  [ "$(echo "$states" | grep -c -E ' (idle|mix|alloc)$')" -eq 2 ]
}

cmd_up() {
  if [ "$(id -u)" -ne 0 ]; then
    say "needs root (network namespaces)"
    return 1
  fi
  "$here/apt-ensure.sh" slurm-wlm munge || return 1
  if [ -e "$run_dir/env" ] && healthy; then
    say "already up"
    cat "$run_dir/env"
    return 0
  fi
  cmd_down >/dev/null 2>&1 || true # a half-started cluster: start again from nothing
  VETH_NET=$net veth_hosts_up "$tag" >&2 || return 1
  write_config
  start_munge
  host_exec 0 slurmctld -f "$conf"
  for i in 0 1; do host_exec "$i" slurmd -f "$conf"; done
  for _ in $(seq 1 60); do
    healthy && break
    sleep 0.5
  done
  if ! healthy; then
    say "the cluster did not come up within 30 s; logs:"
    tail -n 5 "$run_dir"/ctld/slurmctld.log "$run_dir"/dtnode*/slurmd.log >&2 || true
    on "${nodes[0]}" sinfo -N >&2 || true
    say "left as it is for a look; '$0 down' removes it"
    return 1
  fi
  say "up: ${nodes[0]}=${addrs[0]} (slurmctld, slurmd) ${nodes[1]}=${addrs[1]} (slurmd)"
  cat "$run_dir/env"
}

# Stops a daemon by its pid file: SIGTERM, then SIGKILL after 10 s.
stop_pidfile() {
  [ -s "$1" ] || return 0
  local pid
  pid=$(cat "$1")
  kill -TERM "$pid" 2>/dev/null || return 0
  for _ in $(seq 1 100); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.1
  done
  kill -KILL "$pid" 2>/dev/null || true
}

cmd_down() {
  local i n left
  for n in "${nodes[@]}"; do stop_pidfile "$run_dir/$n/slurmd.pid"; done
  stop_pidfile "$run_dir/ctld/slurmctld.pid"
  # What is left in the hosts (job steps, slurmstepd) goes with them.
  for i in 0 1; do
    ip netns pids "${netns[$i]}" 2>/dev/null | xargs -r kill -KILL 2>/dev/null || true
  done
  stop_pidfile "$run_dir/munge/munged.pid"
  ns_a=${netns[0]} ns_b=${netns[1]} veth_hosts_down
  rm -rf "$run_dir"
  left=$(pgrep -a -f "$run_dir" || true)
  if [ -n "$left" ] || ip netns list | grep -q -E "^${tag}[ab]( |$)"; then
    say "left behind: ${left:-namespaces $(ip netns list | grep "^$tag" | tr '\n' ' ')}"
    return 1
  fi
  say "down"
}

cmd_status() {
  if [ ! -e "$run_dir/env" ]; then
    say "down"
    return 1
  fi
  local i
  echo "munged    $(pid_alive "$run_dir/munge/munged.pid" && echo "pid $(cat "$run_dir/munge/munged.pid")" || echo dead)"
  echo "slurmctld $(pid_alive "$run_dir/ctld/slurmctld.pid" && echo "pid $(cat "$run_dir/ctld/slurmctld.pid")" || echo dead)"
  for i in 0 1; do
    local p="$run_dir/${nodes[$i]}/slurmd.pid"
    echo "slurmd    ${nodes[$i]} ${addrs[$i]} ($(pid_alive "$p" && echo "pid $(cat "$p")" || echo dead))"
  done
  on "${nodes[0]}" sinfo -N || true
  healthy
}

case "${1:-}" in
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  on)
    shift
    [ $# -ge 2 ] || {
      say "usage: $0 on NODE CMD..."
      exit 2
    }
    on "$@"
    ;;
  *)
    sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
