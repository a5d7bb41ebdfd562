#!/bin/sh
# gpt2_train under dtrain-run --nnodes 1:2 (#32): two agents of one rank each train GPT-2 tiny
# (DDP, --global_batch 2, a checkpoint every 5 steps); agent b is SIGKILLed mid-run; agent a's
# rank fails on the lost peer, a forms generation 1 alone (world 1, --grad_accum 2), resumes
# from the newest checkpoint and finishes. The metrics file records both generations. No step
# is trained twice: its final weights equal (byte for byte, fp32) those of a reference run at
# world 1 resumed from a copy of the checkpoint generation 1 resumed from, with the same flags.
# Then a resume at another global batch is refused.
# Usage: elastic_gpt2_test.sh path/to/dtrain-run path/to/gpt2_train
set -u
run="$1"
train="$2"
tmp="$(mktemp -d)"
pa=""
pb=""
# shellcheck disable=SC2317  # called by the trap
cleanup() {
  for p in $pa $pb; do kill -KILL "$p" 2>/dev/null; done
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*" >&2
  for f in "$tmp"/*.err; do echo "--- $f:" >&2; tail -n 40 "$f" >&2; done
  exit 1
}
steps=400
port=$((20000 + ($$ * 11) % 12000))
# The trainer's flags, for the elastic agents and the reference run alike.
train_args() {
  echo --data=random --tokenizer=byte --max_tokens=20000 --layers=2 --heads=2 --dim=64 \
    --ctx=32 --steps=$steps --warmup_steps=2 --lr=3e-3 --seed=7 --val_batches=1 \
    --sample_tokens=0 --timeout_s=30 --threads=1 --strategy=ddp --batch=1 --global_batch=2 \
    --ckpt_every=5 --ckpt_keep=1000 --resume
}
agent() {
  # shellcheck disable=SC2046  # train_args: words without spaces
  "$run" --nnodes 1:2 --nproc_per_node 1 --master_port "$port" --host_id "$1" \
    --rdzv_last_call_s 2 --heartbeat_timeout_s 4 --grace_s 10 --max_restarts 2 -- \
    "$train" $(train_args) --ckpt_dir="$tmp/ckpt" --metrics_out="$tmp/m.jsonl" \
    --export="$tmp/elastic.safetensors" >"$tmp/$1.out" 2>"$tmp/$1.err" &
}
agent a
pa=$!
sleep 0.5
agent b
pb=$!

# step S of generation G is in the metrics file
has_step() { grep '"kind": "step"' "$tmp/m.jsonl" 2>/dev/null | grep "\"generation\": $2" | grep -q "\"step\": $1,"; }
i=0
until has_step 20 0; do
  i=$((i + 1))
  [ "$i" -lt 1200 ] || fail "generation 0 did not reach step 20 in 120 s"
  kill -0 "$pa" 2>/dev/null || fail "agent a ended early"
  sleep 0.1
done
has_step "$steps" 0 && fail "the run finished before b could be killed; raise steps"
kill -KILL "$pb"
wait "$pb" 2>/dev/null

i=0
while kill -0 "$pa" 2>/dev/null; do
  i=$((i + 1))
  [ "$i" -lt 3000 ] || fail "agent a still running 300 s after b was killed"
  sleep 0.1
done
wait "$pa"
got=$?
[ "$got" -eq 0 ] || fail "agent a exited $got, want 0"
grep -q '"world_size": 2.*"generation": 0' "$tmp/m.jsonl" || fail "no generation 0 line at world 2"
grep -q '"world_size": 1.*"generation": 1' "$tmp/m.jsonl" || fail "no generation 1 line at world 1"
has_step "$steps" 1 || fail "generation 1 did not reach step $steps"
grep -q "resume: step" "$tmp/a.out" "$tmp/a.err" || fail "generation 1 did not resume from a checkpoint"
# generation 1 starts right after a checkpoint of generation 0 (every 5 steps)
first=$(grep '"kind": "step"' "$tmp/m.jsonl" | grep '"generation": 1' | head -n1 |
  sed 's/.*"step": \([0-9]*\),.*/\1/')
[ $(((first - 1) % 5)) -eq 0 ] || fail "generation 1's first step is $first, not one after a checkpoint"
# The reference: the checkpoint generation 1 resumed from, copied, resumed at world 1 by a
# plain (not elastic) launch with the same flags. Equal final weights mean generation 1
# trained exactly the steps after that checkpoint, each once, on the same samples.
from=$(sed -n 's/.*resume: step [0-9]* from \([^ ]*\) (.*/\1/p' "$tmp/a.out" "$tmp/a.err" | tail -n1)
if [ -z "$from" ] || [ ! -d "$from" ]; then
  fail "no checkpoint directory in generation 1's resume line"
fi
[ "$(basename "$from")" = "$(printf 'step_%09d' $((first - 1)))" ] ||
  fail "generation 1 resumed from $from, not the checkpoint of step $((first - 1))"
mkdir -p "$tmp/ref_ckpt" || fail "cannot create $tmp/ref_ckpt"
cp -r "$from" "$tmp/ref_ckpt/" || fail "cannot copy $from"
[ -s "$tmp/elastic.safetensors" ] || fail "the elastic run wrote no --export file"
# shellcheck disable=SC2046  # train_args: words without spaces
"$run" --nproc_per_node 1 --master_port $((port + 1)) -- "$train" $(train_args) \
  --ckpt_dir="$tmp/ref_ckpt" --export="$tmp/ref.safetensors" >"$tmp/ref.out" 2>"$tmp/ref.err"
got=$?
[ "$got" -eq 0 ] || fail "the reference run exited $got, want 0"
grep -q "resume: step $((first - 1)) from" "$tmp/ref.out" "$tmp/ref.err" ||
  fail "the reference run did not resume from step $((first - 1))"
cmp -s "$tmp/elastic.safetensors" "$tmp/ref.safetensors" ||
  fail "final weights of the elastic run differ from the reference resumed from step $((first - 1))"
# The checkpoints hold global batch 2: resuming at another global batch is refused.
"$train" --data=random --tokenizer=byte --max_tokens=20000 --layers=2 --heads=2 --dim=64 \
  --ctx=32 --steps=$((steps + 5)) --sample_tokens=0 --threads=1 --strategy=single --batch=1 \
  --ckpt_dir="$tmp/ckpt" --resume >"$tmp/refused.out" 2>"$tmp/refused.err"
got=$?
[ "$got" -ne 0 ] || fail "resuming at global batch 1 a checkpoint of global batch 2 succeeded"
grep -q "was written at a global batch of 2 sequences, this run's is 1" "$tmp/refused.out" \
  "$tmp/refused.err" || fail "no message for resuming at another global batch"
echo "elastic_gpt2_test: passed (generation 1 resumed at step $first)"
