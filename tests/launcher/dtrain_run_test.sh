#!/bin/sh
# dtrain-run's contract, checked with `sh -c` ranks: the rank variables, exit status, which
# failed rank is named, stopping the other ranks, signal forwarding, process groups (what a rank
# starts is stopped with it), ranks dying with the launcher, the ranks' BLAS kernel, the
# CPU's bf16 line, no process of a rank's tree outliving the launcher (#17), restarts
# (#18), and the etcd rendezvous flags (#32).
# Usage: dtrain_run_test.sh path/to/dtrain-run [path/to/fake_openblas.so]
# The ranks' scripts are single-quoted on purpose: the variables expand in the ranks.
# shellcheck disable=SC2016
set -u
run="$1"
fake_blas="${2:-}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
failures=0

fail() {
  echo "FAIL: $*" >&2
  echo "--- stderr:" >&2
  cat "$tmp/err" >&2
  failures=$((failures + 1))
}

# expect_status WANT CMD...: runs CMD with stderr in $tmp/err; checks its exit status.
expect_status() {
  want="$1"
  shift
  "$@" 2>"$tmp/err"
  got=$?
  [ "$got" -eq "$want" ] || fail "'$*' exited $got, want $want"
}

expect_stderr() {
  grep -q -- "$1" "$tmp/err" || fail "stderr lacks '$1'"
}

# alive PID: the process exists and is not a zombie (an orphan's zombie waits for init).
alive() {
  state=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1)
  [ -n "$state" ] && [ "$state" != Z ] && [ "$state" != X ]
}

# wait_gone SECONDS PID...: true once none of the PIDs is alive, false after SECONDS.
wait_gone() {
  limit=$(($1 * 10))
  shift
  i=0
  while [ "$i" -lt "$limit" ]; do
    any=0
    for p in "$@"; do alive "$p" && any=1; done
    [ "$any" -eq 0 ] && return 0
    sleep 0.1
    i=$((i + 1))
  done
  return 1
}

# wait_files SECONDS FILE...: true once every FILE exists and is not empty.
wait_files() {
  limit=$(($1 * 10))
  shift
  i=0
  while [ "$i" -lt "$limit" ]; do
    all=1
    for f in "$@"; do [ -s "$f" ] || all=0; done
    [ "$all" -eq 1 ] && return 0
    sleep 0.1
    i=$((i + 1))
  done
  return 1
}

# finish PID SECONDS: waits for the background dtrain-run PID; its exit status in $got
# (SIGKILLed, and 999, when it is still running after SECONDS).
finish() {
  if wait_gone "$2" "$1"; then
    wait "$1"
    got=$?
  else
    kill -KILL "$1"
    wait "$1"
    got=999
  fi
}

# pids_of PREFIX: the pids the ranks wrote to $tmp/PREFIX<rank>.
pids_of() { cat "$tmp/$1"* 2>/dev/null | tr '\n' ' '; }

# 1. Every rank sees a consistent environment; all succeed -> 0.
expect_status 0 "$run" --nproc_per_node 3 -- sh -c \
  'test "$WORLD_SIZE" = 3 && test "$LOCAL_WORLD_SIZE" = 3 && test "$RANK" = "$LOCAL_RANK" &&
   test "$RANK" -lt 3 && test "$MASTER_ADDR" = 127.0.0.1 && test "$MASTER_PORT" -gt 0'

# 2. Ranks get distinct RANK values.
"$run" --nproc_per_node 4 -- sh -c 'echo "$RANK" >"$0/rank$RANK"' "$tmp" 2>"$tmp/err" ||
  fail "rank files run failed"
set -- "$tmp"/rank*
[ $# -eq 4 ] || fail "expected 4 distinct ranks, got: $*"

# 3. Rank 1 exits 1 (exit $RANK): dtrain-run names it and exits non-zero.
expect_status 1 "$run" --nproc_per_node 2 -- sh -c 'exit $((RANK))'
expect_stderr "rank 1 (local rank 1, pid [0-9]*) exited with code 1"

# 4. A failing rank stops a rank that would run for a long time, promptly.
start=$(date +%s)
expect_status 3 "$run" --nproc_per_node 2 -- sh -c \
  'if [ "$RANK" = 1 ]; then sleep 0.2; exit 3; fi; exec sleep 60'
expect_stderr "rank 1 .* exited with code 3"
[ $(($(date +%s) - start)) -lt 20 ] || fail "rank 0 was not stopped promptly"

# 5. A rank killed by a signal: 128 + signal, and the signal is named.
expect_status 137 "$run" --nproc_per_node 2 -- sh -c \
  'if [ "$RANK" = 0 ]; then kill -KILL $$; fi; exec sleep 60'
expect_stderr "rank 0 .* was killed by signal 9"

# 6. A rank that ignores SIGTERM is killed after the grace period. (Rank 1 fails only after
#    0.5 s, so that rank 0 has installed its trap before SIGTERM arrives.)
start=$(date +%s)
expect_status 5 "$run" --nproc_per_node 2 --grace_s 1 -- sh -c \
  'trap "" TERM; if [ "$RANK" = 1 ]; then sleep 0.5; exit 5; fi; i=0; while [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done'
expect_stderr "sending SIGKILL"
[ $(($(date +%s) - start)) -lt 20 ] || fail "the SIGTERM-ignoring rank was not killed"

# 7. Several nodes: this node's ranks are node_rank * nproc_per_node + local rank.
expect_status 0 "$run" --nnodes 2 --node_rank 1 --nproc_per_node 2 --master_port 29999 -- sh -c \
  'test "$RANK" = $((LOCAL_RANK + 2)) && test "$WORLD_SIZE" = 4 && test "$MASTER_PORT" = 29999'

# 8. SIGTERM to dtrain-run is forwarded; it exits 128 + 15.
"$run" --nproc_per_node 2 -- sh -c 'exec sleep 60' 2>"$tmp/err" &
pid=$!
sleep 1
kill -TERM "$pid"
start=$(date +%s)
wait "$pid"
got=$?
[ "$got" -eq 143 ] || fail "forwarded SIGTERM: exit $got, want 143"
[ $(($(date +%s) - start)) -lt 10 ] || fail "ranks did not stop after a forwarded SIGTERM"

# 9. Usage errors exit 2.
expect_status 2 "$run" --nproc_per_node 0 -- true
expect_status 2 "$run" --nproc_per_node 2
expect_status 2 "$run" --bogus 1 -- true
expect_status 0 "$run" --help >/dev/null

# 10. SIGHUP and SIGQUIT are handled like SIGTERM: the ranks get SIGTERM, dtrain-run exits
#     128 + the signal it received. (A shell's background job starts with SIGQUIT ignored;
#     dtrain-run handles it anyway.)
for sig in HUP QUIT INT; do
  case $sig in HUP) want=129 ;; QUIT) want=131 ;; INT) want=130 ;; esac
  rm -f "$tmp"/pid*
  "$run" --nproc_per_node 2 -- sh -c 'echo $$ >"$0/pid$RANK"; exec sleep 60' "$tmp" \
    2>"$tmp/err" &
  pid=$!
  wait_files 10 "$tmp/pid0" "$tmp/pid1" || fail "SIG$sig: ranks did not start"
  ranks=$(pids_of pid)
  kill -s "$sig" "$pid"
  finish "$pid" 10
  [ "$got" -eq "$want" ] || fail "SIG$sig to dtrain-run: exit $got, want $want"
  # shellcheck disable=SC2086
  wait_gone 5 $ranks || fail "SIG$sig to dtrain-run: ranks $ranks still running"
  expect_stderr "SIG$sig received"
done

# 11. SIGKILL of dtrain-run: the ranks die too (parent-death signal), though nobody is left to
#     stop them.
rm -f "$tmp"/pid*
"$run" --nproc_per_node 2 -- sh -c 'echo $$ >"$0/pid$RANK"; exec sleep 60' "$tmp" 2>"$tmp/err" &
pid=$!
wait_files 10 "$tmp/pid0" "$tmp/pid1" || fail "SIGKILL: ranks did not start"
ranks=$(pids_of pid)
kill -KILL "$pid"
wait "$pid"
got=$?
[ "$got" -eq 137 ] || fail "SIGKILLed dtrain-run: exit $got, want 137"
# shellcheck disable=SC2086
wait_gone 5 $ranks || fail "SIGKILLed dtrain-run: ranks $ranks still running"

# 12. What a rank starts is stopped with it (the rank's process group): after SIGTERM to
#     dtrain-run, after another rank failed, and when a rank exits leaving a process behind.
rm -f "$tmp"/pid* "$tmp"/gc*
"$run" --nproc_per_node 2 -- sh -c \
  'sleep 60 & echo $! >"$0/gc$RANK"; echo $$ >"$0/pid$RANK"; wait' "$tmp" 2>"$tmp/err" &
pid=$!
wait_files 10 "$tmp/pid0" "$tmp/pid1" "$tmp/gc0" "$tmp/gc1" || fail "grandchildren: no start"
procs="$(pids_of pid) $(pids_of gc)"
kill -TERM "$pid"
finish "$pid" 10
[ "$got" -eq 143 ] || fail "grandchildren, SIGTERM: exit $got, want 143"
# shellcheck disable=SC2086
wait_gone 5 $procs || fail "after SIGTERM to dtrain-run, still running: $procs"

rm -f "$tmp"/gc*
expect_status 4 "$run" --nproc_per_node 2 -- sh -c \
  'sleep 60 & echo $! >"$0/gc$RANK"; if [ "$RANK" = 1 ]; then sleep 0.5; exit 4; fi; wait' "$tmp"
# shellcheck disable=SC2086
wait_gone 5 $(pids_of gc) || fail "after a rank failed, still running: $(pids_of gc)"

rm -f "$tmp"/gc*
expect_status 0 "$run" --nproc_per_node 2 -- sh -c 'sleep 60 & echo $! >"$0/gc$RANK"' "$tmp"
# shellcheck disable=SC2086
wait_gone 5 $(pids_of gc) || fail "left behind by ranks that exited 0: $(pids_of gc)"

# 13. Started with SIGCHLD ignored (the kernel would then reap the ranks itself and waitpid
#     fail with ECHILD): the ranks' real exit statuses still decide.
if env --ignore-signal=CHLD true 2>/dev/null; then
  expect_status 3 env --ignore-signal=CHLD "$run" --nproc_per_node 2 -- sh -c \
    'if [ "$RANK" = 1 ]; then exit 3; fi; exec sleep 60'
  expect_stderr "rank 1 .* exited with code 3"
fi

# 14. A program that cannot be started: named, exit 1, nothing left running.
expect_status 1 "$run" --nproc_per_node 2 -- /nonexistent/program
expect_stderr "cannot start '/nonexistent/program': No such file or directory"

# 15. The ranks' BLAS kernel, decided on a fake OpenBLAS (--blas_library) that reports
#     OPENBLAS_CORETYPE when set, else FAKE_OPENBLAS_KERNEL, else the generic Prescott.
#     OPENBLAS_CORETYPE may be set where the tests run: each case sets or unsets it.
if [ -n "$fake_blas" ]; then
  clean() { env -u OPENBLAS_CORETYPE -u DTRAIN_BLAS_CHOICE "$@"; }
  best=$(clean "$run" --blas_library "$fake_blas" --blas_info |
    sed -n 's/.*best OpenBLAS kernel: //p')
  [ -n "$best" ] || fail "--blas_info names no best kernel"
  if [ "$best" != "none known" ]; then # x86-64
    # a. Generic fallback: every rank starts with the CPU's best family; dtrain-run says so.
    rm -f "$tmp"/blas*
    clean "$run" --nproc_per_node 2 --blas_library "$fake_blas" -- \
      sh -c 'echo "$OPENBLAS_CORETYPE $DTRAIN_BLAS_CHOICE" >"$0/blas$RANK"' "$tmp" 2>"$tmp/err" ||
      fail "generic-kernel run failed"
    for r in 0 1; do
      got=$(cat "$tmp/blas$r" 2>/dev/null)
      [ "$got" = "$best replaced:Prescott" ] ||
        fail "rank $r: OPENBLAS_CORETYPE DTRAIN_BLAS_CHOICE = '$got', want '$best replaced:Prescott'"
    done
    # Said only with --verbose (#44: no banner on every launch); the ranks get it either way.
    if grep -q "OPENBLAS_CORETYPE" "$tmp/err"; then
      fail "dtrain-run printed its BLAS choice without --verbose: $(cat "$tmp/err")"
    fi
    clean "$run" --verbose --nproc_per_node 1 --blas_library "$fake_blas" -- true 2>"$tmp/err" ||
      fail "--verbose run failed"
    expect_stderr "selecting OPENBLAS_CORETYPE=$best"
    # b. A kernel that already fits the CPU: nothing added.
    expect_status 0 clean FAKE_OPENBLAS_KERNEL="$best" "$run" --nproc_per_node 2 \
      --blas_library "$fake_blas" -- sh -c \
      'test -z "${OPENBLAS_CORETYPE+set}" && test -z "${DTRAIN_BLAS_CHOICE+set}"'
  fi
  # c. Set by the user: passed on unchanged, even the generic kernel or an empty value.
  for value in Prescott ""; do
    expect_status 0 env -u DTRAIN_BLAS_CHOICE OPENBLAS_CORETYPE="$value" "$run" \
      --nproc_per_node 2 --blas_library "$fake_blas" -- sh -c \
      'test "${OPENBLAS_CORETYPE+set}" = set && test "$OPENBLAS_CORETYPE" = "$0" &&
       test -z "${DTRAIN_BLAS_CHOICE+set}"' "$value"
  done
  # d. --blas_kernel keep: the generic kernel stays, and the ranks are told not to choose.
  expect_status 0 clean "$run" --nproc_per_node 2 --blas_kernel keep \
    --blas_library "$fake_blas" -- sh -c \
    'test -z "${OPENBLAS_CORETYPE+set}" && test "$DTRAIN_BLAS_CHOICE" = keep'
  expect_status 2 "$run" --blas_kernel fastest -- true
fi

# 15b. --join_timeout_s: the ranks get DTRAIN_JOIN_TIMEOUT; 0 (the default) passes on what
#      this environment has; a negative or absurd value is a usage error.
expect_status 0 "$run" --nproc_per_node 2 --join_timeout_s 2.5 -- sh -c \
  'test "$DTRAIN_JOIN_TIMEOUT" = 2.5'
expect_status 0 env DTRAIN_JOIN_TIMEOUT=7 "$run" --nproc_per_node 1 -- sh -c \
  'test "$DTRAIN_JOIN_TIMEOUT" = 7'
expect_status 2 "$run" --join_timeout_s -1 -- true
expect_stderr "--join_timeout_s=-1 must be in"

# 16. --blas_info says whether the CPU computes bf16 natively (run-comparison.sh reads it);
#     DTRAIN_HIDE_NATIVE_BF16=1 makes it false on any CPU; a bad value is a usage error.
"$run" --blas_info >"$tmp/info" 2>"$tmp/err" || fail "--blas_info failed"
grep -Eq '^cpu_bf16_native: (true \((avx512_bf16|amx_bf16|avx512_bf16 amx_bf16)\)|false \(no avx512_bf16 or amx_bf16: bf16 is emulated\))$' \
  "$tmp/info" || fail "--blas_info has no cpu_bf16_native line: $(cat "$tmp/info")"
DTRAIN_HIDE_NATIVE_BF16=1 "$run" --blas_info >"$tmp/info" 2>"$tmp/err" || fail "hidden --blas_info failed"
grep -q '^cpu_bf16_native: false ' "$tmp/info" || fail "DTRAIN_HIDE_NATIVE_BF16=1 not applied: $(cat "$tmp/info")"
expect_status 2 env DTRAIN_HIDE_NATIVE_BF16=yes "$run" --blas_info
expect_stderr "DTRAIN_HIDE_NATIVE_BF16 must be 0 or 1, got 'yes'"

# 17. No process of a rank's tree outlives the launcher, however it ends: the ranks' children,
#     a daemon that double-forked into a session of its own, and the per-rank supervisors.
#     Every process started here carries DTRAIN_TREE_MARK=<scenario> in its environment
#     (set on dtrain-run, inherited by all below it), so /proc shows whatever is left, known
#     pids or not.
# marked MARK: the live processes whose environment holds DTRAIN_TREE_MARK=MARK.
marked() {
  for f in $(grep -lzx "DTRAIN_TREE_MARK=$1" /proc/[0-9]*/environ 2>/dev/null); do
    p=${f#/proc/}
    p=${p%/environ}
    alive "$p" && echo "$p"
  done
}
# tree_gone SECONDS MARK WHAT: fails naming what is left of MARK's processes after SECONDS
# (and kills them, so that a failure leaves nothing behind).
tree_gone() {
  limit=$(($1 * 10))
  i=0
  while [ "$i" -lt "$limit" ]; do
    [ -z "$(marked "$2")" ] && return 0
    sleep 0.1
    i=$((i + 1))
  done
  left=""
  for p in $(marked "$2"); do
    left="$left $p ($(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | sed 's/ $//'))"
    kill -KILL "$p" 2>/dev/null
  done
  fail "$3: still running $1 s later:$left"
}
# A wrapper script as the rank's command (`dtrain-run -- ./train.sh`): its program forks a
# child, and a subshell starts a daemon in a new session (setsid) and exits at once, so the
# daemon's parent is gone and it is in no group of the rank's. $1: folder for the pid files;
# $2: wait (for the child, 411 s), fail (rank 1 exits 7 once its daemon runs), exit (every
# rank exits 0 at once).
cat >"$tmp/train.sh" <<'SCRIPT'
dir=$1
sleep 411 &
echo $! >"$dir/child$RANK"
(setsid sh -c 'echo $$ >"$0"; exec sleep 412' "$dir/daemon$RANK" &)
i=0
while [ ! -s "$dir/daemon$RANK" ] && [ "$i" -lt 100 ]; do
  sleep 0.05
  i=$((i + 1))
done
if [ "$2" = exit ] || { [ "$2" = fail ] && [ "$RANK" = 1 ]; }; then
  [ "$2" = exit ] && exit 0
  exit 7
fi
wait
SCRIPT
mark_base="dtrain_run_test_$$"

# a. The issue's case, `sh -c "sleep 411 & wait"` as the rank, and the launcher SIGKILLed:
#    the sleeps were left running, reparented to init.
rm -f "$tmp"/gc* "$tmp"/pid*
DTRAIN_TREE_MARK="${mark_base}_a" "$run" --nproc_per_node 2 -- sh -c \
  'sleep 411 & echo $! >"$0/gc$RANK"; echo $$ >"$0/pid$RANK"; wait' "$tmp" 2>"$tmp/err" &
pid=$!
wait_files 10 "$tmp/gc0" "$tmp/gc1" "$tmp/pid0" "$tmp/pid1" || fail "17a: ranks did not start"
kill -KILL "$pid"
wait "$pid"
tree_gone 5 "${mark_base}_a" "17a: sh -c 'sleep 411 & wait' ranks, dtrain-run SIGKILLed"

# b-e. The wrapper script: the launcher SIGKILLed, SIGTERMed; rank 1 failing; ranks exiting 0.
for scenario in b c d e; do
  rm -f "$tmp"/child* "$tmp"/daemon*
  case $scenario in
    b | c) mode=wait ;;
    d) mode=fail ;;
    e) mode=exit ;;
  esac
  DTRAIN_TREE_MARK="${mark_base}_$scenario" "$run" --nproc_per_node 2 -- sh "$tmp/train.sh" \
    "$tmp" "$mode" 2>"$tmp/err" &
  pid=$!
  if [ "$mode" = wait ]; then
    wait_files 10 "$tmp/child0" "$tmp/child1" "$tmp/daemon0" "$tmp/daemon1" ||
      fail "17$scenario: ranks did not start their processes"
  fi
  case $scenario in
    b)
      what="wrapper script ranks, dtrain-run SIGKILLed"
      kill -KILL "$pid"
      want=137
      ;;
    c)
      what="wrapper script ranks, SIGTERM to dtrain-run"
      kill -TERM "$pid"
      want=143
      ;;
    d)
      what="wrapper script ranks, rank 1 failed"
      want=7
      ;;
    e)
      what="wrapper script ranks that exited 0"
      want=0
      ;;
  esac
  finish "$pid" 20
  [ "$got" -eq "$want" ] || fail "17$scenario: $what: exit $got, want $want"
  tree_gone 5 "${mark_base}_$scenario" "17$scenario: $what"
done

# 18. --max_restarts: a failed rank stops the others, then every rank starts again with the
#     restart count and generation; a stop signal is never followed by a restart.
# a. Rank 1 fails in generations 0 and 1 (rank 0 would sleep 60 s: it is stopped), every
#    rank succeeds in generation 2: exit 0; each rank ran 3 times with the right variables.
rm -f "$tmp"/gen*
expect_status 0 "$run" --nproc_per_node 2 --max_restarts 2 -- sh -c \
  'echo "$TORCHELASTIC_RESTART_COUNT $TORCHELASTIC_MAX_RESTARTS $DTRAIN_GENERATION $MASTER_PORT" >>"$0/gen$RANK"
   [ "$TORCHELASTIC_RESTART_COUNT" -ge 2 ] && exit 0
   if [ "$RANK" = 1 ]; then sleep 0.3; exit 3; fi
   exec sleep 60' "$tmp"
expect_stderr "rank 1 .* exited with code 3; stopping the other ranks"
expect_stderr "restarting every rank of this node (restart 1 of 2)"
expect_stderr "restarting every rank of this node (restart 2 of 2)"
for r in 0 1; do
  got=$(cut -d' ' -f1-3 "$tmp/gen$r" 2>/dev/null | tr '\n' ',')
  [ "$got" = "0 2 0,1 2 1,2 2 2," ] || fail "18a: rank $r ran as '$got', want '0 2 0,1 2 1,2 2 2,'"
done
# A new store port for every generation (the launcher picked it).
[ "$(cut -d' ' -f4 "$tmp/gen0" | sort -u | wc -l)" -eq 3 ] ||
  fail "18a: generations shared a MASTER_PORT: $(cut -d' ' -f4 "$tmp/gen0" | tr '\n' ' ')"

# b. Restarts exhausted: the last failure's status, after 1 + 2 runs.
rm -f "$tmp"/gen*
expect_status 5 "$run" --nproc_per_node 2 --max_restarts 2 -- sh -c \
  'echo "$TORCHELASTIC_RESTART_COUNT" >>"$0/gen$RANK"; [ "$RANK" = 1 ] && exit 5; exec sleep 60' \
  "$tmp"
expect_stderr "no restart left (--max_restarts 2); giving up"
[ "$(wc -l <"$tmp/gen1")" -eq 3 ] || fail "18b: rank 1 ran $(wc -l <"$tmp/gen1") times, want 3"

# c. SIGTERM to dtrain-run: no restart, exit 143, nothing left of the trees.
rm -f "$tmp"/gen*
DTRAIN_TREE_MARK="${mark_base}_18c" "$run" --nproc_per_node 2 --max_restarts 3 -- sh -c \
  'echo "$TORCHELASTIC_RESTART_COUNT" >>"$0/gen$RANK"; exec sleep 60' "$tmp" 2>"$tmp/err" &
pid=$!
wait_files 10 "$tmp/gen0" "$tmp/gen1" || fail "18c: ranks did not start"
kill -TERM "$pid"
finish "$pid" 20
[ "$got" -eq 143 ] || fail "18c: SIGTERM with --max_restarts: exit $got, want 143"
[ "$(cat "$tmp/gen0" "$tmp/gen1" | tr '\n' ' ')" = "0 0 " ] ||
  fail "18c: ranks restarted after SIGTERM: $(cat "$tmp/gen0" "$tmp/gen1" | tr '\n' ' ')"
tree_gone 5 "${mark_base}_18c" "18c: SIGTERM with --max_restarts"

# d. Usage errors: negative, or with several nodes (that needs the elastic rendezvous).
expect_status 2 "$run" --max_restarts -1 -- true
expect_status 2 "$run" --nnodes 2 --node_rank 0 --master_port 29999 --max_restarts 1 -- true
expect_stderr "max_restarts needs nnodes 1"

# 32. --rdzv_backend etcd: the ranks get the rendezvous variables (torchrun's run id among
#     them); one node makes up a fresh id, several need one; bad combinations are usage errors.
#     (Jobs that really meet through etcd: tests/comm/etcd_rendezvous_test.cpp.)
expect_status 0 "$run" --nproc_per_node 2 --rdzv_backend etcd --rdzv_endpoint 127.0.0.1:1 \
  --rdzv_id job32 -- sh -c \
  'echo "$DTRAIN_RDZV_BACKEND $DTRAIN_RDZV_ENDPOINT $TORCHELASTIC_RUN_ID" > '"$tmp"'/rdzv$RANK'
[ "$(cat "$tmp/rdzv0" "$tmp/rdzv1" | tr '\n' ' ')" = "etcd 127.0.0.1:1 job32 etcd 127.0.0.1:1 job32 " ] ||
  fail "32: rank rendezvous variables: $(cat "$tmp/rdzv0" "$tmp/rdzv1" | tr '\n' ' ')"
expect_status 0 "$run" --nproc_per_node 1 --rdzv_backend etcd --rdzv_endpoint 127.0.0.1:1 -- sh -c \
  'echo "$TORCHELASTIC_RUN_ID" > '"$tmp"'/rdzv_id'
grep -q '^dtrain-run-' "$tmp/rdzv_id" || fail "32: no run id made up on one node: $(cat "$tmp/rdzv_id")"
expect_status 0 "$run" --nproc_per_node 1 -- sh -c \
  'echo "${DTRAIN_RDZV_BACKEND:-unset}" > '"$tmp"'/rdzv_default'
[ "$(cat "$tmp/rdzv_default")" = unset ] || fail "32: the default backend set variables"
expect_status 2 "$run" --rdzv_backend etcd -- true
expect_stderr "needs --rdzv_endpoint"
expect_status 2 "$run" --nnodes 2 --rdzv_backend etcd --rdzv_endpoint 127.0.0.1:1 -- true
expect_stderr "needs --rdzv_id"
expect_status 2 "$run" --rdzv_backend zookeeper -- true
expect_stderr "expects c10d, static or etcd"
expect_status 2 "$run" --rdzv_endpoint 127.0.0.1:1 -- true
expect_stderr "is for --rdzv_backend etcd"

if [ "$failures" -ne 0 ]; then
  echo "$failures check(s) failed" >&2
  exit 1
fi
echo "dtrain-run: all checks passed"
