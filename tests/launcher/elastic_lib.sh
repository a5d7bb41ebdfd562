# Helpers shared by the elastic launcher tests (sourced): they read the rank records the
# tests' rank command writes as $tmp/d/env.GEN.RANK ("RANK WORLD_SIZE ...").

# count_gen GEN: how many rank records generation GEN has.
count_gen() {
  c=0
  for f in "$tmp/d/env.$1".*; do
    case "$f" in *.tmp) ;; *) [ -e "$f" ] && c=$((c + 1)) ;; esac
  done
  echo "$c"
}

# wait_gen SECONDS GEN WORLD: true once generation GEN's WORLD rank files exist, each saying
# WORLD_SIZE WORLD, with ranks 0..WORLD-1 (no other rank file of GEN).
wait_gen() {
  i=0
  while [ "$i" -lt $(($1 * 10)) ]; do
    n=$(count_gen "$2")
    [ "$n" -ge "$3" ] && break
    sleep 0.1
    i=$((i + 1))
  done
  [ "$n" -eq "$3" ] || return 1
  r=0
  while [ "$r" -lt "$3" ]; do
    [ -s "$tmp/d/env.$2.$r" ] || return 1
    set -- "$1" "$2" "$3" "$(cut -d' ' -f2 "$tmp/d/env.$2.$r")"
    [ "$4" -eq "$3" ] || return 1
    r=$((r + 1))
  done
  return 0
}

# field GEN RANK N: field N of that rank's record.
field() { cut -d' ' -f"$3" "$tmp/d/env.$1.$2"; }

# finish PID SECONDS: exit status of background agent PID in $got (999: still running).
finish() {
  i=0
  while kill -0 "$1" 2>/dev/null && [ "$i" -lt $(($2 * 10)) ]; do
    sleep 0.1
    i=$((i + 1))
  done
  if kill -0 "$1" 2>/dev/null; then
    kill -KILL "$1"
    wait "$1"
    got=999
  else
    wait "$1"
    got=$?
  fi
}
