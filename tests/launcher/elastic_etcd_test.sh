#!/bin/sh
# dtrain-run --nnodes MIN:MAX --rdzv_backend etcd (#32): the agents' rendezvous (membership,
# generations, heartbeats, failure counts) lives in a real etcd server started here, so no
# agent serves anything the others need. Agent a (the first, which serves the store with
# c10d) is killed: b goes on alone at the next generation within 30 s; a host coming back is
# taken in at the one after (world 4); a stalled agent (a straggler of an old generation) is
# left out of the next generation and taken in only after; when every agent of a generation
# is killed, a new agent ends that generation by its stopped heartbeats and goes on. The ranks are `sh -c` scripts
# recording their variables.
# Usage: elastic_etcd_test.sh path/to/dtrain-run
# Exit 77 (ctest: skipped) when etcd is not installed.
# The rank script is single-quoted on purpose: the variables expand in the ranks.
# shellcheck disable=SC2016
set -u
run="$1"
if ! command -v etcd >/dev/null 2>&1; then
  echo "SKIP: etcd is not installed (Debian: etcd-server; scripts/install-deps.sh installs it)"
  exit 77
fi
tmp="$(mktemp -d)"
agents=""
etcd_pid=""
# shellcheck disable=SC2317  # called by the trap
cleanup() {
  for p in $agents; do
    kill -CONT "$p" 2>/dev/null
    kill -KILL "$p" 2>/dev/null
  done
  [ -n "$etcd_pid" ] && kill -KILL "$etcd_pid" 2>/dev/null
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*" >&2
  for f in "$tmp"/*.err "$tmp/etcd.log"; do
    [ -e "$f" ] || continue
    echo "--- $f:" >&2
    tail -n 40 "$f" >&2
  done
  exit 1
}

# etcd on loopback, ports below the ephemeral range.
eport=$((20000 + ($$ * 13) % 12000))
env -i PATH=/usr/bin:/bin etcd --name t --data-dir "$tmp/etcd" \
  --listen-client-urls "http://127.0.0.1:$eport" --advertise-client-urls "http://127.0.0.1:$eport" \
  --listen-peer-urls "http://127.0.0.1:$((eport + 1))" \
  --initial-advertise-peer-urls "http://127.0.0.1:$((eport + 1))" \
  --initial-cluster "t=http://127.0.0.1:$((eport + 1))" >"$tmp/etcd.log" 2>&1 &
etcd_pid=$!
etcdctl() { env ETCDCTL_API=3 etcdctl --endpoints "127.0.0.1:$eport" --dial-timeout 1s "$@"; }
i=0
until etcdctl endpoint health >/dev/null 2>&1; do
  i=$((i + 1))
  [ "$i" -lt 100 ] || fail "etcd did not start in 20 s"
  sleep 0.2
done

# A rank: records its variables in $tmp/d/env.GEN.RANK, runs until $tmp/d/finish exists.
rank='d="$DIR"; f="$d/env.$DTRAIN_GENERATION.$RANK"
echo "$RANK $WORLD_SIZE $LOCAL_RANK $TORCHELASTIC_RESTART_COUNT $HOSTTAG $$ $DTRAIN_RDZV_BACKEND $TORCHELASTIC_RUN_ID" > "$f.tmp"
mv "$f.tmp" "$f"
while [ ! -e "$d/finish" ]; do sleep 0.1; done'

# agent TAG: starts an agent for host TAG in the background; its pid in $pid. No
# --master_addr: nothing listens there.
agent() {
  DIR="$tmp/d" HOSTTAG="$1" "$run" --nnodes 1:2 --nproc_per_node 2 --host_id "$1" \
    --rdzv_backend etcd --rdzv_endpoint "127.0.0.1:$eport" --rdzv_id "job$$" \
    --rdzv_last_call_s 2 --heartbeat_timeout_s 6 --grace_s 2 --max_restarts 5 \
    -- sh -c "$rank" 2>>"$tmp/$1.err" &
  pid=$!
  agents="$agents $pid"
}

. "$(dirname "$0")/elastic_lib.sh"  # count_gen, wait_gen, field, finish

mkdir "$tmp/d"
agent a
pa=$pid
sleep 0.5
agent b
pb=$pid
wait_gen 30 0 4 || fail "generation 0 is not 2 hosts x 2 ranks"
if [ "$(field 0 0 7)" != etcd ] || [ "$(field 0 3 8)" != "job$$" ]; then
  fail "the ranks did not get DTRAIN_RDZV_BACKEND=etcd and the run id"
fi
a_ranks=""
for r in 0 1 2 3; do [ "$(field 0 $r 5)" = a ] && a_ranks="$a_ranks $(field 0 $r 6)"; done
[ "$(field 0 0 5)" = a ] || fail "rank 0 of generation 0 is not on host a"

# a, the first agent (rank 0's host), is lost: b goes on alone.
start=$(date +%s)
kill -KILL "$pa"
wait "$pa" 2>/dev/null
wait_gen 30 1 2 || fail "no generation 1 of world 2 within 30 s of losing host a"
took=$(($(date +%s) - start))
[ "$took" -le 30 ] || fail "generation 1 started $took s after host a was killed, want <= 30"
if [ "$(field 1 0 5)" != b ] || [ "$(field 1 1 5)" != b ]; then fail "generation 1 is not host b's"; fi
[ "$(field 1 0 4)" = 1 ] || fail "generation 1: restart count $(field 1 0 4), want 1"
for p in $a_ranks; do kill -0 "$p" 2>/dev/null && fail "rank $p of killed host a still runs"; done
grep -q "no heartbeat from the agent of host a" "$tmp/b.err" || fail "b does not say a was lost"
grep -q "host a was lost from generation 0" "$tmp/b.err" || fail "b did not count a's loss"

etcdctl get --prefix --keys-only "/dtrain/job$$/agents/" >"$tmp/keys" 2>&1
grep -q "^/dtrain/job$$/agents/1/members$" "$tmp/keys" ||
  fail "the agents' rendezvous is not in etcd under /dtrain/job$$/agents/: $(head -n 5 "$tmp/keys")"

# a comes back: taken in at generation 2.
agent a
pa=$pid
wait_gen 30 2 4 || fail "host a was not taken in at generation 2 (world 4)"
[ "$(field 2 0 4)" = 1 ] || fail "generation 2: restart count $(field 2 0 4), want 1 (a join is no failure)"

# a stalls past the heartbeat timeout: generation 3 is b's alone; a, resumed, finds its
# generation over and is taken in only at generation 4.
kill -STOP "$pa"
wait_gen 30 3 2 || fail "no generation 3 of world 2 while a was stopped"
kill -CONT "$pa"
wait_gen 40 4 4 || fail "host a was not taken back at generation 4 (world 4)"
for r in 0 1; do [ "$(field 3 $r 5)" = b ] || fail "straggler a got rank $r of generation 3"; done
[ "$(count_gen 5)" -eq 0 ] || fail "an unexpected generation 5"

# Every agent of generation 4 is killed (a whole attempt lost; etcd keeps its keys), and a
# new agent joins with the same id: it ends generation 4 once none of its heartbeats moved
# for the timeout, instead of waiting for an end nobody would write, and runs generation 5.
kill -KILL "$pa" "$pb"
wait "$pa" "$pb" 2>/dev/null
agent c
pc=$pid
wait_gen 40 5 2 || fail "no generation 5 on host c after every agent of generation 4 was killed"
grep -q "ending generation 4: no heartbeat from any of its 2 agent(s)" "$tmp/c.err" ||
  fail "c does not say generation 4's agents are gone"

touch "$tmp/d/finish"
finish "$pc" 30
[ "$got" -eq 0 ] || fail "agent c exited $got, want 0"
echo "elastic_etcd_test: passed (generation 1 started $took s after host a was killed)"
