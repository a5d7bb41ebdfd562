# Sourced by the peer scripts (peer-comparison.sh, peer-profile.sh) with $root set: installs
# dtrain's dependencies and the peer, Debian's python3-torch (PyTorch 1.13, run with
# /usr/bin/python3), if they are missing, and makes OpenMP threads sleep when idle (spinning
# threads distort timings on shared cores).
# Inside scripts/chroot.sh's trixie root (PEER_IN_ROOT) the root has them by construction.
if [ -z "${PEER_IN_ROOT:-}" ]; then
  "$root/scripts/install-deps.sh"
  if ! /usr/bin/python3 -c 'import torch' 2>/dev/null; then
    sudo_cmd=""
    [ "$(id -u)" -ne 0 ] && sudo_cmd=sudo
    DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq python3-torch >/dev/null
  fi
fi
# OMP_WAIT_POLICY=default runs both sides with libgomp's own default instead (idle threads
# spin for a while before they sleep), which favours a single process using every core.
if [ "${OMP_WAIT_POLICY:-}" = default ]; then
  unset OMP_WAIT_POLICY
else
  export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
fi
echo "peer: OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-(libgomp default)}" >&2

# Both sides load the same OpenBLAS, but where it falls back to a generic kernel gpt2_train
# selects a better one for itself (--blas_kernel auto) and PyTorch does not. Called once the
# build exists: exports that choice (dtrain-run --blas_info) for both, so they run one kernel.
peer_same_blas_kernel() {
  local vars v
  vars=$("$build/src/launcher/dtrain-run" --blas_info | sed -n 's/^ranks get: //p')
  for v in $vars; do # KEY=VALUE words, or "no BLAS variables"
    case "$v" in *=*) export "${v?}" ;; esac
  done
  case "$vars" in *=*) echo "peer: both sides run with $vars" >&2 ;; esac
}
