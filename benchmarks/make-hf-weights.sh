#!/bin/sh
# Writes a Hugging Face GPT-2 safetensors file of a preset (random weights, GPT-2's
# initialisation) for --init_from tests and benchmarks: gpt2_train builds the model deferred
# under FSDP, so no rank holds it whole, takes one step at learning rate 1e-12 (--lr must be
# positive; the weights stay the initial ones within about 1e-12) and streams it out with
# --export, one tensor at a time.
#   benchmarks/make-hf-weights.sh PRESET OUT.safetensors [build dir] [ranks]
# e.g. benchmarks/make-hf-weights.sh gpt2-large /tmp/gpt2-large.safetensors (about 3.1 GB).
set -eu
if [ $# -lt 2 ]; then
  echo "usage: $0 PRESET OUT.safetensors [build dir] [ranks]" >&2
  exit 2
fi
PRESET=$1
OUTFILE=$2
BUILD=${3:-build}
NPROC=${4:-4}
"$BUILD/examples/gpt2/gpt2_train" --model "$PRESET" --strategy fsdp --sharding full \
  --nproc "$NPROC" --data random --tokenizer byte --vocab 50257 --ctx 128 --batch 1 \
  --steps 1 --lr 1e-12 --threads 1 --val_batches 1 --sample_tokens 0 --export "$OUTFILE"
ls -l "$OUTFILE"
