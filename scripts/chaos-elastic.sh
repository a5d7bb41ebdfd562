#!/bin/bash
# A long elastic gpt2_train run under random SIGKILLs (#32), then checks of what it trained.
#
#   scripts/chaos-elastic.sh DTRAIN_RUN GPT2_TRAIN [KILLS [STEPS [SEED]]]
#
# The text: the first 400 kB of data/sotu.txt (scripts/fetch-data.sh) when it is there, so
# that the loss moves and a step trained twice would show in it; else random tokens.
# Three dtrain-run agents on this machine play three hosts (a, b, c; --nnodes 1:3, one rank
# each, GPT-2 at 2 layers x 64, DDP, --global_batch 6, a background checkpoint every 5 steps).
# KILLS times (default 20), once the current generation has trained 1 to 10 more steps, one
# of these is SIGKILLed at random: the rank of any agent, or agent b or c itself (its rank
# dies with it), which is started again 0 to 3 s later and asks to join. Agent a serves the
# built-in rendezvous store, the job's single point of failure (docs/multinode.md), so a is
# never killed itself, only its rank. Then the run must finish, and:
#  - every agent exits 0, and the last generation reaches step STEPS (default 1000);
#  - each generation's steps are consecutive, and each generation after the first starts
#    one step after a checkpoint step (a multiple of 5) that an earlier generation reached;
#  - nothing is lost beyond the steps since the last snapshot: a generation resumes at most
#    2 x 5 steps behind the last step trained before it (the newest checkpoint may still be
#    being written in the background when the kill comes; the one before it is complete);
#  - a step trained again after a resume (its first training was lost) trained the same
#    samples (equal `samples_hash`) at the same loss (relative 1e-4, across world sizes):
#    the resumed weights are the checkpoint's, with no lost step in them;
#  - the final weights equal, within 1e-6 (fp32), those of a plain `dtrain-run` run that
#    resumes a copy of the checkpoint the last generation started from, at its world size.
# The summary at the end is what docs/reliability.md quotes. Exit status 0 when every check
# holds. SEED (default: the time) seeds the choice of kills; it is printed for a rerun.
# CHAOS_KEEP=DIR keeps the metrics file and the agents' logs there.
set -u
run="$1"
train="$2"
train_exe="$(readlink -f "$train")"
kills="${3:-20}"
steps="${4:-1000}"
seed="${5:-$(date +%s)}"
RANDOM=$seed
tmp="$(mktemp -d)"
declare -A pid
# shellcheck disable=SC2317  # called by the trap
cleanup() {
  for p in "${pid[@]}"; do kill -KILL "$p" 2>/dev/null; done
  if [ -n "${CHAOS_KEEP:-}" ]; then  # the metrics and logs, for a look afterwards
    mkdir -p "$CHAOS_KEEP" && cp "$tmp"/*.jsonl "$tmp"/*.out "$tmp"/*.err "$CHAOS_KEEP"/ 2>/dev/null
  fi
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*" >&2
  for f in "$tmp"/*.err; do echo "--- $f:" >&2; tail -n 30 "$f" >&2; done
  exit 1
}
every=5
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
data=random
if [ -s "$root/data/sotu.txt" ]; then
  head -c 400000 "$root/data/sotu.txt" >"$tmp/corpus.txt" && data="$tmp/corpus.txt"
fi
port=$((20000 + ($$ * 13) % 12000))
start=$(date +%s)
train_args() {
  echo --data="$data" --tokenizer=byte --max_tokens=200000 --layers=2 --heads=2 --dim=64 \
    --ctx=32 --steps="$steps" --warmup_steps=2 --lr=3e-3 --seed=7 --val_batches=1 \
    --sample_tokens=0 --timeout_s=20 --threads=1 --strategy=ddp --batch=1 --global_batch=6 \
    --ckpt_every=$every --ckpt_keep=100000 --ckpt_async --resume --ckpt_dir="$tmp/ckpt"
}
agent() {
  # shellcheck disable=SC2046  # train_args: words without spaces
  "$run" --nnodes 1:3 --nproc_per_node 1 --master_port "$port" --host_id "$1" \
    --rdzv_last_call_s 2 --heartbeat_timeout_s 10 --grace_s 5 --max_restarts 1000 \
    --max_host_failures 1000 -- "$train" $(train_args) --metrics_out="$tmp/m.jsonl" \
    --export="$tmp/elastic.safetensors" >>"$tmp/$1.out" 2>>"$tmp/$1.err" &
  pid[$1]=$!
}
# The last step line: "GENERATION STEP" (empty before the first).
last_step() {
  grep '"kind": "step"' "$tmp/m.jsonl" 2>/dev/null | tail -n1 |
    sed 's/.*"step": \([0-9]*\),.*"generation": \([0-9]*\).*/\2 \1/'
}
# The pids of the GPT2_TRAIN processes under process $1 (its whole tree).
ranks_of() {
  local todo="$1" p kids found=""
  while [ -n "$todo" ]; do
    # shellcheck disable=SC2086  # a list of pids
    set -- $todo
    p=$1
    shift
    todo="$*"
    kids=$(ps -o pid= --ppid "$p" 2>/dev/null | tr -d ' ' | tr '\n' ' ')
    todo="$todo $kids"
    todo="${todo# }"
    for k in $kids; do
      [ "$(readlink "/proc/$k/exe" 2>/dev/null)" = "$train_exe" ] && found="$found $k"
    done
  done
  echo "$found"
}

echo "chaos-elastic: seed $seed, $kills kills, $steps steps, agents a b c (--nnodes 1:3), data $data"
agent a
sleep 0.5
agent b
agent c
gen_seen=-1
for k in $(seq 1 "$kills"); do
  # Wait for a generation after the last kill's to train 1..10 steps of its own.
  want=$((1 + RANDOM % 10))
  i=0
  while :; do
    read -r g s first <<<"$(last_step) x"
    if [ -n "$g" ] && [ "$g" != x ] && [ "$g" -gt "$gen_seen" ]; then
      first=$(grep '"kind": "step"' "$tmp/m.jsonl" | grep "\"generation\": $g," | head -n1 |
        sed 's/.*"step": \([0-9]*\),.*/\1/')
      [ $((s - first + 1)) -ge "$want" ] && break
    fi
    i=$((i + 1))
    [ "$i" -lt 3000 ] || fail "kill $k: no generation after $gen_seen trained $want steps in 150 s"
    kill -0 "${pid[a]}" 2>/dev/null || fail "kill $k: agent a ended early"
    sleep 0.05
  done
  [ "$s" -lt "$steps" ] || fail "the run reached step $steps before kill $k; raise STEPS"
  gen_seen=$g
  case $((RANDOM % 5)) in
    0 | 1 | 2) # a rank of a random agent
      names=(a b c)
      who=${names[$((RANDOM % 3))]}
      # shellcheck disable=SC2046  # a list of pids
      set -- $(ranks_of "${pid[$who]}")
      if [ $# -eq 0 ]; then
        who=a
        # shellcheck disable=SC2046  # a list of pids
        set -- $(ranks_of "${pid[a]}")
      fi
      [ $# -gt 0 ] || fail "kill $k: no rank process found"
      kill -KILL "$1" 2>/dev/null
      what="rank of agent $who (pid $1)"
      ;;
    *) # agent b or c, started again 0..3 s later
      who=$([ $((RANDOM % 2)) -eq 0 ] && echo b || echo c)
      kill -KILL "${pid[$who]}" 2>/dev/null
      wait "${pid[$who]}" 2>/dev/null
      sleep $((RANDOM % 4))
      agent "$who"
      what="agent $who, restarted"
      ;;
  esac
  echo "kill $k at $(($(date +%s) - start)) s: generation $g step $s: $what"
done

# The end: every agent exits 0.
for who in a b c; do
  i=0
  while kill -0 "${pid[$who]}" 2>/dev/null; do
    i=$((i + 1))
    [ "$i" -lt 3000 ] || fail "agent $who still running 300 s after the last kill"
    sleep 0.1
  done
  wait "${pid[$who]}"
  got=$?
  [ "$got" -eq 0 ] || fail "agent $who exited $got, want 0"
done
elapsed=$(($(date +%s) - start))
[ -s "$tmp/elastic.safetensors" ] || fail "the elastic run wrote no --export file"

# The metrics: steps per generation, resumes, repeated steps.
python3 - "$tmp/m.jsonl" "$steps" "$every" >"$tmp/check.out" <<'EOF' || {
import json, sys
path, steps, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
lines = [json.loads(l) for l in open(path) if '"kind": "step"' in l]
gens = {}
for l in lines:
    gens.setdefault(l["generation"], []).append(l)
order = sorted(gens)
errors, seen, lost, repeated, reached = [], {}, [], 0, 0
for g in order:
    ls = gens[g]
    st = [l["step"] for l in ls]
    if st != list(range(st[0], st[0] + len(st))):
        errors.append(f"generation {g}: steps not consecutive: {st}")
    resumed = st[0] - 1
    if resumed % every != 0 or resumed > reached:
        errors.append(f"generation {g} starts at step {st[0]}, not one after a checkpoint "
                      f"reached before (last step so far {reached})")
    if reached > 0:
        lost.append(reached - resumed)
        if reached - resumed > 2 * every:
            errors.append(f"generation {g} resumed at {resumed}, {reached - resumed} steps "
                          f"behind the last step trained ({reached})")
    for l in ls:
        s = l["step"]
        if l["samples"] != 6:
            errors.append(f"step {s} of generation {g}: {l['samples']} samples, want 6")
        if s in seen:
            repeated += 1
            a = seen[s]
            if a["samples_hash"] != l["samples_hash"]:
                errors.append(f"step {s}: other samples in generation {g} than in {a['generation']}")
            if abs(a["loss"] - l["loss"]) > 1e-4 * abs(a["loss"]):
                errors.append(f"step {s}: loss {l['loss']} in generation {g} (world "
                              f"{l['world_size']}), {a['loss']} in generation {a['generation']} "
                              f"(world {a['world_size']})")
        seen[s] = l
    reached = st[-1]
last = gens[order[-1]]
if last[-1]["step"] != steps:
    errors.append(f"the last generation ended at step {last[-1]['step']}, not {steps}")
worlds = {}
for g in order:
    worlds.setdefault(gens[g][0]["world_size"], 0)
    worlds[gens[g][0]["world_size"]] += 1
print(f"generations that trained: {len(order)}, numbered up to {order[-1]} (by world size: "
      + ", ".join(f"{w}: {n}" for w, n in sorted(worlds.items())) + ")")
print(f"steps trained: {len(lines)} for {steps}; trained again after a resume: {repeated}; "
      f"lost per restart: max {max(lost) if lost else 0}, mean "
      f"{sum(lost) / len(lost) if lost else 0:.1f} (checkpoint every {every}, async)")
print(f"last generation: {order[-1]}, world {last[0]['world_size']}, resumed at step "
      f"{last[0]['step'] - 1}")
print(f"RESUME {last[0]['step'] - 1} {last[0]['world_size']}")
for e in errors:
    print("ERROR:", e)
sys.exit(1 if errors else 0)
EOF
  cat "$tmp/check.out" >&2
  fail "the metrics file's checks failed"
}
grep -v '^RESUME' "$tmp/check.out"
read -r _ from world <<<"$(grep '^RESUME' "$tmp/check.out")"

# The reference: a plain run at the last generation's world size from a copy of the
# checkpoint it resumed from, with the same flags.
dir=$(printf '%s/ckpt/step_%09d' "$tmp" "$from")
[ -d "$dir" ] || fail "no checkpoint $dir for the last generation's resume"
mkdir -p "$tmp/ref" || fail "cannot create $tmp/ref"
cp -r "$dir" "$tmp/ref/" || fail "cannot copy $dir"
# shellcheck disable=SC2046  # train_args: words without spaces
"$run" --nproc_per_node "$world" --master_port $((port + 1)) -- "$train" $(train_args) \
  --ckpt_dir="$tmp/ref" --export="$tmp/ref.safetensors" >"$tmp/ref.out" 2>"$tmp/ref.err" ||
  fail "the reference run failed"
grep -q "resume: step $from from" "$tmp/ref.out" "$tmp/ref.err" ||
  fail "the reference run did not resume from step $from"
python3 - "$tmp/elastic.safetensors" "$tmp/ref.safetensors" <<'EOF' || fail "final weights differ"
import json, struct, sys
from array import array
def load(path):
    b = open(path, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    head = json.loads(b[8:8 + n])
    out = {}
    for k, v in head.items():
        if k == "__metadata__":
            continue
        assert v["dtype"] == "F32", (k, v["dtype"])
        s, e = v["data_offsets"]
        out[k] = array("f", b[8 + n + s:8 + n + e])
    return out
a, b = load(sys.argv[1]), load(sys.argv[2])
assert a.keys() == b.keys(), "tensor names differ"
worst = max(max((abs(x - y) for x, y in zip(a[k], b[k])), default=0.0) for k in a)
print(f"final weights: {len(a)} tensors, max |elastic - reference| = {worst:.3g}")
sys.exit(0 if worst <= 1e-6 else 1)
EOF
echo "chaos-elastic: passed: $kills kills, $steps steps in $elapsed s (seed $seed)"
