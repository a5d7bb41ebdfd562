#!/bin/sh
# scripts/gpu-check.sh --dry-run lists every step with its commands, the profile step among
# them (both sides traced, the table made), and leaves nothing behind in OUTDIR.
set -eu
root="$1"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
text="$(bash "$root/scripts/gpu-check.sh" --dry-run "$out/run" 2>&1)"
for want in '== env' '== build' '== tests' '== strategies' '== gpt2' '== profile' '== offload' \
  'gpt2_train  --model  gpt2' '--trace_out' 'gpu_gpt2.py  torch' 'trace_table.py'; do
  case "$text" in
    *"$want"*) ;;
    *) echo "gpu-check --dry-run shows no '$want':"; echo "$text"; exit 1 ;;
  esac
done
# The profile step comes before offload: it is what the next GPU session measures first.
profile_at=$(printf '%s\n' "$text" | grep -n '^== profile' | cut -d: -f1)
offload_at=$(printf '%s\n' "$text" | grep -n '^== offload' | cut -d: -f1)
[ "$profile_at" -lt "$offload_at" ] || { echo "profile after offload"; exit 1; }
left="$(ls -A "$out/run")"
[ -z "$left" ] || { echo "the dry run left: $left"; exit 1; }
echo "gpu-check --dry-run: all steps shown, nothing left behind"
