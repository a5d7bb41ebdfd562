# Sourced (sh) by the multi-host tests (veth_test.sh, slurm_test.sh, mpirun_test.sh): the
# per-step records of gpt2_train's --metrics_out files, and the comparison of two runs.

# losses FILE: the per-step losses of a metrics file, one per line.
losses() {
  grep '"kind": "step"' "$1" | sed 's/.*"loss": \([-0-9.eE+]*\).*/\1/'
}

# last_field FILE NAME: NAME's value in the last step line of a metrics file.
last_field() {
  grep '"kind": "step"' "$1" | tail -n 1 | sed "s/.*\"$2\": \([-0-9.eE+a-z]*\).*/\1/"
}

# losses_differ A B: nothing when the runs' step losses agree (the same number of steps, at
# least 5, each within 1e-6 relative); otherwise how they differ. Leaves the losses in
# $tmp/la and $tmp/lb.
losses_differ() {
  losses "$1" >"$tmp/la"
  losses "$2" >"$tmp/lb"
  if [ "$(wc -l <"$tmp/la")" -lt 5 ] || [ "$(wc -l <"$tmp/la")" -ne "$(wc -l <"$tmp/lb")" ]; then
    echo "$(wc -l <"$tmp/la") steps against $(wc -l <"$tmp/lb")"
    return
  fi
  paste "$tmp/la" "$tmp/lb" | awk '{ d = $1 - $2; if (d < 0) d = -d; m = $1 < 0 ? -$1 : $1;
    if (d > 1e-6 * m) print "step " NR ": " $1 " vs " $2 }'
}
