#!/usr/bin/env bash
# The newcomer's main command: installs dependencies, builds, and runs the GPT-2
# single-device vs DDP vs FSDP comparison on the built-in corpus.
#
# Until the GPT-2 trainer lands (issue 6), this runs what exists: a 4-process job over
# the TCP store that checks every collective, and says so.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/install-deps.sh"
"$root/scripts/build.sh"
build="${DTRAIN_BUILD_DIR:-$root/build}"
echo "run-comparison: the GPT-2 comparison is not built yet; running the 4-rank collectives check instead."
port=$((20000 + RANDOM % 10000))
pids=()
for r in 0 1 2 3; do
  MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$r WORLD_SIZE=4 LOCAL_RANK=$r LOCAL_WORLD_SIZE=4 \
    "$build/tests/dtrain_test_worker" collectives 60000 &
  pids+=($!)
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
exit $status
