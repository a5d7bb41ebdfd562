#!/usr/bin/env bash
# Installs the given Debian packages that are missing, the way scripts/install-deps.sh does
# (one apt at a time on this host through /var/lock/dtrain-apt.lock, waiting up to 15 minutes
# for other holders of dpkg's lock). For tools only some tests need (Slurm, munge, Open MPI):
# they install them here on first use, so install-deps.sh stays lean.
#
#   scripts/apt-ensure.sh slurm-wlm munge || exit 77
#
# Returns at once, without apt, when every package is installed; 1 (saying why) when apt fails.
set -euo pipefail

missing=()
for p in "$@"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ "${#missing[@]}" -eq 0 ] && exit 0

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "apt-ensure: installing ${missing[*]}" >&2
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! $SUDO env DEBIAN_FRONTEND=noninteractive flock /var/lock/dtrain-apt.lock sh -c \
  "apt-get -o DPkg::Lock::Timeout=900 update -qq &&
   apt-get -o DPkg::Lock::Timeout=900 install -y -qq --no-install-recommends ${missing[*]}" \
  >"$log" 2>&1; then
  tail -n 5 "$log" >&2
  echo "apt-ensure: could not install ${missing[*]}" >&2
  exit 1
fi
