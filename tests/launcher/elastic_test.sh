#!/bin/sh
# dtrain-run --nnodes MIN:MAX (#32) with several agents on this host and `sh -c` ranks:
# generations of the right world size, an agent killed (the other goes on at the smaller world
# within 30 s), a new agent taken in at the next generation, a stalled agent (a straggler of an
# old generation) left out of the next one and taken in only after, restart counts, a rank
# failure counted against its host (--max_host_failures) and --max_restarts running out.
# Usage: elastic_test.sh path/to/dtrain-run
# The rank script is single-quoted on purpose: the variables expand in the ranks.
# shellcheck disable=SC2016
set -u
run="$1"
tmp="$(mktemp -d)"
agents=""
# shellcheck disable=SC2317  # called by the trap
cleanup() {
  for p in $agents; do kill -CONT "$p" 2>/dev/null; kill -KILL "$p" 2>/dev/null; done
  rm -rf "$tmp"
}
trap cleanup EXIT
failures=0
fail() {
  echo "FAIL: $*" >&2
  for f in "$tmp"/*.err; do echo "--- $f:" >&2; cat "$f" >&2; done
  failures=$((failures + 1))
  exit 1  # the later steps build on this one
}

# A rank: records its variables in $tmp/d/env.GEN.RANK, local rank 0 fails once (exit 7) when
# $tmp/d/fail.HOSTTAG exists, runs until $tmp/d/finish exists.
rank='d="$DIR"; f="$d/env.$DTRAIN_GENERATION.$RANK"
echo "$RANK $WORLD_SIZE $LOCAL_RANK $TORCHELASTIC_RESTART_COUNT $TORCHELASTIC_MAX_RESTARTS $HOSTTAG $$ $MASTER_ADDR:$MASTER_PORT $DTRAIN_STORE_TOKEN" > "$f.tmp"
mv "$f.tmp" "$f"
if [ "$LOCAL_RANK" = 0 ] && [ -e "$d/fail.$HOSTTAG" ]; then rm -f "$d/fail.$HOSTTAG"; exit 7; fi
while [ ! -e "$d/finish" ]; do sleep 0.1; done'

# agent TAG PORT EXTRA...: starts an agent for host TAG in the background; its pid in $pid.
agent() {
  tag="$1"
  port="$2"
  shift 2
  DIR="$tmp/d" HOSTTAG="$tag" "$run" --nnodes 1:2 --nproc_per_node 2 --master_port "$port" \
    --host_id "$tag" --rdzv_last_call_s 2 --heartbeat_timeout_s 6 --grace_s 2 "$@" \
    -- sh -c "$rank" 2>"$tmp/$tag.err" &
  pid=$!
  agents="$agents $pid"
}

. "$(dirname "$0")/elastic_lib.sh"  # count_gen, wait_gen, field, finish

free_port() {
  # Below the ephemeral range; the store's bind fails loudly if it is taken after all.
  echo $((20000 + ($$ * 7 + $1) % 12000))
}

# --- usage errors
for bad in 2:1 0:2 x 1:y; do
  "$run" --nnodes "$bad" -- true 2>"$tmp/usage.err"
  got=$?
  [ "$got" -eq 2 ] || fail "--nnodes $bad exited $got, want 2"
done
grep -q -- "--nnodes" "$tmp/usage.err" || fail "usage error does not name --nnodes"

# --- 1. two hosts; B killed; C joins; C stalls (a straggler) and comes back
mkdir "$tmp/d"
port=$(free_port 1)
agent a "$port" --max_restarts 5
pa=$pid
sleep 0.5  # a serves the store
agent b "$port" --max_restarts 5
pb=$pid
wait_gen 30 0 4 || fail "generation 0 is not 2 hosts x 2 ranks"
[ "$(field 0 0 4)" = 0 ] || fail "generation 0: TORCHELASTIC_RESTART_COUNT $(field 0 0 4), want 0"
[ "$(field 0 0 5)" = 5 ] || fail "TORCHELASTIC_MAX_RESTARTS $(field 0 0 5), want 5"
case "$(field 0 3 9)" in */generation/0) ;; *) fail "generation 0's token '$(field 0 3 9)'" ;; esac
[ "$(field 0 0 8)" = "$(field 0 3 8)" ] || fail "ranks of generation 0 got different stores"
b_ranks=""
for r in 0 1 2 3; do [ "$(field 0 $r 6)" = b ] && b_ranks="$b_ranks $(field 0 $r 7)"; done
[ -n "$b_ranks" ] || fail "no rank of generation 0 on host b"

start=$(date +%s)
kill -KILL "$pb"
wait "$pb" 2>/dev/null
if wait_gen 30 1 2; then
  took=$(($(date +%s) - start))
  [ "$took" -le 30 ] || fail "generation 1 started $took s after host b was killed, want <= 30"
  if [ "$(field 1 0 6)" != a ] || [ "$(field 1 1 6)" != a ]; then
    fail "generation 1 is not host a's"
  fi
  [ "$(field 1 0 4)" = 1 ] || fail "generation 1: restart count $(field 1 0 4), want 1 (a lost host)"
  [ "$(field 1 0 8)" != "$(field 0 0 8)" ] || fail "generation 1 reuses generation 0's store port"
else
  fail "no generation 1 of world 2 after host b was killed"
fi
for p in $b_ranks; do kill -0 "$p" 2>/dev/null && fail "rank $p of killed host b still runs"; done
grep -q "no heartbeat from the agent of host b" "$tmp/a.err" || fail "a does not say b was lost"

agent c "$port" --max_restarts 5
pc=$pid
wait_gen 30 2 4 || fail "host c was not taken in at generation 2 (world 4)"
[ "$(field 2 0 4)" = 1 ] || fail "generation 2: restart count $(field 2 0 4), want 1 (a join is no failure)"
grep -q "an agent asks to join" "$tmp/a.err" "$tmp/c.err" || fail "nobody says c asked to join"

# c stalls past the heartbeat timeout: generation 3 is a's alone; c, resumed, finds its
# generation over and is taken in only at generation 4.
kill -STOP "$pc"
wait_gen 30 3 2 || fail "no generation 3 of world 2 while c was stopped"
kill -CONT "$pc"
wait_gen 40 4 4 || fail "host c was not taken back at generation 4 (world 4)"
for r in 0 1; do [ "$(field 3 $r 6)" = a ] || fail "straggler c got rank $r of generation 3"; done
[ "$(field 4 0 4)" = 2 ] || fail "generation 4: restart count $(field 4 0 4), want 2"
[ "$(count_gen 5)" -eq 0 ] || fail "an unexpected generation 5"

touch "$tmp/d/finish"
finish "$pa" 30
[ "$got" -eq 0 ] || fail "agent a exited $got, want 0"
finish "$pc" 30
[ "$got" -eq 0 ] || fail "agent c exited $got, want 0"

# --- 2. a failing rank: its host is counted (--max_host_failures 1 leaves it out), restarts
# run out (--max_restarts 1)
rm -rf "$tmp/d"
mkdir "$tmp/d"
rm -f "$tmp"/*.err
port=$(free_port 2)
agent a "$port" --max_restarts 1 --max_host_failures 1
pa=$pid
sleep 0.5
touch "$tmp/d/fail.b"
agent b "$port" --max_restarts 1 --max_host_failures 1
pb=$pid
finish "$pb" 30
[ "$got" -eq 1 ] || fail "agent b (a failed rank, --max_host_failures 1) exited $got, want 1"
grep -q "host b failed 1 times (--max_host_failures 1): left out" "$tmp/b.err" ||
  fail "b does not say it was left out"
wait_gen 30 1 2 || fail "scenario 2: no generation 1 of host a alone"
[ "$(field 1 0 4)" = 1 ] || fail "scenario 2: restart count $(field 1 0 4), want 1"
kill -KILL "$(field 1 0 7)"  # a's rank fails: the second failure, one restart allowed
finish "$pa" 30
[ "$got" -eq 137 ] || fail "agent a exited $got after its restarts ran out, want 137"
grep -q "no restart is left (--max_restarts 1)" "$tmp/a.err" || fail "a does not say restarts ran out"

[ "$failures" -eq 0 ] && echo "elastic_test: all passed"
exit "$failures"
